"""Replay of one table's uses through the store's two tiers at one size, without
data: LRU, LFU, lookahead and Belady's MIN.

LFU and lookahead are not stack algorithms (one pass cannot give every size, as
tierstore/curves.py does for LRU): :class:`CacheSim` replays a table at one
size through a data-free copy of the planning in ``TableStore._access``
(tierstore/table.py), with the same policies (``tierstore.eviction``), so its
counts equal the store's; :class:`HeapSim` picks the same victims from heaps,
for many small calls. Belady's MIN (farthest next use evicted first, one level
of h + d rows) bounds the hits any policy can get at that size.

This module is the one place the capacity tools simulate a cache step: a change
to how the store plans a step is mirrored here, and nowhere else.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierstore.eviction import make_policy
from tierstore.eviction.lookahead import NOT_IN_WINDOW, LookaheadPolicy
from tierstore.progress import ProgressFactory, open_progress
from tierstore.trace_streams import TableStream


@dataclass
class TierCounts:
    hbm_hits: int = 0
    hbm_misses: int = 0
    ddr_hits: int = 0
    ddr_misses: int = 0
    hbm_evictions: int = 0
    ddr_evictions: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _SimTier:
    """One tier's slots: row, use clock and step count per slot, like CacheTier without data."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows = np.full(capacity, -1, dtype=np.int64)
        self.last = np.zeros(capacity, dtype=np.int64)
        self.freq = np.zeros(capacity, dtype=np.int64)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.n_free = capacity

    def occupied_except(self, slots: np.ndarray) -> np.ndarray:
        mask = self.rows >= 0
        mask[slots] = False
        return np.flatnonzero(mask)

    def add(self, rows, last, freq) -> np.ndarray:
        n = len(rows)
        slots = self._free[self.n_free - n : self.n_free].copy()
        self.n_free -= n
        self.rows[slots], self.last[slots], self.freq[slots] = rows, last, freq
        return slots

    def remove(self, slots) -> None:
        n = len(slots)
        self.rows[slots] = -1
        self._free[self.n_free : self.n_free + n] = slots
        self.n_free += n


class CacheSim:
    """The store's two exclusive tiers for one table, without data: the planning of
    ``TableStore._access`` (tierstore/table.py) on slot arrays, one call at a time.

    ``choose(rows, last, freq, k, now)`` returns positions of the k victims among
    resident rows; ``choose_call`` (default: ``choose``) ranks the rows of a call
    that is larger than a tier (the store uses the plain policy there). A call
    costs O(call + tier) like the store's own planning: the victims are chosen
    among every resident row.
    """

    def __init__(self, space: int, hbm_rows: int, ddr_rows: int,
                 choose: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], np.ndarray],
                 choose_call: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], np.ndarray] | None = None):
        self.H = _SimTier(int(hbm_rows)) if hbm_rows > 0 else None
        self.D = _SimTier(int(ddr_rows)) if ddr_rows > 0 else None
        self.choose = choose
        self.choose_call = choose_call or choose
        self.where = np.zeros(space, dtype=np.int8)  # 0 uncached, 1 HBM, 2 DDR
        self.slot = np.zeros(space, dtype=np.int64)
        self.counts = TierCounts()

    def call(self, u: np.ndarray, key: np.ndarray, now: int) -> None:
        H, D, c = self.H, self.D, self.counts
        n = len(u)
        w = self.where[u]
        sl = self.slot[u]
        in_h, in_d = w == 1, w == 2
        n_h = int(np.count_nonzero(in_h))
        if H is not None:
            c.hbm_hits += n_h
            c.hbm_misses += n - n_h
            if n_h == n:
                H.last[sl] = key
                H.freq[sl] += 1
                return
        n_d = int(np.count_nonzero(in_d))
        if D is not None:
            c.ddr_hits += n_d
            c.ddr_misses += n - n_h - n_d
            if H is None and n_d == n:
                D.last[sl] = key
                D.freq[sl] += 1
                return
        if H is None and D is None:
            return
        new_freq = np.ones(n, dtype=np.int64)
        if n_h:
            new_freq[in_h] += H.freq[sl[in_h]]
        if n_d:
            new_freq[in_d] += D.freq[sl[in_d]]
        keep_h = np.zeros(n, dtype=bool)
        demote = np.empty(0, dtype=np.int64)  # HBM slots of non-call rows going down
        if H is not None:
            keep_h[:] = True
            if n <= H.capacity:
                need = (n - n_h) - H.n_free
                if need > 0:
                    cand = H.occupied_except(sl[in_h])
                    demote = cand[self.choose(H.rows[cand], H.last[cand], H.freq[cand], need, now)]
            else:
                keep_h[self.choose_call(u, key, new_freq, n - H.capacity, now)] = False
                demote = H.occupied_except(sl[in_h])
        e_rows = H.rows[demote] if H is not None else demote
        e_last = H.last[demote] if H is not None else demote
        e_freq = H.freq[demote] if H is not None else demote
        down = np.flatnonzero(~keep_h)
        keep_d = np.zeros(n, dtype=bool)
        drop = np.empty(0, dtype=np.int64)  # DDR slots of non-call rows leaving
        survive = np.zeros(len(demote), dtype=bool)
        if D is not None:
            keep_d[down] = True
            if len(down) > D.capacity:
                keep_d[down[self.choose_call(u[down], key[down], new_freq[down], len(down) - D.capacity, now)]] = False
            others = D.occupied_except(sl[in_d])
            survive[:] = True
            k = len(others) + len(demote) - (D.capacity - int(np.count_nonzero(keep_d)))
            if k > 0:
                v = self.choose(np.concatenate([D.rows[others], e_rows]), np.concatenate([D.last[others], e_last]),
                                np.concatenate([D.freq[others], e_freq]), k, now)
                drop = others[v[v < len(others)]]
                survive[v[v >= len(others)] - len(others)] = False
        if H is not None:
            c.hbm_evictions += len(demote) + int(np.count_nonzero(in_h & ~keep_h))
        if D is not None:
            c.ddr_evictions += int(np.count_nonzero(in_d & ~keep_d & ~keep_h)) + len(drop) + int(np.count_nonzero(~survive))
        # commit, in the store's order
        if H is not None:
            H.remove(np.concatenate([demote, sl[in_h & ~keep_h]]))
            stay = in_h & keep_h
            H.last[sl[stay]], H.freq[sl[stay]] = key[stay], new_freq[stay]
            enter = ~in_h & keep_h
            self.slot[u[enter]] = H.add(u[enter], key[enter], new_freq[enter])
        if D is not None:
            self.where[D.rows[drop]] = 0
            D.remove(np.concatenate([sl[in_d & ~keep_d], drop]))
            stay = in_d & keep_d
            D.last[sl[stay]], D.freq[sl[stay]] = key[stay], new_freq[stay]
            enter = ~in_d & keep_d
            self.slot[u[enter]] = D.add(u[enter], key[enter], new_freq[enter])
            self.slot[e_rows[survive]] = D.add(e_rows[survive], e_last[survive], e_freq[survive])
        self.where[e_rows] = np.where(survive, 2, 0)
        self.where[u] = np.where(keep_h, 1, np.where(keep_d, 2, 0))


_BIG = 1 << 64  # above any use clock: freq * _BIG + last orders by (freq, last), as LFU does


class HeapSim:
    """:class:`CacheSim`'s tiers with each tier's rows in heaps ordered by the policy, so a
    call costs O((call + victims) log tier) instead of O(call + tier): the replay of many
    small calls (one id per call at worst) that CacheSim pays a whole tier scan for.

    Every policy here is a total order on resident rows (LRU: last; LFU: (freq, last);
    lookahead: rows outside the window by the base order, then in-window rows by
    (farthest next use, base order)), and the store's victims are the k smallest, so
    popping k times picks the same rows. Entries go stale when their row is used or
    leaves (checked against the row's ``last`` on pop); a lookahead row whose next use
    enters the window is found on pop and moved to the in-window heap.
    """

    def __init__(self, hbm_rows: int, ddr_rows: int, lfu: bool, window: int | None, look: bool,
                 choose_call: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], np.ndarray]):
        self.cap = (0, int(hbm_rows), int(ddr_rows))  # tiers 1 (HBM) and 2 (DDR); 0 rows: no tier
        self.members: tuple[set, set, set] = (set(), set(), set())
        self.tier: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.freq: dict[int, int] = {}
        self.next: dict[int, int] = {}  # lookahead: the call that next uses the row
        self.lfu, self.window, self.look = lfu, window, look
        self.heaps: tuple[list, list, list] = ([], [], [])  # by base order (lookahead: rows outside the window)
        self.inside: tuple[list, list, list] = ([], [], [])  # lookahead: in-window rows by (-next use, base order)
        self.choose_call = choose_call
        self.counts = TierCounts()
        self.now = 0

    def _in_window(self, row: int) -> bool:
        nxt = self.next.get(row, NOT_IN_WINDOW)
        return nxt != NOT_IN_WINDOW and (self.window is None or nxt <= self.now + self.window)

    def _push(self, t: int, row: int) -> None:
        last = self.last[row]
        base = self.freq[row] * _BIG + last if self.lfu else last
        if self.look and self._in_window(row):
            heapq.heappush(self.inside[t], ((-self.next[row], base), last, row))
        else:
            heapq.heappush(self.heaps[t], (base, last, row))
        if len(self.heaps[t]) + len(self.inside[t]) > 2 * len(self.members[t]) + 1024:
            self._compact(t)

    def _valid(self, t: int, entry, exclude) -> bool:
        row = entry[2]
        return self.tier.get(row) == t and self.last[row] == entry[1] and row not in exclude

    def _compact(self, t: int) -> None:
        for h in (self.heaps[t], self.inside[t]):
            h[:] = [e for e in h if self._valid(t, e, ())]
            heapq.heapify(h)

    def _pop(self, t: int, exclude) -> int:
        """The smallest resident row of tier t outside ``exclude`` (there is one)."""
        h = self.heaps[t]
        while h:
            entry = heapq.heappop(h)
            if not self._valid(t, entry, exclude):
                continue
            if self.look and self._in_window(entry[2]):
                heapq.heappush(self.inside[t], ((-self.next[entry[2]], entry[0]), entry[1], entry[2]))
                continue
            return entry[2]
        h = self.inside[t]
        while True:
            entry = heapq.heappop(h)
            if self._valid(t, entry, exclude):
                return entry[2]

    def _move(self, row: int, t: int) -> None:
        """Row to tier t (0: out of the cache)."""
        old = self.tier.get(row, 0)
        if old:
            self.members[old].discard(row)
        if t:
            self.tier[row] = t
            self.members[t].add(row)
            self._push(t, row)
        else:
            self.tier.pop(row, None)
            self.last.pop(row, None)
            self.freq.pop(row, None)

    def call(self, u: list, key: list, nxt: list | None, now: int) -> None:
        self.now = now
        if nxt is not None:
            self.next.update(zip(u, nxt))
        if len(u) == 1:
            return self._call_one(u[0], key[0])
        H, D = self.cap[1] > 0, self.cap[2] > 0
        c, tier, n = self.counts, self.tier, len(u)
        where = [tier.get(r, 0) for r in u]
        n_h, n_d = where.count(1), where.count(2)
        if H:
            c.hbm_hits += n_h
            c.hbm_misses += n - n_h
        if D:
            c.ddr_hits += n_d
            c.ddr_misses += n - n_h - n_d
        if (H and n_h == n) or (not H and D and n_d == n):
            for r, k in zip(u, key):  # all resident in the top tier: a touch
                self.last[r], self.freq[r] = k, self.freq[r] + 1
                self._push(tier[r], r)
            return
        if not (H or D):
            return
        new_freq = [self.freq[r] + 1 if w else 1 for r, w in zip(u, where)]
        exclude = set(u)
        keep_h = [H] * n
        demote = []
        if H:
            if n <= self.cap[1]:
                need = (n - n_h) - (self.cap[1] - len(self.members[1]))
                demote = [self._pop(1, exclude) for _ in range(need)]
            else:
                for i in self.choose_call(np.array(u), np.array(key), np.array(new_freq), n - self.cap[1], now).tolist():
                    keep_h[i] = False
                demote = list(self.members[1] - exclude)
        down = [i for i in range(n) if not keep_h[i]]
        keep_d = [False] * n
        dead = set()  # rows leaving the cache: DDR victims, demoted rows with no room
        if D:
            for i in down:
                keep_d[i] = True
            if len(down) > self.cap[2]:
                cand = np.array(down)
                for i in self.choose_call(np.array(u)[cand], np.array(key)[cand], np.array(new_freq)[cand],
                                          len(down) - self.cap[2], now).tolist():
                    keep_d[down[i]] = False
            for r in demote:  # demoted rows compete for DDR with their HBM order
                self._move(r, 2)
            k = len(self.members[2]) - n_d - (self.cap[2] - keep_d.count(True))
            dead = {self._pop(2, exclude) for _ in range(k)}
        else:
            dead = set(demote)
        if H:
            c.hbm_evictions += len(demote) + sum(1 for w, kh in zip(where, keep_h) if w == 1 and not kh)
        if D:
            c.ddr_evictions += len(dead) + sum(1 for w, kh, kd in zip(where, keep_h, keep_d) if w == 2 and not kh and not kd)
        for r in dead:
            self._move(r, 0)
        for r, k, f, kh, kd in zip(u, key, new_freq, keep_h, keep_d):
            self.last[r], self.freq[r] = k, f
            self._move(r, 1 if kh else 2 if kd else 0)

    def _call_one(self, r: int, k: int) -> None:
        """``call`` for one id, where every branch of the general case is known."""
        H, D = self.cap[1] > 0, self.cap[2] > 0
        c, w = self.counts, self.tier.get(r, 0)
        if H:
            c.hbm_hits += w == 1
            c.hbm_misses += w != 1
        if D:
            c.ddr_hits += w == 2
            c.ddr_misses += w == 0
        if (H and w == 1) or (not H and D and w == 2):
            self.last[r], self.freq[r] = k, self.freq[r] + 1
            self._push(w, r)
            return
        if not (H or D):
            return
        f = self.freq[r] + 1 if w else 1
        exclude = (r,)
        dead = []
        if H:
            demote = [self._pop(1, exclude)] if len(self.members[1]) >= self.cap[1] else []
            c.hbm_evictions += len(demote)
            if D:
                for d in demote:
                    self._move(d, 2)
                dead = [self._pop(2, exclude) for _ in range(len(self.members[2]) - (w == 2) - self.cap[2])]
                c.ddr_evictions += len(dead)
            else:
                dead = demote
        else:
            dead = [self._pop(2, exclude) for _ in range(len(self.members[2]) - self.cap[2] + 1)]
            c.ddr_evictions += len(dead)
        for d in dead:
            self._move(d, 0)
        self.last[r], self.freq[r] = k, f
        self._move(r, 1 if H else 2)


def simulate(stream: TableStream, hbm_rows: int, ddr_rows: int, policy: str = "lfu",
             window: int | None = None, base: str = "lru", progress: ProgressFactory | None = None,
             method: str = "auto") -> TierCounts:
    """Replay one table through the store's tiers at one size.

    ``policy``: "lru", "lfu" (the store's policies), "lookahead" (the store's
    ``eviction="lookahead"`` with the next ``window`` calls of the table
    announced by prefetch: resident rows they use are pinned and ranked by next
    use, the rest by ``base``; a call larger than a tier keeps its rows by
    ``base``, as the store does) or "belady" (farthest next use first over the
    whole future, the call's own rows included: the offline bound).
    ``method``: "heap" (:class:`HeapSim`, O(log tier) per id), "scan"
    (:class:`CacheSim`, O(call + tier) per call, vectorized) or "auto": the
    cheaper for the stream's mean call size. Both count the same.
    """
    if stream.num_rows is not None:  # as the store does
        hbm_rows, ddr_rows = min(hbm_rows, stream.num_rows), min(ddr_rows, stream.num_rows)
    hbm_rows, ddr_rows = clamp_sizes(hbm_rows, ddr_rows, stream.working_set)
    choose_call = None
    if policy in ("lru", "lfu"):
        pol = make_policy(policy)
        choose = lambda rows, last, freq, k, now: pol.select(last, freq, k)  # noqa: E731
        next_call = None
    elif policy in ("lookahead", "belady"):
        look = LookaheadPolicy(make_policy(base), None if policy == "belady" else window)
        if policy == "lookahead" and window is None:
            raise ValueError("policy='lookahead' needs window=K (batches); policy='belady' is the infinite window")
        nxt = stream.next_use()
        calls = stream.use_call()
        next_call = np.where(nxt >= 0, calls[np.maximum(nxt, 0)], NOT_IN_WINDOW)
        row_next = np.full(stream.space, NOT_IN_WINDOW, dtype=np.int64)

        def choose(rows, last, freq, k, now):
            return look.select(look.next_use_in_window(row_next[rows], now), last, freq, k)

        if policy == "lookahead":
            choose_call = lambda rows, last, freq, k, now: look.base.select(last, freq, k)  # noqa: E731
    else:
        raise ValueError(f"unknown policy {policy!r}; choose lru, lfu, lookahead or belady")
    if method == "auto":
        method = "heap" if _heap_is_cheaper(stream, hbm_rows + ddr_rows) else "scan"
    if method not in ("heap", "scan"):
        raise ValueError(f"unknown method {method!r}; choose auto, heap or scan")
    b = stream.bounds
    bar = open_progress(progress, stream.n_uses, f"{policy} {stream.name} {hbm_rows}:{ddr_rows}")
    if method == "heap":
        sim = HeapSim(hbm_rows, ddr_rows, "lfu" in (policy, base if next_call is not None else None),
                      window if policy == "lookahead" else None, next_call is not None, choose_call or choose)
        rows, keys = stream.row.tolist(), stream.key.tolist()
        nxt = next_call.tolist() if next_call is not None else None
        bl = b.tolist()
        done = 0
        for j in range(stream.n_calls):  # a loop per call; O(log tier) per id
            lo, hi = bl[j], bl[j + 1]
            if hi == lo:
                continue
            if policy == "belady":  # its choose_call reads row_next
                row_next[stream.row[lo:hi]] = next_call[lo:hi]
            sim.call(rows[lo:hi], keys[lo:hi], nxt[lo:hi] if nxt is not None else None, j)
            if hi - done >= 1 << 16:
                bar.update(hi - done)
                done = hi
        bar.update(stream.n_uses - done)
        bar.close()
        return sim.counts
    sim = CacheSim(stream.space, hbm_rows, ddr_rows, choose, choose_call)
    for j in range(stream.n_calls):  # a loop per call; each call is vectorized
        lo, hi = int(b[j]), int(b[j + 1])
        if hi == lo:
            continue
        u = stream.row[lo:hi]
        if next_call is not None:
            row_next[u] = next_call[lo:hi]
        sim.call(u, stream.key[lo:hi], j)
        bar.update(hi - lo)
    bar.close()
    return sim.counts


def _heap_is_cheaper(stream: TableStream, cached_rows: int) -> bool:
    """HeapSim costs ~HEAP_ID_NS per id; CacheSim ~SCAN_CALL_NS per call plus
    ~SCAN_ROW_NS per id and cached row (measured on the 2-core machine)."""
    per_call = stream.n_uses / max(stream.n_calls, 1)
    return per_call * HEAP_ID_NS < SCAN_CALL_NS + (per_call + cached_rows) * SCAN_ROW_NS


HEAP_ID_NS, SCAN_CALL_NS, SCAN_ROW_NS = 8000, 60000, 20


def clamp_sizes(hbm_rows: int, ddr_rows: int, working_set: float) -> tuple[int, int]:
    """The same tiers, no larger than the rows the trace touches: counts do not change
    (HBM fills before anything goes down and stays full, so DDR never holds more
    than the working set less HBM), and slot arrays are not sized by a huge ask.
    A tier stays at least one row, since a tier that exists counts its misses."""
    ws = int(math.ceil(working_set))
    h = min(int(hbm_rows), max(ws, 1))
    return h, min(int(ddr_rows), max(ws - h, 1))


def belady_hits(stream: TableStream, rows: int) -> int:
    """Hits of Belady's MIN with one level of ``rows`` rows under the store's batch
    semantics (every row of a call is brought in; farthest next use leaves first):
    the most any policy can hit with that many rows in total."""
    return simulate(stream, rows, 0, "belady").hbm_hits if rows > 0 else 0
