"""What ``TableSpec(admit_after=N)`` does on a recorded trace, by the store's own
count-min sketch (tierstore/engine/admission.py), so the prediction equals its counters."""
from __future__ import annotations

import numpy as np

from tierstore.engine.admission import CountMinSketch
from tierstore.trace import Trace


def predict_admission(trace: Trace, table: str, admit_after: int, width: int = 1 << 20, depth: int = 4) -> dict:
    """What a table with ``admit_after`` does on this trace, each read call one step:
    ``admitted`` and ``rejected`` row uses (update kept; initial value served and
    update dropped) and ``rows_admitted`` (rows admitted by the end: those that get
    storage once trained), by the store's own count-min sketch, so equal to its
    counters; ``exact_*`` the same by exact counts: the difference is the
    sketch's false positives (rows admitted early)."""
    ids, offsets, _ = trace.table_calls(trace.table_index(table))
    sketch = CountMinSketch(width, depth) if admit_after > 1 else None
    rejected, kept = 0, []
    for lo, hi in zip(offsets[:-1], offsets[1:]):  # a loop per call, as the store's steps
        if sketch is None:
            break
        uid = np.unique(ids[lo:hi])
        admitted = sketch.add(uid)[1] >= admit_after
        rejected += len(uid) - int(admitted.sum())
        kept.append(uid[admitted])
    rows, uses = _uses_per_row(ids, offsets)
    exact_rejected = int(np.minimum(uses, admit_after - 1).sum())
    # admitted at one of its uses (not merely by the end, through other rows' counts)
    rows_admitted = len(np.unique(np.concatenate(kept))) if kept else (0 if sketch else len(rows))
    return {"admit_after": admit_after, "sketch": {"width": width, "depth": depth, "bytes": width * depth,
                                                   "fill": sketch.fill() if sketch else 0.0},
            "distinct_rows": len(rows), "uses": int(uses.sum()), "admitted": int(uses.sum()) - rejected, "rejected": rejected,
            "rows_admitted": rows_admitted, "exact_admitted": int(uses.sum()) - exact_rejected, "exact_rejected": exact_rejected,
            "exact_rows_admitted": int((uses >= admit_after).sum())}


def _uses_per_row(ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows, and the calls that use each (a row repeated in a call counts once)."""
    call = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    pairs = np.unique(np.stack([ids, call]), axis=1)  # (row, call) once each
    return np.unique(pairs[0], return_counts=True)
