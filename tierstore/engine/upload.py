"""Rows read on the host going up to a tier on a GPU: from pinned staging, on a side stream.

A read's step gathers the rows that miss the HBM tier in host memory (from prefetch
staging, the write-back queue, LMDB or the DDR tier) and the HBM tier takes them on the
device. ``Upload`` makes that copy the way a step resolved ahead needs it (the step
itself then only sees slots):

- the rows are copied into a pinned staging buffer, and from it to the device on a side
  stream (``torch.cuda.Stream``): the host enqueues the copy and goes on, and the copy
  overlaps the compute stream's queued kernels (the steps in flight);
- an event recorded after the copy is what the compute stream waits on, enqueued where
  the rows are first used (the tier's own copy into its slots): every later kernel sees
  them, no earlier one waits;
- a staging buffer is refilled only once the event of its last copy has passed (the host
  waits on it then: two buffers take turns, so that wait is on the copy before last);
  the device copy, allocated on the side stream, is ``record_stream``-ed on the compute
  stream, so its memory goes back to the side stream's pool only after the compute
  stream's use of it.

A buffer holds at most ``STAGED_BYTES``: a larger upload is pinned for itself (torch's
pinned-memory cache recycles such blocks once their copy is done), so an odd huge read
does not keep its size pinned.

On the CPU (a tier in host memory, device="cpu") there is no stream and no staging: the
rows are already where the tier is, and the same call hands them over as they are. A CPU
``Upload(staged=True)`` runs the staging half (buffers, turns, sizes) without a stream,
so CI checks it.
"""
from __future__ import annotations

import torch

__all__ = ["STAGED_BYTES", "Upload"]

STAGED_BYTES = 16 << 20  # per staging buffer: 32k rows of 128 floats


class Upload:
    """Host rows up to ``device``; one per store, used with the store's lock held."""

    def __init__(self, device: torch.device, staged: bool | None = None, staged_bytes: int = STAGED_BYTES):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.staged = cuda if staged is None else staged
        self.staged_bytes = staged_bytes
        self.stream = torch.cuda.Stream(self.device) if cuda and self.staged else None
        self._buffers: list[torch.Tensor | None] = [None, None]  # flat float32 (pinned on CUDA), taking turns
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy out
        self._turn = 0
        self.uploads = 0  # through a staging buffer
        self.bypassed = 0  # larger than a buffer: pinned for themselves

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (float32, in host memory) on the device; later work on the compute
        stream sees them. On the CPU, ``rows`` themselves."""
        if not self.staged:
            return rows.to(self.device)
        rows = rows.detach()
        if not rows.numel():
            return rows.to(self.device)
        if rows.numel() * rows.element_size() > self.staged_bytes:
            self.bypassed += 1
            return self._up(rows.pin_memory() if self.stream is not None else rows.clone(), None)
        turn = self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy before last out of this buffer is done
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < rows.numel():
            size = min(self.staged_bytes // rows.element_size(), 2 * rows.numel())
            buffer = self._buffers[turn] = torch.empty(size, dtype=rows.dtype, pin_memory=self.stream is not None)
        staged = buffer[: rows.numel()].view(rows.shape)
        staged.copy_(rows)
        self.uploads += 1
        return self._up(staged, turn)

    def _up(self, staged: torch.Tensor, turn: int | None) -> torch.Tensor:
        if self.stream is None:  # the CPU: a plain copy, the staging buffer free again at once
            return staged.to(self.device, copy=True)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = staged.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        compute.wait_event(copied)
        out.record_stream(compute)
        if turn is not None:
            self._copied[turn] = copied
        return out

    def pinned_bytes(self) -> int:
        """Host memory the staging buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._buffers if b is not None)
