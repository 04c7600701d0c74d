"""The dev cluster's own contract: idempotent `up`, `down` stops everything (jobs first), a second
`up` works and keeps accounting and job ids."""

from __future__ import annotations

import subprocess
import time

import pytest

from hpcrl.slurm import queries
from hpcrl.slurm.command import run_slurm
from hpcrl.slurm.parse import parse_sbatch_job_id
from conftest import devcluster_cmd, wait_for

pytestmark = pytest.mark.slurm


def devcluster(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(devcluster_cmd(*args), capture_output=True, text=True, timeout=timeout_s)


def tagged_processes(state_dir: str) -> list[int]:
    """Processes started for this cluster's state folder (the script tags their environment)."""
    pids = []
    for line in subprocess.run(["ps", "-eo", "pid="], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{line}/environ", "rb") as f:
                if f"HPCRL_DEVCLUSTER_TAG={state_dir}#".encode() in f.read():
                    pids.append(int(line))
        except OSError:
            continue
    return pids


def test_up_is_idempotent_and_status_reports(slurm_cluster):
    t0 = time.monotonic()
    again = devcluster("up")
    assert again.returncode == 0, again.stderr
    assert time.monotonic() - t0 < 60
    status = devcluster("status")
    assert status.returncode == 0 and "UP" in status.stdout


def test_down_stops_everything_and_up_resumes(slurm_cluster):
    state = slurm_cluster["HPCRL_DEVCLUSTER_DIR"]
    first = parse_sbatch_job_id(run_slurm(["sbatch", "--parsable", "--output=/dev/null", "-p", "cpu", "-t", "5", "--wrap", "sleep 300"]).stdout)
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
    second = parse_sbatch_job_id(run_slurm(["sbatch", "--parsable", "--output=/dev/null", "-p", "cpu", "-t", "1", "--wrap", "true"]).stdout)
    assert int(second) > int(first)
