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
from hpcrl.jobs.localrun import pids
from hpcrl.jobs.supervise import queue_states
from hpcrl.rl.learner.service import AUDIT_NAME
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
        # The supervisor and the coordinator die together: the coordinator cannot revive the
        # supervisor, so the other components must (seen in a chaos drill: the run died).
        coord = read_jobs(run_dir)["components"]["coordinator"]["job_id"]
        run_slurm(["scancel", sup, coord])
        wait_for(
            lambda: read_jobs(run_dir)["supervisor"]["job_id"] != sup,
            300,
            what="a component to submit a new supervisor",
        )
        wait_for(
            lambda: read_jobs(run_dir)["components"]["coordinator"]["job_id"] != coord,
            300,
            what="the new supervisor to resubmit the coordinator",
        )
        new_sup = read_jobs(run_dir)["supervisor"]["job_id"]
        wait_for(lambda: queue_states([new_sup]).get(new_sup) == "RUNNING", 120, what="the new supervisor to run")
        again = hpcrl("supervise", str(run_dir))
        assert again.returncode == 0 and f"supervisor job {new_sup} is alive" in again.stdout, again
        # A hung supervisor (stopped, still RUNNING to Slurm) is cancelled and replaced once its
        # heartbeat is older than supervise.hang_s.
        hung = wait_for(lambda: pids(run_dir, "supervisor"), 120, what="the new supervisor's process")
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)  # still RUNNING to Slurm (scancel --signal=STOP stops srun, not it)
        wait_for(
            lambda: read_jobs(run_dir)["supervisor"]["job_id"] != new_sup,
            300,
            what="the hung supervisor to be replaced",
        )
        wait_for(lambda: read_jobs(run_dir)["state"] in ("finished", "failed"), 600, what="the run to finish")
        jobs = read_jobs(run_dir)
        assert jobs["state"] == "finished", jobs
        wait_for(lambda: not queue_states(all_ids(run_dir)), 60, what="every job of the run to leave the queue")
    except BaseException:
        hpcrl("cancel", str(run_dir))
        raise
    g = jobs["components"]["gen-0"]
    assert g["restarts"] >= 1 and len(g["history"]) == g["restarts"] + 1, g  # the coordinator's loss can cost one more
    assert len(jobs["supervisor"]["history"]) == 3
    log = "".join((run_dir / "submitit" / f"{j}_0_log.err").read_text() for j in jobs["supervisor"]["history"])
    assert "gen-0 (job" in log and "is hung" in log and "has not turned its main loop" in log, log[-3000:]
    records, _ = lineage(run_dir / AUDIT_NAME)
    assert [r["step"] for r in records] == list(range(1, 301))
    trained = [i for r in records for i in r["trained"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert json.loads((run_dir / "supervision.json").read_text())["components"]["gen-0"] == "ended"


def test_each_role_requeued_in_turn_resumes_in_place_and_loses_nothing(slurm_cluster, tmp_path):
    """Preemption of every role: `scontrol requeue` (what a preempting partition does) of the store
    writer, the coordinator, the generator and the learner, one after another while the run
    trains. Each job comes back under its own id (nothing resubmitted), and the run ends with every
    step once, no trajectory trained twice and none lost."""
    from hpcrl.rl.audit.audit import account

    out = hpcrl(
        "submit",
        "config.yaml",
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=600",
        "learner.checkpoint_every=10",
        "--run-id",
        "preempt",
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "preempt"
    roles = ("store", "coordinator", "gen-0", "learner")
    try:
        ids = {r: read_jobs(run_dir)["components"][r]["job_id"] for r in roles}
        for role in roles:
            step = wait_for(lambda: status_json(run_dir)["step"] or 0, 300, what="a learner step") + 5
            wait_for(lambda s=step: (status_json(run_dir)["step"] or 0) >= s, 300, what=f"learner step {step}")
            run_slurm(["scontrol", "requeue", ids[role]])  # SIGTERM now; the same job id runs again later
            # Back when its job runs again and the learner has trained past the step it was at.
            wait_for(
                lambda j=ids[role], s=step: (
                    queue_states([j]).get(j) == "RUNNING" and (status_json(run_dir)["step"] or 0) > s
                ),
                300,
                what=f"{role} to run again and training to go on",
            )
        wait_for(lambda: read_jobs(run_dir)["state"] in ("finished", "failed"), 900, what="the run to finish")
        jobs = read_jobs(run_dir)
        assert jobs["state"] == "finished", jobs
        wait_for(lambda: not queue_states(all_ids(run_dir)), 60, what="every job of the run to leave the queue")
    except BaseException:
        hpcrl("cancel", str(run_dir))
        raise
    for role in roles:  # requeued in place: Slurm's job, not a resubmission
        assert jobs["components"][role]["history"] == [ids[role]], (role, jobs["components"][role])
    acct = account(run_dir)
    assert acct.steps == list(range(1, 601)) and acct.cursor_step == 600, acct.as_dict()
    assert acct.trained_twice == 0 and acct.lost == 0, acct.as_dict()
