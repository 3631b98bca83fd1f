"""The ``tierstore`` command. Each verb lives in its own module with a
``register(subparsers)`` function that adds its parser and sets ``func``.

A user's mistake ends the command with one ``tierstore: error: ...`` line and
exit code 2, as argparse does for bad arguments; anything else is a bug and
keeps its traceback."""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

import lmdb

from tierstore.eviction import POLICIES
from tierstore.io import StoreLockedError

# module (in tierstore.tools) -> verbs it registers
COMMAND_MODULES = ("bench", "stats", "trace_cli", "daemon", "demo", "plan_cli")

# The types tierstore raises for bad input, bad files and the environment (a full
# disk, a taken port); every exception class defined in tierstore is one too.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, IndexError, OSError, ImportError, lmdb.Error)
# prefetchd refuses to start with a RuntimeError when a daemon already serves its socket
COMMAND_USER_ERRORS: dict[str, tuple[type[BaseException], ...]] = {"prefetchd": (RuntimeError,)}
# the command line's advice, after a message that gives a Python caller's
CLI_HINTS: dict[type[BaseException], str] = {
    StoreLockedError: "from the command line: stop that process first; `tierstore stats PATH` reads the store while it runs",
}
# set to see the traceback of a user error too
TRACEBACK_ENV = "TIERSTORE_TRACEBACK"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, unless there is none to show
    (None, empty, a flag's) or the help already tells it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        d = action.default
        if action.nargs == 0 or d is None or d is argparse.SUPPRESS or d == [] or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _checked(cast, ok, what: str):
    """An argparse type: bad values are reported against the option's own name
    (``argument --hit: must be ...``), not a library parameter's."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
nonneg_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: 0 < v < math.inf, "a number > 0")
nonneg_float = _checked(float, lambda v: 0 <= v < math.inf, "a number >= 0")
ratio = _checked(float, lambda v: 0 < v <= 1, "a ratio in (0, 1]")


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                yield from _parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description="Tiered embedding store: HBM, DDR and LMDB on SSD.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"tierstore.tools.{name}").register(sub)
    for p in _parsers(parser):  # the same conventions for every verb, whichever module registered it
        p.formatter_class = HelpFormatter
        for action in p._actions:
            if action.dest == "policy" and action.choices is None:
                action.choices = sorted(POLICIES)
    return parser


def is_user_error(e: BaseException, command: str | None = None) -> bool:
    return (isinstance(e, USER_ERRORS + COMMAND_USER_ERRORS.get(command, ()))
            or type(e).__module__.split(".")[0] == "tierstore")


def error_message(e: BaseException) -> str:
    # a KeyError's str() is the repr of its message
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    hints = [h for t, h in CLI_HINTS.items() if isinstance(e, t)]
    return "; ".join([f"tierstore: error: {msg}", *hints])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `tierstore stats ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush of stdout must not fail too
        return 0
    except SystemExit as e:
        if not isinstance(e.code, str):  # a verb's raise SystemExit("message") is a user error too
            raise
        print(f"tierstore: error: {e.code}", file=sys.stderr)
        return 2
    except BaseException as e:
        if not is_user_error(e, args.command) or os.environ.get(TRACEBACK_ENV):
            raise
        print(error_message(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
