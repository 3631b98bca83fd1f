"""The store's public interface, as a Protocol: what a trainer, the embedding modules and the
tools may rely on of any store. ``TieredStore`` (embedded) and ``DaemonStore`` (a client of
``tierstore prefetchd``, from ``open_store(..., daemon=)``) both provide it, neither
inheriting from the other, and tests/test_store_conformance.py runs the same checks
against each. Code that takes any store checks ``isinstance(store, EmbeddingStore)``."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from tierstore.engine.prefetch import PrefetchGroup, PrefetchTicket
from tierstore.spec import TableSpec

if TYPE_CHECKING:
    from tierstore.engine.trainer import TableTrainer


@runtime_checkable
class EmbeddingStore(Protocol):
    """Rows of named tables by id, with optional optimizer state beside them."""

    device: torch.device  # where read() returns rows
    path: Path  # the store's directory
    readonly: bool  # True: write() and evict() raise PermissionError

    @property
    def tables(self) -> dict[str, TableSpec]:
        """The store's tables by name."""

    def spec(self, table: str) -> TableSpec:
        """``table``'s spec; a KeyError naming the store's tables if it has no such table."""

    def trainer(self, table: str) -> "TableTrainer":
        """What a training module uses of the store for ``table`` beside read() and write()
        (tierstore.engine.trainer): one per table for the store's life."""

    def read(self, table: str, ids, with_state: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``ids`` (any order, repeats allowed): [len(ids), dim] (+ state_dim with ``with_state``);
        a row never written reads as its table's initial value."""

    def write(self, table: str, ids, values, with_state: bool = False) -> None:
        """Set rows (and their optimizer state with ``with_state``); the last of repeated ids wins."""

    def evict(self, table: str, ids) -> int:
        """Delete rows everywhere (they read as initial values again); returns how many existed."""

    def prefetch(self, table: str, ids) -> PrefetchTicket:
        """Start reading rows ahead of their read; the ticket's wait() raises what the read would."""

    def prefetch_batch(self, reads: Mapping[str, torch.Tensor]) -> PrefetchGroup | None:
        """A LookaheadLoader's batch, prefetched whole or not yet (tierstore.engine.loader.PrefetchTarget)."""

    def report_step_seconds(self, seconds: float) -> None: ...

    def report_prefetch_depth(self, effective_depth: int, shrunk_steps: int) -> None: ...

    def flush(self) -> None:
        """Make every write so far durable: it survives kill -9 once this returns."""

    def stats(self, per_table: bool = False) -> dict:
        """Cumulative hits, misses, evictions and write-backs per tier, and LMDB's reads and writes."""

    def resident_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` in each cache tier this process holds now: "hbm", and "ddr" where
        the DDR tier is this process's (a daemon client's DDR tier is the daemon's)."""

    def close(self) -> None:
        """Flush and release everything; idempotent."""

    def __enter__(self) -> "EmbeddingStore": ...

    def __exit__(self, *exc) -> None: ...
