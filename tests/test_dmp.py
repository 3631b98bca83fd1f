"""TorchRec's DistributedModelParallel over tierstore shards, against TorchRec's own sharder
and the unsharded model: real rank processes (spawn), gloo over a file rendezvous, real LMDB
under tiny tiers. One launch of 2 ranks trains every case (the process group and TorchRec's
import are paid once); each rank saves what it saw (tests/dmp_ranks.py) and the tests compare."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.multiprocessing as mp

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds on import
    torchrec = pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed: see the README's TorchRec section")
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from dmp_ranks import (CASES, DLRM_TABLES, EPS, LR, OPTIMIZERS, OTHER_TIERS, PLANS, PREFETCHED, STEPS, WORLD, _rank_main,
                       batch, configs, initial_weights, launch)
from tierstore import optim


@pytest.fixture(scope="module")
def trained_at(tmp_path_factory):
    return tmp_path_factory.mktemp("dmp-train")


@pytest.fixture(scope="module")
def trained(trained_at):
    return launch(trained_at, "train")


# -- the oracles ----------------------------------------------------------------------------
def assembled(results: list, case, tables: list[EmbeddingBagConfig] | None = None) -> dict[str, torch.Tensor]:
    """Each table's rows (and "<table>.state": its optimizer state), assembled from every rank's shards."""
    full = {}
    for res in results:
        for table, shards in res[case]["rows"].items():
            for r, c, rows in shards:
                config = next(t for t in tables or configs() if table.split(".")[0] == t.name)
                width = config.embedding_dim if table == config.name else rows.shape[1]
                part = full.setdefault(table, torch.full((config.num_embeddings, width), float("nan")))
                part[r:r + rows.shape[0], c:c + rows.shape[1]] = rows
    return full


def column_blocks(results: list, case) -> dict[str, list[tuple[int, int]]]:
    """Each table's column ranges, one per column shard the plan made."""
    return {table: sorted({(c, c + rows.shape[1]) for res in results for r, c, rows in res[case]["rows"].get(table, [])})
            for table in (c.name for c in configs())}


def unsharded(blocks: dict, opt: str, world: int = WORLD) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """The model on one process, its loss the mean of the ranks' (TorchRec divides the
    embeddings' gradients by the world size), updated by the optimizer's formula on the dense
    gradient (row-wise Adagrad: one accumulator per row of each column shard, ``blocks``, as TorchRec's)."""
    ebc = EmbeddingBagCollection(configs())
    weights = initial_weights()
    with torch.no_grad():
        for name, w in weights.items():
            ebc.embedding_bags[name].weight.copy_(w)
    state = {name: torch.zeros(w.shape[0], len(blocks[name])) for name, w in weights.items()}
    outs = [[] for _ in range(world)]
    for step in range(STEPS):
        ebc.zero_grad()
        total = 0
        for r in range(world):
            o = ebc(batch(step, r)).values()  # keys in KEYS' order
            outs[r].append(o.detach())
            total = total + o.pow(2).sum() / world
        total.backward()
        with torch.no_grad():
            for name in weights:
                w = ebc.embedding_bags[name].weight
                g = w.grad
                if opt == "sgd":
                    w.sub_(LR * g)
                    continue
                for k, (c0, c1) in enumerate(blocks[name]):
                    gb = g[:, c0:c1]
                    state[name][:, k] += gb.pow(2).mean(dim=1)
                    w[:, c0:c1] -= LR * gb / (state[name][:, k:k + 1].sqrt() + EPS)
    return outs, {name: ebc.embedding_bags[name].weight.detach() for name in weights}


@pytest.fixture(scope="module")
def trained_4(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("dmp-train-4"), "train-4", world=4)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dmp_trains_as_torchrecs_sharder_and_the_unsharded_model(trained, plan_name, opt):
    check_trains_as_torchrec_and_unsharded(trained, plan_name, opt)


@pytest.mark.slow  # 4 processes: a minute on 2 cores
@pytest.mark.parametrize("plan_name", ["row", "column"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dmp_on_4_ranks_trains_as_torchrecs_sharder_and_the_unsharded_model(trained_4, plan_name, opt):
    check_trains_as_torchrec_and_unsharded(trained_4, plan_name, opt)


@pytest.mark.slow
def test_dmp_on_4_ranks_tier_sizes_and_prefetch_change_no_bit(trained_4):
    check_same_bits(trained_4, ("row", "rowwise", "tierstore", "tiny"), ("row", "rowwise", "tierstore", "roomy"))
    check_same_bits(trained_4, ("row", "rowwise", "tierstore", "tiny"), ("pipelines", "row"))


def check_trains_as_torchrec_and_unsharded(trained: list, plan_name: str, opt: str) -> None:
    ours, theirs = (plan_name, opt, "tierstore", "tiny"), (plan_name, opt, "torchrec", "tiny")
    assert column_blocks(trained, ours) == column_blocks(trained, theirs)
    outs, rows = unsharded(column_blocks(trained, theirs), opt, len(trained))
    for r, res in enumerate(trained):
        for step in range(STEPS):
            torch.testing.assert_close(res[ours]["outs"][step], outs[r][step], rtol=0, atol=1e-5)
            torch.testing.assert_close(res[ours]["outs"][step], res[theirs]["outs"][step], rtol=0, atol=1e-5)
    got, want = assembled(trained, ours), assembled(trained, theirs)
    for name in rows:
        assert not got[name].isnan().any()
        torch.testing.assert_close(got[name], rows[name], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_the_fused_optimizers_state_has_torchrecs_keys_and_shapes(trained, plan_name):
    """Row-wise Adagrad's momentum1 of a column-sharded table holds each column shard's
    accumulators, [rows x column shards], as TorchRec's."""
    ours, theirs = (plan_name, "rowwise", "tierstore", "tiny"), (plan_name, "rowwise", "torchrec", "tiny")
    for res in trained:  # TorchRec's names a rank's own tables; tierstore's every table (no rows where none)
        got, want = res[ours]["optim_shapes"], res[theirs]["optim_shapes"]
        assert want and {p: got[p] for p in want} == want
    assert trained[0][("column", "rowwise", "torchrec", "tiny")]["optim_shapes"]["ebc.embedding_bags.t1.weight"] == \
        {"t1.momentum1": (80,)}


def test_every_sharding_type_on_the_cpu_was_run(trained):
    types = {t for res in trained for case in CASES for t in res[case]["types"].values()}
    assert types == {"table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"}


def test_the_planner_counts_a_shards_tiers_not_its_table(tmp_path):
    """A table 10x a rank's memory is planned onto ranks whose memory holds its tiers; TorchRec's
    own planner finds no plan for it. A memory_budget per rank plans it too."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import PlannerError

    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    tables = [EmbeddingBagConfig(name="big", num_embeddings=10_000_000, embedding_dim=64, feature_names=["f1"]),
              EmbeddingBagConfig(name="small", num_embeddings=100, embedding_dim=8, feature_names=["f2"])]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=256 << 20)  # the table: 2.56 GB
    with pytest.raises(PlannerError, match="insufficient storage"):
        EmbeddingShardingPlanner(topology=topology).plan(ebc, [EmbeddingBagCollectionSharder()])
    for tiers in ({"ddr_rows": 100_000}, {"memory_budget": "64MiB"}):
        sharder = TieredEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.RowWiseAdagrad(0.1), **tiers)
        plan = sharder.planner(topology).plan(ebc, [sharder]).plan[""]
        assert {p.compute_kernel for p in plan.values()} == {"customized_kernel"}
        assert set(plan) == {"big", "small"}
    for tiers in ({"ddr_rows": 10_000_000}, {"memory_budget": "300MiB"}):  # the whole table in DDR; a budget over a rank's
        sharder = TieredEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.RowWiseAdagrad(0.1), **tiers)
        with pytest.raises(PlannerError, match="Unable to find a plan"):
            sharder.planner(topology).plan(ebc, [sharder])


def check_same_bits(trained: list, case, other) -> None:
    """The outputs and trained rows of ``other`` are ``case``'s, bit for bit (each a case, or
    ("pipelines", plan) for a prefetched run)."""
    def at(res: dict, key) -> dict:
        return res["pipelines"][key[1]] if key[0] == "pipelines" else res[key]

    results = [{"a": at(res, case), "b": at(res, other)} for res in trained]
    for res in results:
        assert all(torch.equal(x, y) for x, y in zip(res["a"]["outs"], res["b"]["outs"], strict=True))
    a, b = assembled(results, "a"), assembled(results, "b")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("plan_name,opt,tiers", OTHER_TIERS)
def test_tier_sizes_change_no_bit(trained, plan_name, opt, tiers):
    check_same_bits(trained, (plan_name, opt, "tierstore", "tiny"), (plan_name, opt, "tierstore", tiers))


def test_torchrecs_pipeline_changes_no_bit(trained):
    for res in trained:
        plain = res[("mixed", "rowwise", "tierstore", "tiny")]["outs"]
        assert all(torch.equal(a, b) for a, b in zip(plain, res["pipelines"]["pipelined"], strict=True))


@pytest.mark.parametrize("plan_name", list(PREFETCHED))
def test_prefetching_batches_ahead_after_the_input_dist_changes_no_bit(trained, plan_name):
    """Rows prefetched PREFETCHED[plan] batches ahead of their lookup, so some are read before the
    previous step's update, train to the same bits as without prefetch."""
    check_same_bits(trained, (plan_name, "rowwise", "tierstore", "tiny"), ("pipelines", plan_name))


def test_a_model_holding_tierstores_collection_shards_as_torchrecs(trained):
    for res in trained:
        plain = res[("table", "sgd", "tierstore", "tiny")]["outs"]
        assert all(torch.equal(a, b) for a, b in zip(plain, res["tierstore-collection"]))


def test_two_shards_of_a_table_on_a_rank_live_in_two_stores(trained):
    case = ("mixed", "sgd", "tierstore", "tiny")
    assert len(column_blocks(trained, case)["t1"]) == 4
    assert sorted(p.name for p in (trained[0]["path"] / "-".join(case)).iterdir()) == ["rank-0", "rank-0.1", "rank-1", "rank-1.1"]


def test_init_fn_gives_the_rows_their_first_values(trained):
    """t2's init_fn (normal, std 0.3) and t1's default (uniform +-1/sqrt(40)) are what the
    first forward pools: the unsharded model from those rows gives the same outputs."""
    w = initial_weights()
    assert w["t1"].abs().max() <= 40 ** -0.5 and w["t2"].std() > 0.2
    outs, _ = unsharded(column_blocks(trained, ("table", "sgd", "torchrec", "tiny")), "sgd")
    for r, res in enumerate(trained):
        torch.testing.assert_close(res[("table", "sgd", "tierstore", "tiny")]["outs"][0], outs[r][0], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def loaded(trained, trained_at):
    """The checkpoints of the 2-rank launch restored by a launch of ``world`` ranks (each once)."""
    runs = {}

    def at(world: int) -> list:
        if world not in runs:
            runs[world] = launch(trained_at / f"load-{world}", "load", world=world)
        return runs[world]

    return at


@pytest.mark.parametrize("world", [2, 1, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: 45 s on 2 cores
def test_a_dcp_checkpoint_of_2_ranks_loads_onto_another_plan_and_world_size(trained, loaded, world):
    """DCP saves each rank's shards in chunks under TorchRec's names (t1 on rank 0, t2 on rank 1);
    loaded onto 2 ranks (t1 split by rows, t2 on rank 0), 1 rank (every table there) and 4 (t1
    split by rows, t2 on rank 3), the rows and row-wise Adagrad's state are the saved ones, bit
    for bit."""
    assert "ebc.embedding_bags.t1.weight" in trained[0]["dcp"]["keys"]
    saved = assembled(trained, "dcp")
    results = [{"dcp": res["load-2"]} for res in trained] if world == 2 else loaded(world)
    loaded = assembled(results, "dcp")
    assert sorted(saved) == sorted(loaded) == ["t1", "t1.state", "t2", "t2.state"]
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: 45 s on 2 cores
def test_a_dlrm_with_a_table_10x_its_ranks_ddr_tier_trains_checkpoints_and_restores_bit_for_bit(trained, loaded, world):
    """torchrec's DLRM, its big table row-wise on 2 ranks (200 rows a rank under DDR tiers of 20
    and HBM tiers of 4, the rest in LMDB), trains as with TorchRec's own sharder (same rows and
    dense layers at the start); its DCP checkpoint restores onto 1 rank (every table there) and
    4 (big row-wise, small on rank 3): rows, row-wise Adagrad's state and the dense layers bit
    for bit."""
    ours, theirs = ([res["dlrm"][kind] for res in trained] for kind in ("tierstore", "torchrec"))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.stack(a["losses"]), torch.stack(b["losses"]), rtol=0, atol=1e-5)
        assert sorted(a["dense"]) == sorted(b["dense"]) and a["dense"]
        for key in a["dense"]:
            torch.testing.assert_close(a["dense"][key], b["dense"][key], rtol=0, atol=1e-5)
    saved = assembled([{"x": r} for r in ours], "x", DLRM_TABLES)
    want = assembled([{"x": r} for r in theirs], "x", DLRM_TABLES)
    for table in ("big", "small"):
        torch.testing.assert_close(saved[table], want[table], rtol=0, atol=1e-5)
    trained_rows = (saved["big"] != initial_weights(DLRM_TABLES)["big"]).any(1)
    assert int(trained_rows[:200].sum()) > 24 and int(trained_rows[200:].sum()) > 24  # more than a rank's tiers hold
    restored = [res["dlrm"] for res in loaded(world)]
    got = assembled([{"x": r} for r in restored], "x", DLRM_TABLES)
    assert sorted(got) == sorted(saved) == ["big", "big.state", "small", "small.state"]
    for name in saved:
        assert torch.equal(got[name], saved[name]), name
    for res in restored:
        assert sorted(res["dense"]) == sorted(ours[0]["dense"])
        assert all(torch.equal(res["dense"][k], ours[0]["dense"][k]) for k in res["dense"])


def test_column_shards_resume_from_a_dcp_checkpoint_as_if_uninterrupted(trained):
    """Each column shard's row-wise Adagrad accumulators are saved (TorchRec's momentum1 holds one
    per row of each column shard): the restored model's next steps are the uninterrupted ones."""
    for res in trained:
        a, b = res["resumed"]["uninterrupted"], res["resumed"]["restored"]
        assert all(torch.equal(x, y) for x, y in zip(a["outs"], b["outs"]))
        assert sorted(a["rows"]) == sorted(b["rows"]) and "t1.state" in a["rows"]
        for table in a["rows"]:
            for (r, c, x), (r2, c2, y) in zip(a["rows"][table], b["rows"][table], strict=True):
                assert (r, c) == (r2, c2) and torch.equal(x, y), (table, r, c)


def test_a_rank_killed_between_steps_ends_the_other_with_rank_failed_error(tmp_path):
    spawn = mp.get_context("spawn")
    ranks = [spawn.Process(target=_rank_main, args=(r, WORLD, str(tmp_path), "killed")) for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 3]
    error = torch.load(tmp_path / "result-0.pt", weights_only=False)["error"]
    assert error is not None and error[0] == "RankFailedError", error
    assert "rank 0: TorchRec's dists with the other ranks failed" in error[1] and "a rank died" in error[1]
