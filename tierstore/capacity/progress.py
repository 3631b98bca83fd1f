"""The progress hook of long trace computations (stack distances, SHARDS
sampling, cache replays).

The library only reports counts; how they are shown (a bar on a terminal, a
line every few seconds in a log) is the caller's choice, so these loops take a
*factory*: ``progress(total, desc)`` returns an object with ``update(n)`` and
``close()``. The command line's factory is ``tierstore.tools.capacity_progress.bars``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tierstore.errors import ArgumentTypeError


class Progress(Protocol):
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


ProgressFactory = Callable[[int, str], Progress]


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def open_progress(progress: ProgressFactory | bool | None, total: int, desc: str) -> Progress:
    """The caller's bar for ``total`` units of ``desc``, or one that shows nothing.

    ``False``/``None``: nothing. ``True`` is refused rather than guessed at: the
    library has no display of its own."""
    if progress is None or progress is False:
        return _Silent()
    if progress is True:
        raise ArgumentTypeError("progress takes a factory (total, desc) -> object with update(n) and close(), "
                        "e.g. tierstore.tools.capacity_progress.bars; True has no display in the library")
    return progress(total, desc)
