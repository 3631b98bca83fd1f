"""How ``tierstore capacity`` shows the progress of its long loops: tqdm on a
terminal, a line every few seconds in a log or a pipe (both to stderr).

:func:`bars` is a ``tierstore.capacity.progress.ProgressFactory``: the library's loops
report counts to it and know nothing of terminals.
"""
from __future__ import annotations

import sys
import time

from tierstore.capacity.progress import Progress

PROGRESS_SECONDS = 5.0  # between progress lines when stderr is not a terminal
PROGRESS_ACCESSES = 2_000_000  # traces longer than this show progress by default (a run of seconds or more)


class LineBar:
    """Progress for a log or a pipe: a line to stderr every ``seconds`` (and at the first
    update with ``show_first``), and one at the end; tqdm's ``\r`` updates would make one
    long line. ``set_postfix`` figures (tqdm's call) end each line."""

    def __init__(self, total: int, desc: str, unit: str, seconds: float, show_first: bool = False):
        self.total, self.desc, self.unit, self.n, self.seconds = total, desc, unit, 0, seconds
        self.postfix: dict = {}
        self.t0 = time.monotonic()
        self.shown = None if show_first else self.t0

    def _line(self, now: float, end: str = "") -> None:
        rate = self.n / max(now - self.t0, 1e-9)
        left = f", ~{(self.total - self.n) / rate:,.0f} s left" if rate and self.n < self.total else ""
        post = "".join(f" {k}={v}" for k, v in self.postfix.items())
        # one write, newline included: print() writes the line and its newline apart, and a
        # Ctrl-C between the two left the CLI's "interrupted" line glued to the progress line
        sys.stderr.write(f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}s ({self.n / max(self.total, 1):.0%}, "
                         f"{rate:,.{1 if rate < 100 else 0}f} {self.unit}s/s{left}){end}{post}\n")
        sys.stderr.flush()
        self.shown = now

    def set_postfix(self, postfix: dict, refresh: bool = False) -> None:
        self.postfix = dict(postfix)

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if self.shown is None or now - self.shown >= self.seconds:
            self._line(now)

    def close(self) -> None:
        self._line(time.monotonic(), f", done in {time.monotonic() - self.t0:.1f} s")


def bars(total: int, desc: str, seconds: float | None = None) -> Progress:
    """A bar for ``total`` units of ``desc``: tqdm on a terminal, else a :class:`LineBar`
    printing every ``seconds`` (default :data:`PROGRESS_SECONDS`)."""
    unit = "id" if "SHARDS" in desc or "ids" in desc else "use"
    if not sys.stderr.isatty():
        return LineBar(total, desc, unit, PROGRESS_SECONDS if seconds is None else seconds)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, leave=False)
