"""``tierstore export SRC DST``: a training store's weights into a serving store (docs/serving.md)."""
from __future__ import annotations

import argparse

from tierstore.io.serving_layout import SERVING_DTYPES
from tierstore.serving.export import export
from tierstore.tools.cli import add_verb


def register(sub) -> None:
    p = add_verb(sub, "export")
    p.add_argument("src", help="training store directory (the one holding data.mdb)")
    p.add_argument("dst", help="new directory for the serving store (must not exist, or be empty)")
    p.add_argument("--tables", nargs="+", default=None, help="tables to export (default: all)")
    p.add_argument("--dtype", choices=SERVING_DTYPES, default="int8",
                   help="serving rows: float32, float16, or FBGEMM's row-wise int8/int4 (float16 scale and bias per row)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = export(args.src, args.dst, tables=args.tables, dtype=args.dtype)
    from tierstore.io.serving_layout import ServingReader

    reader = ServingReader(path)
    try:
        for t in reader.meta["tables"]:
            print(f"{t['name']}: {t['rows']:,} rows of {t['row_bytes']} bytes ({t['dtype']}, dim {t['dim']})")
    finally:
        reader.close()
    print(f"serving store written to {path}")
    return 0
