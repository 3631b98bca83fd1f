"""The memory budget (tierstore.engine.memory): the size parser, the split, what the store says
it holds against what it allocates, the memory-limit detection against fixture cgroup
files, and a store opened under a real memory cgroup where the machine lets a test make one."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tierstore import TableSpec, TieredEmbeddingBag, TieredStore, optim
from tierstore.eviction import make_policy
from tierstore.io import index_bytes_bound, mapped_bytes_bound, runs_bytes_bound, dense_bytes
from tierstore.io.rowlog import segment_bytes_bound
from tierstore.engine.memory import (
    DEFAULT_WRITEBACK_ROWS, PAGE, QUEUE_BYTES_PER_ROW, WORK_BYTES_PER_SLOT, MemoryLimit, check_fits,
    cgroup_memory_limit, detect_limit, fit_rows, machine_memory, parse_bytes, split_memory, tier_bytes,
)
from tierstore.precision import DTYPES
from tierstore.engine.prefetch import PrefetchConfig
from tierstore.engine.tiers import CacheTier

MiB, GiB = 1 << 20, 1 << 30
WRITE_TXN = 65536 * PAGE  # LMDB's dirty pages of one write transaction of the default size, the worst case


def dirty_bytes(budget: int) -> int:
    """One write transaction's dirty pages under ``budget``: 1/16 of it, 1024..65536 rows of a page."""
    return min(65536, max(1024, budget // 16 // PAGE)) * PAGE


# -- the parser --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("1GiB", GiB), ("512MiB", 512 * MiB), ("2G", 2 * 10**9), ("2g", 2 * 10**9), ("1.5GB", 1_500_000_000), ("1.5gib", 3 * 2**29),
    ("64Ki", 64 << 10), ("1000", 1000), (" 3 KiB ", 3 << 10), ("1TiB", 1 << 40), ("7MB", 7_000_000), ("10b", 10), ("4k", 4000),
])
def test_sizes_parse(text, expected):
    assert parse_bytes(text) == expected


@given(st.integers(1, 1 << 50))
def test_an_int_is_bytes(n):
    assert parse_bytes(n) == parse_bytes(np.int64(n)) == parse_bytes(str(n)) == n


@given(st.integers(1, 1 << 20), st.sampled_from(["K", "Ki", "KiB", "M", "MiB", "G", "GiB", "KB", "MB", "GB"]))
def test_units_scale(n, unit):
    scale = ({"K": 1 << 10, "M": 1 << 20, "G": 1 << 30} if "i" in unit else {"K": 10**3, "M": 10**6, "G": 10**9})[unit[0]]
    assert parse_bytes(f"{n}{unit}") == n * scale


@pytest.mark.parametrize("bad", ["", "GiB", "1 GiBs", "1XB", "-1GiB", "1e9", "0", "0MiB", "one gig", 0, -5, 1.5, True, None, "1,5G", "1iB"])
def test_bad_sizes_are_named_with_the_accepted_forms(bad):
    with pytest.raises(ValueError) as e:
        parse_bytes(bad)
    assert repr(bad) in str(e.value) and "'1GiB'" in str(e.value) and "'512MiB'" in str(e.value)


def test_the_store_and_the_module_take_the_parser(tmp_path):
    with pytest.raises(ValueError, match="memory_budget '1 gigabyte' is not a size"):
        TieredStore(tmp_path / "a", [TableSpec("t", 10, 2)], memory_budget="1 gigabyte")
    with pytest.raises(ValueError, match="memory_budget .* is not a size"):
        TieredEmbeddingBag(10, 2, path=tmp_path / "b", memory_budget="lots")
    assert not (tmp_path / "a").exists()


# -- the split ---------------------------------------------------------------------------------
specs_st = st.lists(
    st.builds(lambda i, rows, dim, dtype, state: TableSpec(f"t{i}", rows, dim, dtype=dtype, state_dim=state),
              st.integers(0, 10**6), st.one_of(st.none(), st.integers(1, 10**8)), st.integers(1, 512),
              st.sampled_from(sorted(DTYPES)), st.integers(0, 4)),
    min_size=1, max_size=4, unique_by=lambda s: s.name)


@given(specs_st, st.integers(400 * MiB, 1 << 40), st.booleans(), st.booleans())
def test_the_split_stays_within_the_budget(specs, budget, on_host, writes):
    split = split_memory(budget, specs, hbm_on_host=on_host, writes=writes)
    by_name = {s.name: s for s in specs}
    # the log layout's row index: a sixteenth of the budget, whatever the tables declare, besides
    # what a table's segments' entries may take past half its share (or past what its mapped levels' bits leave), and the dense levels it
    # holds, a third at most, only where the page cache cannot keep the rows; a table's runs
    # may take half its share at least, or all its rows could take
    held = split.held_index
    index = split.parts["row_index"].bytes
    rows = sum(s.num_rows for s in specs if s.num_rows is not None)
    shares = {s.name: budget // 16 * s.num_rows // rows for s in specs if s.num_rows is not None}
    past = sum(max(0, segment_bytes_bound(by_name[n].num_rows, by_name[n].row_bytes + (8 if by_name[n].ttl_steps is not None else 0))
                   + max(share // 2, mapped_bytes_bound(by_name[n].num_rows) * 4 // 3) - share) for n, share in shares.items())
    assert index - sum(held.values()) <= budget // 16 + past and sum(held.values()) <= budget // 3
    assert not held or sum(s.num_rows * s.row_bytes for s in specs if s.num_rows is not None) > budget // 4
    assert all(nbytes == dense_bytes(by_name[name].num_rows) for name, nbytes in held.items())
    for s in specs:
        if s.num_rows is not None:
            share = budget // 16 * s.num_rows // rows
            assert split.index_limits[s.name] >= min(share // 2, runs_bytes_bound(s.num_rows))
    assert split.host_bytes <= budget
    assert sum(p.bytes for p in split.parts.values() if p.host) == split.host_bytes
    for part, rows in (("hbm", split.hbm_rows), ("ddr", split.ddr_rows), ("staging", split.staged_rows)):
        assert all(r >= 0 for r in rows.values()) and split.parts[part].rows == sum(rows.values())
        assert all(by_name[n].num_rows is None or r <= by_name[n].num_rows for n, r in rows.items())
        assert split.parts[part].bytes == sum(tier_bytes(by_name[n], r) for n, r in rows.items())
    assert split.hbm_rows == dict.fromkeys(by_name, 0)  # left out: the budget is host memory
    # a quarter to the page cache, a sixth where it would keep none of a step's rows: every
    # table's rows read directly and no lookup reading a mapped level of its index
    logged = [s for s in specs if s.num_rows is not None]
    passed_by = (len(logged) == len(specs) and sum(s.num_rows * s.row_bytes for s in logged) > budget // 4
                 and all(s.name in held or split.index_limits[s.name] >= runs_bytes_bound(s.num_rows) for s in logged))
    assert split.parts["page_cache"].bytes == budget // (6 if passed_by else 4)
    assert split.parts["lmdb_dirty"].bytes == (dirty_bytes(budget) if writes else 0)
    assert split.txn_rows * PAGE == dirty_bytes(budget)
    width = max(s.width for s in specs)
    assert split.writeback_rows >= 0 and split.parts["writeback"].bytes == split.writeback_rows * ((4 * width + QUEUE_BYTES_PER_ROW) if writes else 0)
    # the budget is used: a table that can grow gets a DDR tier of a good part of what is left (less
    # what its hash index, doubling at powers of two, cannot use)
    if budget >= GiB and any(s.num_rows is None for s in specs):
        assert split.parts["ddr"].bytes > (budget - budget // 4 - dirty_bytes(budget) - index) // 3


def test_a_budget_whose_rows_the_page_cache_cannot_keep_gives_its_share_to_the_ddr_tier():
    # the bench-scale table: 8.1 GiB of rows under 0.5 GiB, its dense index level held
    table = TableSpec("t", 34_000_000, 64)
    passed_by = split_memory(512 * MiB, [table])
    assert passed_by.held_index and passed_by.parts["page_cache"].bytes == 512 * MiB // 6
    # the same reads through the page cache (direct_reads=False), or beside a keyed table (read
    # through LMDB's map), or rows that fit its share keep a quarter
    for split in (split_memory(512 * MiB, [table], direct_reads=False),
                  split_memory(512 * MiB, [table, TableSpec("k", None, 64)]),
                  split_memory(512 * MiB, [TableSpec("t", 400_000, 64)])):
        assert split.parts["page_cache"].bytes == 128 * MiB
    cached = split_memory(512 * MiB, [table], direct_reads=False)
    assert passed_by.ddr_rows["t"] > 1.2 * cached.ddr_rows["t"] and passed_by.host_bytes <= 512 * MiB
    # a table whose dense level is too large to hold (200M rows under 256 MiB) looks its rows up in
    # a mapped level, through the page cache: a quarter
    assert split_memory(256 * MiB, [TableSpec("t", 200_000_000, 16)]).parts["page_cache"].bytes == 64 * MiB


def test_a_store_says_what_its_page_cache_share_is(tmp_path):
    table = TableSpec("t", 2_000_000, 64)  # 512 MB of rows under 64 MiB
    with TieredStore(tmp_path / "a", [table], memory_budget="64MiB") as store:
        assert store.memory().parts["page_cache"].bytes == 64 * MiB // 6
    with TieredStore(tmp_path / "b", [table], memory_budget="64MiB", direct_reads=False) as store:
        assert store.memory().parts["page_cache"].bytes == 16 * MiB


@given(specs_st, st.integers(400 * MiB, 64 * GiB), st.integers(0, 10**6), st.integers(0, 10**6))
def test_given_sizes_come_out_of_the_budget_first(specs, budget, hbm, queue):
    try:
        split = split_memory(budget, specs, hbm_rows=hbm, writeback_rows=queue)
    except ValueError as e:
        assert ("cannot hold the sizes given" in str(e) or "the row index" in str(e)) and "memory_budget=" in str(e)
        return
    assert split.host_bytes <= budget and split.writeback_rows == queue
    assert all(r == (hbm if s.num_rows is None else min(hbm, s.num_rows)) for s, r in zip(specs, split.hbm_rows.values()))


@pytest.mark.parametrize("budget", [1, MiB, 5 * MiB])
def test_a_budget_below_the_fixed_parts_is_refused(budget):
    with pytest.raises(ValueError, match=r"is too small.*1,024 rows x 4 KiB = 4.0 MiB.*give at least 6.3 MiB"):
        split_memory(budget, [TableSpec("t", None, 8)])


def test_a_budget_sizes_lmdb_write_transactions(tmp_path):
    """LMDB mallocs a dirty page for each random row a transaction writes: the store's
    transactions hold at most what the budget set aside for them (1/16 of it)."""
    from tierstore.io import LmdbBackend

    with TieredStore(tmp_path / "s", [TableSpec("t", None, 8)], memory_budget="256MiB", device="cpu") as s:
        assert s.memory().txn_rows == 4096 and s.memory().parts["lmdb_dirty"].bytes == 16 * MiB
        ids = np.random.default_rng(0).choice(1 << 40, 10_000, replace=False)
        s.write("t", ids, np.ones((10_000, 8), np.float32))
        s.flush()
        assert torch.equal(s.read("t", ids[:5]), torch.ones(5, 8))
    backend = LmdbBackend(tmp_path / "b", txn_rows=1000)
    try:
        backend.open_table("t", 8)
        before = backend.env.info()["last_txnid"]
        backend.put_rows([("t", np.arange(2500, dtype=np.int64), np.ones((2500, 8), np.float32))])
        assert backend.env.info()["last_txnid"] - before == 3  # 1000 + 1000 + 500 rows
        assert backend.get_rows("t", np.arange(2500, dtype=np.int64))[1].all()
    finally:
        backend.close()


def test_without_a_budget_the_split_is_todays_defaults():
    specs = [TableSpec("a", 1000, 8), TableSpec("b", None, 4)]
    split = split_memory(None, specs, ddr_rows={"a": 5000})
    assert split.ddr_rows == {"a": 1000, "b": 0}  # a tier holds at most num_rows
    assert split.staged_rows == {"a": 5000, "b": 65536}  # staging: ddr_rows as given, else 65536 (tierstore.engine.prefetch)
    assert split.writeback_rows == DEFAULT_WRITEBACK_ROWS and split.parts["page_cache"].bytes == 0


@given(st.one_of(st.none(), st.integers(1, 5000)), st.integers(1, 64), st.sampled_from(sorted(DTYPES)),
       st.integers(0, 3), st.integers(1, 3000))
def test_tier_bytes_are_what_a_tier_allocates(num_rows, dim, dtype, state_dim, rows):
    spec = TableSpec("t", num_rows, dim, dtype=dtype, state_dim=state_dim)
    tier = CacheTier("ddr", rows, dim, state_dim, torch.device("cpu"), make_policy("lru"), num_rows, DTYPES[dtype])
    assert tier_bytes(spec, rows) == allocated(tier)
    assert tier_bytes(spec, fit_rows(spec, tier_bytes(spec, rows))) <= tier_bytes(spec, rows)
    assert fit_rows(spec, tier_bytes(spec, rows)) >= (rows if num_rows is None or rows <= num_rows else 0)


def allocated(tier: CacheTier) -> int:
    """The memory under the tier's tensors and its index's arrays (numpy's on the host), each
    buffer once (an array's views share it), and the working buffers eviction and prefetch keep
    per slot."""
    buffers = {}
    for obj in (tier, tier.index):
        for v in vars(obj).values():
            if isinstance(v, torch.Tensor):
                buffers[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            elif isinstance(v, np.ndarray):
                while isinstance(v.base, np.ndarray):
                    v = v.base
                buffers[v.__array_interface__["data"][0]] = v.nbytes
    return sum(buffers.values()) + WORK_BYTES_PER_SLOT * tier.capacity


def tier_of(spec: TableSpec, name: str, rows: int) -> CacheTier:
    """A tier of ``rows`` slots for ``spec``'s rows, as the store builds its tiers and staging, on its own:
    allocated() of it is what the store's tier of that many rows holds."""
    policy = None if name == "staged" else make_policy("lru")
    return CacheTier(name, rows, spec.dim, spec.state_dim, torch.device("cpu"), policy, spec.num_rows, DTYPES[spec.dtype])


# -- the accounting: what the store says against what it allocates ---------------------------
def test_a_store_reports_what_it_allocates(tmp_path, monkeypatch):
    specs = [TableSpec("u", None, 24, state_dim=1), TableSpec("b", 200_000, 8, dtype="float16"), TableSpec("small", 500, 4)]
    budget = 400 * MiB
    # sync_read_us=0: announced rows are always read ahead, so a prefetch fills staging
    with TieredStore(tmp_path, specs, memory_budget="400MiB", device="cpu", prefetch=PrefetchConfig(sync_read_us=0)) as s:
        m = s.memory()
        assert m.budget == budget and s.stats()["memory"]["budget"] == budget
        assert m.host_bytes <= budget
        fill = {spec.name: s.snapshot().tables[spec.name].tiers for spec in specs}
        assert all(set(tiers) == {"ddr"} for tiers in fill.values())  # no HBM tier
        ddr = [tier_of(spec, "ddr", fill[spec.name]["ddr"].capacity) for spec in specs]
        assert m.parts["ddr"].bytes == sum(allocated(t) for t in ddr) > 0.5 * (budget - budget // 4 - WRITE_TXN)
        assert m.parts["ddr"].rows == sum(t.capacity for t in ddr) and ddr[2].capacity == 500
        # a prefetch of more rows than a table's staging holds stages as many as it holds
        tickets = [s.prefetch(spec.name, np.arange(min(m.staged_rows[spec.name] + 10, spec.num_rows or 1 << 62))) for spec in specs]
        for ticket in tickets:
            ticket.wait()
        staged = {name: c["staged_rows"] for name, c in s.prefetch_stats()["tables"].items()}
        assert staged == m.staged_rows and s.memory().parts["staging"].used_rows == m.parts["staging"].rows
        staging = [tier_of(spec, "staged", staged[spec.name]) for spec in specs]
        assert m.parts["staging"].bytes == sum(allocated(t) for t in staging) and m.parts["staging"].rows == sum(staged.values())
        for ticket in tickets:
            ticket.release()
        assert m.parts["writeback"].rows == s.config.writeback_rows > 0
        assert m.parts["writeback"].bytes == m.parts["writeback"].rows * (4 * 25 + QUEUE_BYTES_PER_ROW)
        # what the parts hold now, LMDB's commits held back so that the queue keeps what was written
        gate = threading.Event()
        real = s._backend.put_rows  # latency injection: LMDB commits wait for the gate
        monkeypatch.setattr(s._backend, "put_rows", lambda *a, **k: (gate.wait(60), real(*a, **k))[1])
        s.read("u", np.arange(1000))
        s.write("b", np.arange(300), np.ones((300, 8), np.float32))
        now = s.memory().parts
        assert now["ddr"].used_rows == sum(s.resident_rows(spec.name)["ddr"] for spec in specs) == 1000
        assert now["writeback"].used_rows == 300
        assert now["lmdb_dirty"].used_bytes is None and now["page_cache"].used_bytes is None
        assert json.loads(json.dumps(s.stats()["memory"]))["parts"]["ddr"]["used_rows"] == 1000
        # the queue takes the rows the split gives it before a call waits for LMDB: a call with it full
        # returns at once (waiting, it would return only after the gate, the queue committed)
        limit = m.parts["writeback"].rows
        s.write("u", np.arange(10**6, 10**6 + limit - 300), np.ones((limit - 300, 25), np.float32), with_state=True)
        s.read("small", [0])
        assert s.snapshot().writeback_queued_rows == limit
        gate.set()


def test_given_tiers_are_accounted_with_the_same_function(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", None, 16)], hbm_rows=3000, ddr_rows=7000, device="cpu") as s:
        m = s.memory()
        assert m.budget is None and s.stats()["memory"]["budget"] is None
        fill, spec = s.snapshot().tables["t"].tiers, s.spec("t")
        assert (fill["hbm"].capacity, fill["ddr"].capacity) == (3000, 7000)
        assert m.parts["hbm"].bytes == allocated(tier_of(spec, "hbm", 3000)) and m.parts["ddr"].bytes == allocated(tier_of(spec, "ddr", 7000))
        assert m.parts["staging"].rows == 7000 and m.parts["writeback"].rows == DEFAULT_WRITEBACK_ROWS
        assert m.parts["lmdb_dirty"].bytes == WRITE_TXN and m.parts["page_cache"].bytes == 0


def test_neither_budget_nor_tiers_keeps_todays_store_and_says_what_it_uses(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 1000, 4)], device="cpu") as s:
        m = s.memory()
        assert s.snapshot().tables["t"].tiers == {}  # no tier
        # the row index: what its rows could take, its runs at most 4 bytes a declared row (a dense map's)
        index = m.parts["row_index"].bytes
        assert index_bytes_bound(1000, 16) - runs_bytes_bound(1000) < index <= index_bytes_bound(1000, 16) - runs_bytes_bound(1000) + 4 * 1000
        assert m.budget is None and m.host_bytes == m.parts["staging"].bytes + m.parts["writeback"].bytes + WRITE_TXN + index
        s.write("t", np.arange(1000), np.ones((1000, 4), dtype=np.float32))
        s.flush()
        index = s.memory().parts["row_index"]
        assert 0 < index.used_bytes <= index.bytes  # the log layout's index: its runs and its segments
        assert m.limit is not None and m.limit.machine == machine_memory()


def test_a_budget_derived_split_trains_the_same_rows_as_no_tiers(tmp_path):
    """Tier sizes never change numerics: a budget that derives a DDR tier smaller than the
    rows the training touches (so rows are evicted and written back) gives the rows of a
    store with no tiers at all, bit for bit."""
    n, dim = 8_000, 2048
    g = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(4):
        ids = (torch.rand(2400, generator=g) ** 2 * n).long()
        steps.append((ids, torch.arange(0, 2400, 300), torch.randn(8, dim, generator=g)))
    final = {}
    for name, sizes in (("budget", dict(memory_budget="64MiB")), ("no tiers", dict(hbm_rows=0, ddr_rows=0))):
        emb = TieredEmbeddingBag(n, dim, mode="sum", path=tmp_path / name.replace(" ", "_"), optimizer=optim.SGD(lr=0.1),
                                 device="cpu", **sizes)
        for ids, offsets, target in steps:
            (emb(ids, offsets) * target).sum().backward()
        if name == "budget":
            ddr = emb.store.snapshot().tables[emb.table].tiers["ddr"]
            assert ddr.capacity < len(torch.cat([ids for ids, _, _ in steps]).unique()), "the budget must make the tier evict"
            assert emb.store.stats()["ddr"]["writebacks"] > 0
        touched = torch.cat([ids for ids, _, _ in steps]).unique()
        final[name] = emb.store.read(emb.table, touched)
        emb.close()
    assert torch.equal(final["budget"], final["no tiers"])


# -- the limit ---------------------------------------------------------------------------------
def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_cgroup_v2_lowest_limit_of_the_group_and_its_ancestors(tmp_path):
    proc = write(tmp_path / "cgroup", "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "fs"
    write(root / "kubepods/pod1/ctr/memory.max", "max\n")
    write(root / "kubepods/pod1/memory.max", "1073741824\n")
    write(root / "kubepods/memory.max", "4294967296\n")
    assert cgroup_memory_limit(proc, root) == (GiB, str(root / "kubepods/pod1/memory.max"))


def test_cgroup_v2_max_everywhere_is_no_limit(tmp_path):
    proc = write(tmp_path / "cgroup", "0::/user.slice\n")
    root = tmp_path / "fs"
    write(root / "user.slice/memory.max", "max\n")
    assert cgroup_memory_limit(proc, root) is None
    meminfo = write(tmp_path / "meminfo", "MemTotal:       2048000 kB\nMemFree: 1 kB\n")
    limit = detect_limit(proc, root, meminfo)
    assert limit == MemoryLimit(2048000 * 1024) and limit.bytes == 2048000 * 1024
    assert "MemTotal" in limit.describe()


def test_cgroup_v1_limit_in_bytes_and_its_unlimited_value(tmp_path):
    proc = write(tmp_path / "cgroup", "5:cpu,cpuacct:/x\n4:memory:/a/b\n0::/\n")  # hybrid: v1 memory, v2 without it
    root = tmp_path / "fs"
    write(root / "memory/a/b/memory.limit_in_bytes", "536870912\n")
    write(root / "memory/a/memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "cpu,cpuacct/x/memory.limit_in_bytes", "1\n")  # not the memory controller's
    assert cgroup_memory_limit(proc, root) == (512 * MiB, str(root / "memory/a/b/memory.limit_in_bytes"))
    meminfo = write(tmp_path / "meminfo", "MemTotal:       4194304 kB\n")
    limit = detect_limit(proc, root, meminfo)
    assert limit.bytes == 512 * MiB and "memory cgroup's limit 512.0 MiB" in limit.describe()
    write(root / "memory/a/b/memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_memory_limit(proc, root) is None


def test_a_group_path_the_container_cannot_see_reads_its_own_root(tmp_path):
    proc = write(tmp_path / "cgroup", "4:memory:/docker/0123abcd\n")
    root = tmp_path / "fs"
    write(root / "memory/memory.limit_in_bytes", "268435456\n")
    assert cgroup_memory_limit(proc, root) == (256 * MiB, str(root / "memory/memory.limit_in_bytes"))
    assert cgroup_memory_limit(tmp_path / "missing", root) is None


def test_what_cannot_fit_under_the_limit_is_refused_naming_the_figures():
    limit = MemoryLimit(8 * GiB, GiB, "/sys/fs/cgroup/memory/x/memory.limit_in_bytes")
    split = split_memory(GiB, [TableSpec("t", None, 8)])
    check_fits(split, limit, 0, "memory_budget=1GiB")
    with pytest.raises(ValueError) as e:
        check_fits(split, limit, 100 * MiB, "memory_budget=1GiB")
    msg = str(e.value)
    assert "needs 1.0 GiB" in msg and "memory cgroup's limit 1.0 GiB (/sys/fs/cgroup/memory/x/memory.limit_in_bytes)" in msg
    assert "100.0 MiB this process already holds (RSS)" in msg and "leaves 924.0 MiB" in msg
    assert "pass memory_budget= of at most 924.0 MiB" in msg


def test_a_budget_or_tiers_beyond_the_machine_are_refused_at_open(tmp_path):
    too_much = 2 * detect_limit().bytes
    with pytest.raises(ValueError, match=r"memory_budget=.* needs .*\(MemTotal\).*RSS.*pass memory_budget= of at most"):
        TieredStore(tmp_path, [TableSpec("t", None, 8)], memory_budget=too_much, device="cpu")
    with pytest.raises(ValueError, match=r"hbm_rows=0, ddr_rows=.* needs .*give smaller ddr_rows="):
        TieredStore(tmp_path, [TableSpec("t", None, 8)], hbm_rows=0, ddr_rows=too_much // 8, device="cpu")
    with TieredStore(tmp_path, device="cpu") as s:  # the refused opens left the store as it was
        assert list(s.tables) == ["t"] and s.memory().budget is None


# -- a real memory cgroup ------------------------------------------------------------------------
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CHILD = textwrap.dedent("""
    import json, sys
    sys.stdin.readline()  # moved into the group by the parent by now
    from tierstore import TableSpec, TieredStore
    from tierstore.engine.memory import detect_limit
    out = {"limit": detect_limit().cgroup}
    try:
        TieredStore(sys.argv[1] + "/big", [TableSpec("t", None, 16)], memory_budget=sys.argv[2], device="cpu")
        out["big"] = "opened"
    except ValueError as e:
        out["big"] = str(e)
    with TieredStore(sys.argv[1] + "/small", [TableSpec("t", None, 16)], memory_budget=sys.argv[3], device="cpu") as s:
        s.write("t", list(range(1000)), [[1.0] * 16] * 1000)
        s.flush()
        out["small"] = s.memory().budget
    print(json.dumps(out))
""")


def _memory_cgroup() -> Path:
    """A fresh child group of the cgroup v1 memory controller, or a skip naming what is missing."""
    if not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip(f"no cgroup v1 memory controller at {CGROUP_V1} to make a memory cgroup in")
    if os.geteuid() != 0:
        pytest.skip(f"making a memory cgroup under {CGROUP_V1} needs root")
    group = CGROUP_V1 / f"tierstore-test-{uuid.uuid4().hex[:12]}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup under {CGROUP_V1}: {e}")
    return group


def test_a_store_under_a_real_memory_cgroup(tmp_path):
    group = _memory_cgroup()
    limit = 1536 * MiB
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "1536MiB", "400MiB"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            (group / "cgroup.procs").write_text(str(child.pid))
            out, err = child.communicate("go\n", timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, err
        result = json.loads(out)
        assert result["limit"] == limit
        assert result["big"].startswith("memory_budget=1,610,612,736 bytes needs 1.5 GiB")
        assert f"memory cgroup's limit 1.5 GiB ({group}/memory.limit_in_bytes)" in result["big"]
        assert result["small"] == 400 * MiB
    finally:
        group.rmdir()


# -- where the budget is shown: metrics, `tierstore stats`, prefetchd ------------------------------
def test_metrics_export_the_budget_and_each_part(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(registry):
        text = generate_latest(registry).decode()
        return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}

    registry = CollectorRegistry()
    with TieredStore(tmp_path / "a", [TableSpec("t", None, 8)], memory_budget="400MiB", device="cpu", registry=registry, name="a") as s, \
         TieredStore(tmp_path / "b", [TableSpec("t", 100, 8)], device="cpu", registry=registry, name="b"):
        s.read("t", np.arange(100))
        m = s.memory()
        got = scrape(registry)
    assert got[("tierstore_memory_budget_bytes", (("store", "a"),))] == 400 * MiB
    assert np.isnan(got[("tierstore_memory_budget_bytes", (("store", "b"),))])  # no budget
    for part, p in m.parts.items():
        assert got[("tierstore_memory_bytes", (("kind", "allowed"), ("part", part), ("store", "a")))] == p.bytes
        used = got.get(("tierstore_memory_bytes", (("kind", "used"), ("part", part), ("store", "a"))))
        assert used == p.used_bytes
    assert m.parts["ddr"].used_bytes > 0


def test_stats_cli_shows_the_split_for_a_budget(tmp_path, capsys):
    from tierstore.tools.cli import main

    specs = [TableSpec("t", 10**7, 32), TableSpec("u", None, 8, state_dim=1)]
    TieredStore(tmp_path, specs, device="cpu").close()
    assert main(["stats", str(tmp_path), "--json", "--memory-budget", "1GiB"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    expected = split_memory(GiB, specs, hbm_on_host=not torch.cuda.is_available())
    assert memory["budget"] == GiB and memory["parts"] == {k: {**v, "used_rows": None, "used_bytes": None} for k, v in expected.as_dict()["parts"].items()}
    assert memory["limit"]["machine"] == machine_memory()
    assert main(["stats", str(tmp_path), "--ddr-rows", "5000"]) == 0
    text = capsys.readouterr().out
    assert "no budget" in text and any(line.split()[:2] == ["ddr", "10,000"] for line in text.splitlines())
    with pytest.raises(SystemExit):
        main(["stats", str(tmp_path), "--memory-budget", "lots"])
    assert "'lots' is not a size" in capsys.readouterr().err


def test_prefetchd_takes_a_memory_budget(tmp_path):
    from tierstore.daemon.config import DaemonConfig

    with pytest.raises(ValueError, match=r"--ddr-rows N .* or --memory-budget SIZE"):
        DaemonConfig(tmp_path, tmp_path / "s.sock", None)
    with pytest.raises(ValueError, match="--memory-budget '1 GB please' is not a size"):
        DaemonConfig(tmp_path, tmp_path / "s.sock", None, memory_budget="1 GB please")
    TieredStore(tmp_path / "store", [TableSpec("t", None, 8)], device="cpu").close()
    sockdir = Path(tempfile.mkdtemp(prefix="tsm-"))  # short: Unix socket paths are limited to ~104 bytes
    proc = subprocess.Popen([sys.executable, "-m", "tierstore.tools.cli", "prefetchd", str(tmp_path / "store"),
                             "--socket", str(sockdir / "d.sock"), "--memory-budget", "400MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), proc.stderr.read() if proc.poll() is not None else line
        import tierstore
        with tierstore.open_store(tmp_path / "store", daemon=str(sockdir / "d.sock")) as client:
            memory = client.stats()["memory"]
        expected = split_memory(400 * MiB, [TableSpec("t", None, 8)])
        assert memory["budget"] == 400 * MiB and memory["parts"]["ddr"]["rows"] == expected.parts["ddr"].rows > 0
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
        proc.stdout.close()
        proc.stderr.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_flush_writes_a_write_back_queue_of_rows_at_a_time(tmp_path):
    """A flush of a DDR tier full of dirty rows copies them out a queue's worth at a time
    (writeback_rows), not all at once: what numpy allocates meanwhile stays near one
    queue's rows (taken whole, 14.6 MB at the peak for 5.1 MB of rows; 2.5 MB in chunks)."""
    import tracemalloc
    with TieredStore(tmp_path, [TableSpec("t", 20_000, 64)], ddr_rows=20_000, writeback_rows=1_000, device="cpu") as s:
        s.read("t", np.arange(20_000))  # every row resident: the write leaves them dirty in the DDR tier
        s.write("t", np.arange(20_000), np.ones((20_000, 64), dtype=np.float32))
        tracemalloc.start()
        try:
            s.flush()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert s.stored_ids("t").numel() == 20_000
    assert peak < 20_000 * 256, f"flush allocated {peak:,} bytes at its peak"


def test_only_tables_in_the_log_layout_charge_a_row_index(tmp_path, monkeypatch):
    """A store written before the log layout keeps its bounded tables by key: no index in
    memory, so none of the budget goes to one (it went to every bounded table)."""
    from tierstore.io import lmdb_backend
    monkeypatch.setattr(lmdb_backend, "NEW_TABLE_LAYOUT", "keyed")
    with TieredStore(tmp_path / "keyed", [TableSpec("t", 100_000, 4)], device="cpu"):
        pass
    monkeypatch.undo()
    with TieredStore(tmp_path / "keyed", memory_budget="64MiB", device="cpu") as s:
        assert s.memory().parts["row_index"].bytes == 0
    with TieredStore(tmp_path / "log", [TableSpec("t", 100_000, 4)], memory_budget="64MiB", device="cpu") as s:
        # all its rows could take more than the budget's sixteenth: that is the index's
        assert s.memory().parts["row_index"].bytes == (64 << 20) // 16 < index_bytes_bound(100_000, 16)


_FREED_HELD = textwrap.dedent("""
    import ctypes, sys
    import numpy as np

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    if sys.argv[1] == "budget":  # the control imports neither torch nor tierstore: seconds less
        from tierstore import TableSpec, TieredStore
        store = TieredStore("store", [TableSpec("t", num_rows=1000, dim=8)], memory_budget="64MiB")  # in its cwd, tmp_path
    first = np.ones(1 << 18, np.float32)
    del first  # a freed 1 MiB block: glibc raises its mmap threshold past it
    blocks = [np.ones(1 << 18, np.float32) for _ in range(64)]
    del blocks[::2]  # every other one freed, none at the heap's top
    print(libc.mallinfo2().fordblks)
""")


def test_a_budgeted_store_keeps_malloc_from_holding_freed_blocks(tmp_path):
    """Freed temporaries of 1 MiB stay in glibc's arenas once its mmap threshold has risen (the
    control process), memory outside every part of the budget; a process with a budgeted store
    open gives them back (tierstore.engine.memory.return_freed_blocks)."""
    held = {}
    for mode in ("control", "budget"):
        out = subprocess.run([sys.executable, "-c", _FREED_HELD, mode], capture_output=True, text=True, cwd=tmp_path)
        if out.returncode and "mallinfo2" in out.stderr:
            pytest.skip("needs glibc >= 2.33 (mallinfo2) to see what malloc holds")
        assert out.returncode == 0, out.stderr
        held[mode] = int(out.stdout)
    if held["control"] < 24 << 20:
        pytest.skip(f"this C library's malloc does not hold freed 1 MiB blocks (held {held['control']:,} bytes)")
    assert held["budget"] < 4 << 20, held


_MAPPED = textwrap.dedent("""
    import sys
    import numpy as np
    from tierstore import TableSpec, TieredStore

    def mapped():  # bytes of data.mdb mapped into this process: its mappings' Rss in /proc/self/smaps
        total, ours = 0, False
        for line in open("/proc/self/smaps"):
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's first line: address range ... path
                ours = line.rstrip().endswith("/data.mdb")
            elif ours and fields[0] == "Rss:":
                total += int(fields[1]) << 10
        return total

    n = 300_000
    store = TieredStore(sys.argv[1], [TableSpec("t", n, 64)], memory_budget="64MiB", device="cpu")
    rng = np.random.default_rng(0)
    for lo in range(0, n, 50_000):  # every row written: 77 MB of rows, more than the page cache's share
        store.write("t", np.arange(lo, lo + 50_000), np.ones((50_000, 64), dtype=np.float32))
    store.flush()
    for step in range(30):  # overwrites: the log collects its emptiest segments, reading them
        ids = rng.integers(0, n, 8192)
        store.write("t", ids, store.read("t", ids) + 1)
        store.read("t", ids[:10])  # a small read: through LMDB's map
        if step % 10 == 9:
            store.flush()
    print(mapped(), store.memory().parts["page_cache"].bytes)
""")


def test_a_budgeted_store_keeps_its_mapped_file_pages_within_the_page_cache_share(tmp_path):
    """A page of data.mdb read through LMDB's map stays mapped, in the process's RSS, and a read
    maps the cached pages around it too (the kernel's fault-around): a trainer's RSS grew past
    its budget by most of the file (2M x 64 rows, 256 MiB budget: 278 MiB of it mapped against
    a 64 MiB share). A budgeted store unmaps them once they pass half the page cache's share."""
    out = subprocess.run([sys.executable, "-c", _MAPPED, str(tmp_path / "s")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    mapped, share = map(int, out.stdout.split())
    assert mapped <= share, f"{mapped >> 20} MiB of data.mdb mapped, over the page cache's share of {share >> 20} MiB"
