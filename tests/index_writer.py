"""Child process for the row index's crash tests: the writer of a log table of many declared
rows whose index is limited to a few runs (it spills to its file), applying commands read
from stdin, one JSON object a line, each acknowledged with a line "ok" once done."""
import json
import sys

import numpy as np

from tierstore.io.lmdb_backend import LmdbBackend

DIM = 2


def open_writer(path: str, rows: int, limit: int) -> LmdbBackend:
    b = LmdbBackend(path, publish_at_flush=True)
    b.limit_index({"t": limit})
    b.write_meta({}, new_tables={"t": (False, rows)})
    b.open_table("t", DIM, create=False, num_rows=rows)
    return b


if __name__ == "__main__":
    b = open_writer(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        ids = np.array(cmd.get("ids", []), dtype=np.int64)
        if cmd["op"] == "put":
            b.put_rows([("t", ids, np.array(cmd["rows"], dtype=np.float32).reshape(-1, DIM))])
        elif cmd["op"] == "delete":
            b.delete_rows("t", ids)
        elif cmd["op"] == "publish":
            b.publish()
        print("ok", flush=True)
