"""Files that must never be seen half-written: the run directory's state, records and endpoints.

    atomic_write_json(run_dir / "jobs.json", record)       # tmp, fsync, rename, fsync the folder
    atomic_write_bytes(path, data, mode=0o600)
    read_json(path)                                         # the parsed file, or None if absent
    fsync_path(folder, directory=True)
    atomic_write_json(path, state, keep_previous=True)      # the replaced file stays as <name>.prev
    read_state_json(path)                                   # path, or its .prev with a warning if path is corrupt

A reader sees the old file or the new one, never a mix: the data goes to a temporary file in
the same folder (a name no other writer uses: pid and random), is fsynced, renamed over the
target, and the folder is fsynced so the rename itself survives a crash. Every component of a
run shares its directory on a parallel filesystem, where a crash or a full disk in the middle
of a plain write would leave a truncated file for the next reader.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = [
    "fsync_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "read_json",
    "read_state_json",
    "StateFileError",
    "previous_copy",
]

log = logging.getLogger("hpcrl.files")


class StateFileError(ValueError):
    """A state file and its previous copy are both unreadable (the message names both)."""


def fsync_path(path: str | os.PathLike, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def previous_copy(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".prev")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644, keep_previous: bool = False) -> None:
    """Replace `path` with `data` atomically and durably (see the module docstring).

    keep_previous: the file being replaced becomes `<name>.prev` first, a fallback for
    `read_state_json` should the new one be found corrupt later (a filesystem that lost data,
    an operator's editor). Between the two renames a reader finds only the .prev, and takes it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if keep_previous:
            try:
                os.replace(path, previous_copy(path))
            except FileNotFoundError:
                pass
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent, directory=True)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = 0o644, keep_previous: bool = False) -> None:
    atomic_write_bytes(path, text.encode(), mode, keep_previous)


def atomic_write_json(
    path: str | os.PathLike, data: Any, mode: int = 0o644, sort_keys: bool = False, keep_previous: bool = False
) -> None:
    text = json.dumps(data, indent=1, sort_keys=sort_keys) + "\n"
    atomic_write_bytes(path, text.encode(), mode, keep_previous)


def read_json(path: str | os.PathLike) -> Any:
    """The parsed JSON file, or None when it does not exist (other errors are raised)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def read_state_json(
    path: str | os.PathLike, check=None, advice: str = "move the file aside to start afresh, or restore it"
) -> Any:
    """A state file written with keep_previous: the parsed file; if it is corrupt (not JSON, not
    UTF-8, or `check(data)` raises), its `.prev` copy with a warning naming both; None if neither
    exists. Both corrupt: StateFileError, naming the files and what to do (`advice`)."""
    path = Path(path)
    errors = []
    for candidate in (path, previous_copy(path)):
        try:
            data = json.loads(candidate.read_bytes().decode())
            if check is not None:
                check(data)
        except FileNotFoundError:
            continue
        except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            errors.append(f"{candidate}: {type(exc).__name__}: {exc}")
            continue
        if errors:
            log.warning("%s; using the previous copy %s", errors[0], candidate)
        return data
    if errors:
        raise StateFileError(f"{'; '.join(errors)}: no readable copy; {advice}")
    return None
