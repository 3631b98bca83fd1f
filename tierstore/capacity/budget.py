"""Cache sizes from LRU curves (tierstore/capacity/curves.py): the rows per table that reach
hit-ratio targets, and the split of a byte budget across tables for the most hits."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tierstore.capacity.curves import LruCurve


def rows_for_targets(curve: LruCurve, hbm_target: float | None, hit_target: float | None) -> dict:
    """Smallest HBM rows reaching ``hbm_target`` HBM hit ratio, and smallest DDR rows
    on top reaching ``hit_target`` cache hit ratio (LRU)."""
    out = {"reachable": True, "max_hit_ratio": curve.max_hit_ratio()}
    ws = int(math.ceil(curve.working_set))
    h = 0
    if hbm_target:
        r = curve.rows_for(hbm_target)
        out["reachable"] &= r is not None
        h = ws if r is None else r
    total = h
    if hit_target:
        r = curve.rows_for(hit_target)
        out["reachable"] &= r is not None
        total = max(h, ws if r is None else r)
    out.update(hbm_rows=int(h), ddr_rows=int(total - h))
    return out


def _size_grid(curves, row_bytes, start=None, points: int = 400):
    """Per table, candidate extra rows (0 and geometric steps to the working set),
    the hits they add on top of ``start`` rows, and their bytes: (T, points + 1) each."""
    start = np.zeros(len(curves), dtype=np.int64) if start is None else np.asarray(start, dtype=np.int64)
    T = len(curves)
    cand = np.zeros((T, points + 1), dtype=np.float64)
    gain = np.zeros((T, points + 1), dtype=np.float64)
    for i, c in enumerate(curves):  # a loop per table
        room = max(int(math.ceil(c.working_set)) - int(start[i]), 0)
        sizes = np.unique(np.concatenate([[0], np.geomspace(1, max(room, 1), points).round()]))[: points + 1] if room else np.zeros(1)
        sizes = np.pad(sizes, (0, points + 1 - len(sizes)), mode="edge")
        cand[i] = sizes
        gain[i] = np.asarray(c.hits(start[i] + sizes), dtype=np.float64) - float(c.hits(start[i]))
    return cand, gain, cand * np.asarray(row_bytes, dtype=np.float64)[:, None]


def total_curve(curves: Sequence[LruCurve], row_bytes: Sequence[int], points: int = 40) -> dict:
    """The whole trace's LRU hit ratio against the bytes of one cache split across
    the tables by :func:`split_budget` (each table its own tiers), at budgets from
    one row to every working set."""
    if not curves:
        return {"bytes": [], "rows": [], "hit_ratio": []}
    rb = np.asarray(row_bytes, dtype=np.float64)
    full = float(sum(math.ceil(c.working_set) * b for c, b in zip(curves, rb)))
    budgets = np.unique(np.geomspace(rb.min(), max(full, rb.min()), points).round())
    uses = sum(c.n_uses for c in curves) or 1.0
    out = {"bytes": [], "rows": [], "hit_ratio": []}
    for b in budgets:  # a loop per budget
        sizes = split_budget(curves, row_bytes, float(b))
        out["bytes"].append(float(sum(x * r for x, r in zip(sizes, rb))))
        out["rows"].append(int(sum(sizes)))
        out["hit_ratio"].append(float(sum(float(c.hits(x)) for c, x in zip(curves, sizes))) / uses)
    return out


def split_budget(curves: Sequence[LruCurve], row_bytes: Sequence[int], budget: float,
                 start: Sequence[int] | None = None, points: int = 400) -> list[int]:
    """Rows per table that maximise total hits within ``budget`` bytes (on top of
    ``start`` rows already given): a Lagrangian over each curve's hull, searched
    on a grid of sizes per table, bisecting the price of a byte."""
    T = len(curves)
    if T == 0 or budget <= 0:
        return [0] * T
    cand, gain, cost = _size_grid(curves, row_bytes, start, points)

    def pick(price):
        k = np.argmax(gain - price * cost, axis=1)
        return k, cost[np.arange(T), k].sum()

    k, spent = pick(0.0)
    if spent <= budget:
        return cand[np.arange(T), k].astype(np.int64).tolist()
    lo, hi = 0.0, 1.0
    while pick(hi)[1] > budget:
        hi *= 4
    for _ in range(60):
        mid = (lo + hi) / 2
        if pick(mid)[1] > budget:
            lo = mid
        else:
            hi = mid
    k, spent = pick(hi)
    sizes = cand[np.arange(T), k].astype(np.int64)
    # the price leaves part of the budget where a hull segment did not fit whole:
    # spend it on the steepest next segments, the last one partly
    left = budget - spent
    open_ = np.ones(T, dtype=bool)
    rb = np.asarray(row_bytes, dtype=np.float64)
    for _ in range(4 * T):
        nxt = np.minimum(k + 1, points)
        step_rows = cand[np.arange(T), nxt] - cand[np.arange(T), k]
        can = open_ & (step_rows > 0) & (rb <= left)
        if not can.any():
            break
        slope = np.where(can, (gain[np.arange(T), nxt] - gain[np.arange(T), k]) / np.maximum(step_rows * rb, 1e-300), -np.inf)
        i = int(np.argmax(slope))
        rows = min(int(step_rows[i]), int(left // rb[i]))
        sizes[i] += rows
        left -= rows * rb[i]
        if rows == step_rows[i]:
            k[i] += 1
        else:
            open_[i] = False
    return sizes.tolist()
