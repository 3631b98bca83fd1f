"""The ``tierstore`` command. Each verb lives in its own module with a
``register(subparsers)`` function that adds its parser and sets ``func``.

A user's mistake ends the command with one ``tierstore: error: ...`` line and
exit code 2, as argparse does for bad arguments; anything else is a bug and
keeps its traceback. Ctrl-C ends it with one ``tierstore: interrupted`` line
saying what was kept, and exit code 130."""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import math
import os
import re
import sys

import lmdb

from tierstore.errors import SettingError, TierstoreError
from tierstore.io.errors import StoreLockedError

# verb -> (the module in tierstore.tools that registers it, its help line). `tierstore --help`
# and `--version` list verbs from here alone, and a verb imports only its own module: the
# verbs' modules import torch, which takes seconds.
VERBS: dict[str, tuple[str, str]] = {
    "bench": ("bench", "measure speed and memory against in-run baselines"),
    "stats": ("stats", "print a store's tables, rows on disk, bytes and last flush (read-only; safe while a writer runs), "
                       "or a serving store's version, dtypes, rows and bytes"),
    "compact": ("stats", "rewrite a closed store's data.mdb without LMDB's free pages; prints its size before and after"),
    "trace": ("trace_cli", "make, convert and inspect access traces (see tierstore.trace for the format)"),
    "capacity": ("trace_cli", "miss-ratio curves, tier sizing and SSD bandwidth of a trace"),
    "prefetchd": ("daemon", "serve a store's DDR tier and LMDB files to trainer processes over a Unix socket"),
    "demo": ("demo", "train a small DLRM whose embedding tables are larger than memory tiers"),
    "plan": ("plan_cli", "shard a trace's tables across ranks, balancing lookups, SSD reads and bytes"),
    "export": ("export_cli", "write a serving store (weights only, quantized row-wise where asked) from a training store; "
                             "safe while its writer trains"),
}

# A user's error: every error tierstore raises on purpose is a TierstoreError; OSError and
# lmdb.Error are the environment's (a full disk, a taken port, a path that is not there).
USER_ERRORS: tuple[type[BaseException], ...] = (TierstoreError, OSError, lmdb.Error)
# The command line's advice in place of a Python caller's: these errors' messages state the
# fact, then after the first "; " what to do in Python (e.g. readonly=True), which a CLI user cannot.
CLI_HINTS: dict[type[BaseException], str] = {
    StoreLockedError: "stop that process first, or read the store while it runs with `tierstore stats PATH`",
}
# what to do about an OS error on a path the user gave, by errno
OS_HINTS: dict[int, str] = {
    errno.ENOENT: "check the path (a file to write needs its directory to exist)",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EACCES: "you may not use this path: pick one you can write to, or fix its permissions",
    errno.EPERM: "you may not use this path: pick one you can write to, or fix its permissions",
    errno.EROFS: "the file system is read-only: pick a path on a writable one",
    errno.ENOSPC: "the disk is full: free space, or pick a path on another disk",
    errno.EEXIST: "it already exists: pick a new path, or move it aside",
    errno.EISDIR: "it is a directory: pass a file",
}
# set to see the traceback of a user error too
TRACEBACK_ENV = "TIERSTORE_TRACEBACK"
# the exit code of a command ended by Ctrl-C (128 + SIGINT), as shells report it
INTERRUPTED = 130


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

SIZE_FORMS = "a number of bytes with an optional unit, e.g. 16G, 1.5GiB, 512M or 17179869184 (k/M/G/T: powers of 1000, Ki/Mi/Gi/Ti: of 1024)"


def parse_size(text: str | None, flag: str) -> int | None:
    """Bytes from a size flag's text (``16G``, ``1.5GiB``, ``512MB``, ``17179869184``); None
    stays None. Every size flag of the CLI reads its value here (tierstore.engine.memory.size_bytes,
    as memory_budget= is read), so a bad value is reported against the flag that carried it."""
    if text is None:
        return None
    from tierstore.engine.memory import size_bytes  # here: tierstore.engine.memory imports torch

    n = size_bytes(str(text))
    if n is None:
        raise SettingError(f"{flag} {text!r} is not a size; write {SIZE_FORMS}")
    return n


def size(flag: str):
    """An argparse type for a size flag: checked when the arguments are parsed, before any
    work; the text is kept (the verb reads it with parse_size, and may echo it)."""

    def check(text: str) -> str:
        try:
            parse_size(text, flag)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a size, got {text!r}; write {SIZE_FORMS}") from None
        return text

    return check


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                yield from _parsers(sub)


def version() -> str:
    """The installed package's version (its metadata), as pip shows it."""
    try:
        return importlib.metadata.version("tierstore")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e . in the repository)"


def plain(text: str | None) -> str | None:
    """Help text from a docstring: RST's ``literal`` becomes the CLI's `literal`."""
    return None if text is None else re.sub(r"``(.+?)``", r"`\1`", text)


def add_verb(sub, name: str, **kwargs) -> argparse.ArgumentParser:
    """A verb's parser, with its help line from :data:`VERBS`."""
    return sub.add_parser(name, help=VERBS[name][1], **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser, every verb's module imported; with ``command``, only the
    module of that verb (none for an unknown one), the other verbs named with their help."""
    parser = argparse.ArgumentParser(prog="tierstore", description="Tiered embedding store: HBM, DDR and LMDB on SSD.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in dict.fromkeys(m for m, _ in VERBS.values()):
        verbs = [v for v, (m, _) in VERBS.items() if m == module]
        if command is None or command in verbs:
            importlib.import_module(f"tierstore.tools.{module}").register(sub)
        else:
            for verb in verbs:
                add_verb(sub, verb)
    for p in _parsers(parser):
        conventions(p)
    return parser


def conventions(p: argparse.ArgumentParser) -> None:
    """The same conventions for every verb's parser, whichever module made it: defaults in the
    help, plain-text help, and the eviction policies as ``--policy``'s choices."""
    from tierstore.eviction import POLICIES

    p.formatter_class = HelpFormatter
    p.description = plain(p.description)
    for action in p._actions:
        action.help = plain(action.help)
        if action.dest == "policy" and action.choices is None:
            action.choices = sorted(POLICIES)


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, USER_ERRORS)  # any other error is a bug: its traceback is kept


def error_message(e: BaseException) -> str:
    # a KeyError's str() is the repr of its message
    msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
    hints = [h for t, h in CLI_HINTS.items() if isinstance(e, t)]
    if hints:
        msg = msg.split("; ", 1)[0]  # the fact, without the Python caller's advice
    elif isinstance(e, OSError) and e.filename is not None and len(e.args) == 2 and e.strerror:
        # the OS's own words ("[Errno 2] No such file or directory: 'x'"): the path first, then what to do
        hints = [OS_HINTS[e.errno]] if e.errno in OS_HINTS else []
        msg = f"{e.filename}: {e.strerror[:1].lower()}{e.strerror[1:]}"
    return "; ".join([f"tierstore: error: {msg}", *hints])


def interrupted_message(args: argparse.Namespace) -> str:
    """The one line a command stopped by Ctrl-C ends with: what it kept. A verb tells it with
    ``set_defaults(kept=...)``, a string or a function of the arguments."""
    kept = getattr(args, "kept", None)
    kept = kept(args) if callable(kept) else kept
    return "tierstore: interrupted" + (f"; {kept}" if kept else "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # the first word not an option is the verb: the top level's options take no value
        parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # while the verb's module (torch) loads: nothing was done yet
        print("tierstore: interrupted", file=sys.stderr)
        return INTERRUPTED
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # LMDB commits are atomic: an interrupted command leaves each store as of its last
        # commit (what its last flush reported durable stays); the verb's note says what that is
        print(interrupted_message(args), file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # `tierstore stats ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush of stdout must not fail too
        return 0
    except SystemExit as e:
        if not isinstance(e.code, str):  # a verb's raise SystemExit("message") is a user error too
            raise
        print(f"tierstore: error: {e.code}", file=sys.stderr)
        return 2
    except BaseException as e:
        if not is_user_error(e) or os.environ.get(TRACEBACK_ENV):
            raise
        print(error_message(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
