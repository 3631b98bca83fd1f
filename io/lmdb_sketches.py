"""LmdbBackend's admission sketches: each table's counters of ids seen (tierstore.engine.admission),
kept in one database by table name so that admission survives a restart."""
from __future__ import annotations

_SKETCH_DB = b"__sketch__"  # admission sketches, by table name, as raw counters


class Sketches:
    """LmdbBackend's methods for its tables' admission sketches."""

    def put_sketches(self, sketches: dict[str, bytes]) -> None:
        """Store tables' admission sketches (one transaction)."""
        opened = [None]
        self._write(lambda txn: self._put_sketches(txn, sketches, opened))
        self._sketch_db = opened[0]

    def _put_sketches(self, txn, sketches: dict[str, bytes], opened: list) -> None:
        if not sketches:
            return
        # opened in this transaction: env.open_db alone begins a write transaction
        # holding the GIL, which waits forever for the writer thread's transaction;
        # kept (opened[0]) only once committed (a replayed op's first handle died with its abort)
        opened[0] = self._sketch_db or self.env.open_db(_SKETCH_DB, txn=txn)
        for table, blob in sketches.items():
            txn.put(table.encode(), blob, db=opened[0])

    def get_sketch(self, table: str) -> bytes | None:
        """A table's stored admission sketch; None if none was stored."""
        with self._reading() as txn:
            if txn.get(_SKETCH_DB) is None:  # never created: a readonly environment cannot create it
                return None
            return txn.get(table.encode(), db=self.env.open_db(_SKETCH_DB, txn=txn, create=False))
