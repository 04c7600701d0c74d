"""Host helpers of the dev cluster's verbs: quoting for `env`, a port probe, private files written
atomically, and the one-`up`-or-`down`-at-a-time lock of a state folder."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .layout import Failed, Layout

__all__ = ["port_in_use", "secret_file", "shquote", "state_lock", "write_file"]


def shquote(text: str) -> str:
    """Always single-quoted, as `env` has always printed its values."""
    return "'" + text.replace("'", "'\\''") + "'"


def port_in_use(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Atomically, and with its final mode from the first byte (keys and passwords are never readable)."""
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@contextmanager
def state_lock(layout: Layout, timeout_s: float = 120) -> Iterator[None]:
    """One `up`/`down` at a time per state folder (flock(2): the lock the former bash script took too)."""
    path = layout.state / ".lock"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # not inheritable: the daemons never hold it
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Failed(f"another devcluster up/down holds {path}") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def secret_file(path: Path, make: Callable[[], bytes]) -> None:
    """Create a private (0600) file once; keep its content on later runs."""
    if not path.exists() or path.stat().st_size == 0:
        write_file(path, make(), 0o600)
    path.chmod(0o600)
