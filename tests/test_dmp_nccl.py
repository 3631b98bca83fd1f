"""TorchRec's DistributedModelParallel over tierstore shards on a GPU: NCCL, world size 1
(one process, one GPU), the model and its batches on CUDA, against TorchRec's own sharder
(FBGEMM's fused CUDA TBE) on the same batches. The ids reach the lookup on the GPU and the
pooled embeddings leave it there; the shards' rows move between the host tier and the GPU."""
from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds on import
    pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed: see the README's TorchRec section")

from dmp_ranks import OPTIMIZERS, STEPS, _dmp, _local_rows, _set_torchrec_rows, batch, initial_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no NCCL backend")]

# one rank holds every shard: whole tables, row shards, and two column shards of t1 (two stores)
PLANS = {"table": {"t1": ("table_wise", {"rank": 0}), "t2": ("table_wise", {"rank": 0})},
         "row": {"t1": ("row_wise", {}), "t2": ("row_wise", {})},
         "column": {"t1": ("column_wise", {"ranks": [0, 0]}), "t2": ("table_wise", {"rank": 0})}}
# "tiny": 2 rows on the GPU, 3 in host memory (most rows read from LMDB and moved up each step);
# "ddr": no GPU tier (every row goes up from the host tier)
CASES = [(plan, opt, tiers) for plan in PLANS for opt in OPTIMIZERS for tiers in ("tiny", "ddr")]


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    rendezvous = tmp_path_factory.mktemp("nccl") / "rendezvous"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


def _train(path, plan: str, opt: str, kind: str, tiers: str, device: torch.device) -> tuple[list, dict]:
    dmp = _dmp(path / "-".join((plan, opt, kind, tiers)), plan, opt, kind, tiers, world=1, plans=PLANS, device=device)
    if kind == "torchrec":
        _set_torchrec_rows(dmp, initial_weights())
    outs = []
    for step in range(STEPS):
        o = dmp(batch(step, 0).to(device))
        assert o.device == device
        o.pow(2).sum().backward()
        dmp.fused_optimizer.step()
        outs.append(o.detach().cpu())
    rows = {table: [(r, c, t.cpu()) for r, c, t in shards] for table, shards in _local_rows(dmp, kind).items()}
    if kind == "tierstore":
        dmp.module.ebc.close()
    return outs, rows


@pytest.mark.parametrize("plan,opt,tiers", CASES)
def test_tierstore_shards_train_as_torchrec_on_nccl(nccl, tmp_path, plan, opt, tiers):
    ours, our_rows = _train(tmp_path, plan, opt, "tierstore", tiers, nccl)
    theirs, their_rows = _train(tmp_path, plan, opt, "torchrec", tiers, nccl)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for table, shards in their_rows.items():
        mine = {(r, c): t for r, c, t in our_rows[table]}
        for r, c, t in shards:
            torch.testing.assert_close(mine[r, c], t, atol=1e-5, rtol=1e-5, msg=f"table {table} shard at ({r}, {c})")
