"""Run directories: one folder per run under `experiment.run_root`, shared by every component.

Components find each other, their keys and the trajectory shards through this folder, so on
a cluster it must sit on the parallel filesystem. The resolved config is written first.

Nobody but the run's owner may write into it: endpoint files say where to connect and the
supervisor unpickles job results, so a planted file is an attack. The folder is 0750, and
`private_umask()` (called by the CLI and by every component at start) keeps group and others
from writing anything created under it, whatever the user's umask (002 on many sites).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from hpcrl.core.config import Config, write_resolved

__all__ = ["RunDirError", "RUN_ID_RE", "new_run_id", "create_run_dir", "private_umask"]

# The run id is a folder name and the `run` of every trajectory id: no '/', no leading '.', short.
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RunDirError(ValueError):
    """The run directory cannot be created as asked; the message says what to do instead."""


def private_umask() -> None:
    """Files and folders this process creates are never group- or world-writable."""
    os.umask(os.umask(0) | 0o022)


def new_run_id(cfg: Config) -> str:
    # Time first so `ls` sorts runs by age; a random tail so two submissions in the same
    # second never share a folder.
    return f"{cfg.experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def check_run_id(cfg: Config, run_id: str | None) -> None:
    """RunDirError for a --run-id that is malformed or names a run that exists; creates nothing
    (a verb that asks something slow first, like the cluster, checks this before it asks)."""
    if run_id is None:
        return
    if not RUN_ID_RE.fullmatch(run_id):
        raise RunDirError(
            f"--run-id {run_id[:80]!r}: use 1-64 letters, digits, '_', '.', '-', starting with a letter "
            "or digit (it names a folder under experiment.run_root)"
        )
    run_dir = Path(cfg.experiment.run_root) / run_id
    if run_dir.exists():
        raise RunDirError(f"run directory {run_dir} already exists; pick another --run-id or remove it")


def create_run_dir(cfg: Config, run_id: str | None = None) -> Path:
    """Create `<run_root>/<run_id>/` with the resolved config in it; refuse to reuse one."""
    check_run_id(cfg, run_id)
    private_umask()
    root = Path(cfg.experiment.run_root)
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / (run_id or new_run_id(cfg))
    try:
        run_dir.mkdir(mode=0o750)
    except FileExistsError:
        raise RunDirError(f"run directory {run_dir} already exists; pick another --run-id or remove it") from None
    os.chmod(run_dir, 0o750)
    write_resolved(cfg, run_dir)
    return run_dir
