"""A plain-Python model of the store's cache semantics (see tierstore/store.py),
written from the documented rules, one id at a time: the oracle for placement
and hit counts in the state-machine tests."""
from __future__ import annotations


class CacheModel:
    def __init__(self, hbm_rows: int, ddr_rows: int, policy: str):
        self.h, self.d, self.policy = hbm_rows, ddr_rows, policy
        self.hbm: dict[int, tuple[int, int]] = {}  # id -> (last use clock, frequency)
        self.ddr: dict[int, tuple[int, int]] = {}
        self.clock = 0
        self.counts = {"hbm": [0, 0], "ddr": [0, 0]}  # hits, misses

    def _rank(self, meta):
        last, freq = meta
        return (freq, last) if self.policy == "lfu" else (last,)

    def _top(self, items: dict, k: int) -> set:
        return set(sorted(items, key=lambda x: self._rank(items[x]), reverse=True)[: max(k, 0)])

    def read(self, ids: list[int]) -> None:
        first: dict[int, int] = {}
        for pos, x in enumerate(ids):
            first.setdefault(x, pos)
        new = {}
        for x, pos in first.items():
            if x in self.hbm:
                old_freq = self.hbm[x][1]
            elif x in self.ddr:
                old_freq = self.ddr[x][1]
            else:
                old_freq = 0
            new[x] = (self.clock + pos, old_freq + 1)
            if self.h:
                self.counts["hbm"][0 if x in self.hbm else 1] += 1
            if self.d and x not in self.hbm:
                self.counts["ddr"][0 if x in self.ddr else 1] += 1
        self.clock += len(ids)

        if self.h:
            kept_calls = self._top(new, self.h)
            others = {x: m for x, m in self.hbm.items() if x not in new}
            kept_others = self._top(others, self.h - len(kept_calls))
            demoted = {x: others[x] for x in others if x not in kept_others}
            self.hbm = {**{x: others[x] for x in kept_others}, **{x: new[x] for x in kept_calls}}
            down = {x: new[x] for x in new if x not in kept_calls}
        else:
            demoted, down = {}, dict(new)
        if self.d:
            kept_down = self._top(down, self.d)
            others = {**{x: m for x, m in self.ddr.items() if x not in new}, **demoted}
            kept_others = self._top(others, self.d - len(kept_down))
            self.ddr = {**{x: others[x] for x in kept_others}, **{x: down[x] for x in kept_down}}
