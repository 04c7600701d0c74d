"""The dev cluster's own contract: idempotent `up`, `down` stops everything (jobs first), a second
`up` works and keeps accounting and job ids; `env` and the config templates without a cluster."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.slurm import queries
from hpcrl.slurm.command import run_slurm
from hpcrl.slurm.devcluster.cluster import Cluster
from hpcrl.slurm.devcluster.layout import Layout
from hpcrl.slurm.parse import parse_sbatch_job_id

from conftest import devcluster_cmd, wait_for


def devcluster(*args: str, timeout_s: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        devcluster_cmd(*args), capture_output=True, text=True, timeout=timeout_s, env=env, check=False
    )


def tagged_processes(state_dir: str) -> list[int]:
    """Processes started for this cluster's state folder (the dev cluster tags their environment)."""
    pids = []
    for line in subprocess.run(["ps", "-eo", "pid="], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{line}/environ", "rb") as f:
                if f"HPCRL_DEVCLUSTER_TAG={state_dir}#".encode() in f.read():
                    pids.append(int(line))
        except OSError:
            continue
    return pids


def test_env_evals_to_the_state_folder(tmp_path: Path):
    state = os.path.realpath(tmp_path / "it's here")
    script = f'eval "$({shlex.join(devcluster_cmd("env"))})"; printf "%s\\n" "$SLURM_CONF" "$HPCRL_DEVCLUSTER_DIR"'
    env = dict(os.environ, HPCRL_DEVCLUSTER_DIR=state)
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{state}/etc/slurm.conf", state]
    assert devcluster("nonsense", env=env).returncode == 2


def test_configs_render_from_the_templates(tmp_path: Path):
    for d in ("etc", "mariadb"):
        (tmp_path / d).mkdir()
    (tmp_path / "mariadb" / "slurm.pass").write_text("pw")
    Cluster(Layout(tmp_path, "c", "a", 20000)).render_configs()
    etc = tmp_path / "etc"
    assert sorted(p.name for p in etc.iterdir()) == ["gres.conf", "slurm.conf", "slurmdbd.conf"]
    texts = {p.name: p.read_text() for p in etc.iterdir()}
    assert not any("$" in t or "@" in t for t in texts.values())
    assert "SlurmctldPort=20007" in texts["slurm.conf"] and "Port=20010" in texts["slurm.conf"]
    assert f"File={tmp_path}/dev/nvidia[0-3]" in texts["gres.conf"]
    assert "StoragePass=pw" in texts["slurmdbd.conf"] and (etc / "slurmdbd.conf").stat().st_mode & 0o777 == 0o600


def test_the_module_imports_no_other_hpcrl_module():
    code = "import sys, hpcrl.slurm.devcluster.__main__; print(*(m for m in sys.modules if m.startswith('hpcrl')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out and all(m in ("hpcrl", "hpcrl.slurm") or m.startswith("hpcrl.slurm.devcluster") for m in out), out


@pytest.mark.slurm
def test_up_is_idempotent_and_status_reports(slurm_cluster):
    t0 = time.monotonic()
    again = devcluster("up")
    assert again.returncode == 0, again.stderr
    assert time.monotonic() - t0 < 60
    status = devcluster("status")
    assert status.returncode == 0 and "UP" in status.stdout


@pytest.mark.slurm
def test_down_stops_everything_and_up_resumes(slurm_cluster):
    state = slurm_cluster["HPCRL_DEVCLUSTER_DIR"]
    first = parse_sbatch_job_id(
        run_slurm(["sbatch", "--parsable", "--output=/dev/null", "-p", "cpu", "-t", "5", "--wrap", "sleep 300"]).stdout
    )
    wait_for(lambda: [r for r in queries.queue(job_ids=[first]) if r["state"] == "RUNNING"], 60, what="job running")

    down = devcluster("down")
    assert down.returncode == 0, down.stderr
    assert devcluster("status").returncode != 0
    assert tagged_processes(state) == [], "down left daemons or job steps running"

    t0 = time.monotonic()
    up = devcluster("up")
    assert up.returncode == 0, up.stdout + up.stderr
    assert time.monotonic() - t0 < 60
    nodes = queries.nodes()
    assert {n.name for n in nodes} == {"n1", "n2"} and all(n.usable for n in nodes)
    # down cancelled the running job first; accounting (MariaDB) kept its record.
    rec = wait_for(lambda: queries.job_records([first]).get(first), 30, what="record of the job from before down")
    assert rec.state == "CANCELLED"
    # Slurm's state survived, so job ids keep counting instead of restarting at 1.
    second = parse_sbatch_job_id(
        run_slurm(["sbatch", "--parsable", "--output=/dev/null", "-p", "cpu", "-t", "1", "--wrap", "true"]).stdout
    )
    assert int(second) > int(first)
