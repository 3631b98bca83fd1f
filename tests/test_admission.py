"""Admission (admit_after), TTL eviction (ttl_steps) and store.evict for unbounded id spaces.

Oracles: exact counts of the ids (np.unique) for the sketch; a plain torch model
(nn.EmbeddingBag(sparse=True) and torch.optim.SGD over a dense weight matrix) that
applies the README's rules directly (an update is kept from the N-th step that
uses a row on; a row unused for T steps starts over from its initial value);
and the same training with other tier sizes, policies and prefetch depths.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import tierstore
from tierstore import RowInit, TableSpec, TieredEmbeddingBag, TieredStore, optim
from tierstore.engine.admission import CountMinSketch
from tierstore.engine.prefetch import LookaheadLoader
from tierstore.spec import initial_rows

D = 4
POOL = 600  # distinct ids of the tests' streams, spread over the 63-bit id space
IDS = np.random.default_rng(5).choice(1 << 62, POOL, replace=False).astype(np.int64)
LR = 0.5


def spec(**kw) -> TableSpec:
    return TableSpec("t", None, D, init=RowInit.normal(0, 0.1, seed=2), **kw)


def stream(steps: int, seed: int = 0, per_step: int = 24):
    """(positions into IDS, offsets, target) per step: a long tail, most rows used once or twice."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        pos = (torch.rand(per_step, generator=g) ** 4 * POOL).long()
        out.append((pos, torch.arange(0, per_step, 4), torch.randn(per_step // 4, D, generator=g)))
    return out


def module(path, table: TableSpec, kernels: str = "torch", **tiers) -> TieredEmbeddingBag:
    store = TieredStore(path, tables=[table], device="cpu", **tiers)
    return TieredEmbeddingBag(None, D, mode="sum", store=store, table="t", optimizer=optim.SGD(lr=LR), kernels=kernels)


def loss(out, target):
    return ((out - target) ** 2).sum()


def train(emb: TieredEmbeddingBag, steps, depth: int = 0) -> None:
    batches = [(torch.from_numpy(IDS)[pos], off, target) for pos, off, target in steps]
    loader = LookaheadLoader([(ids, off) for ids, off, _ in batches], emb, depth=depth)
    for (ids, off), (_, _, target) in zip(loader, batches):
        loss(emb(ids, off), target).backward()


class Reference:
    """The rules on a dense matrix: torch's EmbeddingBag and SGD, then the rows not
    admitted put back; before each step, rows idle ttl_steps or more set to initial."""

    def __init__(self, table: TableSpec):
        self.init = torch.from_numpy(initial_rows(table, IDS))
        self.bag = torch.nn.EmbeddingBag.from_pretrained(self.init.clone(), freeze=False, mode="sum", sparse=True)
        self.opt = torch.optim.SGD(self.bag.parameters(), lr=LR)
        self.table = table
        self.count = np.zeros(POOL, dtype=np.int64)
        self.last = np.full(POOL, -1, dtype=np.int64)
        self.step = 0

    def train(self, steps) -> None:
        for pos, off, target in steps:
            self.step += 1
            used = np.unique(pos.numpy())
            w = self.bag.weight.data
            if self.table.ttl_steps is not None:
                idle = used[(self.last[used] >= 0) & (self.last[used] + self.table.ttl_steps <= self.step - 1)]
                w[idle] = self.init[idle]
            self.count[used] += 1
            self.last[used] = self.step
            before = w.clone()
            self.opt.zero_grad()
            loss(self.bag(pos, off), target).backward()
            self.opt.step()
            rejected = used[self.count[used] < self.table.admit_after]
            w[rejected] = before[rejected]

    def rows(self) -> torch.Tensor:
        """Rows as a read after the last step sees them."""
        w = self.bag.weight.detach().clone()
        if self.table.ttl_steps is not None:
            idle = (self.last >= 0) & (self.last + self.table.ttl_steps <= self.step)
            w[idle] = self.init[idle]
        return w


def rows_after(emb: TieredEmbeddingBag) -> torch.Tensor:
    """Every row as the reference numbers them; a read, but with admission and TTL a read is a step: done last."""
    return emb.store.read(emb.table, torch.from_numpy(IDS))


# -- the sketch --------------------------------------------------------------------------------
def test_sketch_counts_never_fall_short_and_are_exact_without_collisions():
    rng = np.random.default_rng(1)
    steps = [np.unique(rng.choice(IDS, 40)) for _ in range(60)]
    exact = {}
    narrow, wide = CountMinSketch(64, 2), CountMinSketch(1 << 16, 4)
    for uid in steps:
        for i in uid:
            exact[i] = exact.get(i, 0) + 1
        before, after, _ = narrow.add(uid)
        assert (after > before).all()
        wide.add(uid)
    ids = np.array(sorted(exact), dtype=np.int64)
    truth = np.array([exact[i] for i in ids])
    assert (narrow.estimate(ids) >= truth).all()
    assert (narrow.estimate(ids) > truth).any(), "64 counters for 600 ids must collide"
    assert (wide.estimate(ids) == truth).all()


def test_sketch_is_deterministic_saturates_and_undoes():
    a, b = CountMinSketch(256, 3), CountMinSketch(256, 3)
    uid = np.unique(IDS[:50])
    for _ in range(300):
        a.add(uid)
        b.add(uid)
    assert np.array_equal(a.counters, b.counters)
    assert (a.estimate(uid) == 255).all()
    fresh = CountMinSketch(256, 3)
    fresh.add(uid[:10])
    saved = fresh.counters.copy()
    *_, token = fresh.add(uid)
    fresh.undo(token)
    assert np.array_equal(fresh.counters, saved)


# -- admission -----------------------------------------------------------------------------------
def test_rows_read_initial_and_drop_updates_until_admitted(tmp_path):
    table = spec(admit_after=3)
    emb = module(tmp_path, table, hbm_rows=8)
    ids, off = torch.tensor([IDS[0], IDS[1]]), torch.tensor([0, 1])
    init = torch.from_numpy(initial_rows(table, IDS[:2]))
    for step in (1, 2):
        loss(emb(ids, off), torch.ones(2, D)).backward()
        assert torch.equal(emb.store.trainer("t").reread(torch.sort(ids).values), init[torch.argsort(ids)]), f"step {step}"
    loss(emb(ids, off), torch.ones(2, D)).backward()  # the third use: its update is kept
    assert not torch.equal(emb.store.trainer("t").reread(torch.sort(ids).values), init[torch.argsort(ids)])
    emb.store.flush()
    rows = emb.store.stats(per_table=True)["t"]["rows"]
    assert rows["admitted"] == 2 and rows["rejected"] == 4 and rows["stored"] == 2
    emb.store.close()


def _fbgemm():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FBGEMM warns about its CPU-only build on import
        pytest.importorskip("fbgemm_gpu", reason="FBGEMM (optional peer) is not installed: pip install 'tierstore[fbgemm]'")
    return "fbgemm"


@pytest.mark.parametrize("admit_after, ttl, kernels", [(1, 6, "torch"), (3, None, "torch"), (2, 5, "torch"), (2, 5, "fbgemm")],
                         ids=["ttl", "admission", "both", "both-fbgemm"])
def test_training_follows_the_rules_whatever_the_tiers_policy_and_prefetch(tmp_path, admit_after, ttl, kernels):
    if kernels == "fbgemm":
        _fbgemm()
    table = spec(admit_after=admit_after, ttl_steps=ttl, admit_width=1 << 16)  # wide: exact counts
    steps = stream(40)
    ref = Reference(table)
    ref.train(steps)
    configs = {
        "no tiers": dict(),
        "all in hbm": dict(hbm_rows=POOL),
        "hbm=8": dict(hbm_rows=8),
        "hbm=8 ddr=16 lru": dict(hbm_rows=8, ddr_rows=16),
        "hbm=4 ddr=8 lfu": dict(hbm_rows=4, ddr_rows=8, policy="lfu"),
        "ddr=30 depth=4": dict(ddr_rows=30, depth=4),
    }
    final = {}
    for name, cfg in configs.items():
        depth = cfg.pop("depth", 0)
        emb = module(tmp_path / name.replace(" ", "_"), table, kernels, writeback_rows=64, writeback_group_rows=16, **cfg)
        train(emb, steps, depth)
        final[name] = rows_after(emb)
        life = emb.store.stats(per_table=True)["t"]["rows"]
        emb.store.close()
        if admit_after > 1:
            assert life["rejected"] > 0 and life["admitted"] > 0
    base = final["no tiers"]
    torch.testing.assert_close(base, ref.rows(), rtol=1e-5, atol=1e-6)
    init = torch.from_numpy(initial_rows(table, IDS))
    changed = (base != init).any(1)
    used = ref.count > 0
    assert changed.any() and (used & ~changed.numpy()).any(), "some used rows must be trained, some not (rejected or idle)"
    for name, rows in final.items():
        assert torch.equal(rows, base), f"{name} differs from the store without tiers"


# -- TTL -----------------------------------------------------------------------------------------
def stepped(store: TieredStore, n: int, start: int = 10_000) -> None:
    """n steps of the table that use other rows."""
    for i in range(n):
        store.read("t", [start + i])


@pytest.mark.parametrize("tiers", [dict(), dict(hbm_rows=4), dict(hbm_rows=2, ddr_rows=2)], ids=["none", "hbm", "small"])
def test_a_row_unused_for_ttl_steps_reads_initial_and_a_write_recreates_it(tmp_path, tiers):
    table = spec(ttl_steps=3)
    init = torch.from_numpy(initial_rows(table, np.array([7, 8])))
    with TieredStore(tmp_path, tables=[table], device="cpu", **tiers) as s:
        s.read("t", [7, 8])  # step 1 uses both
        s.write("t", [7, 8], torch.ones(2, D))
        stepped(s, 2)  # steps 2, 3
        assert torch.equal(s.read("t", [8]), torch.ones(1, D))  # step 4: 8 unused for 2 steps only
        stepped(s, 2)  # steps 5, 6
        assert torch.equal(s.read("t", [7, 8]), torch.cat([init[:1], torch.ones(1, D)]))  # step 7: 7 unused for 5 steps, 8 for 2
        s.write("t", [7], torch.full((1, D), 2.0))
        stepped(s, 2)  # steps 8, 9
        assert torch.equal(s.read("t", [7]), torch.full((1, D), 2.0))  # step 10
        stepped(s, 3)  # steps 11, 12, 13: 7 is gone
        s.write("t", [7], torch.full((1, D), 5.0))  # a write re-creates it, used at the latest step (13)
        stepped(s, 2)  # steps 14, 15
        assert torch.equal(s.read("t", [7]), torch.full((1, D), 5.0))  # step 16
        stepped(s, 3)
        assert torch.equal(s.read("t", [7, 8]), init)  # step 20


def test_idle_rows_leave_the_disk_and_the_rule_survives_reopen(tmp_path):
    table = spec(ttl_steps=4)
    init0 = torch.from_numpy(initial_rows(table, np.array([0])))
    with TieredStore(tmp_path, tables=[table], device="cpu", hbm_rows=8, writeback_rows=8, writeback_group_rows=4) as s:
        s.write("t", np.arange(200), np.ones((200, D)))  # no step yet: last used at step 0
        s.flush()
        assert s.stats(per_table=True)["t"]["rows"]["stored"] == 200
        s.read("t", [0, 1])  # step 1
        s.write("t", [0, 1], np.full((2, D), 3.0))
        stepped(s, 2, start=1000)  # steps 2, 3
        assert torch.equal(s.read("t", [0]), torch.full((1, D), 3.0))  # step 4
        for i in range(40):  # steps 5..44, a flush every 4 steps: commits, each followed by a sweep
            s.read("t", np.arange(2000 + 8 * i, 2008 + 8 * i))
            if i % 4 == 3:
                s.flush()
        rows = s.stats(per_table=True)["t"]["rows"]
        # the sweep judges rows by the durable step count: the last sweep ran after the flush
        # at step 44, with the cutoff of step 44's read: the flush at step 40, less 4.
        # Left: the rows of steps 37..44; gone: 0..199, 1000, 1001 and the 256 rows of steps 5..36
        assert rows["stored"] == 64 and rows["evicted"] == 458, rows
        assert (tmp_path / "data.mdb").stat().st_size > 0
    with TieredStore(tmp_path, device="cpu") as s:
        assert torch.equal(s.read("t", [0]), init0)
        assert torch.equal(s.read("t", [2000 + 8 * 39]), torch.from_numpy(initial_rows(table, np.array([2312]))))
        assert s.life("t").steps == 46


# -- evict -----------------------------------------------------------------------------------------
def test_evict_deletes_rows_everywhere_and_a_failure_changes_nothing(tmp_path, monkeypatch):
    table = spec()
    init = torch.from_numpy(initial_rows(table, np.arange(6)))
    with TieredStore(tmp_path, tables=[table], device="cpu", hbm_rows=2, ddr_rows=2) as s:
        s.write("t", np.arange(6), np.ones((6, D)))
        s.flush()
        s.read("t", [0, 1, 2, 3])  # 0..3 cached, 4, 5 on disk only
        s.write("t", [0, 4], np.full((2, D), 5.0))  # 0 dirty in a tier, 4 queued
        real = s._backend.delete_rows  # fault injection: LMDB deletes fail

        def failing(*args):
            raise OSError("injected")
        monkeypatch.setattr(s._backend, "delete_rows", failing)
        before = s.read("t", np.arange(6))
        with pytest.raises(OSError, match="injected"):
            s.evict("t", [0, 4, 5])
        assert torch.equal(s.read("t", np.arange(6)), before)
        monkeypatch.setattr(s._backend, "delete_rows", real)
        assert s.evict("t", [0, 4, 5, 99]) == 3
        assert torch.equal(s.read("t", [0, 4, 5]), init[[0, 4, 5]])
        assert torch.equal(s.read("t", [1, 2, 3]), torch.ones(3, D))
        assert s.stats(per_table=True)["t"]["rows"] == {"stored": 3, "admitted": 0, "rejected": 0, "expired": 0, "evicted": 3}
    with TieredStore(tmp_path, device="cpu") as s:
        assert torch.equal(s.read("t", np.arange(6)), torch.cat([init[:1], torch.ones(3, D), init[4:]]))


def test_bad_knobs_are_refused_with_the_fix():
    for kw, match in ((dict(admit_after=0), "admit_after"), (dict(admit_after=256), r"\[1, 255\]"),
                      (dict(admit_width=1000), "power of two"), (dict(admit_depth=9), "admit_depth"),
                      (dict(ttl_steps=0), "ttl_steps"), (dict(ttl_steps=2.5), "ttl_steps"),
                      (dict(evict_l2_below=0.0), "evict_l2_below"), (dict(evict_l2_below=float("nan")), "finite")):
        with pytest.raises(ValueError, match=match):
            spec(**kw)
    assert TableSpec.from_json(spec(admit_after=4, ttl_steps=9).to_json()) == spec(admit_after=4, ttl_steps=9)
    assert tierstore.TableSpec is TableSpec


def test_admission_counts_and_steps_are_durable_at_flush(tmp_path):
    table = spec(admit_after=3, ttl_steps=50)
    ids, off = torch.tensor([IDS[3]]), torch.tensor([0])
    emb = module(tmp_path, table, hbm_rows=4)
    for _ in range(2):
        loss(emb(ids, off), torch.ones(1, D)).backward()
    emb.store.close()  # flushes
    emb = module(tmp_path, table, hbm_rows=4)
    assert emb.store.life("t").steps == 2
    init = torch.from_numpy(initial_rows(table, IDS[3:4]))
    loss(emb(ids, off), torch.ones(1, D)).backward()  # the third use since the store was made
    assert not torch.equal(emb.store.trainer("t").reread(ids), init)
    emb.store.close()


def test_admitted_rejected_expired_evicted_are_exported_per_table(tmp_path):
    import urllib.request

    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    table = spec(admit_after=2, ttl_steps=2)
    with TieredStore(tmp_path, tables=[table], device="cpu", hbm_rows=4, registry=registry, name="s") as s:
        for i in range(6):
            s.read("t", [1, 2, 10 + i])  # 1 and 2 admitted at the 2nd step; 10 + i seen once each
        s.write("t", [1], np.ones((1, D)))
        stepped(s, 3)
        s.read("t", [1])  # expired
        s.evict("t", [1, 2])
        server = s.serve_metrics(0)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        samples = {x.name: x.value for fam in text_string_to_metric_families(text) for x in fam.samples
                   if x.labels.get("table") == "t" and x.name.startswith("tierstore_rows_")}
        life = s.stats(per_table=True)["t"]["rows"]
    assert life["admitted"] == 2 * 5 + 1 and life["rejected"] == 2 + 6 + 3 and life["expired"] == 1 and life["evicted"] >= 1
    assert samples == {f"tierstore_rows_{k}_total": float(life[k]) for k in ("admitted", "rejected", "expired", "evicted")}


def test_tierstore_stats_shows_rows_on_disk_evicted_rows_and_the_file_size(tmp_path, capsys):
    from tierstore.tools.cli import main

    table = spec(admit_after=2, ttl_steps=5)
    with TieredStore(tmp_path, tables=[table], device="cpu") as s:
        s.write("t", np.arange(50), np.ones((50, D)))
        s.flush()
        assert s.evict("t", np.arange(20)) == 20
    assert main(["stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "admit_after" in out and "rows on disk" in out and "data.mdb" in out
    line = next(x for x in out.splitlines()[::-1] if x.strip().startswith("t "))
    assert line.split() == ["t", "2", "5", "-", "30", "20"]
    assert main(["stats", str(tmp_path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["tables"][0]["evicted_rows"] == 20 and facts["tables"][0]["rows_on_disk"] == 30 and facts["disk_bytes"] > 0


def test_capacity_predicts_admission_exactly_as_the_store_counts(tmp_path):
    from tierstore.tools.capacity import CapacityConfig, analyze
    from tierstore.trace import Trace

    table = spec(admit_after=3, admit_width=256, admit_depth=2)  # narrow: the sketch admits some rows early
    calls = [np.asarray(IDS[(torch.rand(30, generator=torch.Generator().manual_seed(i)) ** 3 * POOL).long().numpy()])
             for i in range(80)]
    trace = Trace.from_calls([(i, "t", c) for i, c in enumerate(calls)])
    with TieredStore(tmp_path, tables=[table], device="cpu", hbm_rows=16, ddr_rows=16) as s:
        for c in calls:
            s.read("t", c)
        measured = s.stats(per_table=True)["t"]["rows"]
    predicted = analyze(trace, CapacityConfig(admit_after=3, admit_width=256, admit_depth=2, policies=(), belady=False))["admission"]["t"]
    assert (predicted["admitted"], predicted["rejected"]) == (measured["admitted"], measured["rejected"])
    trace.save(tmp_path / "t.npz")  # the same through `tierstore capacity --admit-after`
    args = ["capacity", str(tmp_path / "t.npz"), "--admit-after", "3", "--admit-width", "256", "--admit-depth", "2", "--policies", ""]
    out = subprocess.run([sys.executable, "-m", "tierstore.tools.cli", *args, "--json"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["admission"]["t"] == predicted
    table_text = subprocess.run([sys.executable, "-m", "tierstore.tools.cli", *args], capture_output=True, text=True, check=True).stdout
    assert f"{predicted['rows_admitted']:,}" in table_text.split("admission (admit_after 3")[1]
    assert predicted["exact_rows_admitted"] < predicted["rows_admitted"] and predicted["exact_rejected"] > predicted["rejected"]
    uses = {}
    for c in calls:
        for i in set(c.tolist()):
            uses[i] = uses.get(i, 0) + 1
    assert predicted["exact_rows_admitted"] == sum(u >= 3 for u in uses.values())
    assert predicted["exact_rejected"] == sum(min(u, 2) for u in uses.values())
    assert predicted["admitted"] + predicted["rejected"] == sum(uses.values())
    # rows that get storage once trained: a store that writes each admitted row it reads
    with TieredStore(tmp_path / "trained", tables=[table], device="cpu", hbm_rows=16) as s:
        for c in calls:
            rows = s.read("t", np.unique(c))
            keep = s.trainer("t").admitted(torch.from_numpy(np.unique(c)))
            s.write("t", np.unique(c)[keep.numpy()], rows[keep] + 1)
        s.flush()
        assert s.stats(per_table=True)["t"]["rows"]["stored"] == predicted["rows_admitted"]


@pytest.mark.parametrize("tiers", [dict(hbm_rows=2, ddr_rows=2), dict(hbm_rows=16)], ids=["small", "all cached"])
def test_a_readonly_store_follows_the_rules_and_writes_nothing(tmp_path, tiers):
    table = spec(admit_after=2, ttl_steps=3)
    with TieredStore(tmp_path, tables=[table], device="cpu") as s:
        s.write("t", np.arange(10), np.ones((10, D)))
        stepped(s, 1)
    size = (tmp_path / "data.mdb").stat().st_size
    with TieredStore(tmp_path, device="cpu", readonly=True, **tiers) as ro:
        # step 2: written at step 0, not 3 steps idle yet; a readonly store's reads are not recorded as uses
        assert torch.equal(ro.read("t", np.arange(10)), torch.ones(10, D))
        stepped(ro, 2)
        assert torch.equal(ro.read("t", [4]), torch.from_numpy(initial_rows(table, np.array([4]))))
        assert ro.stats(per_table=True)["t"]["rows"]["stored"] == 10
    assert (tmp_path / "data.mdb").stat().st_size == size


def test_two_forwards_before_their_backwards_count_no_extra_step_whatever_the_tiers(tmp_path):
    """A backward whose forward's rows went stale re-reads them (on small tiers only):
    that re-read is not a step, so admission and TTL see the same steps on every tier size."""
    table = spec(admit_after=2, ttl_steps=4, admit_width=1 << 16)
    steps = stream(24, seed=3)
    final = {}
    for name, tiers in {"all in hbm": dict(hbm_rows=POOL), "hbm=3": dict(hbm_rows=3), "hbm=3 ddr=3": dict(hbm_rows=3, ddr_rows=3)}.items():
        emb = module(tmp_path / name.replace(" ", "_"), table, **tiers)
        for (pa, oa, ta), (pb, ob, tb) in zip(steps[::2], steps[1::2]):
            out_a = emb(torch.from_numpy(IDS)[pa], oa)
            out_b = emb(torch.from_numpy(IDS)[pb], ob)
            loss(out_b, tb).backward()
            loss(out_a, ta).backward()
        assert emb.store.life("t").steps == 24
        final[name] = rows_after(emb)
        emb.store.close()
    init = torch.from_numpy(initial_rows(table, IDS))
    assert (final["all in hbm"] != init).any()
    assert torch.equal(final["hbm=3"], final["all in hbm"]) and torch.equal(final["hbm=3 ddr=3"], final["all in hbm"])


def test_a_failed_read_counts_no_step_and_changes_nothing(tmp_path, monkeypatch):
    table = spec(admit_after=2, ttl_steps=3, admit_width=1 << 12)
    calls = [IDS[i: i + 6] for i in range(0, 60, 3)]

    def run(path, fail_at=None):
        with TieredStore(path, tables=[table], device="cpu", hbm_rows=4) as s:
            real = s._backend.get_rows  # fault injection: an LMDB read fails
            out = []
            for i, c in enumerate(calls):
                if i == fail_at:
                    before = (s.life("t"), s.stats(per_table=True))
                    monkeypatch.setattr(s._backend, "get_rows", lambda *a, **k: (_ for _ in ()).throw(OSError("injected")))
                    with pytest.raises(OSError, match="injected"):
                        s.read("t", c)
                    monkeypatch.setattr(s._backend, "get_rows", real)
                    life = s.life("t")
                    assert life.steps == before[0].steps and np.array_equal(life.sketch, before[0].sketch)
                    assert s.stats(per_table=True) == before[1]
                rows = s.read("t", c)
                keep = s.trainer("t").admitted(torch.from_numpy(np.sort(c)))
                s.write("t", np.sort(c)[keep.numpy()], rows[torch.argsort(torch.from_numpy(c))][keep] * 0.5 + 1)
                out.append(rows)
            return torch.cat(out)
    assert torch.equal(run(tmp_path / "a", fail_at=9), run(tmp_path / "b"))


# -- the L2 score -----------------------------------------------------------------------------------
@pytest.mark.parametrize("ttl", [None, 5])
def test_rows_below_the_norm_read_initial_whatever_the_tiers(tmp_path, ttl):
    """Each step reads its rows and writes them back halved: rows shrink until a use
    finds them below the norm and they start over (a plain numpy model of the rules)."""
    table = spec(evict_l2_below=0.05, ttl_steps=ttl)
    init = initial_rows(table, IDS)
    calls = [(torch.rand(12, generator=torch.Generator().manual_seed(i)) ** 2 * 40).long().numpy() for i in range(60)]
    w, last = init.copy(), np.full(POOL, -1)
    expect = []
    for step, pos in enumerate(calls, start=1):
        used = np.unique(pos)
        small = (w[used].astype(np.float64) ** 2).sum(1) < 0.05 ** 2
        idle = (last[used] >= 0) & (last[used] + ttl <= step - 1) if ttl else np.zeros(len(used), dtype=bool)
        w[used[small | idle]] = init[used[small | idle]]
        expect.append(w[pos].copy())
        w[used] *= 0.5
        last[used] = step
    final = {}
    for name, tiers in {"none": dict(), "hbm=4": dict(hbm_rows=4), "hbm=4 ddr=8 lfu": dict(hbm_rows=4, ddr_rows=8, policy="lfu")}.items():
        with TieredStore(tmp_path / name.replace(" ", "_"), tables=[table], device="cpu", writeback_rows=16, writeback_group_rows=8, **tiers) as s:
            for pos, want in zip(calls, expect):
                got = s.read("t", IDS[pos])
                assert torch.equal(got, torch.from_numpy(want)), name
                used, first = np.unique(pos, return_index=True)
                s.write("t", IDS[used], got[torch.from_numpy(first)] * 0.5)
            final[name] = s.read("t", IDS[:40])
            assert s.stats(per_table=True)["t"]["rows"]["expired"] > 0
    assert torch.equal(final["hbm=4"], final["none"]) and torch.equal(final["hbm=4 ddr=8 lfu"], final["none"])


def test_the_sweep_deletes_rows_below_the_norm_from_disk(tmp_path):
    table = spec(evict_l2_below=0.5)
    with TieredStore(tmp_path, tables=[table], device="cpu", hbm_rows=4, writeback_rows=8, writeback_group_rows=4) as s:
        s.write("t", np.arange(100), np.full((100, D), 0.1))  # norm 0.2: below
        s.write("t", np.arange(100, 150), np.ones((50, D)))  # norm 2: kept
        s.flush()
        for i in range(10):  # steps whose write-backs commit, each commit followed by a sweep
            s.read("t", np.arange(1000 + 8 * i, 1008 + 8 * i))
            s.write("t", np.arange(1000 + 8 * i, 1008 + 8 * i), np.ones((8, D)))
        s.flush()
        rows = s.stats(per_table=True)["t"]["rows"]
        assert rows["evicted"] == 100 and rows["stored"] == 50 + 80, rows
        assert torch.equal(s.read("t", [5, 120]), torch.cat([torch.from_numpy(initial_rows(table, np.array([5]))), torch.ones(1, D)]))


def test_flushed_counts_steps_and_evictions_survive_kill_9(tmp_path):
    import os
    import signal

    child = (
        "import sys, numpy as np, tierstore\n"
        "spec = tierstore.TableSpec('t', None, 4, init=tierstore.RowInit.normal(0, 0.1, seed=2), admit_after=2, ttl_steps=4, admit_width=1024)\n"
        "s = tierstore.TieredStore(sys.argv[1], [spec], hbm_rows=4, device='cpu')\n"
        "s.write('t', [3], np.full((1, 4), 3.0))\n"
        "s.read('t', [1, 2]); s.read('t', [1, 2])\n"
        "s.write('t', [1, 2], np.ones((2, 4)))\n"
        "s.evict('t', [3])\n"
        "s.flush()\n"
        "print('flushed', flush=True)\n"
        "i = 0\n"
        "while True:\n"
        "    s.read('t', [1000 + i]); s.write('t', [1000 + i], np.full((1, 4), 7.0)); i += 1\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "flushed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    table = spec(admit_after=2, ttl_steps=4, admit_width=1024)
    with TieredStore(tmp_path, device="cpu") as s:
        assert s.life("t").steps == 2
        assert s.trainer("t").admitted(torch.tensor([1, 2])).all() and not s.trainer("t").admitted(torch.tensor([5])).any()
        assert torch.equal(s.read("t", [1, 2, 3]), torch.cat([torch.ones(2, D), torch.from_numpy(initial_rows(table, np.array([3])))]))


def test_a_replayed_sweep_looks_at_the_same_rows_again(tmp_path, monkeypatch):
    """LMDB's map fills during a sweep's transaction: _write grows it and replays the
    sweep, which must start where the aborted one did."""
    import lmdb

    from tierstore.io import LmdbBackend

    backend = LmdbBackend(tmp_path)
    try:
        backend.open_table("t", D, last_use=True)
        ids = np.arange(10, dtype=np.int64)
        backend.put_rows([("t", ids, np.ones((10, D), dtype=np.float32))], last_use={"t": np.where(ids < 5, 1, 9)})
        write, full = backend._write, [True]  # fault injection: the first commit finds the map full

        def map_full_once(op):
            def first_fills_the_map(txn):
                op(txn)
                if full.pop() if full else False:
                    raise lmdb.MapFullError("injected")
            write(first_fills_the_map)
        monkeypatch.setattr(backend, "_write", map_full_once)
        assert backend.sweep("t", cutoff=1, budget=6) == 5  # rows 0..4 last used at step 1
        assert not full  # the fault was injected
        assert backend.get_rows("t", ids)[1].tolist() == [False] * 5 + [True] * 5
        assert backend.get_last_use("t", ids).tolist() == [-1] * 5 + [9] * 5
    finally:
        backend.close()
