"""Which slots of a row log's segments (io.rowlog) hold their id's latest row: a bit a slot.

Why: a collection copies the live slots of its victims, and asking the row index for each
victim's ids read a page of a mapped level a row (under a 0.5 GiB budget, half the index
lookups of the DLRM step's write-back). The bits are kept as rows are written (a new
segment's slots all live) and overwritten (the slots they leave cleared), and a collection
reads them instead.

A bit a slot is 25 MB for 200M rows of 16 floats: more than a small budget's share of the
index, and unlike the runs it is touched at random by every write, so it cannot be spilled
to a level. The bits live in a sparse file beside the store's (in the temporary directory
where the store's may not be written), mapped shared and unlinked at once: pages never
written take neither memory nor disk, the pages written are the page cache's, which the
kernel writes out and drops under memory pressure as it does the mapped index levels' (the
budget's page_cache part), and nothing is left behind, even after kill -9. The disk under
the entries in use is allocated as they are added (reserve), before the write that needs them
commits: a page written over a hole of a full disk would kill the process (SIGBUS), where a
failed allocation fails that write. The saved index holds a copy (io.rowlog.write_index)."""
from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np

from .lmdb_map import PAGE, will_need
from .rowindex import LOOKUP_PAGES


def _mapped(entries: int, width: int, folder: Path | None, reserved: int = 0) -> tuple[int, np.ndarray]:
    """(its descriptor, a zeroed [entries, width] uint8 array) of a sparse file, mapped shared
    and unlinked, the disk under its first ``reserved`` entries allocated."""
    if folder is None or not os.access(folder, os.W_OK):
        folder = Path(tempfile.gettempdir())
    path = folder / f"live-slots-{os.getpid()}-{os.urandom(8).hex()}.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        path.unlink()
        os.ftruncate(fd, entries * width)
        if reserved:
            os.posix_fallocate(fd, 0, reserved * width)
        m = mmap.mmap(fd, entries * width, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    m.madvise(mmap.MADV_RANDOM)  # a row a segment, at random: read-ahead would read 32 pages for one
    return fd, np.frombuffer(m, dtype=np.uint8).reshape(entries, width)


class LiveSlots:
    """A bit a slot (little-endian, rows of whole 8-byte words: saved as int64) for each of
    ``entries`` segment entries of up to ``slots`` slots, kept in a sparse file in ``folder``."""

    def __init__(self, slots: int, entries: int, folder: Path | None = None):
        self.entries, self.folder, self.reserved = entries, folder, 0
        self._take(*_mapped(entries, 8 * -(-slots // 64), folder))

    def _take(self, fd: int, rows: np.ndarray) -> None:
        self.rows = rows
        self._closed = weakref.finalize(self, os.close, fd)  # called by widen, or when this goes
        self._fd = fd

    def reserve(self, used: int) -> None:
        """Allocate the disk under the first ``used`` entries (OSError ENOSPC where the disk is full)."""
        if used > self.reserved:
            os.posix_fallocate(self._fd, 0, used * self.rows.shape[1])
            self.reserved = used

    @property
    def slots(self) -> int:
        """The most slots a segment may have."""
        return 8 * self.rows.shape[1]

    def widen(self, slots: int, used: int) -> None:
        """Room for segments of ``slots`` slots (one written under an older segment size),
        the first ``used`` entries kept."""
        if slots > self.slots:
            fd, wider = _mapped(self.entries, 8 * -(-slots // 64), self.folder, self.reserved)
            wider[:used, :self.rows.shape[1]] = self.rows[:used]
            self._closed()
            self._take(fd, wider)

    def reset(self, s: int, n: int) -> None:
        """Entry ``s`` is a segment of ``n`` slots, all live (0: a free entry)."""
        self.rows[s] = np.packbits(np.arange(self.slots) < n, bitorder="little")

    def clear(self, segments: np.ndarray, slots: np.ndarray) -> None:
        """The slots ``slots`` of entries ``segments`` (int64, one each) hold a row no longer."""
        at = segments * self.rows.shape[1] + (slots >> 3)
        mask = ~(np.uint8(1) << (slots & 7).astype(np.uint8))
        for part in self._asked(at):
            # .at: two slots of one byte must both clear (a fancy-indexed &= keeps one of them)
            np.bitwise_and.at(self.rows.reshape(-1), at[part], mask[part])

    def live_at(self, segments: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether each slot ``slots`` of entries ``segments`` (int64, one each) holds a row."""
        at = segments * self.rows.shape[1] + (slots >> 3)
        byte = np.empty(len(at), dtype=np.uint8)
        for part in self._asked(at):
            byte[part] = self.rows.reshape(-1)[at[part]]
        return (byte >> (slots & 7).astype(np.uint8)) & 1 == 1

    def _asked(self, at: np.ndarray):
        """Parts of ``at`` (byte offsets into the bits) of at most LOOKUP_PAGES pages each
        (masks: as many as the index's lookups ask at once, to stay in the page cache until
        read), the pages of each asked of the kernel all at once before it is yielded
        (io.lmdb_map.will_need). Read a fault at a time, at queue depth 1 where the page cache
        had dropped them, the bits took 70% of the write-back's samples (py-spy, `tierstore
        bench scale`'s DLRM step on the 200M x 16 table aged by training, 256 MiB)."""
        pages, part = np.unique(at // PAGE, return_inverse=True)
        part //= LOOKUP_PAGES
        for i in range(-(-len(pages) // LOOKUP_PAGES)):
            will_need(self.rows.ctypes.data, pages[i * LOOKUP_PAGES: (i + 1) * LOOKUP_PAGES] * PAGE, PAGE)
            yield part == i

    def live(self, segments: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Mask of the first ``counts`` slots of each of entries ``segments``, concatenated:
        those that hold their id's latest row."""
        bits = np.unpackbits(self.rows[segments], axis=1, bitorder="little").view(bool)
        return bits[np.arange(self.slots) < counts[:, None]]

    def saved(self, used: int) -> np.ndarray:
        """The first ``used`` entries' bits, as int64 (io.rowindex_file saves int64 arrays)."""
        return np.ascontiguousarray(self.rows[:used]).reshape(-1).view(np.int64)

    def load(self, words: np.ndarray, used: int) -> None:
        """The bits of the first ``used`` entries from ``words`` (saved(used) of a log)."""
        if used:
            rows = words.view(np.uint8).reshape(used, -1)
            self.widen(8 * rows.shape[1], 0)
            self.reserve(used)
            self.rows[:used] = 0
            self.rows[:used, :rows.shape[1]] = rows
