"""Run directories: one folder per run under `experiment.run_root`, shared by every component.

Components find each other, their keys and the trajectory shards through this folder, so on
a cluster it must sit on the parallel filesystem. The resolved config is written first.

Nobody but the run's owner may write into it: endpoint files say where to connect and the
supervisor unpickles job results, so a planted file is an attack. Nobody else may read it
either, unless asked: it holds the run's keys, trajectories (prompts, model output, rewards),
checkpoints and weights, and on many sites a user's group is everyone. The folder is 0700 and
what is created in it 0600; with `experiment.share_with_group: true` 0750 and 0640 (the group
reads, nobody else; `keys/` stays the owner's alone). `private_umask()` sets the mask: the CLI
calls it before any verb, every component at start with the run directory, whose own mode
says whether the run is shared. The user's umask (002 on many sites) does not count.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from hpcrl.core.config import Config, write_resolved

__all__ = ["RunDirError", "RUN_ID_RE", "new_run_id", "create_run_dir", "private_umask", "PRIVATE_UMASK", "GROUP_UMASK"]

# The run id is a folder name and the `run` of every trajectory id: no '/', no leading '.', short.
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RunDirError(ValueError):
    """The run directory cannot be created as asked; the message says what to do instead."""


PRIVATE_UMASK = 0o077  # files 0600, folders 0700
GROUP_UMASK = 0o027  # files 0640, folders 0750: the group reads, nobody writes


def private_umask(run_dir: str | os.PathLike | None = None) -> None:
    """What this process creates is its owner's alone; or, under a run directory that is
    group-readable (`experiment.share_with_group`), readable by the group too. Never writable
    by anyone else."""
    shared = False
    if run_dir is not None:
        try:
            shared = bool(os.stat(run_dir).st_mode & 0o040)
        except OSError:
            pass
    os.umask(GROUP_UMASK if shared else PRIVATE_UMASK)


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
    shared = cfg.experiment.share_with_group
    os.umask(GROUP_UMASK if shared else PRIVATE_UMASK)
    root = Path(cfg.experiment.run_root)
    root.mkdir(parents=True, exist_ok=True)  # new folders on the way: the group may pass only if shared
    run_dir = root / (run_id or new_run_id(cfg))
    mode = 0o750 if shared else 0o700
    try:
        run_dir.mkdir(mode=mode)
    except FileExistsError:
        raise RunDirError(f"run directory {run_dir} already exists; pick another --run-id or remove it") from None
    os.chmod(run_dir, mode)
    write_resolved(cfg, run_dir)
    return run_dir
