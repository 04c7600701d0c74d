"""A run directory is its owner's alone unless the config shares it with the group; every CLI
verb and every component works under that mask, whatever the user's umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpcrl.core.config import load_config
from hpcrl.core.transport import RunKeys
from hpcrl.jobs.cli import main
from hpcrl.jobs.rundir import create_run_dir, private_umask

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def site_umask():
    """A site umask of 002 (group-writable files), the test's own restored after."""
    old = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_a_run_directory_is_its_owners_alone_by_default(tmp_path, site_umask):
    cfg = load_config(None, [f"experiment.run_root={tmp_path / 'runs'}"])
    run_dir = create_run_dir(cfg, "r")
    assert mode(run_dir) == 0o700 and mode(run_dir / "config.resolved.yaml") == 0o600
    os.umask(0o002)  # a component's job starts with whatever umask Slurm or the shell gave it
    private_umask(run_dir)
    (run_dir / "trajectories").mkdir()
    (run_dir / "trajectories" / "shard.h5").write_bytes(b"x")
    assert mode(run_dir / "trajectories") == 0o700 and mode(run_dir / "trajectories" / "shard.h5") == 0o600


def test_share_with_group_lets_the_group_read_and_nobody_write(tmp_path, site_umask):
    cfg = load_config(None, [f"experiment.run_root={tmp_path / 'runs'}", "experiment.share_with_group=true"])
    run_dir = create_run_dir(cfg, "r")
    assert mode(tmp_path / "runs") == 0o750  # the group can reach the run
    assert mode(run_dir) == 0o750 and mode(run_dir / "config.resolved.yaml") == 0o640
    os.umask(0o002)
    private_umask(run_dir)  # a component reads the choice from the folder's mode
    (run_dir / "weights").mkdir()
    (run_dir / "weights" / "v1.safetensors").write_bytes(b"x")
    assert mode(run_dir / "weights") == 0o750 and mode(run_dir / "weights" / "v1.safetensors") == 0o640
    RunKeys(run_dir).ensure("gen-0")  # the keys stay the owner's alone even so
    assert mode(run_dir / "keys") == 0o700 and mode(run_dir / "keys" / "gen-0.key_secret") == 0o600


def test_every_cli_verb_runs_under_the_private_umask(site_umask, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["validate", "config.yaml"]) == 0
    assert os.umask(0o002) == 0o077
