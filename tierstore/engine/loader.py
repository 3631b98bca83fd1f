"""The loader that keeps the batches ahead prefetched (LookaheadLoader), and what it needs of a store
(PrefetchTarget): TieredStore, the daemon client and the sharded module each provide it. The reads
themselves are tierstore.engine.prefetch's."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from tierstore.validate import check_int
from tierstore.errors import ArgumentTypeError

if TYPE_CHECKING:
    from tierstore.engine.prefetch import PrefetchTicket


class PrefetchGroup:
    """Tickets of several tables for one batch, handled as one."""

    def __init__(self, tickets: Iterable[PrefetchTicket]):
        self.tickets = list(tickets)

    def done(self) -> bool:
        return all(t.done() for t in self.tickets)

    def wait(self, timeout: float | None = None) -> None:
        """Raise a failure of the fetches; a rejected batch is the read's to raise
        (the same exception, at the same place, as without prefetch)."""
        for t in self.tickets:
            if t.rejected:
                t.dismiss()
            else:
                t.wait(timeout)

    def release(self) -> None:
        for t in self.tickets:
            t.release()


class PrefetchTarget(Protocol):
    """What a LookaheadLoader needs of a store: TieredStore, the daemon client
    (DaemonStore) and the sharded module's prefetch each provide it."""

    def prefetch_batch(self, reads: Mapping[str, torch.Tensor]) -> "PrefetchGroup | None":
        """Issue one batch's prefetches whole (its unique ids per table); None, issuing
        nothing, while there is no room for all of them yet."""

    def report_step_seconds(self, seconds: float) -> None:
        """The trainer spent ``seconds`` on a batch: prefetch reads are sized to land in time."""

    def report_prefetch_depth(self, effective_depth: int, shrunk_steps: int) -> None:
        """The loader's depth now and the steps at which it was short of the one asked, for stats."""


class LookaheadLoader:
    """Yield ``batches`` in order while keeping ``depth`` batches ahead prefetched.

    ``ids(batch) -> {table: ids}`` says what a batch reads; by default the
    module's ``batch_reads(batch)`` does (a TieredEmbeddingBag's or collection's
    batch is in its forward's input form); a store needs ``ids``. ``depth=0``: no prefetch.
    A failure of batch i's prefetch is raised when batch i is due. A module that resolves
    batches ahead (``resolve_ahead()``: tierstore.training.devstep) resolves each batch
    ``depth`` batches ahead instead (a failure is raised then), is handed each batch's slots
    as the batch is yielded (``begin_step``: its forward is then the step on slots alone, which
    torch.compile compiles whole), and each batch's rows stay pinned until the loader is
    asked for the next batch.
    """

    def __init__(self, batches: Iterable, module, depth: int = 2, ids: Callable[[object], Mapping[str, object]] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        check_int(depth, "depth", meaning="0 = no prefetch")
        self.batches = batches
        self.module = module
        self.store: PrefetchTarget = module.store if hasattr(module, "store") else module
        if ids is None and not hasattr(module, "batch_reads"):
            raise ArgumentTypeError(f"pass ids= (a function batch -> {{table: ids}}): a {type(module).__name__} cannot say what a batch reads")
        self.depth = depth
        self.ids = ids
        self.clock = clock
        self.effective_depth = 0
        self.shrunk_steps = 0

    @property
    def _resolves(self) -> bool:
        """Whether the module's steps run on the device over a cache (resolve_ahead): it then
        resolves each batch's rows itself, ``depth`` batches ahead, and keeps them until the
        loader hands out the next batch."""
        return bool(getattr(self.module, "resolves_ahead", False))

    def _reads(self, batch) -> dict[str, torch.Tensor] | None:
        """What a batch reads; None for a batch the module cannot read, whose own
        forward then raises, at its step. A failing ``ids`` function raises here."""
        if self.ids is not None:
            reads = self.ids(batch)
        else:
            try:
                reads = self.module.batch_reads(batch)
            except Exception:
                return None
        return {table: torch.as_tensor(ids).reshape(-1) for table, ids in reads.items()}

    def _issue(self, entry: list) -> PrefetchGroup | None:
        if self._resolves:  # the device step over a cache: the module brings the batch's rows up now
            self.module.resolve_batch(entry[0])
            return PrefetchGroup(())
        if entry[2] is None:  # deduped once: a batch that waits for room is tried again each step
            reads = self._reads(entry[0])
            if reads is None:
                return PrefetchGroup(())  # nothing to prefetch
            try:
                reads = {table: torch.unique(ids) for table, ids in reads.items()}
            except (RuntimeError, TypeError):  # not ids: the store says so at the batch's step
                pass
            entry[2] = reads
        return self.store.prefetch_batch(entry[2])

    def __iter__(self) -> Iterator:
        it = iter(self.batches)
        ahead: deque[list] = deque()  # [batch, group or None, its reads once computed]
        exhausted = False
        try:
            while True:
                while not exhausted and len(ahead) < self.depth + 1:
                    try:
                        ahead.append([next(it), None, None])
                    except StopIteration:
                        exhausted = True
                if not ahead:
                    return
                if self.depth:
                    for entry in ahead:  # in order; a batch that does not fit waits
                        if entry[1] is None:
                            entry[1] = self._issue(entry)
                            if entry[1] is None:
                                break
                    issued = sum(e[1] is not None for e in list(ahead)[1:])
                    self.effective_depth = issued
                    if issued < min(self.depth, len(ahead) - 1):
                        self.shrunk_steps += 1
                    self._report()
                batch, group, _ = ahead.popleft()
                try:
                    if group is not None:
                        group.wait()
                    handed = self.clock()
                    if self._resolves:  # its slots set aside on the host: the step itself only uses them
                        self.module.begin_step(batch)
                    yield batch
                    if self._resolves:  # the batch's step is done: its rows may go
                        self.module.release_steps()
                    if self.depth:
                        self.store.report_step_seconds(self.clock() - handed)
                finally:
                    if group is not None:
                        group.release()
        finally:
            for _, group, _ in ahead:
                if group is not None:
                    group.release()
            self.effective_depth = 0
            self._report()

    def _report(self) -> None:
        self.store.report_prefetch_depth(self.effective_depth, self.shrunk_steps)
