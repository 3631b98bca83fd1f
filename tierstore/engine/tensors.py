"""The tensors a store's callers hand it and get back: ids and values checked against a
table (one check for the store, its prefetcher, the daemon and its client, the modules and
the sharded module), a read's rows gathered into ``out=``, and the device the HBM tier is on.
A leaf: what the store's users share without importing the store."""
from __future__ import annotations

import numpy as np
import torch

from tierstore.engine.tiers import CacheTier
from tierstore.precision import round_nearest
from tierstore.spec import MAX_ID, TableSpec
from tierstore.errors import ArgumentTypeError, BadIdsError, BadValuesError, IdRangeError, SettingError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The HBM tier's device. None is torch's default device (the CPU unless
    torch.set_default_device), as for the torch modules tierstore's stand in for: a
    model built beside them on a GPU machine computes on one device. "cuda" is the
    device current now, index included: threads start on device 0, so tensors the
    store's threads make for "cuda" would land on cuda:0 beside tiers on cuda:k; and
    cuda:0 != cuda, so a caller's ``out=`` would never match."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingError("device='cuda' but CUDA is not available; pass device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_has_values(t: torch.Tensor, what: str, table: str) -> None:
    """Refuse a tensor that holds no values (one on the meta device) before anything
    reads it: the store, tierstore.nn's modules and the daemon client all check here."""
    if t.device.type == "meta":
        raise BadValuesError(f"{what} for table {table!r} are a tensor on the meta device, which holds no values; "
                         "pass a tensor on the CPU or a GPU")


def as_ids(spec: TableSpec, ids) -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor on their device, or the store's named error: the
    one id check of the store's calls, its prefetcher, the daemon and its client and
    the sharded module."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ArgumentTypeError(f"ids for table {spec.name!r} must be integers, got a tensor of {ids.dtype}")
        check_has_values(ids, "ids", spec.name)
        t = ids.detach()
        if t.dtype == torch.uint64 and t.numel():  # torch casts ids >= 2**63 to negative int64s
            wrapped = t.view(torch.int64)
            if bool((wrapped < 0).any()):
                big = int(wrapped[wrapped < 0].max()) + (1 << 64)
                raise IdRangeError(f"id {big} out of range for table {spec.name!r} (ids are < 2**63)")
    else:
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise ArgumentTypeError(f"ids for table {spec.name!r} must be integers, got {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and arr.max() > MAX_ID:
            raise IdRangeError(f"id {int(arr.max())} out of range for table {spec.name!r} (ids are < 2**63)")
        # a read-only array (a memory-mapped trace, np.frombuffer) is copied: torch tensors
        # are always writable, and torch warns when it must share an array that is not
        t = torch.from_numpy(arr.astype(np.int64, copy=not arr.flags.writeable))
    if t.dim() != 1:
        raise BadIdsError(f"ids for table {spec.name!r} must be 1-D, got shape {tuple(t.shape)}")
    t = t.to(dtype=torch.int64)  # stays on its device: on CUDA the HBM probe runs there
    if len(t):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0:
            raise IdRangeError(f"id {lo} is negative for table {spec.name!r}; ids must be >= 0")
        if spec.num_rows is not None and hi >= spec.num_rows:
            raise IdRangeError(f"id {hi} out of range for table {spec.name!r} with num_rows={spec.num_rows}")
    return t


def as_values(spec: TableSpec, values, n: int, cols: int) -> torch.Tensor:
    """``values`` for ``n`` rows of ``cols`` columns as a float32 CPU tensor (the weights rounded
    to the table's dtype), or the store's named error: the store's, the daemon client's and the
    sharded module's one values check."""
    if isinstance(values, torch.Tensor):
        check_has_values(values, "values", spec.name)
        v = values.detach()
    else:
        arr = np.asarray(values)
        if arr.dtype.kind not in "fiu":
            raise ArgumentTypeError(f"values for table {spec.name!r} must be floating point, got {arr.dtype}")
        v = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # as ids above
    if v.dtype.is_complex or not (v.dtype.is_floating_point or v.dtype in (torch.int32, torch.int64)):
        raise ArgumentTypeError(f"values for table {spec.name!r} must be floating point, got {v.dtype}")
    if tuple(v.shape) != (n, cols):
        raise BadValuesError(f"values for table {spec.name!r} must have shape ({n}, {cols}), got {tuple(v.shape)}")
    v = v.to(device="cpu", dtype=torch.float32)
    if spec.dtype != "float32":  # a new tensor: the caller's is not changed
        v = torch.cat([round_nearest(v[:, : spec.dim], spec.dtype), v[:, spec.dim:]], dim=1)
    return v


def check_out(out: torch.Tensor | None, n: int, cols: int, device: torch.device) -> None:
    """Refuse a read's ``out=`` that cannot take its rows (the store's and the daemon client's check)."""
    if out is not None and (tuple(out.shape) != (n, cols) or out.dtype != torch.float32 or out.device != device):
        raise BadValuesError(f"out must be a float32 tensor of shape ({n}, {cols}) on {device}, got {out.dtype} {tuple(out.shape)} on {out.device}")


def gather_tier(tier: CacheTier, slots: torch.Tensor, cols: int, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The first ``cols`` columns of ``tier``'s rows at ``slots``, on ``device`` or into ``out``."""
    if out is None:
        return tier.gather(slots, cols).to(device, non_blocking=True)
    if out.device != tier.device:
        return out.copy_(tier.gather(slots, cols), non_blocking=True)
    return tier.gather(slots, cols, out)


def gather_rows(rows: torch.Tensor, index: torch.Tensor, cols: int, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The first ``cols`` columns of ``rows[index]``, on ``device`` or into ``out``."""
    src = rows if cols == rows.shape[1] else rows[:, :cols]
    if out is None:
        return src.index_select(0, index).to(device, non_blocking=True)
    if src.device == out.device:
        return torch.index_select(src, 0, index, out=out)
    return out.copy_(src.index_select(0, index), non_blocking=True)


def unpicklable(store: object, holds: str) -> TypeError:
    """What pickling or deep-copying a store (or a model holding one) raises: pickle and
    deepcopy would otherwise fail on its lock with "cannot pickle '_thread.RLock'"."""
    return ArgumentTypeError(
        f"{store!r} cannot be pickled or deep-copied: it holds {holds}. "
        "Save a model holding it with torch.save(model.state_dict()) (small tables) or "
        "torch.distributed.checkpoint.save(model.state_dict(), checkpoint_id=DIR) (any size), or snapshot "
        "the store with store.checkpoint(path); to copy such a model, build it again and load_state_dict() into it")
