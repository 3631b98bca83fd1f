"""Stateful test: the store against a dict of row values and the plain cache model."""
import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tierstore
from tierstore.spec import initial_rows
from cache_model import CacheModel

ID_SPACE = 24
DIM = 3
ids_strategy = st.lists(st.integers(0, ID_SPACE - 1), min_size=0, max_size=12)


class StoreMachine(RuleBasedStateMachine):
    @initialize(
        hbm=st.integers(0, 5), ddr=st.integers(0, 7), policy=st.sampled_from(["lru", "lfu"]),
        unbounded=st.booleans(),
    )
    def open_store(self, hbm, ddr, policy, unbounded):
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        # unbounded id space uses the hash index, bounded the dense one
        self.spec = tierstore.TableSpec("t", None if unbounded else ID_SPACE, DIM, init=tierstore.RowInit.uniform(-1, 1, seed=7), state_dim=1)
        self.sizes = dict(hbm_rows=hbm, ddr_rows=ddr, policy=policy)
        self.store = tierstore.TieredStore(self.tmp.name, [self.spec], device="cpu", **self.sizes)
        self.values = {}  # id -> full stored row (weights + state)
        self.model = CacheModel(hbm, ddr, policy)
        self.durable = {}

    def expected(self, ids):
        rows = initial_rows(self.spec, np.asarray(ids, dtype=np.int64))
        for i, x in enumerate(ids):
            if x in self.values:
                rows[i] = self.values[x]
        return rows

    @rule(ids=ids_strategy, with_state=st.booleans())
    def read(self, ids, with_state):
        got = self.store.read("t", ids, with_state=with_state)
        want = self.expected(ids)[:, : (DIM + 1 if with_state else DIM)]
        assert torch.equal(got, torch.from_numpy(want)), (got, want)
        self.model.read(ids)

    @rule(ids=ids_strategy, data=st.data(), with_state=st.booleans())
    def write(self, ids, data, with_state):
        cols = DIM + 1 if with_state else DIM
        vals = np.array(
            data.draw(st.lists(st.lists(st.floats(-4, 4, width=32), min_size=cols, max_size=cols), min_size=len(ids), max_size=len(ids))),
            dtype=np.float32,
        ).reshape(len(ids), cols)
        self.store.write("t", ids, vals, with_state=with_state)
        current = self.expected(ids)
        for i, x in enumerate(ids):  # last value wins
            row = current[i].copy() if x not in self.values else self.values[x].copy()
            row[:cols] = vals[i]
            self.values[x] = row

    @rule()
    def flush(self):
        self.store.flush()
        self.durable = {k: v.copy() for k, v in self.values.items()}

    @rule()
    def reopen(self):
        self.store.close()
        self.store = tierstore.TieredStore(self.tmp.name, device="cpu", **self.sizes)
        self.model = CacheModel(self.model.h, self.model.d, self.model.policy)

    @precondition(lambda self: hasattr(self, "store"))
    @invariant()
    def placement_and_counts_match_model(self):
        t = self.store._tables["t"]
        for name, tier in (("hbm", t.hbm), ("ddr", t.ddr)):
            want = getattr(self.model, name)
            got = set() if tier is None else set(tier.ids[tier.ids >= 0].tolist())
            assert got == set(want), (name, got, set(want))
            if tier is not None:
                for x, (last, freq) in want.items():
                    slot = int(tier.lookup(torch.tensor([x]))[0])
                    assert int(tier.last[slot]) == last
                    if self.model.policy == "lfu":  # LRU never reads frequencies, so the store may skip them
                        assert int(tier.freq[slot]) == freq
        stats = self.store.stats()
        counts = self.model.counts
        # the model's counts restart at reopen; the store's are per open too
        assert (stats["hbm"]["hits"], stats["hbm"]["misses"]) == tuple(counts["hbm"])
        assert (stats["ddr"]["hits"], stats["ddr"]["misses"]) == tuple(counts["ddr"])

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            # everything survives a final close and reopen
            with tierstore.TieredStore(self.tmp.name, device="cpu") as again:
                ids = sorted(self.values)
                if ids:
                    assert torch.equal(again.read("t", ids, with_state=True), torch.from_numpy(self.expected(ids)))
            self.tmp.cleanup()


TestStoreMachine = StoreMachine.TestCase
