"""Cluster-backfill sizing (slurm/backfill/planner.py), task leases (slurm/backfill/taskqueue.py) and the rollout
worker (slurm/backfill/worker.py), without a cluster. tests/test_backfill_cluster.py runs the
same code against the dev Slurm cluster."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcrl.core.config import SchedulerConfig
from hpcrl.slurm.backfill.estimates import DurationEstimator
from hpcrl.slurm.backfill.packer import RolloutTask
from hpcrl.slurm.backfill.planner import BackfillPlanner, find_window, jobs_fitting, no_window_reason
from hpcrl.slurm.backfill.taskqueue import DirTaskQueue, TaskQueueError
from hpcrl.slurm.backfill.worker import run_window
from hpcrl.slurm.queries import NodeState, PartitionState, PendingJob
from hpcrl.slurm.sbatch import Resources

ROOT = Path(__file__).resolve().parents[1]
NOW = dt.datetime(2026, 12, 2, 12, 0, 0)


def node(name, gpus_alloc, state="MIXED"):
    return NodeState(name, state, ("cpu", "gpu"), 8, 2, 4, gpus_alloc, 16384, 1024)


def part(name, nodes=("n1", "n2")):
    return PartitionState(name, True, nodes, None, 16, 0, 16, 8, 0, 8)


def pending(job_id, gpus, start_in_s, partition="gpu"):
    start = None if start_in_s is None else NOW + dt.timedelta(seconds=start_in_s)
    return PendingJob(job_id, partition, "other", "big", 2, 2, gpus, 60, start, "Resources", 100)


PARTS = [part("cpu"), part("gpu")]


# ------------------------------------------------------------------------------ windows
def test_window_ends_at_the_earliest_pending_gpu_job():
    nodes = [node("n1", 4, "ALLOCATED"), node("n2", 1)]
    jobs = [pending("10", 8, 300), pending("11", 1, 180), pending("12", 0, 5, "cpu"), pending("13", 2, 60)]
    w = find_window("gpu", nodes, PARTS, jobs, NOW, exclude=("13",))
    assert w.idle_by_node == (("n2", 3),) and w.gpus_idle == 3
    assert (w.end, w.blocked_by, w.length_s) == (NOW + dt.timedelta(seconds=180), "11", 180.0)
    assert w.jobs_that_fit(1) == 3 and w.jobs_that_fit(2) == 1 and w.jobs_that_fit(4) == 0


def test_window_without_pending_gpu_jobs_is_unbounded_and_unplanned_jobs_close_it():
    nodes = [node("n1", 0, "IDLE"), node("n2", 0, "IDLE")]
    assert find_window("gpu", nodes, PARTS, [], NOW).length_s == float("inf")
    w = find_window("gpu", nodes, PARTS, [pending("20", 1, None)], NOW)
    assert w.length_s == 0.0 and w.blocked_by == "20"  # Slurm has not planned it yet: wait
    drained = [node("n1", 0, "IDLE+DRAIN"), node("n2", 4)]
    assert find_window("gpu", drained, PARTS, [], NOW).gpus_idle == 0
    with pytest.raises(ValueError, match="partition 'gpuu' does not exist; partitions: cpu, gpu"):
        find_window("gpuu", nodes, PARTS, [], NOW)


def test_a_window_counts_only_whole_rollout_jobs_that_the_nodes_cpus_and_memory_hold():
    # As on the dev cluster in run 19: n1 has a GPU idle but the run's own learner and generator
    # hold its memory; Slurm left a 4-GB rollout job sized to that GPU pending (reason Priority).
    full = NodeState("n1", "MIXED", ("cpu", "gpu"), 8, 7, 4, 3, 16384, 14592)  # 1 GPU, 1 CPU, 1.75 GB free
    roomy = NodeState("n2", "MIXED", ("cpu", "gpu"), 8, 5, 4, 1, 16384, 4096)  # 3 GPUs, 3 CPUs, 12 GB free
    gen = Resources(partition="gpu", gpus_per_node=1, cpus_per_task=1, mem_mb=4096)
    w = find_window("gpu", [full, roomy], PARTS, [], NOW, need=gen)
    assert w.idle_by_node == (("n2", 3),) and w.need == "1 GPU, 1 CPU, 4096 MB"
    assert jobs_fitting(full, gen) == 0 and jobs_fitting(roomy, gen) == 3
    assert jobs_fitting(roomy, dataclasses.replace(gen, cpus_per_task=2)) == 1  # 3 CPUs: one 2-CPU job
    assert jobs_fitting(roomy, dataclasses.replace(gen, mem_mb=5000)) == 2  # 12 GB: two 5-GB jobs
    assert jobs_fitting(roomy, dataclasses.replace(gen, gpus_per_node=2)) == 1
    assert find_window("gpu", [full, roomy], PARTS, [], NOW).idle_by_node == (("n1", 1), ("n2", 3))  # GPUs only
    alone = find_window("gpu", [full], PARTS, [], NOW, need=gen)
    why = no_window_reason(alone, CFG, 1)
    assert why == "no node of gpu has room for a rollout job (1 GPU, 1 CPU, 4096 MB free)", why


# ------------------------------------------------------------------------------ planning
CFG = SchedulerConfig(job_overhead_s=20.0, slurm_margin_s=30.0)


def window(length_s, idle=(("n2", 4),)):
    end = None if length_s is None else NOW + dt.timedelta(seconds=length_s)
    return find_window(
        "gpu",
        [node("n1", 4, "ALLOCATED")] + [node(n, 4 - k) for n, k in idle],
        PARTS,
        [] if end is None else [pending("99", 8, length_s)],
        NOW,
    )


def tasks(*ests, domain="code"):
    return [RolloutTask(i, domain, e, version=0) for i, e in enumerate(ests)]


def test_plan_fits_the_window_in_whole_minutes():
    plan = BackfillPlanner(CFG).plan(window(400), tasks(*[30.0] * 20))  # 600 s of work
    # 400 s window - 30 s margin = 6 whole minutes at most; 4 idle GPUs.
    assert plan.time_limit_min * 60 <= 400 - 30 and plan.jobs <= 4
    assert plan.jobs * (plan.time_limit_min * 60 - CFG.job_overhead_s) >= plan.est_work_s
    assert plan.time_min_min == 1 and plan.time_min_min <= plan.time_limit_min
    assert plan.sbatch_args() == ["--partition=gpu", "--gpus-per-node=1", "--nodes=1", f"--time={plan.time_limit_min}"]


def test_plan_asks_only_for_what_the_work_needs():
    plan = BackfillPlanner(CFG).plan(window(3600), tasks(10.0, 10.0))
    assert (plan.jobs, plan.time_limit_min) == (1, 1)
    unbounded = BackfillPlanner(CFG, unbounded_time_min=30).plan(window(None), tasks(*[200.0] * 40))
    assert unbounded.time_limit_min == 30 and unbounded.jobs == 4


def test_no_plan_when_nothing_can_start_in_the_window():
    planner = BackfillPlanner(CFG)
    assert planner.plan(window(80), tasks(5.0)) is None  # 80 - 30 s margin < one minute
    assert planner.plan(window(200), tasks(400.0)) is None  # no task fits 2 minutes
    assert planner.plan(window(600, idle=()), tasks(5.0)) is None  # no idle GPU
    assert planner.plan(window(600), []) is None
    assert BackfillPlanner(CFG, gpus_per_job=2).plan(window(600, idle=(("n2", 1),)), tasks(5.0)) is None


@pytest.mark.parametrize(
    "now, reservation, minutes",
    [
        # Measured on the dev cluster (bf_resolution=60, bf_interval=1): a 1-minute job ...
        ((12, 51, 54), (12, 53, 53), 1),  # ... started by backfill at once
        ((12, 52, 10), (12, 53, 53), 0),  # ... kept waiting until the reserved job had run
        ((12, 56, 44), (12, 58, 43), 1),  # ... started at once
        ((12, 57, 0), (12, 58, 43), 0),  # ... kept waiting
    ],
)
def test_window_accounts_for_backfill_resolution(now, reservation, minutes):
    planner = BackfillPlanner(dataclasses.replace(CFG, slurm_margin_s=5.0))
    now, end = dt.datetime(2026, 12, 2, *now), dt.datetime(2026, 12, 2, *reservation)
    w = dataclasses.replace(window(600), now=now, end=end)
    assert planner.minutes_that_fit(w) == minutes
    assert (planner.plan(w, tasks(5.0)) is None) == (minutes == 0)


def test_plan_uses_domain_history_once_there_is_enough():
    est = DurationEstimator(history=50, min_samples=5)
    for _ in range(20):
        est.record("slow", 250.0)
    planner = BackfillPlanner(CFG, est)
    assert planner.estimate(RolloutTask(1, "slow", 5.0)) == 250.0
    assert planner.estimate(RolloutTask(2, "unknown", 5.0)) == 5.0
    assert planner.plan(window(200), tasks(5.0, domain="slow")) is None  # history says it cannot fit


# ------------------------------------------------------------------------------ task queue
def test_claim_complete_release_cycle(tmp_path):
    q = DirTaskQueue(tmp_path / "q")
    for t in tasks(1.0, 2.0, 3.0):
        q.put(t, {"work_s": t.est_s})
    assert [t.task_id for t in q.pending_tasks()] == [0, 1, 2]
    assert q.claim(0, "slurm-1") and not q.claim(0, "slurm-2")  # one winner
    assert q.claim(1, "slurm-1") and q.claim(2, "slurm-2")
    assert q.claimed_payload(1, "slurm-1")[1] == {"work_s": 2.0}
    q.complete(0, "slurm-1", {"reward": 1})
    (q.results_dir / ".tmp-1-slurm-1").write_text('{"half": ')  # a result being written when the job died
    assert q.counts() == {"pending": 0, "claimed": 2, "done": 1}
    assert q.release("slurm-1") == [1]
    assert not list(q.results_dir.glob(".tmp-*")) and q.results() == {0: {"reward": 1}}
    assert [t.task_id for t in q.pending_tasks()] == [1] and q.claimed() == {"slurm-2": [2]}
    with pytest.raises(ValueError, match="owner 'a b'"):
        q.claim(1, "a b")
    (q.pending_dir / "7.json").write_text("{not json")
    with pytest.raises(TaskQueueError, match="7.json: unreadable"):
        q.pending_tasks()


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_run_window_takes_oldest_fitting_tasks_until_the_deadline(tmp_path):
    q = DirTaskQueue(tmp_path / "q")
    for t in [
        RolloutTask(1, "a", 50.0, version=0),
        RolloutTask(2, "a", 5.0, version=1),
        RolloutTask(3, "a", 5.0, version=0),
        RolloutTask(4, "a", 12.0, version=2),
    ]:
        q.put(t, {"work_s": t.est_s})
    clock = FakeClock()
    ran = []

    def runner(task, payload, stop):
        ran.append(task.task_id)
        clock.t += payload["work_s"]
        return {"ok": True}

    report = run_window(q, "learner-1", until=clock.t + 20.0, runner=runner, stop=threading.Event(), clock=clock)
    # 20 s window: task 1 (50 s) never fits; 3 (v0), 2 (v1) run; 4 (12 s) no longer fits in the last 10 s.
    assert ran == [3, 2] and report.tasks_done == 2 and report.busy_s == 10.0 and not report.stopped
    assert sorted(q.results()) == [2, 3] and [t.task_id for t in q.pending_tasks()] == [1, 4]


def test_interrupted_task_stores_nothing_and_is_reissued(tmp_path):
    q = DirTaskQueue(tmp_path / "q")
    q.put(RolloutTask(1, "a", 5.0), {"work_s": 5.0})
    stop = threading.Event()

    def runner(task, payload, stop_event):
        stop_event.set()  # the owner reclaims the GPU mid-task
        return None

    report = run_window(q, "gen-3", until=time.time() + 60, runner=runner, stop=stop)
    assert report.stopped and report.tasks_done == 0
    assert q.results() == {} and q.claimed() == {"gen-3": [1]}
    assert q.release("gen-3") == [1] and [t.task_id for t in q.pending_tasks()] == [1]


def worker(*args, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "hpcrl.slurm.backfill.worker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_worker_process_stops_on_sigterm_without_a_half_result(tmp_path):
    q = DirTaskQueue(tmp_path / "q")
    q.put(RolloutTask(1, "a", 0.2), {"work_s": 0.2})
    q.put(RolloutTask(2, "a", 30.0), {"work_s": 30.0})
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    proc = worker(
        "--queue", str(q.root), "--owner", "w1", "--until", str(time.time() + 120), "--margin-s", "0", env=env
    )
    deadline = time.time() + 20
    while q.claimed().get("w1") != [2] and time.time() < deadline:
        time.sleep(0.05)
    assert q.claimed().get("w1") == [2], "the worker did not claim the long task"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert "1 task(s)" in out and "stopped by signal" in out
    assert sorted(q.results()) == [1] and json.loads((q.results_dir / "1.json").read_text())["owner"] == "w1"
    assert q.release("w1") == [2]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--owner", "w", "--until", "1"], "--queue {q}/nope: no such folder"),
        (["--owner", "w"], "--until is required outside a Slurm job"),
        (["--owner", "w", "--until", "1", "--runner", "nomodule"], "expected module:function"),
        (["--owner", "w", "--until", "1", "--runner", "os:nosuch"], "cannot load it"),
    ],
)
def test_worker_bad_arguments_exit_2(tmp_path, args, fragment):
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    qdir = tmp_path / "nope" if "no such folder" in fragment else DirTaskQueue(tmp_path / "q").root
    proc = worker("--queue", str(qdir), *args, env=env)
    _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and fragment.format(q=tmp_path) in err and len(err.strip().splitlines()) == 1, err


def test_planner_settings_come_from_the_config():
    # 125 s to a reservation Slurm floors to 120 s; 0 would derive the margin from bf_interval
    cfg = dataclasses.replace(CFG, slurm_margin_s=1.0, job_overhead_s=0.0)
    plan = BackfillPlanner(cfg).plan(window(125), tasks(50.0))
    assert plan.time_limit_min == 1  # 119 s: one whole minute, and a 50-s task fits it with no overhead
    assert BackfillPlanner(CFG).plan(window(125), tasks(50.0)) is None  # 90 s: 1 minute, 20 s + 50 s do not
