"""The writer process of the crash tests of tables whose rows come and go
(admission, TTL, the L2 score): applies the commands it receives, answering each
once it is done, until killed. Started from a forkserver that has imported
tierstore, so that a test can start many."""
import numpy as np

from tierstore import RowInit, TableSpec, TieredStore

D = 4
TABLES = [
    TableSpec("ttl", None, D, init=RowInit.normal(0, 0.1, seed=2), ttl_steps=3),
    TableSpec("l2", None, D, init=RowInit.normal(0, 0.1, seed=3), evict_l2_below=0.05),
    TableSpec("adm", None, D, init=RowInit.normal(0, 0.1, seed=4), admit_after=2, admit_width=1024, ttl_steps=4),
]


def serve(conn, path: str, hbm_rows: int, ddr_rows: int) -> None:
    store = TieredStore(path, TABLES, hbm_rows=hbm_rows, ddr_rows=ddr_rows, device="cpu",
                        writeback_rows=64, writeback_group_rows=1)
    conn.send("open")
    while (cmd := conn.recv()) is not None:
        if cmd["op"] == "step":  # one step of each table: read the rows, write them back changed
            ids = np.asarray(cmd["ids"], dtype=np.int64)
            uid, first = np.unique(ids, return_index=True)
            seen = {}
            for table in TABLES:
                rows = seen[table.name] = store.read(table.name, ids).numpy()
                store.write(table.name, uid, rows[first] * np.float32(cmd["mul"]) + np.float32(cmd["add"]))
            conn.send(seen)
        else:
            store.flush()
            conn.send("flushed")
    store.close()  # None: a clean end
    conn.send("closed")
