"""Reduced-precision weights: float16 and bfloat16 rows.

A table's weights are stored in its ``dtype`` in every tier and in LMDB; its
optimizer state stays float32. Everywhere between storage and the caller rows
are float32 holding values the dtype represents exactly, so converting to and
from storage never rounds. Rounding happens at two places only:

- values given by the caller (write, from_pretrained, initial values) round to
  nearest;
- an optimizer step rounds stochastically, up with probability equal to the
  value's distance from its lower neighbour over the gap, so small updates are
  not lost to rounding on average. The random number of each element is a pure
  function of (table, row id, column, the table's update count): the same data
  and seed give the same rows whatever the tier sizes, policy or prefetch depth.
"""
from __future__ import annotations

import zlib

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; products wrap)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_COLUMN = -3372029247567499373  # 0xD1B54A32D192ED03


def round_nearest(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 values rounded to the nearest value of ``dtype`` (still float32)."""
    if dtype == "float32":
        return values
    return values.to(DTYPES[dtype]).to(torch.float32)


def update_key(table: str, count: int) -> int:
    """The key of one update of a table: its name and its update count."""
    return ((zlib.crc32(table.encode()) << 32) ^ (count & 0xFFFFFFFF)) - (1 << 63)


def round_stochastic(values: torch.Tensor, dtype: str, ids: torch.Tensor, key: int) -> torch.Tensor:
    """float32 ``values`` [n, dim] of rows ``ids`` rounded stochastically to
    ``dtype`` (still float32); values it represents, and non-finite ones, stay."""
    if dtype == "float32":
        return values
    low_precision = DTYPES[dtype]
    nearest = values.to(low_precision)
    near = nearest.to(torch.float32)
    # the neighbour on the other side of the value, one step of the dtype away
    away = torch.where(values > near, torch.inf, -torch.inf).to(low_precision)
    other = torch.nextafter(nearest, away).to(torch.float32)
    low, high = torch.minimum(near, other), torch.maximum(near, other)
    up = _uniform(ids.to(values.device), values.shape[1], key) * (high - low) < values - low
    rounded = torch.where(up, high, low)
    return torch.where((near == values) | ~torch.isfinite(other), near, rounded)


def _uniform(ids: torch.Tensor, dim: int, key: int) -> torch.Tensor:
    """U[0, 1) float32 [len(ids), dim], a pure function of (key, id, column)."""
    cols = torch.arange(dim, dtype=torch.int64, device=ids.device) * _COLUMN
    x = _mix(ids.to(torch.int64) ^ key).unsqueeze(1) + cols
    bits = (_mix(x) >> 40) & 0xFFFFFF  # 24 bits: exact in float32
    return bits.to(torch.float32) * (1.0 / (1 << 24))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer; >> on int64 is arithmetic, so the high bits are masked."""
    x = x + _GOLDEN
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))
