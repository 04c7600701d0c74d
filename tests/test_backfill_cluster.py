"""Backfill-aware rollout jobs on the real dev Slurm cluster (make devcluster).

Our learner holds one node's GPUs, another user's job that needs every GPU queues behind it,
and rollout work is pending. The job sized by the backfill planner starts at once on the free
GPUs, ahead of the queued job and without moving its expected start, while a job with the
usual long limit waits; a reclaimed (cancelled) rollout job's unfinished task is re-issued
and no half-written result is left; a preempted (requeued) job's killed run gives its task
back and the next run finishes the work. Only our own jobs are ever cancelled, by id.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest

from hpcrl.core.config import SchedulerConfig
from hpcrl.slurm import parse, queries
from hpcrl.slurm.backfill.packer import RolloutTask
from hpcrl.slurm.backfill.planner import BackfillPlanner, RolloutJobs, live_window
from hpcrl.slurm.backfill.taskqueue import DirTaskQueue
from hpcrl.slurm.command import run_slurm
from hpcrl.slurm.sbatch import Resources, render_script, submit_script, write_script

from conftest import wait_for

pytestmark = pytest.mark.slurm


def hold(tmp_path, name: str, nodes: int, gpus: int, time_min: int, seconds: int, *sbatch_args: str) -> str:
    text = render_script(
        [Resources(partition="gpu", time_min=time_min, nodes=nodes, gpus_per_node=gpus, mem_mb=256)],
        [f"sleep {seconds}"],
        job_name=name,
        output=str(tmp_path / f"{name}-%j.out"),
    )
    return submit_script(write_script(text, tmp_path / f"{name}.sh"), list(sbatch_args))


def state(job_id: str) -> str | None:
    rows = queries.queue(job_ids=[job_id])
    return rows[0]["state"] if rows else None


def expected_start(job_id: str) -> dt.datetime | None:
    return next((j.expected_start for j in queries.pending_jobs("gpu") if j.job_id == job_id), None)


def test_sized_rollout_job_backfills_ahead_of_the_queue_and_reissues_on_reclaim(slurm_cluster, tmp_path):
    queue = DirTaskQueue(tmp_path / "queue")
    for i in range(12):
        queue.put(RolloutTask(i, f"code-{i % 3}", est_s=4.0), {"work_s": 3.0})
    cfg = SchedulerConfig(job_overhead_s=5.0, slurm_margin_s=20.0)
    jobs = RolloutJobs(queue, partition="gpu", log_dir=tmp_path / "logs", worker_margin_s=2.0)
    own: list[str] = []
    try:
        learner = hold(tmp_path, "hpcrl-learner", 1, 4, 3, 170)
        own.append(learner)
        wait_for(lambda: state(learner) == "RUNNING", 60, what="our learner holding a node's GPUs")
        planner = BackfillPlanner(cfg)
        probe = planner.plan(live_window("gpu", exclude=(learner,)), queue.pending_tasks())
        assert probe is not None, "no idle GPU on the other node (is another user's job holding it?)"
        free_at = planner.resources_free_at(probe)
        assert free_at <= dt.datetime.now() + dt.timedelta(seconds=75), "the other node's GPUs are idle now"

        big = hold(tmp_path, "other-user-all-gpus", 2, 4, 1, 5)
        own.append(big)
        before = wait_for(lambda: expected_start(big), 30, what="Slurm's planned start of the queued 8-GPU job")

        # The usual long limit cannot fit before the queued job: it just waits behind it.
        naive = jobs.submit_one(time_limit_min=60)
        own.append(naive.job_id)

        window = live_window("gpu", exclude=(learner, naive.job_id))
        assert window.blocked_by == big and window.gpus_idle >= 1
        assert 30 <= window.length_s <= 3 * 60 + 30
        plan = planner.plan(window, queue.pending_tasks())
        assert plan is not None and plan.time_limit_min * 60 <= window.length_s - cfg.slurm_margin_s
        (sized,) = jobs.submit(dataclasses.replace(plan, jobs=1))
        own.append(sized.job_id)

        wait_for(lambda: state(sized.job_id) == "RUNNING", 45, what="the sized rollout job started by backfill")
        assert state(big) == "PENDING" and state(naive.job_id) == "PENDING", "it started ahead of the queue"
        rec = queries.show_job(sized.job_id)
        assert parse.parse_duration_s(rec["TimeLimit"]) <= window.length_s
        after = expected_start(big)
        assert after is not None and after <= before + dt.timedelta(seconds=60), "the queued job was pushed back"

        # Reclaim the borrowed GPU in the middle of a task.
        wait_for(
            lambda: len(queue.results()) >= 2 and queue.claimed().get(sized.owner),
            60,
            what="two rollout results and a task in flight",
        )
        in_flight = queue.claimed()[sized.owner]
        jobs.cancel([sized.job_id])
        reissued: list[int] = []

        def gone():
            reissued.extend(jobs.poll())
            return sized.job_id not in jobs.active

        wait_for(gone, 30, what="the cancelled rollout job leaving the queue")
        assert set(in_flight) <= set(reissued), "the interrupted task was not re-issued"
        results = queue.results()
        assert all(json.loads((queue.results_dir / f"{i}.json").read_text())["owner"] == sized.owner for i in results)
        assert not list(queue.results_dir.glob(".tmp-*")), "a half-written result was left behind"
        pending = {t.task_id for t in queue.pending_tasks()}
        assert not set(results) & pending and set(results) | pending == set(range(12))
        assert sized.owner not in queue.claimed()
        assert state(naive.job_id) == "PENDING"
    finally:
        queries.cancel(own)
    wait_for(lambda: not queries.queue(job_ids=own), 30, what="our jobs to leave the queue")
    assert jobs.poll() == []  # the naive job never ran: nothing of it to re-issue
    assert not jobs.active and queue.claimed() == {}


def test_requeued_rollout_job_gives_back_what_its_killed_run_held(slurm_cluster, tmp_path):
    """Preemption (here `scontrol requeue`) kills the run but keeps the job id: the killed run's
    task goes back to the queue, the next run claims under a new name, every task ends up done once."""
    queue = DirTaskQueue(tmp_path / "queue")
    for i in range(4):
        queue.put(RolloutTask(i, "agent-1", est_s=3.0), {"work_s": 2.0})
    jobs = RolloutJobs(queue, partition="gpu", log_dir=tmp_path / "logs", worker_margin_s=1.0)
    job = jobs.submit_one(time_limit_min=2)
    reissued: list[int] = []
    try:

        def working():
            reissued.extend(jobs.poll())
            return queue.claimed().get(job.owner)

        held = wait_for(working, 60, interval_s=0.2, what="the rollout job's first run holding a task")
        run_slurm(["scontrol", "requeue", job.job_id])

        def given_back():
            reissued.extend(jobs.poll())
            return set(held) <= set(reissued)

        wait_for(given_back, 60, interval_s=0.2, what="the killed run's task to be re-issued")
        assert job.job_id in jobs.active  # same job, pending or running again

        def all_done():
            reissued.extend(jobs.poll())
            return len(queue.results()) == 4

        wait_for(all_done, 75, interval_s=0.5, what="the requeued job's next run to finish the work")
        owners = {r["owner"] for r in queue.results().values()}
        assert owners <= {job.owner, f"{job.owner_prefix}1"} and f"{job.owner_prefix}1" in owners
        assert not list(queue.results_dir.glob(".tmp-*")) and not queue.pending_tasks()
    finally:
        queries.cancel([job.job_id])
    wait_for(lambda: not queries.queue(job_ids=[job.job_id]), 30, what="the rollout job to leave the queue")
    jobs.poll()
    assert queue.claimed() == {} and not jobs.active


def test_a_live_window_counts_whole_jobs_and_a_job_slurm_leaves_pending_is_withdrawn(slurm_cluster, tmp_path):
    """The window as the planner reads it from the live controller counts only rollout jobs that
    fit a node's memory too; and a job Slurm has looked at and left pending (here: held) is
    withdrawn by id, once it has pended withdraw_after_s."""
    from hpcrl.core.config import load_config
    from hpcrl.jobs.rollout_plan import RolloutPlanner
    from hpcrl.jobs.rollout_slurm import SlurmBackend
    from hpcrl.slurm.backfill.planner import no_window_reason

    gpus_only = live_window("gpu")
    assert gpus_only.gpus_idle > 0, "the dev cluster should have idle GPUs between tests"
    small = live_window("gpu", need=Resources(partition="gpu", gpus_per_node=1, mem_mb=256))
    assert small.gpus_idle == gpus_only.gpus_idle  # 256 MB and one CPU per GPU: every idle GPU takes one
    biggest = max(n.real_memory_mb for n in queries.nodes())
    huge = live_window("gpu", need=Resources(partition="gpu", gpus_per_node=1, mem_mb=biggest + 1))
    assert huge.jobs_that_fit(1) == 0
    assert "has room for a rollout job (1 GPU, 1 CPU" in no_window_reason(huge, SchedulerConfig(), 1)

    held = hold(tmp_path, "hpcrl-rollout-held", 1, 1, 1, 30, "--hold")
    other = hold(tmp_path, "someone-else", 1, 1, 1, 30, "--hold")
    try:
        wait_for(
            lambda: next((j.reason for j in queries.pending_jobs() if j.job_id == held), "None") != "None",
            30,
            what="Slurm's reason for the held job",
        )
        backend = SlurmBackend(None, lambda: (), withdraw_after_s=6.0)
        p = RolloutPlanner(load_config(None, []), tmp_path, None, backend)
        rec = {"job_id": held, "state": "active", "gpus": 1, "pending": True, "submitted": 0.0}
        p.record["jobs"]["rollout-0"] = rec
        assert backend.withdraw(p, now=5.0) is False and rec["state"] == "active"  # not 6 s yet
        assert backend.withdraw(p, now=6.0) is True and rec["state"] == "ended" and rec["withdrawn"] == 6.0
        wait_for(lambda: state(held) in (None, "CANCELLED"), 30, what="the withdrawn job to be cancelled")
        assert state(other) == "PENDING", "only our own job is withdrawn, by id"
    finally:
        queries.cancel([held, other])
    wait_for(lambda: not queries.queue(job_ids=[held, other]), 30, what="the held jobs to leave the queue")
