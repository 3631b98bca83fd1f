"""One cache step of one table, planned without data: the one statement of the step's rules.

A read step takes the call's unique ids through a table's tiers, HBM above DDR
(either may be absent; exclusive: a cached row lives in one of them). Given
where each id is now and what the tiers hold (per-slot use clocks, step counts
and dirty bits, capacities, policy, the prefetch window's next uses),
:meth:`StepPlanner.plan` decides the whole step and changes nothing:

- HBM keeps every row of the call (the policy's highest ranked, if the call is
  larger than HBM), making room by evicting its other rows, ranked by the policy;
  those go down to DDR;
- DDR takes the call's rows HBM does not keep (the highest ranked, if they are
  more than DDR holds), and makes room by evicting its other rows and the rows
  HBM sent down, ranked together; those leave the cache;
- rows the prefetch window uses next are pinned: evicted only when nothing else
  is left (farthest next use first with lookahead eviction);
- dirty rows leaving the cache are written back before they go.

Each call row is used at its use clock; its step count is one more than it had
in the cache (1 when it comes in), and it keeps its dirty bit as it moves.

Three callers carry the plan out: the store over its rows (tierstore/engine/table.py),
the daemon client over the wire (tierstore/daemon/client.py), and the capacity
simulator over slot arrays without rows (tierstore/capacity/cachesim.py); so the
simulator's counts are the store's. Because planning changes nothing, a failed
fetch or write-back leaves a store as it was.

Numpy only: a tier is read through :class:`TierMeta`, whose arrays are on the host.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tierstore.eviction import UNUSED, EvictionPolicy
from tierstore.eviction.lookahead import NOT_IN_WINDOW, lookahead_victims

# UNUSED: the use clock and step count of a free slot. Every policy ranks it after every
# row, so victims are chosen over the per-slot arrays as they are (StepPlanner._make_room).

_EMPTY = np.empty(0, dtype=np.int64)


class TierMeta(Protocol):
    """What the planner reads of one tier (tierstore.engine.tiers.CacheTier, or the simulator's)."""

    capacity: int
    policy: EvictionPolicy
    lookahead: bool  # rank pinned rows by next use (eviction="lookahead")

    @property
    def free(self) -> int: ...

    def slot_meta(self) -> tuple[np.ndarray, np.ndarray]:
        """Use clock and step count of every slot (UNUSED in free slots), on the host;
        read, never written."""
        ...

    def meta_at(self, slots: np.ndarray, *names: str) -> list[np.ndarray]:
        """The per-slot ``names`` ("ids", "last", "freq", "dirty") at ``slots``, on the host."""
        ...


# next use of the row in each slot of a tier, NOT_IN_WINDOW for none or a free slot; None without a window
NextUse = Callable[[TierMeta], "np.ndarray | None"]
# positions (into the given call rows) of the k to send below, from their use clocks and step counts
CallVictims = Callable[[np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]
# which of these ids an announced batch reads (a mask); None without a window
InWindow = Callable[[np.ndarray], "np.ndarray | None"]
# Rounds of asking the window about the policy's victims (excluding those it reads) before
# ranking every slot by its next use: the rows a window pins are seldom the least recently used
PIN_ROUNDS = 4


@dataclass(frozen=True)
class LevelPlan:
    """One tier's part of a step. Masks are over the call's unique rows; slots are the tier's."""

    slot: np.ndarray  # each call row's slot in this tier, -1 where it is not here
    hit: np.ndarray  # call rows the tier holds before the step
    keep: np.ndarray  # call rows the tier holds after it
    evict: np.ndarray  # slots of the tier's other rows that leave it
    evictions: int  # rows counted as evicted from this tier

    def staying(self) -> np.ndarray:
        """Positions of the call rows the tier holds before and after."""
        return np.flatnonzero(self.hit & self.keep)

    def entering(self) -> np.ndarray:
        """Positions of the call rows the tier takes in."""
        return np.flatnonzero(~self.hit & self.keep)

    def leaving(self) -> np.ndarray:
        """Slots emptied: the evicted rows', and those of call rows the tier does not keep."""
        return np.concatenate([self.evict, self.slot[self.hit & ~self.keep]])


@dataclass(frozen=True)
class Demotion:
    """HBM's evicted rows on their way down: their HBM slots, ids, use clocks, step
    counts and dirty bits, and which of them DDR takes (the rest leave the cache)."""

    slots: np.ndarray
    ids: np.ndarray
    last: np.ndarray
    freq: np.ndarray
    dirty: np.ndarray
    kept: np.ndarray


@dataclass(frozen=True)
class WriteBack:
    """Dirty rows leaving the cache, to write to the level below before they go."""

    call: np.ndarray  # positions of call rows
    hbm: np.ndarray  # HBM slots (demoted rows DDR does not take)
    ddr: np.ndarray  # DDR slots

    def __len__(self) -> int:
        return len(self.call) + len(self.hbm) + len(self.ddr)


@dataclass(frozen=True)
class StepPlan:
    """A planned step: the call's rows after it, and each tier's part (None for an absent tier)."""

    clock: np.ndarray  # each call row's use clock
    freq: np.ndarray  # its step count after the step
    dirty: np.ndarray  # its dirty bit before the step, where it moves between tiers or out (else False)
    hbm: LevelPlan | None
    ddr: LevelPlan | None
    demoted: Demotion
    write_back: WriteBack

    def leaving(self) -> np.ndarray:
        """Positions of the call rows no tier keeps."""
        keep = np.zeros(len(self.clock), dtype=bool)
        for level in (self.hbm, self.ddr):
            if level is not None:
                keep |= level.keep
        return np.flatnonzero(~keep)


class StepPlanner:
    """Plans the steps of one table's tiers, one at a time; keeps the arrays ranking
    copies into for the next step (a fresh 8 MB array, 1M slots, page-faults on every step)."""

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def plan(self, hbm: TierMeta | None, ddr: TierMeta | None, clock: np.ndarray, slot_h: np.ndarray,
             slot_d: np.ndarray, *, refresh: np.ndarray | None = None, next_use: NextUse | None = None,
             in_window: InWindow | None = None, call_victims: CallVictims | None = None) -> StepPlan:
        """Plan one step of the call's unique rows, used at ``clock``, at ``slot_h`` in HBM and
        ``slot_d`` in DDR (-1 where not there). ``refresh``: call rows to write back if they
        leave the cache even when clean. ``next_use``: the prefetch window, per slot of a tier;
        ``in_window``, where given, answers for the policy's victims alone first (the same plan).
        ``call_victims``: ranks the call's own rows where a tier cannot hold them all (default:
        the tier's policy)."""
        n = len(clock)
        in_h, in_d = slot_h >= 0, slot_d >= 0
        freq = np.ones(n, dtype=np.int64)
        for tier, slot, hit in ((hbm, slot_h, in_h), (ddr, slot_d, in_d)):
            if tier is not None and hit.any():
                at = np.flatnonzero(hit)
                freq[at] += tier.meta_at(slot[at], "freq")[0]
        windows: dict[int, np.ndarray | None] = {}

        def window(tier: TierMeta) -> np.ndarray | None:  # asked once a step: HBM's is read by both levels
            if next_use is None:
                return None
            if id(tier) not in windows:
                windows[id(tier)] = next_use(tier)
            return windows[id(tier)]

        keep_h, demote = np.zeros(n, dtype=bool), _EMPTY
        if hbm is not None:
            keep_h, demote = self._make_room("hbm", hbm, slot_h, in_h, clock, freq, window, in_window, call_victims)
        if hbm is not None and len(demote):
            d_ids, d_last, d_freq, d_dirty = hbm.meta_at(demote, "ids", "last", "freq", "dirty")
        else:
            d_ids, d_last, d_freq, d_dirty = _EMPTY, _EMPTY, _EMPTY, np.zeros(0, dtype=bool)

        keep_d = np.zeros(n, dtype=bool)
        evict_d = _EMPTY
        d_kept = np.zeros(len(demote), dtype=bool)
        if ddr is not None:
            keep_d = ~keep_h
            if n - int(np.count_nonzero(keep_h)) > ddr.capacity:
                down = np.flatnonzero(keep_d)
                keep_d[down[self._rank_call(ddr, call_victims, down, clock, freq, len(down) - ddr.capacity)]] = False
            hits = slot_d[in_d]
            k = (ddr.capacity - ddr.free) - len(hits) + len(demote) - (ddr.capacity - int(np.count_nonzero(keep_d)))
            d_kept[:] = True
            if k > 0:  # DDR's other rows and HBM's demoted ones compete for its room
                last, ranked_freq = self._ranked("ddr", ddr, hits, *((d_last, d_freq) if len(demote) else ()))

                def ddr_window() -> np.ndarray | None:
                    nu = window(ddr)
                    return np.concatenate([nu, window(hbm)[demote]]) if nu is not None and hbm is not None else nu

                def ddr_ids(at: np.ndarray) -> np.ndarray:  # positions past DDR's slots are HBM's demoted rows
                    ids, inside = np.empty(len(at), dtype=np.int64), at < ddr.capacity
                    ids[inside] = ddr.meta_at(at[inside], "ids")[0]
                    ids[~inside] = d_ids[at[~inside] - ddr.capacity]
                    return ids
                rows = (ddr.capacity - ddr.free) - len(hits) + len(demote)
                victims = self._pick(ddr, last, ranked_freq, k, rows, ddr_window,
                                     in_window and (lambda at: in_window(ddr_ids(at))))
                evict_d = victims[victims < ddr.capacity]
                d_kept[victims[victims >= ddr.capacity] - ddr.capacity] = False

        dropped = ~d_kept
        hbm_plan = ddr_plan = None
        if hbm is not None:
            hbm_plan = LevelPlan(slot_h, in_h, keep_h, demote, len(demote) + int(np.count_nonzero(in_h & ~keep_h)))
        if ddr is not None:
            ddr_plan = LevelPlan(slot_d, in_d, keep_d, evict_d, int(np.count_nonzero(in_d & ~keep_d & ~keep_h)) + len(evict_d)
                                 + int(np.count_nonzero(dropped)))
        # dirty bits of the call rows that move: a row keeps its bit where it stays
        dirty = np.zeros(n, dtype=bool)
        for tier, level in ((hbm, hbm_plan), (ddr, ddr_plan)):
            if level is not None:
                moving = np.flatnonzero(level.hit & ~level.keep)
                if len(moving):
                    dirty[moving] = tier.meta_at(level.slot[moving], "dirty")[0]
        call_dirty = dirty if refresh is None else dirty | refresh
        write_back = WriteBack(
            call=np.flatnonzero(~keep_h & ~keep_d & call_dirty),
            hbm=demote[dropped & d_dirty],
            ddr=evict_d[ddr.meta_at(evict_d, "dirty")[0]] if ddr is not None and len(evict_d) else _EMPTY,
        )
        return StepPlan(clock, freq, dirty, hbm_plan, ddr_plan, Demotion(demote, d_ids, d_last, d_freq, d_dirty, d_kept),
                        write_back)

    def _make_room(self, level: str, tier: TierMeta, slot: np.ndarray, hit: np.ndarray, clock: np.ndarray,
                   freq: np.ndarray, window: NextUse, in_window: InWindow | None,
                   call_victims: CallVictims | None) -> tuple[np.ndarray, np.ndarray]:
        """The mask of call rows ``tier`` keeps (all of them unless the call is larger than
        the tier) and the slots of its other rows to evict.

        The policy ranks the per-slot arrays themselves, the call's slots set to UNUSED
        in a copy (free slots hold it already), not a gathered list of the other
        occupied slots: at 1M slots, gathering that list and its metadata costs ~20x the copy."""
        n = len(clock)
        keep = np.ones(n, dtype=bool)
        hits = slot[hit]
        if n > tier.capacity:  # keep the call rows ranked highest, and only them; every other row goes
            keep[self._rank_call(tier, call_victims, np.arange(n), clock, freq, n - tier.capacity)] = False
            others = tier.slot_meta()[0] != UNUSED
            others[hits] = False
            return keep, np.flatnonzero(others)
        need = n - len(hits) - tier.free
        if need <= 0:
            return keep, _EMPTY
        last, ranked_freq = self._ranked(level, tier, hits)
        return keep, self._pick(tier, last, ranked_freq, need, (tier.capacity - tier.free) - len(hits), lambda: window(tier),
                                in_window and (lambda at: in_window(tier.meta_at(at, "ids")[0])))

    @staticmethod
    def _rank_call(tier: TierMeta, call_victims: CallVictims | None, at: np.ndarray, clock: np.ndarray, freq: np.ndarray,
                   k: int) -> np.ndarray:
        if call_victims is not None:
            return call_victims(at, clock[at], freq[at], k)
        return tier.policy.select(clock[at], freq[at], k)

    def _ranked(self, level: str, tier: TierMeta, hits: np.ndarray, more_last: np.ndarray | None = None,
                more_freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """What a policy ranks to evict from ``tier``, but the rows at slots ``hits``: the
        per-slot use clocks and step counts, the hits' (and free slots') UNUSED, followed
        by those of rows coming in from above (``more_*``, also candidates). Copies."""
        n = tier.capacity + (0 if more_last is None else len(more_last))
        buffers = self._buffers.get(level)
        if buffers is None or len(buffers[0]) < n:
            buffers = self._buffers[level] = (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64))
        ranked = []
        for buffer, values, more in zip(buffers, tier.slot_meta(), (more_last, more_freq)):
            if len(ranked) == 1 and not tier.policy.uses_frequency and more is None:
                ranked.append(values)  # neither read nor written (_pick)
                continue
            out = buffer[:n]
            np.copyto(out[: tier.capacity], values)
            out[hits] = UNUSED
            if more is not None:
                out[tier.capacity:] = more
            ranked.append(out)
        return ranked[0], ranked[1]

    @staticmethod
    def _pick(tier: TierMeta, last: np.ndarray, freq: np.ndarray, k: int, rows: int,
              next_use: Callable[[], np.ndarray | None],
              in_window: Callable[[np.ndarray], np.ndarray | None] | None = None) -> np.ndarray:
        """Positions into the candidates' use clocks and step counts (from ``_ranked``, which
        it may overwrite) of the k rows to evict. A candidate whose use clock is UNUSED is
        not a row: it is never chosen; ``rows`` candidates are rows (counted by the caller:
        a pass over a 1M-slot tier to count them cost the planner ~5 ms).

        ``next_use()`` (the prefetch window's next step using each candidate, or
        NOT_IN_WINDOW) pins rows the window uses: they go only when nothing else is
        left, farthest next use first with lookahead eviction, else by policy.
        ``in_window(positions)``, where given, says which candidates the window reads: the
        policy's 2k lowest ranked are asked; if k of them are not read, the victims are the
        k of those the policy ranks lowest, else the ones read are set aside and the policy
        asked again. Use clocks are unique, so the victims are the k the policy ranks lowest
        among the rows the window does not read, as with ``next_use()``, which is asked only
        where PIN_ROUNDS did not settle it. (Asking for k at a time took three rounds a step
        at 1 GiB, each a pass over the whole tier.)"""
        uses_frequency = tier.policy.uses_frequency
        if in_window is not None:
            aside, left = [], rows
            for _ in range(PIN_ROUNDS):
                if left < k:
                    break
                chosen = tier.policy.select(last, freq, min(left, 2 * k))
                named = in_window(chosen)
                free = chosen if named is None else chosen[~named]
                if len(free) >= k:
                    return free[tier.policy.select(last[free], freq[free], k)]
                pinned = chosen[named]
                aside.append((pinned, last[pinned].copy(), freq[pinned].copy() if uses_frequency else None))
                last[pinned] = UNUSED
                if uses_frequency:
                    freq[pinned] = UNUSED
                left -= len(pinned)
            for pinned, was_last, was_freq in reversed(aside):  # as they were, for the ranking of every slot
                last[pinned] = was_last
                if was_freq is not None:
                    freq[pinned] = was_freq
        next_use = next_use()
        pinned = None if next_use is None else np.flatnonzero(next_use != NOT_IN_WINDOW)
        if pinned is not None and len(pinned):
            pinned = pinned[last[pinned] != UNUSED]
            if rows - len(pinned) >= k:  # the usual step: enough rows the window does not use
                last[pinned] = UNUSED
                if uses_frequency:
                    freq[pinned] = UNUSED
                pinned = None
        if pinned is None or not len(pinned):
            return tier.policy.select(last, freq, k)
        if not tier.lookahead:  # pinned, but ranked among themselves by the policy
            next_use = np.where(next_use == NOT_IN_WINDOW, NOT_IN_WINDOW, 0)
        next_use = np.where(last == UNUSED, -1, next_use)  # not a row: behind every pinned one
        return lookahead_victims(next_use, last, freq, k, tier.policy)
