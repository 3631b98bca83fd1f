"""Loss of a 40-step, 2-rank RowWiseAdagrad run with float32, float16 and bfloat16 exchange (the README figure):
/work/venv-s17/bin/python tests/distributed_comm_dtype.py"""
import sys, torch
sys.path.insert(0, "tests")
import test_distributed as t
from pathlib import Path
import tempfile, torch.multiprocessing as mp

def scen(rank, world, out):
    res = {}
    for d in (None, "float16", "bfloat16"):
        r = t.train_sharded(rank, world, out / str(d), "rowwise", steps=40, mode="mean", comm_dtype=d)
        res[str(d)] = {"losses": r["losses"], "rows": r["rows"]}
    return res
t.SCENARIOS["comm"] = scen

if __name__ == '__main__':
    d = Path(tempfile.mkdtemp())
    res = t.launch(d, "comm", 2)
    for key in ("None", "float16", "bfloat16"):
        tot = [a + b for a, b in zip(res[0][key]["losses"], res[1][key]["losses"])]
        ref = [a + b for a, b in zip(res[0]["None"]["losses"], res[1]["None"]["losses"])]
        rel = max(abs(x - y) / y for x, y in zip(tot, ref))
        rowdiff = max((res[0][key]["rows"][n] - res[0]["None"]["rows"][n]).abs().max().item() for n in res[0][key]["rows"])
        print(f"{key:9} loss step1 {tot[0]:.6f} step40 {tot[-1]:.6f}  max rel loss diff vs float32 {rel:.2e}  max |row diff| {rowdiff:.2e}")
