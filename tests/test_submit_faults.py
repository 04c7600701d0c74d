"""Faults on the dev cluster that squeue alone cannot see or heal: a hung component, then a dead
supervisor. A generator under SIGSTOP stays RUNNING in squeue; its heartbeat goes stale and the
supervisor cancels and resubmits it. A cancelled supervisor job is replaced by the coordinator's
watch (its heartbeat is stale and its job has left the queue), and `hpcrl supervise` is a no-op
while one is alive. The run still finishes, with no trajectory trained twice."""

from __future__ import annotations

import json
import os
import signal

import pytest

from hpcrl.jobs.launch import read_jobs
from hpcrl.jobs.supervise import pids, queue_states
from hpcrl.rl.learner_service import AUDIT_NAME
from hpcrl.slurm.command import run_slurm

from audit import lineage
from conftest import wait_for
from test_submit import SMALL, all_ids, hpcrl, status_json

pytestmark = pytest.mark.slurm


def test_a_hung_generator_and_a_dead_supervisor_are_replaced(slurm_cluster, tmp_path):
    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=300",
        "supervise.hang_s=20",
        "supervise.backoff_s=1",
        "--run-id",
        "faults",
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "faults"
    try:
        wait_for(lambda: (status_json(run_dir)["step"] or 0) >= 3, 300, what="learner step 3")
        gen = read_jobs(run_dir)["components"]["gen-0"]["job_id"]
        wait_for(lambda: pids(run_dir, "gen-0"), 120, what="gen-0's process")
        for pid in pids(run_dir, "gen-0"):
            os.kill(pid, signal.SIGSTOP)  # still RUNNING to Slurm
        wait_for(
            lambda: read_jobs(run_dir)["components"]["gen-0"]["job_id"] != gen,
            300,
            what="the hung generator to be cancelled and resubmitted",
        )
        sup = read_jobs(run_dir)["supervisor"]["job_id"]
        assert "is alive; nothing to do" in hpcrl("supervise", str(run_dir)).stdout
        run_slurm(["scancel", sup])
        wait_for(
            lambda: read_jobs(run_dir)["supervisor"]["job_id"] != sup,
            300,
            what="the coordinator to submit a new supervisor",
        )
        new_sup = read_jobs(run_dir)["supervisor"]["job_id"]
        wait_for(lambda: queue_states([new_sup]).get(new_sup) == "RUNNING", 120, what="the new supervisor to run")
        again = hpcrl("supervise", str(run_dir))
        assert again.returncode == 0 and f"supervisor job {new_sup} is alive" in again.stdout, again
        wait_for(lambda: read_jobs(run_dir)["state"] in ("finished", "failed"), 600, what="the run to finish")
        jobs = read_jobs(run_dir)
        assert jobs["state"] == "finished", jobs
        wait_for(lambda: not queue_states(all_ids(run_dir)), 60, what="every job of the run to leave the queue")
    except BaseException:
        hpcrl("cancel", str(run_dir))
        raise
    g = jobs["components"]["gen-0"]
    assert g["restarts"] == 1 and len(g["history"]) == 2 and len(g["restart_times"]) == 1, g
    assert len(jobs["supervisor"]["history"]) == 2
    log = "".join((run_dir / "submitit" / f"{j}_0_log.err").read_text() for j in jobs["supervisor"]["history"])
    assert "gen-0 (job" in log and "is hung" in log and "has not turned its main loop" in log, log[-3000:]
    records, _ = lineage(run_dir / AUDIT_NAME)
    assert [r["step"] for r in records] == list(range(1, 301))
    trained = [i for r in records for i in r["trained"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert json.loads((run_dir / "supervision.json").read_text())["components"]["gen-0"] == "ended"
