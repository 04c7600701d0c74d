"""Run directories: one folder per run under `experiment.run_root`, shared by every component.

Components find each other, their keys and the trajectory shards through this folder, so on
a cluster it must sit on the parallel filesystem. The resolved config is written first.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from hpcrl.core.config import Config, write_resolved


def new_run_id(cfg: Config) -> str:
    # Time first so `ls` sorts runs by age; a random tail so two submissions in the same
    # second never share a folder.
    return f"{cfg.experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def create_run_dir(cfg: Config, run_id: str | None = None) -> Path:
    """Create `<run_root>/<run_id>/` with the resolved config in it; refuse to reuse one."""
    root = Path(cfg.experiment.run_root)
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / (run_id or new_run_id(cfg))
    try:
        run_dir.mkdir()
    except FileExistsError:
        raise FileExistsError(f"run directory {run_dir} already exists; pick another run id or remove it") from None
    os.chmod(run_dir, 0o750)
    write_resolved(cfg, run_dir)
    return run_dir
