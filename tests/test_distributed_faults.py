"""Faults between the ranks of a sharded collection: ranks that call
different collectives, ranks configured differently, a rank with an empty local
batch. Real rank processes (spawn), gloo over 127.0.0.1, real LMDB; the ranks
save what they saw and the test process checks it and their exit codes (a gloo
message of an unexpected size aborts a process: SIGABRT, exit code -6)."""
from __future__ import annotations

import dataclasses
import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import CHECK_IDS, TABLES, TIERS, local_batch, loss_of, make_plan, raised, rendezvous

from tierstore import RowInit, TieredEmbeddingBagCollection, optim

PARTS = ("settings", "empty", "mismatch")  # run in this order by one launch of 2 ranks


def _rank_main(rank: int, world: int, init_method: str, out: str, parts: tuple[str, ...]):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    for part in parts:  # each part's result saved at once: a later part that kills the rank loses none
        try:
            result = SCENARIOS[part](rank, world, Path(out) / part)
        except BaseException:
            (Path(out) / f"error-{part}-{rank}.txt").write_text(traceback.format_exc())
            raise
        torch.save(result, Path(out) / f"result-{part}-{rank}.pt")
    dist.destroy_process_group()


def run_ranks(out: Path, parts: tuple[str, ...] = PARTS, world: int = 2) -> list[int | None]:
    """Run ``parts`` on ``world`` ranks; their exit codes (negative: killed by that signal)."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_rank_main, args=(world, rendezvous(out), str(out), parts), nprocs=world, join=False,
                             start_method="spawn")
    for p in ctx.processes:
        p.join(timeout=120)
    for p in ctx.processes:  # a rank left waiting (its peer died): ours to end
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in ctx.processes]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One launch for every part (starting two ranks costs more than the parts): (out, exit codes)."""
    out = tmp_path_factory.mktemp("faults")
    return out, run_ranks(out)


def results(ranks, part: str, world: int = 2) -> list:
    out, codes = ranks
    got = [out / f"result-{part}-{r}.pt" for r in range(world)]
    errors = "\n".join(p.read_text() for p in sorted(out.glob("error-*.txt")))
    assert all(p.exists() for p in got), f"part {part!r} did not finish; exit codes {codes}\n{errors}"
    return [torch.load(p) for p in got]


def _module(path, tables=TABLES, **kw):
    from tierstore.distributed import ShardedEmbeddingBagCollection

    return ShardedEmbeddingBagCollection(tables, make_plan(2), path, **{"optimizer": optim.SGD(lr=0.1), **TIERS, **kw})


def _read_all(module, rank: int) -> dict:
    return {name: module.read(name, ids if rank == 0 else ids[:0], with_state=True) for name, ids in CHECK_IDS.items()}


# -- (a) ranks that call different collectives ---------------------------------------------------------------
def scenario_mismatch(rank, world, out):
    module = _module(out / "store")
    batch = local_batch(0, rank)
    loss_of(module(batch)).backward()
    before = _read_all(module, rank)

    def skip_backward():  # rank 1 goes on to its next forward without running backward through its outputs
        o = module(batch)
        if rank == 0:
            loss_of(o).backward()
        else:
            module(batch)

    calls = {
        "flush_read": (module.flush, lambda: module.read("user", [1, 2])),
        "read_with_state": (lambda: module.read("wide", [1], with_state=True), lambda: module.read("wide", [1])),
        "write_flush": (lambda: module.write("item", [3], torch.zeros(1, 4)), module.flush),
        "checkpoint_read": (lambda: module.checkpoint(out / "ckpt"), lambda: module.read("item", [3])),
        "train_eval": (lambda: module(batch), lambda: torch.no_grad()(module)(batch)),
    }
    res = {key: raised(pair[rank]) for key, pair in calls.items()}
    res["skip_backward"] = raised(skip_backward)
    res["unchanged"] = all(torch.equal(a, b) for a, b in zip(before.values(), _read_all(module, rank).values()))
    loss_of(module(batch)).backward()  # still in step
    module.flush()
    module.close()
    return res


def test_ranks_calling_different_collectives_raise_on_every_rank_without_a_signal(ranks):
    res = results(ranks, "mismatch")
    assert ranks[1] == [0, 0], f"exit codes {ranks[1]} (negative: killed by that signal)"
    expect = {
        "flush_read": ("flush()", "read('user', with_state=False)"),
        "read_with_state": ("read('wide', with_state=True)", "read('wide', with_state=False)"),
        "write_flush": ("write('item', with_state=False)", "flush()"),
        "checkpoint_read": ("checkpoint()", "read('item', with_state=False)"),
        "train_eval": ("forward with training", "forward without training"),
        "skip_backward": ("backward of forward 2", "forward with training"),
    }
    for key, (call0, call1) in expect.items():
        for r in range(2):
            kind, message = res[r][key]
            assert kind == "RankFailedError", (key, r, kind, message)
            assert f"rank 0: {call0}" in message and f"rank 1: {call1}" in message, (key, r, message)
    assert res[0]["unchanged"] and res[1]["unchanged"]


# -- (b) ranks configured differently --------------------------------------------------------------------------
def scenario_settings(rank, world, out):
    res = {}
    for key, kw in (("comm_dtype", {"comm_dtype": "float16" if rank == 1 else None}),
                    ("mode", {"mode": "mean" if rank == 0 else "sum"}),
                    ("optimizer", {"optimizer": optim.Adagrad(lr=0.1) if rank == 1 else optim.SGD(lr=0.1)}),
                    ("tables", {"tables": [dataclasses.replace(TABLES[0], init=RowInit.normal(0.0, 0.5, seed=9)), *TABLES[1:]]
                                if rank == 1 else TABLES})):
        def build():
            _module(out / key, **kw).close()  # the old code built it: close it, so the ranks stay in step
        res[key] = raised(build)
    module = _module(out / "good")  # still in step
    loss_of(module(local_batch(0, rank))).backward()
    module.close()
    return res


def test_ranks_configured_differently_raise_a_named_error_at_construction(ranks):
    res = results(ranks, "settings")
    for r in range(2):
        for key, names in (("comm_dtype", ("rank 0: float32", "rank 1: float16")),
                           ("mode", ("rank 0: 'mean'", "rank 1: 'sum'")),
                           ("optimizer", ("ranks [1]", "SGD(lr=0.1)" if r == 0 else "Adagrad(lr=0.1")),
                           ("tables", ("ranks [1]",))):
            assert res[r][key] is not None, (key, r, "constructed")
            kind, message = res[r][key]
            assert kind == "SettingsMismatchError" and message.startswith(f"{key} differ"), (key, r, message)
            assert all(n in message for n in names), (key, r, message)
    assert not (ranks[0] / "settings" / "comm_dtype").exists()  # no store opened


# -- (c) an empty local batch ------------------------------------------------------------------------------------
def _zero_ids() -> dict:
    """A batch of zero ids: two empty bags of "user", no bags of "item"."""
    return {"user": (torch.zeros(0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)),
            "item": (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))}


EMPTY_STEPS = [  # per step, each rank's batch: {} ("empty"), zero ids, or ids
    ("empty", "ids"), ("zero", "ids"), ("ids", "empty"), ("empty", "empty"), ("ids", "ids"),
]


def _batch(kind: str, step: int, rank: int) -> dict:
    return {"empty": {}, "zero": _zero_ids(), "ids": local_batch(step, rank)}[kind]


def scenario_empty(rank, world, out):
    module = _module(out / "store")
    outs = []
    for step, kinds in enumerate(EMPTY_STEPS):
        o = module(_batch(kinds[rank], step, rank))
        if o:  # {} gives no outputs to run backward through
            loss_of(o).backward()
        outs.append({k: v.detach() for k, v in o.items()})
    rows = _read_all(module, rank)
    module.close()
    return {"outs": outs, "rows": rows}


def test_an_empty_local_batch_takes_part_in_the_step(ranks, tmp_path):
    res = results(ranks, "empty")
    single = TieredEmbeddingBagCollection(TABLES, path=tmp_path / "single", optimizer=optim.SGD(lr=0.1), **TIERS)
    for step, kinds in enumerate(EMPTY_STEPS):
        locals_ = [_batch(k, step, r) for r, k in enumerate(kinds)]
        names = [n for n in (s.name for s in TABLES) if any(n in b for b in locals_)]
        if not names:
            assert res[0]["outs"][step] == {} and res[1]["outs"][step] == {}
            continue
        glob = {}
        for n in names:  # the concatenated global batch: rank 0's bags, then rank 1's
            parts = [b[n] for b in locals_ if n in b]
            at = torch.tensor([0, *[len(p[0]) for p in parts[:-1]]]).cumsum(0)
            glob[n] = (torch.cat([p[0] for p in parts]), torch.cat([p[1] + a for p, a in zip(parts, at)]))
        o = single(glob)
        loss_of(o).backward()
        for n in names:
            at = 0
            for r, b in enumerate(locals_):
                if n not in b:
                    assert n not in res[r]["outs"][step], (step, r, n)
                    continue
                bags = len(b[n][1])
                assert torch.equal(res[r]["outs"][step][n], o[n].detach()[at: at + bags]), (step, r, n)
                at += bags
    for name, ids in CHECK_IDS.items():
        assert torch.equal(res[0]["rows"][name], single.store.read(name, ids, with_state=True)), name
    single.close()


SCENARIOS = {"mismatch": scenario_mismatch, "settings": scenario_settings, "empty": scenario_empty}
