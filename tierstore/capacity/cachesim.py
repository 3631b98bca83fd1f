"""Replay of one table's uses through the store's two tiers at one size, without
data: every registered policy (LRU, LFU, ...), lookahead and Belady's MIN.

LFU and lookahead are not stack algorithms (one pass cannot give every size, as
tierstore/capacity/curves.py does for LRU): :class:`CacheSim` replays a table at one
size through the store's own step (tierstore.engine.step plans it; CacheSim carries
it out on slot arrays without data), with the same policies
(``tierstore.eviction``), so its counts equal the store's; :class:`HeapSim`
picks the same victims from heaps, for many small calls, and is checked
against CacheSim (tests/test_capacity.py). Belady's MIN (farthest next use
evicted first, one level of h + d rows) bounds the hits any policy can get at
that size.
"""
from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierstore.eviction import POLICIES, EvictionPolicy, make_policy
from tierstore.eviction.lookahead import NOT_IN_WINDOW, LookaheadPolicy
from tierstore.capacity.progress import ProgressFactory, open_progress
from tierstore.engine.step import UNUSED, LevelPlan, StepPlan, StepPlanner
from tierstore.capacity.trace_streams import TableStream
from tierstore.errors import SettingError


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
    """One tier's slots without data: row id, use clock and step count per slot (UNUSED
    where free), as tierstore.engine.step reads a CacheTier."""

    def __init__(self, capacity: int, policy: EvictionPolicy, lookahead: bool):
        self.capacity = capacity
        self.policy = policy
        self.lookahead = lookahead
        self.rows = np.full(capacity, -1, dtype=np.int64)
        self.last = np.full(capacity, UNUSED, dtype=np.int64)
        self.freq = np.full(capacity, UNUSED, dtype=np.int64)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.free = capacity

    def slot_meta(self) -> tuple[np.ndarray, np.ndarray]:
        return self.last, self.freq

    def meta_at(self, slots: np.ndarray, *names: str) -> list[np.ndarray]:
        columns = {"ids": self.rows, "last": self.last, "freq": self.freq}
        return [columns[name][slots] if name in columns else np.zeros(len(slots), dtype=bool) for name in names]  # never dirty

    def commit(self, level: LevelPlan, plan: StepPlan, u: np.ndarray) -> np.ndarray:
        """This tier's part of a planned step of the call's rows ``u``, as CacheTier.commit;
        returns the slots of the rows that came in."""
        self.remove(level.leaving())
        stay = level.staying()
        self.last[level.slot[stay]], self.freq[level.slot[stay]] = plan.clock[stay], plan.freq[stay]
        enter = level.entering()
        return self.add(u[enter], plan.clock[enter], plan.freq[enter])

    def add(self, rows, last, freq) -> np.ndarray:
        n = len(rows)
        slots = self._free[self.free - n : self.free].copy()
        self.free -= n
        self.rows[slots], self.last[slots], self.freq[slots] = rows, last, freq
        return slots

    def remove(self, slots) -> None:
        n = len(slots)
        self.rows[slots], self.last[slots], self.freq[slots] = -1, UNUSED, UNUSED
        self._free[self.free : self.free + n] = slots
        self.free += n


# the next use of each of the rows, in the window (NOT_IN_WINDOW outside it), at call ``now``
RowsNextUse = Callable[[np.ndarray, int], np.ndarray]
# positions of the k of a call's rows to send below, from the rows, use clocks, step counts, at call ``now``
CallChoice = Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], np.ndarray]


class CacheSim:
    """The store's two exclusive tiers for one table, without data: the step that
    tierstore.engine.step plans, carried out on slot arrays, one call at a time.

    ``policy`` ranks rows as the store's tiers do; with ``next_use`` (lookahead
    eviction) the rows the window uses are pinned and ranked by next use.
    ``rank_call`` ranks the rows of a call larger than a tier (default: the policy,
    as the store does). A call costs O(call + tier) like the store's own planning:
    the victims are chosen among every resident row.
    """

    def __init__(self, space: int, hbm_rows: int, ddr_rows: int, policy: EvictionPolicy,
                 next_use: RowsNextUse | None = None, rank_call: CallChoice | None = None):
        look = next_use is not None
        self.H = _SimTier(int(hbm_rows), policy, look) if hbm_rows > 0 else None
        self.D = _SimTier(int(ddr_rows), policy, look) if ddr_rows > 0 else None
        self.next_use = next_use
        self.rank_call = rank_call
        self.planner = StepPlanner()
        self.where = np.zeros(space, dtype=np.int8)  # 0 uncached, 1 HBM, 2 DDR
        self.slot = np.zeros(space, dtype=np.int64)
        self.counts = TierCounts()

    def _window(self, tier: _SimTier, now: int) -> np.ndarray:
        occupied = tier.rows >= 0
        return np.where(occupied, self.next_use(np.where(occupied, tier.rows, 0), now), NOT_IN_WINDOW)

    def _rank_call(self, u: np.ndarray, now: int, at: np.ndarray, last: np.ndarray, freq: np.ndarray, k: int) -> np.ndarray:
        return self.rank_call(u[at], last, freq, k, now)

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
            if n_h == n:  # every row in HBM: nothing moves
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
        plan = self.planner.plan(H, D, key, np.where(in_h, sl, -1), np.where(in_d, sl, -1),
                                 next_use=None if self.next_use is None else functools.partial(self._window, now=now),
                                 call_victims=None if self.rank_call is None else functools.partial(self._rank_call, u, now))
        down = plan.demoted
        if H is not None:
            c.hbm_evictions += plan.hbm.evictions
            self.slot[u[plan.hbm.entering()]] = H.commit(plan.hbm, plan, u)
        if D is not None:
            c.ddr_evictions += plan.ddr.evictions
            self.where[D.rows[plan.ddr.evict]] = 0
            self.slot[u[plan.ddr.entering()]] = D.commit(plan.ddr, plan, u)
            self.slot[down.ids[down.kept]] = D.add(down.ids[down.kept], down.last[down.kept], down.freq[down.kept])
        self.where[down.ids] = np.where(down.kept, 2, 0)
        keep_h = plan.hbm.keep if H is not None else False
        keep_d = plan.ddr.keep if D is not None else False
        self.where[u] = np.where(keep_h, 1, np.where(keep_d, 2, 0))


class HeapSim:
    """:class:`CacheSim`'s tiers with each tier's rows in heaps ordered by the policy, so a
    call costs O((call + victims) log tier) instead of O(call + tier): the replay of many
    small calls (one id per call at worst) that CacheSim pays a whole tier scan for.

    Every policy is a total order on resident rows (its ``order``: LRU last, LFU (freq,
    last); lookahead: rows outside the window by the base order, then in-window rows by
    (farthest next use, base order)), and the store's victims are the k smallest, so
    popping k times picks the same rows. Entries go stale when their row is used or
    leaves (checked against the row's ``last`` on pop); a lookahead row whose next use
    enters the window is found on pop and moved to the in-window heap.
    """

    def __init__(self, hbm_rows: int, ddr_rows: int, policy: EvictionPolicy, window: int | None, look: bool,
                 rank_call: CallChoice):
        self.cap = (0, int(hbm_rows), int(ddr_rows))  # tiers 1 (HBM) and 2 (DDR); 0 rows: no tier
        self.members: tuple[set, set, set] = (set(), set(), set())
        self.tier: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.freq: dict[int, int] = {}
        self.next: dict[int, int] = {}  # lookahead: the call that next uses the row
        self.policy, self.window, self.look = policy, window, look
        self.heaps: tuple[list, list, list] = ([], [], [])  # by base order (lookahead: rows outside the window)
        self.inside: tuple[list, list, list] = ([], [], [])  # lookahead: in-window rows by (-next use, base order)
        self.rank_call = rank_call
        self.counts = TierCounts()
        self.now = 0

    def _in_window(self, row: int) -> bool:
        nxt = self.next.get(row, NOT_IN_WINDOW)
        return nxt != NOT_IN_WINDOW and (self.window is None or nxt <= self.now + self.window)

    def _push(self, t: int, row: int) -> None:
        last = self.last[row]
        base = self.policy.order(last, self.freq[row])
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
                for i in self.rank_call(np.array(u), np.array(key), np.array(new_freq), n - self.cap[1], now).tolist():
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
                for i in self.rank_call(np.array(u)[cand], np.array(key)[cand], np.array(new_freq)[cand],
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

    ``policy``: a registered policy's name ("lru", "lfu": the store's policies,
    ``tierstore.eviction.POLICIES``), "lookahead" (the store's
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
    if policy in POLICIES:
        pol = make_policy(policy)
        next_call = rows_next_use = rank_call = None
    elif policy in ("lookahead", "belady"):
        look = LookaheadPolicy(make_policy(base), None if policy == "belady" else window)
        if policy == "lookahead" and window is None:
            raise SettingError("policy='lookahead' needs window=K (batches); policy='belady' is the infinite window")
        pol = look.base
        nxt = stream.next_use()
        calls = stream.use_call()
        next_call = np.where(nxt >= 0, calls[np.maximum(nxt, 0)], NOT_IN_WINDOW)
        row_next = np.full(stream.space, NOT_IN_WINDOW, dtype=np.int64)

        def rows_next_use(rows, now):  # pins the rows the window uses
            return look.next_use_in_window(row_next[rows], now)

        def by_next_use(rows, last, freq, k, now):  # the offline bound ranks the call's own rows so too
            return look.select(rows_next_use(rows, now), last, freq, k)

        rank_call = by_next_use if policy == "belady" else None
    else:
        raise SettingError(f"unknown policy {policy!r}; choose {', '.join(sorted(POLICIES))}, lookahead or belady")
    if method == "auto":
        method = "heap" if _heap_is_cheaper(stream, hbm_rows + ddr_rows) else "scan"
    if method not in ("heap", "scan"):
        raise SettingError(f"unknown method {method!r}; choose auto, heap or scan")
    b = stream.bounds
    bar = open_progress(progress, stream.n_uses, f"{policy} {stream.name} {hbm_rows}:{ddr_rows}")
    if method == "heap":
        sim = HeapSim(hbm_rows, ddr_rows, pol, window if policy == "lookahead" else None, next_call is not None,
                      rank_call or (lambda rows, last, freq, k, now: pol.select(last, freq, k)))
        rows, keys = stream.row.tolist(), stream.key.tolist()
        nxt = next_call.tolist() if next_call is not None else None
        bl = b.tolist()
        done = 0
        for j in range(stream.n_calls):  # a loop per call; O(log tier) per id
            lo, hi = bl[j], bl[j + 1]
            if hi == lo:
                continue
            if policy == "belady":  # its rank_call reads row_next
                row_next[stream.row[lo:hi]] = next_call[lo:hi]
            sim.call(rows[lo:hi], keys[lo:hi], nxt[lo:hi] if nxt is not None else None, j)
            if hi - done >= 1 << 16:
                bar.update(hi - done)
                done = hi
        bar.update(stream.n_uses - done)
        bar.close()
        return sim.counts
    sim = CacheSim(stream.space, hbm_rows, ddr_rows, pol, rows_next_use, rank_call)
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
