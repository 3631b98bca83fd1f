"""Child process for the crash tests: writes, flushes, reports, keeps writing until killed."""
import sys

import numpy as np

from tierstore import TableSpec, TieredStore

path, rounds = sys.argv[1], int(sys.argv[2])
store = TieredStore(path, [TableSpec("t", 5000, 8)], hbm_rows=64, ddr_rows=256, device="cpu")
rng = np.random.default_rng(0)
for r in range(1, 10**9):
    ids = rng.choice(5000, 300, replace=False)
    store.read("t", ids)
    store.write("t", ids, np.full((300, 8), r, dtype=np.float32))
    if r <= rounds:
        store.flush()
        print(f"flushed {r}", flush=True)
    elif r == rounds + 1:
        print("writing unflushed", flush=True)
