"""Files that must never be seen half-written: the run directory's state, records and endpoints.

    atomic_write_json(run_dir / "jobs.json", record)       # tmp, fsync, rename, fsync the folder
    atomic_write_bytes(path, data, mode=0o600)
    read_json(path)                                         # the parsed file, or None if absent
    fsync_path(folder, directory=True)

A reader sees the old file or the new one, never a mix: the data goes to a temporary file in
the same folder (a name no other writer uses: pid and random), is fsynced, renamed over the
target, and the folder is fsynced so the rename itself survives a crash. Every component of a
run shares its directory on a parallel filesystem, where a crash or a full disk in the middle
of a plain write would leave a truncated file for the next reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_path", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "read_json"]


def fsync_path(path: str | os.PathLike, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably (see the module docstring)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent, directory=True)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode(), mode)


def atomic_write_json(path: str | os.PathLike, data: Any, mode: int = 0o644, sort_keys: bool = False) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=1, sort_keys=sort_keys) + "\n").encode(), mode)


def read_json(path: str | os.PathLike) -> Any:
    """The parsed JSON file, or None when it does not exist (other errors are raised)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
