"""Child process of tests/test_whole_flushes.py: trains a store under a memory budget, a step
at a time, with a pause (or a SIGKILL) at the points a reader could see part of a flush.

Each step k sets every row of both tables to k: table "t" (cached whole in DDR, so its
rows reach LMDB only when flush() writes them, in several transactions) and table "u" (no
tier: its rows are written back before the flush). Step 2 stops once its write-back is
committed and once the flush has committed its first transaction: mode "pause" prints
where it is and waits for a line on stdin; mode "kill" kills itself mid-flush."""
import os
import signal
import sys

import numpy as np

from tierstore import TableSpec, TieredStore
from tierstore.io import LmdbBackend

N, U, DIM = 24_000, 4_000, 64  # t's rows take 6 MB: more than one transaction under a 64 MiB budget


def main(path: str, mode: str) -> None:
    store = TieredStore(path, [TableSpec("t", N, DIM), TableSpec("u", U, DIM)], memory_budget="64MiB",
                        ddr_rows={"t": N, "u": 0}, device="cpu")
    state = {"flushing": False, "commits": 0, "step": 0}
    real_write = LmdbBackend._write

    def write(self, *args, **kwargs):  # fault injection: stops after the flush's first commit
        real_write(self, *args, **kwargs)
        if state["flushing"]:
            state["commits"] += 1
            if state["step"] == 2 and state["commits"] == 1:
                stop("mid-flush")
    LmdbBackend._write = write

    def stop(where: str) -> None:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print(where, state["step"], flush=True)
        sys.stdin.readline()

    for step in (1, 2, 3):
        state["step"] = step
        store.read("t", np.arange(N))  # cached: a write then only marks the rows dirty
        store.write("t", np.arange(N), np.full((N, DIM), step, dtype=np.float32))
        store.write("u", np.arange(U), np.full((U, DIM), step, dtype=np.float32))
        store.drain_writeback()
        if step == 2 and mode == "pause":
            stop("written-back")
        state["flushing"], state["commits"] = True, 0
        store.flush()
        state["flushing"] = False
        print("flushed", step, "commits", state["commits"], flush=True)
        if mode == "pause":
            sys.stdin.readline()
    store.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
