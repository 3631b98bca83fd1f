"""Small file-system steps the io modules share."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by its path (a directory: so that a rename in it survives a power loss)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
