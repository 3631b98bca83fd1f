"""Settings in one place: a store's settings passed whole as
``TieredStore(path, tables, config=StoreConfig(...))``, a keyword that contradicts
the config refused before anything is created, and the shared validators
(tierstore.validate) with the messages the entry points give. Real LMDB stores."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from tierstore import PrefetchConfig, StoreConfig, TableSpec, TieredStore, open_store
from tierstore.trace import TraceTable
from tierstore.validate import check_choice, check_int, check_number, check_rows
from tierstore.daemon.wire import Limits

SPEC = TableSpec("t", 1000, 4)


def opened(path, *args, **kwargs) -> TieredStore:
    return TieredStore(path, *args, registry=CollectorRegistry(), **kwargs)


def test_a_config_opens_the_store_as_its_keywords_do(tmp_path):
    cfg = StoreConfig(hbm_rows=8, ddr_rows={"t": 32}, policy="lfu", device="cpu", writeback_group_rows=16)
    with opened(tmp_path / "a", [SPEC], config=cfg) as a, \
            opened(tmp_path / "b", [SPEC], hbm_rows=8, ddr_rows={"t": 32}, policy="lfu", device="cpu",
                   writeback_group_rows=16) as b:
        assert dataclasses.replace(a.config, path=None) == dataclasses.replace(b.config, path=None)
        assert a.config.path == tmp_path / "a" and a.path == tmp_path / "a"
        ids = torch.arange(100)
        for s in (a, b):
            s.read("t", ids)
        assert a.stats() == b.stats()  # the same tier sizes and policy: the same hits, evictions, write-backs
    assert cfg.hbm_rows == 8 and cfg.path is None  # the caller's config is not the store's to change


def test_a_store_keeps_the_spare_space_it_is_given_for_its_tables_logs(tmp_path):
    """spare_space is the room each log table keeps for dead rows (io.rowlog.RowLog.spare),
    as given at this open: it is not stored, and a reopen may give another."""
    for spare in (1.0, 0.25):
        with opened(tmp_path / "s", [SPEC], device="cpu", spare_space=spare) as s:
            s.write("t", torch.arange(10), torch.ones(10, 4))
            assert s.config.spare_space == spare and s._backend._logs["t"].spare == spare


def test_a_config_reopens_readonly(tmp_path):
    opened(tmp_path / "s", [SPEC], device="cpu").close()
    with opened(tmp_path / "s", config=StoreConfig(readonly=True, device="cpu")) as s:
        assert s.readonly
        with pytest.raises(PermissionError):
            s.write("t", [1], torch.ones(1, 4))


@pytest.mark.parametrize("keywords, setting", [
    (dict(hbm_rows=4), "hbm_rows"),
    (dict(policy="lru", eviction="lookahead"), "eviction"),
    (dict(memory_budget="1GiB"), "memory_budget"),
])
def test_a_keyword_that_contradicts_the_config_is_refused_and_creates_nothing(tmp_path, keywords, setting):
    cfg = StoreConfig(hbm_rows=8, policy="lfu", device="cpu")
    with pytest.raises(ValueError, match=rf"^TieredStore: {setting}=.* contradicts config\.{setting}=.*"
                                         rf"dataclasses\.replace\(config, {setting}=\.\.\.\)"):
        opened(tmp_path / "s", [SPEC], config=cfg, **keywords)
    assert not (tmp_path / "s").exists()


def test_a_config_naming_another_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="path=.* contradicts config.path="):
        opened(tmp_path / "s", [SPEC], config=StoreConfig(tmp_path / "other", device="cpu"))
    assert not (tmp_path / "s").exists() and not (tmp_path / "other").exists()


def test_keywords_that_agree_with_the_config_are_taken(tmp_path):
    cfg = StoreConfig(tmp_path / "s", hbm_rows=8, policy="lfu", device="cpu", memory_budget=1 << 30)
    with opened(tmp_path / "s", [SPEC], config=cfg, hbm_rows=8, device=torch.device("cpu"), memory_budget="1GiB") as s:
        assert s.config.policy == "lfu" and s.config.memory_budget == 1 << 30


def test_config_must_be_a_store_config(tmp_path):
    with pytest.raises(TypeError, match="config must be a tierstore.StoreConfig, got dict"):
        opened(tmp_path / "s", [SPEC], config={"hbm_rows": 8})


def test_the_keywords_and_the_config_have_the_same_defaults():
    """A keyword left out yields to the config only while its default is the config's."""
    params = inspect.signature(TieredStore.__init__).parameters
    for f in dataclasses.fields(StoreConfig):
        if f.name != "path":
            assert params[f.name].default == f.default, f.name


# -- the validators ------------------------------------------------------------------

def test_check_int():
    assert check_int(np.int64(3), "n") == 3 and type(check_int(np.int64(3), "n")) is int
    assert check_int(None, "n", none=True) is None
    assert check_int(5, "n", at_least=1, at_most=5) == 5
    with pytest.raises(ValueError, match=r"^workers must be an int >= 1 \(threads reading ahead\), got 0$"):
        check_int(0, "workers", at_least=1, meaning="threads reading ahead")
    with pytest.raises(ValueError, match=r"^n must be an int in \[1, 255\], got 256$"):
        check_int(256, "n", at_least=1, at_most=255)
    with pytest.raises(ValueError, match=r"^n must be an int >= 0 or None, got -1$"):
        check_int(-1, "n", none=True)
    for bad in (True, np.bool_(False), 2.0, "3", None):
        with pytest.raises(ValueError, match="n must be an int >= 0"):
            check_int(bad, "n")


def test_check_number():
    assert check_number(2, "lr", above=True) == 2.0
    assert check_number(0, "wait") == 0.0
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match=r"^lr must be a finite number > 0 \(the step size\), got "):
            check_number(bad, "lr", above=True, meaning="the step size")
    assert check_number(float("inf"), "wait", finite=False) == float("inf")  # a threshold never reached
    assert check_number(1, "share", above=True, at_most=1.0) == 1.0
    with pytest.raises(ValueError, match=r"^share must be a finite number > 0 and <= 1, got 1.01$"):
        check_number(1.01, "share", above=True, at_most=1.0)
    with pytest.raises(ValueError, match=r"^wait must be a number >= 0, got nan$"):
        check_number(float("nan"), "wait", finite=False)


def test_check_choice_and_rows():
    assert check_choice("lfu", "policy", ("lru", "lfu")) == "lfu"
    with pytest.raises(ValueError, match=r"^policy must be one of 'lru', 'lfu', got 'mru'$"):
        check_choice("mru", "policy", ("lru", "lfu"))
    check_rows({"a": 0, "b": np.int32(4)}, "hbm_rows")
    check_rows(None, "hbm_rows")
    with pytest.raises(ValueError, match=r"^hbm_rows for b must be an int >= 0 \(0 = no such tier\), got -4$"):
        check_rows({"a": 0, "b": -4}, "hbm_rows")
    with pytest.raises(ValueError, match=r"^ddr_rows for every table must be an int >= 0 \(0 = no such tier\), got 1.5$"):
        check_rows(1.5, "ddr_rows")


@pytest.mark.parametrize("keywords, message", [
    (dict(hbm_rows={"t": -1}), r"hbm_rows for t must be an int >= 0 \(0 = no such tier\), got -1"),
    (dict(writeback_group_rows=True), r"writeback_group_rows must be an int >= 0 \(rows the writer gathers"),
    (dict(writeback_rows=-1), r"writeback_rows must be an int >= 0 or None \(rows queued for LMDB"),
    (dict(eviction="belady"), r"eviction must be one of 'policy', 'lookahead'"),
    (dict(spare_space=0), r"spare_space must be a finite number > 0 and <= 1 \(dead rows kept at most, as a fraction of the live rows"),
    (dict(spare_space=1.5), r"spare_space must be a finite number > 0 and <= 1 .*, got 1.5"),
    (dict(spare_space="1"), r"spare_space must be a finite number > 0 and <= 1 .*, got '1'"),
])
def test_the_store_reports_bad_settings_by_name(tmp_path, keywords, message):
    with pytest.raises(ValueError, match=message):
        opened(tmp_path / "s", [SPEC], device="cpu", **keywords)
    with pytest.raises(ValueError, match=message):
        StoreConfig(**keywords)
    assert not (tmp_path / "s").exists()


# -- the entry points that use them ---------------------------------------------------

def _daemon_config(**kw):
    from tierstore.daemon.config import DaemonConfig
    return DaemonConfig("store", "sock", **{"ddr_rows": 10, **kw})


def _capacity_config(**kw):
    from tierstore.tools.capacity_analysis import CapacityConfig
    return CapacityConfig(**kw)


def _synth_config(**kw):
    from tierstore.tools.synth import SynthConfig
    return SynthConfig(**{"tables": (("t", 100),), **kw})


def _bench_config(**kw):
    from tierstore.tools.bench_sharded import ShardedBenchConfig
    return ShardedBenchConfig(**kw)


@pytest.mark.parametrize("make, message", [
    # a bool is not a count: True passed isinstance(x, int) in several of the checks these replace
    (lambda: PrefetchConfig(workers=True), r"prefetch workers must be an int >= 1, got True"),
    (lambda: PrefetchConfig(staged_rows={"t": True}), r"prefetch staged_rows must be an int >= 0 or None, got True"),
    (lambda: _daemon_config(ddr_rows=True), r"--ddr-rows must be an int >= 0 or None, got True"),
    (lambda: _daemon_config(depth=True), r"--depth must be an int >= 1, got True"),
    (lambda: _daemon_config(frame_timeout=0), r"--frame-timeout must be a number > 0 \(seconds\), got 0"),
    (lambda: _capacity_config(steps_per_s=float("nan")), r"steps_per_s must be a finite number > 0, got nan"),
    (lambda: TableSpec("t", 0, 4), r"TableSpec.num_rows must be an int in \[1, 9223372036854775808\] or None \(None = an unbounded"),
    (lambda: TableSpec("t", 10, 4, ttl_steps=0), r"TableSpec.ttl_steps must be an int >= 1 or None \(steps of the table"),
    (lambda: TableSpec("t", 10, 4, evict_l2_below=float("inf")), r"TableSpec.evict_l2_below must be a finite number > 0 or None"),
    (lambda: Limits(max_ids=0), r"Limits.max_ids must be an int >= 1, got 0"),
    (lambda: TraceTable("t", num_rows=0), r"trace table 't': num_rows must be an int >= 1 or None, got 0"),
    (lambda: _synth_config(tables=(("t", True),)), r"table 't': rows must be an int >= 1, got True"),
    (lambda: _synth_config(alpha=float("inf")), r"alpha must be a finite number > 0 \(Zipf exponent"),
    (lambda: _bench_config(steps=True), r"steps must be an int >= 1, got True"),
    (lambda: open_store("store", daemon="no.sock", shm_bytes=True), r"shm_bytes must be an int >= 0 \(0 = no shared memory\), got True"),
    (lambda: open_store("store", daemon="no.sock", timeout=0), r"timeout must be a number > 0 \(seconds\), got 0"),
])
def test_entry_points_report_bad_settings_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_infinity_stays_a_threshold_never_reached():
    assert PrefetchConfig(sync_read_us=float("inf")).sync_read_us == float("inf")  # never read ahead
    assert _daemon_config(idle_timeout=float("inf")).idle_timeout == float("inf")


# -- modules take a StoreConfig as store= -------------------------------------------------------------------
MODULE_CFG = StoreConfig(hbm_rows=8, ddr_rows=32, policy="lfu", device="cpu", eviction="lookahead", writeback_group_rows=16)


def _is_module_cfg(store: TieredStore, path) -> bool:
    c = store.config
    return (c.path, c.hbm_rows, c.ddr_rows, c.policy, c.eviction, c.writeback_group_rows) == (
        path, {"t": 8}, {"t": 32}, "lfu", "lookahead", 16)


def test_every_module_opens_its_store_with_a_config_given_as_store(tmp_path):
    """No module took a StoreConfig: eviction, writeback_*, map_size, direct_reads and clock could not be set from a model."""
    import tierstore

    bag = tierstore.TieredEmbeddingBag(1000, 4, path=tmp_path / "a", store=MODULE_CFG, table="t",
                                       optimizer=tierstore.optim.SGD(lr=0.1))
    assert _is_module_cfg(bag.store, tmp_path / "a") and bag.store.tables["t"].num_rows == 1000
    bag.close()
    ebc = tierstore.TieredEmbeddingBagCollection([SPEC], store=dataclasses.replace(MODULE_CFG, path=tmp_path / "b"))
    assert _is_module_cfg(ebc.store, tmp_path / "b")
    ebc.close()
    torchrec = pytest.importorskip("torchrec", reason="the TorchRec collection needs the optional peer TorchRec")
    from tierstore.torchrec import TieredEmbeddingBagCollection

    table = torchrec.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=1000, feature_names=["t"])
    trc = TieredEmbeddingBagCollection([table], path=tmp_path / "c", store=MODULE_CFG)
    assert _is_module_cfg(trc.store, tmp_path / "c")
    trc.close()


def test_a_module_refuses_a_keyword_that_contradicts_its_config_and_options_beside_an_open_store(tmp_path):
    import tierstore

    with pytest.raises(ValueError, match=r"hbm_rows=4 contradicts config\.hbm_rows=8"):
        tierstore.TieredEmbeddingBag(1000, 4, path=tmp_path / "a", store=MODULE_CFG, hbm_rows=4)
    assert not (tmp_path / "a").exists()
    with opened(tmp_path / "s", [SPEC], device="cpu") as s:
        with pytest.raises(ValueError, match=r"its own settings apply: drop path=, hbm_rows="):
            tierstore.TieredEmbeddingBag(1000, 4, path=tmp_path / "x", store=s, table="t", hbm_rows=4)
    with pytest.raises(ValueError, match=r"pass path=.*store=StoreConfig\(path="):
        tierstore.TieredEmbeddingBag(1000, 4, store=MODULE_CFG)


def test_the_sharded_module_opens_each_rank_store_with_the_config(tmp_path):
    import torch.distributed as dist

    from tierstore.distributed import ShardedEmbeddingBagCollection, plan

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="leave the config's path unset"):
            ShardedEmbeddingBagCollection([SPEC], plan([SPEC], 1), tmp_path / "m", store=StoreConfig(tmp_path / "x"))
        module = ShardedEmbeddingBagCollection([SPEC], plan([SPEC], 1), tmp_path / "m", store=MODULE_CFG,
                                               registry=CollectorRegistry())
        assert _is_module_cfg(module.local_store, tmp_path / "m" / "rank-0")
        module.close()
    finally:
        dist.destroy_process_group()


def test_the_dmp_sharder_opens_each_rank_store_with_the_config(tmp_path):
    """TieredEmbeddingBagCollectionSharder takes store=StoreConfig(...) as the other modules do."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds on import
        torchrec = pytest.importorskip("torchrec", reason="the DMP sharder needs the optional peer TorchRec")
        from torchrec.distributed import sharding_plan as sp
        from torchrec.distributed.types import ShardingEnv
    import tierstore
    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    with pytest.raises(ValueError, match="leave the config's path unset"):
        TieredEmbeddingBagCollectionSharder(tmp_path / "m", store=StoreConfig(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"hbm_rows=4 contradicts config.hbm_rows=8"):
        TieredEmbeddingBagCollectionSharder(tmp_path / "m", store=MODULE_CFG, hbm_rows=4)
    sharder = TieredEmbeddingBagCollectionSharder(tmp_path / "m", store=MODULE_CFG, optimizer=tierstore.optim.SGD(lr=0.1))
    ebc = torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=1000,
                                                                       feature_names=["t"])], device=torch.device("meta"))
    params = sp.construct_module_sharding_plan(ebc, {"t": sp.table_wise(rank=0)}, sharder=sharder, local_size=1,
                                               world_size=1, device_type="cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        module = sharder.shard(ebc, params, ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))
        assert _is_module_cfg(module.stores.stores[0], tmp_path / "m" / "rank-0")
        module.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("given, error, says", [
    ({"hbm_rows": -1}, "SettingError", "hbm_rows for every table must be an int >= 0"),
    ({"ddr_rows": {"t": "many"}}, "SettingError", "ddr_rows for t must be an int >= 0"),
    ({"policy": "mru"}, "SettingError", "unknown eviction policy 'mru'; choose one of"),
    ({"memory_budget": "lots"}, "SettingError", "memory_budget 'lots' is not a size"),
    ({"kernels": "cuda"}, "SettingError", "kernels must be one of 'torch', 'fbgemm'"),
    ({"init": "normal"}, "ArgumentTypeError", r"init must be a tierstore.RowInit"),
    ({"store": {"hbm_rows": 3}}, "ArgumentTypeError", "store must be a tierstore.StoreConfig"),
    ({"fused_params": {"optimizer": "EXACT_SGD", "learning_rate": 0.1}}, "SettingError",
     r"fused_params \['learning_rate', 'optimizer'\] configure FBGEMM's fused optimizer.*pass optimizer=tierstore.optim"),
])
def test_the_dmp_sharder_refuses_bad_settings_where_it_is_made(tmp_path, given, error, says):
    """Checked when the sharder is made, not on every rank once DistributedModelParallel shards."""
    import warnings

    from tierstore import errors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchrec", reason="the DMP sharder needs the optional peer TorchRec")
    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    with pytest.raises(getattr(errors, error), match=says):
        TieredEmbeddingBagCollectionSharder(tmp_path, **given)


def test_the_dmp_sharder_refuses_a_path_or_topology_of_another_type(tmp_path):
    import warnings

    from tierstore import errors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchrec", reason="the DMP sharder needs the optional peer TorchRec")
    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    with pytest.raises(errors.ArgumentTypeError, match="path must be the directory of the ranks' stores"):
        TieredEmbeddingBagCollectionSharder(None)
    with pytest.raises(errors.ArgumentTypeError, match=r"topology must be TorchRec's .*Topology\(world_size="):
        TieredEmbeddingBagCollectionSharder(tmp_path).planner(None)


def test_a_table_layout_that_contradicts_the_stored_one_names_the_directory_and_the_fixes(tmp_path):
    """A module or the DMP sharder opens the store for the caller: the error says which directory holds the other layout."""
    import tierstore

    TieredStore(tmp_path / "s", [SPEC], registry=CollectorRegistry()).close()
    with pytest.raises(tierstore.errors.SettingError,
                       match=rf"dim=8 contradicts the dim=4 stored in {tmp_path / 's'}; open it without tables=.*or give a new path"):
        tierstore.TieredEmbeddingBag(1000, 8, path=tmp_path / "s", table="t")


def test_a_path_or_tables_of_another_type_is_named_with_the_fix(tmp_path):
    from tierstore import errors

    with pytest.raises(errors.ArgumentTypeError, match=r"path must be the store's directory \(a str or pathlib.Path\), got int"):
        TieredStore(5, [SPEC])
    with pytest.raises(errors.ArgumentTypeError, match="tables must be a list of tierstore.TableSpec.*got TableSpec: wrap the one spec in a list"):
        opened(tmp_path / "a", SPEC)
    with pytest.raises(errors.ArgumentTypeError, match=r"got a list holding \['str'\]"):
        opened(tmp_path / "a", ["t"])
    assert not (tmp_path / "a").exists()  # refused before anything is created
    with opened(tmp_path / "a", (SPEC,)) as store:  # a tuple is a list of specs
        assert list(store.tables) == ["t"]
