"""The collectives of ShardedEmbeddingBagCollection: the header every call begins with, its
op codes, the exchanges of ids, rows and gradients, and the errors they raise."""
from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tierstore.errors import kind
from tierstore.training.bags import MODES
from tierstore.training.sharding import PlanMismatchError, RankFailedError


COMM_DTYPES = {None: torch.float32, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_COMM_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
RECEIVED = ("headers", "sizes", "ids", "rows", "grads")
_MAX_MESSAGE = 2048  # bytes of an error message sent to the other ranks


class _Op(enum.IntEnum):
    """What a collective call is: the header's first field."""

    INIT = 1
    FORWARD = 2
    BACKWARD = 3
    READ = 4
    WRITE = 5
    FLUSH = 6
    CHECKPOINT = 7
    CLOSE = 8
    ANNOUNCE = 9
    # the ok/error exchanges inside a call, after work that may fail on one rank
    FETCHED = 10
    WRITTEN = 11
    FLUSHED = 12
    SAVED = 13
    RESTORED = 14


# the header's fields after the message length: every rank all-gathers the same 6 int64s per call
_OP, _ARG, _SETTINGS, _PENDING, _TOTAL = range(1, 6)


class _Comm:
    """The collectives a step uses, on CPU tensors (gloo) or CUDA ones (NCCL)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        # bytes received from the other ranks, by what they carried (RECEIVED's keys)
        self.received = dict.fromkeys(RECEIVED, 0)

    def _run(self, what: str, op):
        try:
            return op()
        except RuntimeError as e:
            raise RankFailedError(
                f"rank {self.rank}: {what} with the other ranks failed ({kind(e)}: {e}); a rank died, did not "
                "answer within the process group's timeout (init_process_group(timeout=...)), or called another collective"
            ) from e

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.to(self.device)
        self.received["headers"] += t.numel() * t.element_size() * (self.world - 1)
        out = [torch.empty_like(t) for _ in range(self.world)]
        self._run("all_gather", lambda: dist.all_gather(out, t, group=self.group))
        return [o.cpu() for o in out]

    def header(self, error: BaseException | None, fields: Sequence[int]) -> torch.Tensor:
        """Every rank's [message length, *fields], [world, 1 + len(fields)]: ``fields`` must
        have the same length on every rank whatever it calls (gloo aborts on a size mismatch)."""
        return torch.stack(self.all_gather(torch.tensor([len(_message(error)), *fields], dtype=torch.int64)))

    def raise_failures(self, error: BaseException | None, got: torch.Tensor) -> None:
        """After ``header``: raise ``error`` on a failing rank and RankFailedError naming it on the others."""
        msg = _message(error)
        if bool(got[:, 0].any()):
            buf = torch.zeros(int(got[:, 0].max()), dtype=torch.uint8)
            if msg:
                buf[: len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
            texts = self.all_gather(buf)
            if error is not None:
                raise error
            failed = [f"rank {r} failed: {bytes(texts[r][:n].tolist()).decode(errors='replace')}"
                      for r, n in enumerate(got[:, 0].tolist()) if n]
            raise RankFailedError("; ".join(failed) + f" (the step is aborted on rank {self.rank} too; nothing changed)")

    def exchange(self, send: list[list[torch.Tensor]], recv_bytes: Sequence[int], what: str) -> list[torch.Tensor]:
        """Send ``send[r]`` (tensors, as raw bytes) to rank r; the bytes from each rank.
        ``what`` they carry counts the bytes from the others in ``received``."""
        self.received[what] += sum(recv_bytes) - recv_bytes[self.rank]
        chunks = [torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in parts]) if parts
                  else torch.empty(0, dtype=torch.uint8) for parts in send]
        out = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=self.device)
        inp = torch.cat(chunks).to(self.device)
        self._run("all_to_all", lambda: dist.all_to_all_single(out, inp, list(recv_bytes), [len(c) for c in chunks],
                                                               group=self.group))
        return list(out.cpu().split(list(recv_bytes)))


def _digest(text: str) -> int:
    """56 bits of the text's SHA-256: a non-negative int64."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _message(error: BaseException | None) -> bytes:
    return b"" if error is None else f"{kind(error)}: {error}".encode()[:_MAX_MESSAGE]


class _Reader:
    """Consumes typed tensors from the bytes received from one rank, in order."""

    def __init__(self, data: torch.Tensor):
        self.data, self.at = data, 0

    def take(self, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        size = n * width * torch.empty(0, dtype=dtype).element_size()
        part = self.data[self.at: self.at + size]
        if part.storage_offset() % 8:  # a view needs the element size's alignment (not so after 2-byte values)
            part = part.clone()
        self.at += size
        return part.view(dtype).reshape(n, width).to(torch.float32)



def _error_of(op) -> Exception | None:
    """Run ``op`` (if any); its exception, for _begin to raise on every rank."""
    try:
        if op is not None:
            op()
    except Exception as e:
        return e
    return None


class SettingsMismatchError(PlanMismatchError):
    """A setting that shapes the ranks' messages (tables, optimizer, comm_dtype, mode)
    differs between the ranks constructing a sharded collection."""


def raise_settings_mismatch(comm: "_Comm", settings: dict[str, str], rank: int) -> None:
    """Raise the error naming the first setting that differs between ranks (every rank calls this,
    with what ShardedEmbeddingBagCollection must have the same on each)."""
    got = torch.stack(comm.all_gather(torch.tensor([_digest(v) for v in settings.values()])))
    for i, (name, value) in enumerate(settings.items()):
        column = got[:, i].tolist()
        if len(set(column)) == 1:
            continue
        if name in ("comm_dtype", "mode"):  # short: name every rank's value
            known = {_digest(v): v for v in (*_COMM_NAMES.values(), *MODES)}
            each = ", ".join(f"rank {r}: {known.get(d, '?') if name == 'comm_dtype' else repr(known.get(d, '?'))}"
                             for r, d in enumerate(column))
            raise SettingsMismatchError(f"{name} differs between ranks ({each}); give every rank the same {name}")
        differ = [r for r, d in enumerate(column) if d != column[0]]
        if name == "plan":
            raise PlanMismatchError(f"the sharding plan differs between ranks: ranks {differ} have another plan than rank 0; "
                                    "give every rank the same plan (e.g. one ShardingPlan.to_json() file)")
        if name == "tables":
            raise SettingsMismatchError(f"tables differ between ranks: ranks {differ} have other TableSpecs than rank 0; "
                                        "give every rank the same tables")
        raise SettingsMismatchError(f"optimizer differs between ranks: ranks {differ} have another optimizer than rank 0 "
                                    f"(rank {rank} has {value}); give every rank the same optimizer")
