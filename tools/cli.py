"""The ``tierstore`` command. Each verb lives in its own module with a
``register(subparsers)`` function that adds its parser and sets ``func``."""
from __future__ import annotations

import argparse
import importlib
import sys

# module (in tierstore.tools) -> verbs it registers
COMMAND_MODULES = ("bench", "stats", "trace_cli", "daemon", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description="Tiered embedding store: HBM, DDR and LMDB on SSD.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"tierstore.tools.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
