"""tierstore.distributed against one process: real rank processes (spawn), gloo over
127.0.0.1, real LMDB under tiny tiers. Each launch runs many checks; the ranks save
what they saw and the test process compares it with TieredEmbeddingBagCollection
trained on the concatenated global batch (rank 0's local batch, then rank 1's, ...)."""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import traceback
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierstore import RowInit, TableSpec, TieredEmbeddingBagCollection, optim
from tierstore.training.bags import sort_is_stable
from tierstore.training.sharding import PlanMismatchError, Shard, ShardingPlan, TablePlan

TIERS = {"hbm_rows": 3, "ddr_rows": 4, "device": "cpu"}  # tiny: rows go through LMDB every step; on the CPU
# even where CUDA is (the default device), so the ranks and one process compare bit for bit
TABLES = [
    TableSpec("user", 40, 8, init=RowInit.normal(0.0, 0.5, seed=1)),
    TableSpec("item", 30, 4, init=RowInit.uniform(-1.0, 1.0, seed=2)),
    TableSpec("wide", 20, 6, init=RowInit.normal(0.0, 0.5, seed=3)),
    TableSpec("hashed", None, 4, init=RowInit.normal(0.0, 0.5, seed=4)),
]
OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.1),
    "rowwise": lambda: optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: optim.Adam(lr=0.05),
}


def whole(rank: int) -> Shard:
    return Shard(rank, None, None, 0, 0)


def make_plan(world: int) -> ShardingPlan:
    """Every sharding type: user by row ranges, item whole on the last rank, wide by
    columns, hashed (unbounded) by hash."""
    cuts = [round(40 * r / world) for r in range(world + 1)]
    cols = [round(6 * r / world) for r in range(world + 1)]
    return ShardingPlan(world, {
        "user": TablePlan("user", "row", tuple(Shard(r, cuts[r], cuts[r + 1], 0, 8) for r in range(world))),
        "item": TablePlan("item", "table", (Shard(world - 1, None, None, 0, 4),)),
        "wide": TablePlan("wide", "column", tuple(Shard(r, None, None, cols[r], cols[r + 1]) for r in range(world))),
        "hashed": TablePlan("hashed", "row", tuple(Shard(r, None, None, 0, 4) for r in range(world))),
    })


def local_batch(step: int, rank: int, weighted: bool = False) -> dict:
    """Rank ``rank``'s batch of ``step``: many repeated ids, so rows recur across ranks."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for spec in TABLES:
        bags = 5 + rank
        lengths = torch.randint(0, 7, (bags,), generator=g)
        n = int(lengths.sum())
        hi = spec.num_rows or 50
        values = torch.randint(0, min(hi, 12), (n,), generator=g) * (hi // 12 or 1) if spec.name == "hashed" else \
            torch.randint(0, hi, (n,), generator=g) % 9
        offsets = torch.cumsum(lengths, 0) - lengths
        out[spec.name] = (values, offsets)
        if weighted and spec.name == "user":
            out[spec.name] = (values, offsets, torch.rand(n, generator=g))
    return out


def concat(batches: list[dict]) -> dict:
    out = {}
    for name in batches[0]:
        values, offsets, weights, at = [], [], [], 0
        for b in batches:
            values.append(b[name][0])
            offsets.append(b[name][1] + at)
            at += len(b[name][0])
            if len(b[name]) == 3:
                weights.append(b[name][2])
        out[name] = (torch.cat(values), torch.cat(offsets), *([torch.cat(weights)] if weights else []))
    return out


def loss_of(outs: dict) -> torch.Tensor:
    return sum(o.pow(2).sum() for o in outs.values())


CHECK_IDS = {"user": torch.arange(40), "item": torch.arange(30), "wide": torch.arange(20),
             "hashed": torch.arange(0, 50, 4)}


# -- rank side ------------------------------------------------------------------------------
def rendezvous(out: Path) -> str:
    """Where the ranks of one launch meet: a file in the launch's own folder. (A port picked free and
    closed again can be taken by another test's process before rank 0 binds it: `pytest -n` runs
    tests side by side.) The ranks still talk over gloo's TCP sockets."""
    return f"file://{Path(out).resolve() / 'rendezvous'}"


def _rank_main(rank: int, world: int, init_method: str, out: str, scenario: str):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        result = SCENARIOS[scenario](rank, world, Path(out))
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    torch.save(result, Path(out) / f"result-{rank}.pt")
    dist.destroy_process_group()


def launch(tmp_path: Path, scenario: str, world: int) -> list:
    tmp_path.mkdir(parents=True, exist_ok=True)
    try:
        mp.spawn(_rank_main, args=(world, rendezvous(tmp_path), str(tmp_path), scenario), nprocs=world, join=True)
    except Exception:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("error-*.txt")))
        raise AssertionError(f"a rank failed:\n{errors}") from None
    return [torch.load(tmp_path / f"result-{r}.pt") for r in range(world)]


def read_all(module, rank: int) -> dict:
    """Every checked row with its state, read by rank 0 (the others ask for none)."""
    return {name: module.read(name, ids if rank == 0 else ids[:0], with_state=True) for name, ids in CHECK_IDS.items()}


def train_sharded(rank, world, path, opt_name, steps=3, mode="sum", weighted=False, depth=None, comm_dtype=None,
                  checkpoint=None, registry=None):
    from tierstore import LookaheadLoader
    from tierstore.distributed import ShardedEmbeddingBagCollection

    module = ShardedEmbeddingBagCollection(TABLES, make_plan(world), path, optimizer=OPTIMIZERS[opt_name](), mode=mode,
                                           comm_dtype=comm_dtype, registry=registry, **TIERS)
    batches = [local_batch(s, rank, weighted) for s in range(steps)]
    if depth is not None:
        batches = LookaheadLoader(batches, module, depth=depth)
    outs, losses = [], []
    for batch in batches:
        o = module(batch)
        loss = loss_of(o)
        loss.backward()
        outs.append({k: v.detach() for k, v in o.items()})
        losses.append(float(loss.detach()))
    rows = read_all(module, rank)
    if checkpoint is not None:
        module.checkpoint(checkpoint)
    metrics = None
    if registry is not None:
        from prometheus_client import generate_latest
        metrics = generate_latest(registry).decode()
    module.close()
    return {"outs": outs, "rows": rows, "losses": losses, "metrics": metrics}


def raised(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def fail_with(error: Exception):
    def fail(*args, **kwargs):
        raise error
    return fail


def bad_inputs(rank, world, path) -> dict:
    """Each rank's error for bad input on one rank; the rows stay as they were and the
    ranks stay in step (a good step follows)."""
    from tierstore.distributed import ShardedEmbeddingBagCollection

    module = ShardedEmbeddingBagCollection(TABLES, make_plan(world), path, optimizer=optim.SGD(lr=0.1), **TIERS)
    before = read_all(module, rank)
    good = local_batch(0, rank)
    bad_id = dict(good, user=(torch.tensor([1, 99] if rank == 1 else [1, 2]), torch.tensor([0])))
    bad_table = dict(good, nope=good["user"]) if rank == 0 else good
    res = {
        "id": raised(lambda: loss_of(module(bad_id)).backward()),
        "table": raised(lambda: loss_of(module(bad_table)).backward()),
        "read": raised(lambda: module.read("item", [3, 30] if rank == 1 else [3])),
        "write": raised(lambda: module.write("item", [3], torch.zeros(1, 5) if rank == 0 else torch.zeros(1, 4))),
    }
    # a fault in one rank's store between collectives: no rank hangs, every rank raises
    for key, victim, method in (("serve", 1, "read"), ("store_write", 0, "write"), ("flush", 0, "flush")):
        if rank == victim:
            setattr(module.local_store, method, fail_with(OSError(f"injected {method} fault")))
        res[key] = raised({"serve": lambda: loss_of(module(good)).backward(),
                           "store_write": lambda: module.write("user", [1], torch.zeros(1, 8)),
                           "flush": module.flush}[key])
        module.local_store.__dict__.pop(method, None)
    res["unchanged"] = all(torch.equal(a, b) for a, b in zip(before.values(), read_all(module, rank).values()))
    loss_of(module(good)).backward()  # still in step
    module.close()
    other = make_plan(world)
    if rank == 1:
        tables = dict(other.tables, item=TablePlan("item", "table", (Shard(0, None, None, 0, 4),)))
        other = ShardingPlan(world, tables)
    res["plan"] = raised(lambda: ShardedEmbeddingBagCollection(TABLES, other, path / "other", optimizer=optim.SGD(lr=0.1)))
    return res


def scenario_train(rank, world, out):
    from prometheus_client import CollectorRegistry

    res = {}
    for opt_name, mode, weighted in (("sgd", "sum", True), ("rowwise", "mean", False), ("adam", "sum", False)):
        res[opt_name] = train_sharded(rank, world, out / opt_name, opt_name, mode=mode, weighted=weighted)
    res["sgd-depth2"] = train_sharded(rank, world, out / "depth2", "sgd", weighted=True, depth=2, registry=CollectorRegistry())
    for dtype in ("float16", "bfloat16"):
        res[dtype] = train_sharded(rank, world, out / dtype, "sgd", weighted=True, comm_dtype=dtype)
    res["bad"] = bad_inputs(rank, world, out / "bad")
    return res


def scenario_four(rank, world, out):
    return {"adam": train_sharded(rank, world, out / "adam", "adam", mode="mean", checkpoint=out / "ckpt")}


def scenario_reshard(rank, world, out):
    """Restore the checkpoint named in out/source onto this world size, read every row,
    and checkpoint again for the next resharding."""
    from tierstore.distributed import ShardedEmbeddingBagCollection

    source = Path((out / "source").read_text())
    module = ShardedEmbeddingBagCollection.from_checkpoint(source, plan=make_plan(world), path=out / "restored",
                                                           optimizer=OPTIMIZERS["adam"](), mode="mean", **TIERS)
    rows = read_all(module, rank)
    module.checkpoint(out / "ckpt")
    module.close()
    return {"rows": rows}


def scenario_dead(rank, world, out):
    """Rank 1 dies (os._exit) after a flushed step; rank 0's next step must raise, not hang."""
    import time

    from tierstore.distributed import ShardedEmbeddingBagCollection

    module = ShardedEmbeddingBagCollection(TABLES, make_plan(world), out / "store", optimizer=OPTIMIZERS["sgd"](), **TIERS)
    loss_of(module(local_batch(0, rank))).backward()
    module.flush()
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    error = raised(lambda: loss_of(module(local_batch(1, rank))).backward())
    torch.save({"error": error, "seconds": time.monotonic() - start}, out / f"result-{rank}.pt")
    os._exit(0)  # the process group has lost a rank: leave without its teardown


def scenario_dies_in(what: str):
    """Rank 1 dies (os._exit) in the middle of a training step, as it enters the exchange of
    ``what`` (ids in forward, grads in backward); rank 0 must raise, not hang."""
    def scenario(rank, world, out):
        import time

        from tierstore.distributed import ShardedEmbeddingBagCollection

        module = ShardedEmbeddingBagCollection(TABLES, make_plan(world), out / "store", optimizer=OPTIMIZERS["sgd"](), **TIERS)
        loss_of(module(local_batch(0, rank))).backward()
        if rank == 1:  # fault injection: the process ends where it would send ``what``
            exchange = module._comm.exchange
            module._comm.exchange = lambda send, recv, kind: os._exit(3) if kind == what else exchange(send, recv, kind)
        start = time.monotonic()
        error = raised(lambda: loss_of(module(local_batch(1, rank))).backward())
        torch.save({"error": error, "seconds": time.monotonic() - start}, out / f"result-{rank}.pt")
        os._exit(0)  # the process group has lost a rank: leave without its teardown
    return scenario


def scenario_cuda(rank, world, out):
    """Row-wise Adagrad, then SGD with per-sample weights; the batches on the GPU."""
    from tierstore.distributed import ShardedEmbeddingBagCollection

    res = {}
    for opt_name, weighted in (("rowwise", False), ("sgd", True)):
        module = ShardedEmbeddingBagCollection(TABLES, make_plan(world), out / opt_name, optimizer=OPTIMIZERS[opt_name](),
                                               **{**TIERS, "device": "cuda"})
        outs = []
        for s in range(2):
            batch = {k: tuple(t.cuda() for t in v) for k, v in local_batch(s, rank, weighted).items()}
            o = module(batch)
            loss_of(o).backward()
            outs.append({k: v.detach().cpu() for k, v in o.items()})
        res[opt_name] = {"outs": outs, "rows": {k: v.cpu() for k, v in read_all(module, rank).items()}}
        module.close()
    return res


def sized_batch(step: int, rank: int) -> dict:
    """Step 0: 16,384 ids of user per rank (the global batch's sort is torch's stable radix sort,
    so each owner gets only its own ids), weighted; step 1: at most 16 ids of every table in all
    (an insertion sort, stable too); step 2: the usual sizes (unstable: user goes whole)."""
    if step == 2:
        return local_batch(step, rank, weighted=True)
    g = torch.Generator().manual_seed(77 * step + rank)
    out = local_batch(step, rank, weighted=True)
    bags, length = (2048, 8) if step == 0 else (2, 2)
    for name in (("user",) if step == 0 else out):
        hi = TABLES[[t.name for t in TABLES].index(name)].num_rows or 50
        values = torch.randint(0, min(hi, 40), (bags * length,), generator=g)
        out[name] = (values, torch.arange(bags) * length, *([torch.rand(bags * length, generator=g)] if name == "user" else []))
    return out


def scenario_sized(rank, world, out):
    """Training as one process whether owners get the whole of a row-sharded table or their own ids,
    and the ids each rank received from the other."""
    from tierstore.distributed import ShardedEmbeddingBagCollection

    module = ShardedEmbeddingBagCollection(TABLES, make_plan(world), out / "store", optimizer=OPTIMIZERS["sgd"](), **TIERS)
    outs, received = [], []
    for s in range(3):
        before = module.received_bytes["ids"]
        o = module(sized_batch(s, rank))
        loss_of(o).backward()
        received.append(module.received_bytes["ids"] - before)
        outs.append({k: v.detach() for k, v in o.items()})
    result = {"sgd": {"outs": outs, "rows": read_all(module, rank)}, "received": received,
              "counts": module.received_bytes}
    module.close()
    return result


SCENARIOS = {"train": scenario_train, "sized": scenario_sized, "dies-in-ids": scenario_dies_in("ids"),
             "dies-in-grads": scenario_dies_in("grads"), "four": scenario_four, "reshard": scenario_reshard, "dead": scenario_dead,
             "cuda": scenario_cuda}


# -- the oracle ------------------------------------------------------------------------------
def train_single(path, world, opt_name, steps=3, mode="sum", weighted=False, batch=None):
    module = TieredEmbeddingBagCollection(TABLES, path=path, optimizer=OPTIMIZERS[opt_name](), mode=mode, **TIERS)
    outs = []
    for s in range(steps):
        locals_ = [local_batch(s, r, weighted) if batch is None else batch(s, r) for r in range(world)]
        o = module(concat(locals_))
        loss_of(o).backward()
        # split the global output back into the ranks' bags
        sizes = {k: [len(b[k][1]) for b in locals_] for k in o}
        outs.append([{k: v.detach()[sum(sizes[k][:r]): sum(sizes[k][: r + 1])] for k, v in o.items()} for r in range(world)])
    rows = {name: module.store.read(name, ids, with_state=True) for name, ids in CHECK_IDS.items()}
    module.close()
    return outs, rows


def assert_same(results, world, tmp_path, opt_name, **kw):
    ref_outs, ref_rows = train_single(tmp_path / f"single-{opt_name}", world, opt_name, **kw)
    for r in range(world):
        for s, got in enumerate(results[r][opt_name]["outs"]):
            for k in got:
                assert torch.equal(got[k], ref_outs[s][r][k]), (opt_name, r, s, k, (got[k] - ref_outs[s][r][k]).abs().max())
    for name, rows in results[0][opt_name]["rows"].items():
        assert rows.shape == ref_rows[name].shape, (name, rows.shape, ref_rows[name].shape)
        assert torch.equal(rows, ref_rows[name]), (opt_name, name, (rows - ref_rows[name]).abs().max())


def test_two_ranks_train_as_one_process(tmp_path):
    results = launch(tmp_path / "run", "train", 2)
    assert_same(results, 2, tmp_path, "sgd", weighted=True)
    assert_same(results, 2, tmp_path, "rowwise", mode="mean")
    assert_same(results, 2, tmp_path, "adam")

    # LookaheadLoader at depth 2 announces the batches ahead and changes nothing
    for r in range(2):
        for a, b in zip(results[r]["sgd-depth2"]["outs"], results[r]["sgd"]["outs"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["sgd-depth2"]["rows"].values(), results[0]["sgd"]["rows"].values()))

    # every rank's store exports its tiers with its rank, and the lookups it served and sent
    for r in range(2):
        text = results[r]["sgd-depth2"]["metrics"]
        tiers = [line for line in text.splitlines() if line.startswith(("tierstore_resident_rows", "tierstore_lookups_total"))]
        assert tiers and all(f'rank="{r}"' in line for line in tiers)
        sent = [line for line in text.splitlines() if line.startswith("tierstore_sharded_lookups_sent_total")]
        assert sent and f'rank="{r}"' in sent[0] and float(sent[0].split()[-1]) > 0
        served = [line for line in text.splitlines() if line.startswith("tierstore_sharded_lookups_served_total")]
        assert served and float(served[0].split()[-1]) > 0
    dashboard = resources.files("tierstore.tools").joinpath("grafana-dashboard.json").read_text()
    panels = set(re.findall(r"\btierstore_sharded_[a-z_]+", dashboard))  # the load-imbalance panels
    assert panels and all(any(line.startswith(name) for line in text.splitlines()) for name in panels), panels

    # reduced-precision exchange: close to float32's loss, not equal to it
    for dtype, tol in (("float16", 1e-2), ("bfloat16", 5e-2)):
        for r in range(2):
            got, ref = torch.tensor(results[r][dtype]["losses"]), torch.tensor(results[r]["sgd"]["losses"])
            assert torch.allclose(got, ref, rtol=tol), (dtype, got, ref)
            assert not torch.equal(got, ref)

    # bad input on one rank: its own named error there, RankFailedError naming it on the other
    bad = [results[r]["bad"] for r in range(2)]
    assert bad[1]["id"][0] == "BagIndexError" and "99" in bad[1]["id"][1]
    assert bad[0]["id"][0] == "RankFailedError" and "rank 1 failed: BagIndexError" in bad[0]["id"][1]
    assert bad[0]["table"][0] == "UnknownTableError" and "nope" in bad[0]["table"][1]
    assert bad[1]["table"][0] == "RankFailedError" and "rank 0 failed: KeyError" in bad[1]["table"][1]
    assert bad[1]["read"][0] == "IdRangeError" and bad[0]["read"][0] == "RankFailedError"
    assert bad[0]["write"][0] == "BadValuesError" and "shape" in bad[0]["write"][1] and bad[1]["write"][0] == "RankFailedError"
    for key, victim, method in (("serve", 1, "read"), ("store_write", 0, "write"), ("flush", 0, "flush")):
        assert bad[victim][key] == ("OSError", f"injected {method} fault")
        assert bad[1 - victim][key][0] == "RankFailedError" and f"rank {victim} failed: OSError" in bad[1 - victim][key][1]
    assert bad[0]["unchanged"] and bad[1]["unchanged"]
    for r in range(2):
        assert bad[r]["plan"][0] == "PlanMismatchError" and "ranks [1]" in bad[r]["plan"][1]


def test_owners_get_only_their_ids_where_the_sort_allows_and_train_as_one_process(tmp_path):
    results = launch(tmp_path / "run", "sized", 2)
    assert_same(results, 2, tmp_path, "sgd", batch=sized_batch)
    plan = make_plan(2)
    for r in range(2):
        expect = []
        for s in range(3):
            other, mine = sized_batch(s, 1 - r), sized_batch(s, r)
            n = 0
            for name, feature in other.items():  # what rank r's shard of each table holds of the other's ids
                ids, tp = feature[0], plan.tables[name]
                # a row shard gets the whole table's ids where torch.sort's order of the global batch is unstable
                whole = tp.sharding == "column" or (tp.sharding == "row" and not sort_is_stable(len(ids) + len(mine[name][0])))
                if r in tp.ranks:
                    n += len(ids) if whole else int((tp.owner(ids) == tp.ranks.index(r)).sum())
            expect.append(8 * n)
        assert results[r]["received"] == expect, (r, results[r]["received"], expect)
        assert set(results[r]["counts"]) == {"headers", "sizes", "ids", "rows", "grads"}
        assert min(results[r]["counts"].values()) > 0


@pytest.mark.parametrize("n", [2, 16, 17, 1000, 32767, 32768, 50000])
def test_sort_is_stable_says_where_torch_sort_orders_ties_as_a_stable_sort(n):
    ids = torch.randint(0, 7, (n,), generator=torch.Generator().manual_seed(n))  # many ties
    same = torch.equal(torch.sort(ids).indices, torch.sort(ids, stable=True).indices)
    assert same or not sort_is_stable(n), n  # (an unstable sort may happen to keep some ties in order)
    assert sort_is_stable(n) == (n <= 16 or n >= 32768)  # torch 2.x on CPU: insertion sort, introsort, radix sort


def test_four_ranks_then_reshard_to_two_then_three(tmp_path):
    four = launch(tmp_path / "four", "four", 4)
    assert_same(four, 4, tmp_path, "adam", mode="mean")
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "source").write_text(str(tmp_path / "four" / "ckpt"))
    two = launch(tmp_path / "two", "reshard", 2)
    (tmp_path / "three").mkdir()
    (tmp_path / "three" / "source").write_text(str(tmp_path / "two" / "ckpt"))
    three = launch(tmp_path / "three", "reshard", 3)
    for name, rows in four[0]["adam"]["rows"].items():
        assert torch.equal(two[0]["rows"][name], rows), name
        assert torch.equal(three[0]["rows"][name], rows), name


def test_a_dead_rank_makes_the_others_raise_and_its_flushed_rows_survive(tmp_path):
    from tierstore import TieredStore

    ctx = mp.start_processes(_rank_main, args=(2, rendezvous(tmp_path), str(tmp_path), "dead"), nprocs=2, join=False,
                             start_method="spawn")
    for p in ctx.processes:
        p.join(timeout=90)
    assert [p.exitcode for p in ctx.processes] == [0, 3], (tmp_path / "error-0.txt").read_text() \
        if (tmp_path / "error-0.txt").exists() else None
    seen = torch.load(tmp_path / "result-0.pt")
    assert seen["error"][0] == "RankFailedError" and "a rank died" in seen["error"][1], seen
    assert seen["seconds"] < 25  # the process group's timeout is 20 s
    _, ref = train_single(tmp_path / "single", 2, "sgd", steps=1)
    with TieredStore(tmp_path / "store" / "rank-1", readonly=True) as store:  # what rank 1 flushed
        ids = torch.arange(20, 40)
        assert torch.equal(store.read("user", ids), ref["user"][20:40])
        assert torch.equal(store.read("item", torch.arange(30)), ref["item"])
        assert torch.equal(store.read("wide", torch.arange(20)), ref["wide"][:, 3:6])


@pytest.mark.parametrize("what", ["ids", "grads"])
def test_a_rank_dying_mid_step_makes_the_other_raise_a_named_error(tmp_path, what):
    ctx = mp.start_processes(_rank_main, args=(2, rendezvous(tmp_path), str(tmp_path), f"dies-in-{what}"), nprocs=2,
                             join=False, start_method="spawn")
    for p in ctx.processes:
        p.join(timeout=90)
    assert [p.exitcode for p in ctx.processes] == [0, 3]
    seen = torch.load(tmp_path / "result-0.pt")
    assert seen["error"][0] == "RankFailedError" and "a rank died" in seen["error"][1], seen
    assert seen["seconds"] < 25  # the process group's timeout is 20 s


@pytest.mark.gpu
def test_one_rank_on_cuda_trains_as_the_cpu_collection(tmp_path):
    result = launch(tmp_path / "run", "cuda", 1)[0]
    for opt_name, weighted in (("rowwise", False), ("sgd", True)):
        got = result[opt_name]
        ref_outs, ref_rows = train_single(tmp_path / f"single-{opt_name}", 1, opt_name, steps=2, weighted=weighted)
        for s, outs in enumerate(got["outs"]):
            for k, v in outs.items():
                torch.testing.assert_close(v, ref_outs[s][0][k], rtol=1e-5, atol=1e-6)
        for k, v in got["rows"].items():
            torch.testing.assert_close(v, ref_rows[k], rtol=1e-5, atol=1e-6)
