"""The rollout decisions on a queue snapshot (slurm/backfill/planner.py, give_way.py, book.py),
without a cluster: the window and whole jobs of the generator's shape, sizing to whole minutes of
Slurm's backfill resolution, the plan a snapshot gives (or why none), withdrawal, give-way, and
the rollout-job counts. tests/test_backfill_snapshot.py takes snapshots from the dev cluster."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from hpcrl.core.config import SchedulerConfig
from hpcrl.slurm.backfill.book import SlurmRollouts, rollout_job_counts
from hpcrl.slurm.backfill.give_way import jobs_to_give_way
from hpcrl.slurm.backfill.planner import (
    PlanSettings,
    find_window,
    jobs_fitting,
    no_window_reason,
    plan_rollout_jobs,
    size_rollout_jobs,
)
from hpcrl.slurm.backfill.snapshot import QueueSnapshot
from hpcrl.slurm.queries import NodeState, PartitionState, PendingJob, RunningJob
from hpcrl.slurm.sbatch import Resources

NOW = dt.datetime(2026, 12, 2, 12, 0, 0)


def node(name, gpus_alloc, state="MIXED"):
    return NodeState(name, state, ("cpu", "gpu"), 8, 2, 4, gpus_alloc, 16384, 1024)


def part(name, nodes=("n1", "n2")):
    return PartitionState(name, True, nodes, None, 16, 0, 16, 8, 0, 8)


def pending(job_id, gpus, start_in_s, partition="gpu", nodes=2):
    start = None if start_in_s is None else NOW + dt.timedelta(seconds=start_in_s)
    return PendingJob(job_id, partition, "other", "big", nodes, 2, gpus, 60, start, "Resources", 100)


PARTS = [part("cpu"), part("gpu")]


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
    why = no_window_reason(alone, SchedulerConfig(), 1)
    assert why == "no node of gpu has room for a rollout job (1 GPU, 1 CPU, 4096 MB free)", why


# ------------------------------------------------------------------------------ sizing
CFG = SchedulerConfig(job_overhead_s=20.0, slurm_margin_s=30.0, rollout_drain_s=10.0)
KW = dict(gpus_per_job=1, jobs_free=8, gpus_free=8, unbounded_min=60)


def window(length_s, idle=(("n2", 4),)):
    end = None if length_s is None else NOW + dt.timedelta(seconds=length_s)
    return find_window(
        "gpu",
        [node("n1", 4, "ALLOCATED")] + [node(n, 4 - k) for n, k in idle],
        PARTS,
        [] if end is None else [pending("99", 8, length_s)],
        NOW,
    )


def test_jobs_fit_the_window_in_whole_minutes():
    size = size_rollout_jobs(window(400), CFG, 30.0, **KW)
    # ends 12:06:40, planned by Slurm from 12:06:00: 360 s - 30 s margin = 5 whole minutes; 4 idle
    # GPUs; --time-min one minute less
    assert (size.jobs, size.time_limit_min, size.time_min_min, size.window_s) == (4, 5, 4, 400.0)
    assert size_rollout_jobs(window(None), CFG, 30.0, **KW).time_limit_min == 60  # nothing pending: the role's
    assert size_rollout_jobs(window(80), CFG, 5.0, **KW) is None  # 80 - 30 s margin < one minute
    assert size_rollout_jobs(window(200), CFG, 400.0, **KW) is None  # no episode fits 2 minutes
    assert size_rollout_jobs(window(600, idle=()), CFG, 5.0, **KW) is None  # no idle GPU
    assert size_rollout_jobs(window(600, idle=(("n2", 1),)), CFG, 5.0, **{**KW, "gpus_per_job": 2}) is None


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
    cfg = dataclasses.replace(CFG, slurm_margin_s=5.0, job_overhead_s=0.0, rollout_drain_s=0.0)
    now, end = dt.datetime(2026, 12, 2, *now), dt.datetime(2026, 12, 2, *reservation)
    w = dataclasses.replace(window(600), now=now, end=end)
    size = size_rollout_jobs(w, cfg, 5.0, **KW)
    assert (size.time_limit_min if size else 0) == minutes


# ------------------------------------------------------------------------------ one snapshot, every decision
def snapshot(pending_jobs=(), running=(), nodes=None):
    nodes = nodes or (node("n1", 4, "ALLOCATED"), node("n2", 1))
    return QueueSnapshot(NOW, tuple(nodes), tuple(PARTS), tuple(pending_jobs), tuple(running), 60, 1.0)


SETTINGS = PlanSettings("gpu", 1, 60, CFG, Resources(partition="gpu", gpus_per_node=1, mem_mb=1024))


def test_a_snapshot_gives_the_plan_or_says_why_not():
    snap = snapshot([pending("10", 8, 600), pending("13", 2, 60)])
    d = plan_rollout_jobs(snap, SETTINGS, {}, {"13"}, 30.0, jobs_free=2, gpus_free=8)
    assert d.window.blocked_by == "10" and d.size.jobs == 2 and d.size.time_limit_min == 9  # (600 - 30) // 60
    assert d.key == ["10", (NOW + dt.timedelta(seconds=600)).timestamp(), [["n2", 3]]]
    # Slurm left a job sized to this very window pending: not again until it changes.
    withdrawn = {"rollout-0": {"job_id": "5", "state": "ended", "withdrawn": 1.0, "window_key": d.key}}
    again = plan_rollout_jobs(snap, SETTINGS, withdrawn, {"13", "5"}, 30.0, 2, 8)
    assert again.size is None and "pending in this window (before job 10)" in again.why
    short = plan_rollout_jobs(snapshot([pending("10", 8, 70)]), SETTINGS, {}, set(), 30.0, 2, 8)
    assert short.size is None and "window 70 s before job 10" in short.why and short.why_key[0] == "10"


def _rec(job_id, pending=False, submitted=0.0, gpus=1):
    return {"job_id": job_id, "state": "active", "pending": pending, "submitted": submitted, "gpus": gpus}


def test_give_way_reads_where_ours_run_from_the_snapshot():
    # n2 has 1 idle GPU and 3 of our rollout jobs; another user's 4-GPU job needs them.
    ours = {f"rollout-{i}": _rec(f"r{i}") for i in range(3)}
    running = [RunningJob(f"r{i}", "gpu", "rollout", ("n2",), 1, None) for i in range(3)]
    nodes = (node("n1", 4, "ALLOCATED"), node("n2", 3))
    snap = snapshot([pending("b", 4, 60, nodes=1)], running, nodes)
    assert jobs_to_give_way(snap, ours, own_ids=()) == {"r0": "b", "r1": "b", "r2": "b"}
    assert jobs_to_give_way(snap, ours, own_ids=("b",)) == {}  # the run's own job: no one to give way to
    assert jobs_to_give_way(snap, ours, (), rollout_partition="gpu") == {}  # Slurm plans those below ours
    assert jobs_to_give_way(snapshot([pending("b", 1, 60, nodes=1)], running, nodes), ours, ()) == {}  # fits


class _Cluster:
    def __init__(self, snap):
        self.snap, self.cancelled = snap, []

    def snapshot(self):
        return self.snap

    def job_states(self, ids):
        return {"r0": "RUNNING", "p0": "PENDING"}

    def preempt_time(self, job_id):
        return None

    def cancel(self, ids):
        self.cancelled += ids


def test_one_reap_withdraws_and_gives_way_on_one_snapshot_and_counts_as_the_bench_does():
    running = [RunningJob("r0", "gpu", "rollout", ("n2",), 1, None)]
    idle_reason = PendingJob("p0", "gpu", "me", "rollout", 1, 1, 1, 60, None, "Priority", 0)
    snap = snapshot([pending("b", 2, 30, nodes=1), idle_reason], running, (node("n1", 4), node("n2", 3)))
    cluster = _Cluster(snap)
    rounds = SlurmRollouts(cluster, SETTINGS, withdraw_after_s=6.0)
    jobs = {"rollout-0": _rec("r0", pending=True), "rollout-1": _rec("p0", pending=True, submitted=10.0)}
    jobs["rollout-0"]["window_end"] = 500.0
    assert rounds.reap(jobs, now=16.0) and sorted(cluster.cancelled) == ["p0", "r0"] and rounds.snapshots == 1
    assert jobs["rollout-0"]["started"] == 16.0 and jobs["rollout-0"]["yielded_to"] == "b"
    assert jobs["rollout-1"]["withdrawn"] == 16.0 and jobs["rollout-1"]["state"] == "ended"
    counts = rollout_job_counts(jobs, {"r0": 16.0, "p0": None}, {"r0": 20.0})
    assert counts == {
        "submitted": 2,
        "started": 1,
        "withdrawn": 1,
        "gave_way": 1,
        "preempted": 0,
        "ended_in_window": 1,
    }
    assert rollout_job_counts(jobs, {"r0": 16.0}, {"r0": 501.0})["ended_in_window"] == 0


# ------------------------------------------------------------------------------ give-way at scale
def _yield_by_scanning(pending, idle_by_node, ours_by_node, members, now=None):
    """The plain reading of rollout_jobs_to_yield's rule: every node of the partition looked at
    for every job, in priority order (the oracle for the indexed version)."""
    waiting = ("JobHeld", "Dependency", "BeginTime", "Reservation", "PartitionDown", "PartitionInactive")
    idle = dict(idle_by_node)
    ours = {n: list(js) for n, js in ours_by_node.items()}
    out, held = {}, []
    for _, job in sorted(enumerate(pending), key=lambda ij: (-ij[1].priority, ij[0])):
        if job.nodes < 1 or job.gpus < 1 or job.reason.startswith(waiting):
            continue
        per_node = -(-job.gpus // job.nodes)
        end = None
        if now is not None:
            end = now + dt.timedelta(seconds=job.time_limit_s) if job.time_limit_s is not None else dt.datetime.max
        nodes = [
            n
            for n in members.get(job.partition, ())
            if n in idle and not (end is not None and any(n in ns and s < end for s, ns in held))
        ]
        ready = sorted((n for n in nodes if idle[n] >= per_node), key=lambda n: idle[n])
        could = sorted(
            (n for n in nodes if idle[n] < per_node <= idle[n] + sum(g for _, g in ours.get(n, []))),
            key=lambda n: -idle[n],
        )
        short = max(job.nodes - len(ready), 0)
        if short > len(could):
            if job.expected_start is not None and job.sched_nodes:
                held.append((job.expected_start, frozenset(job.sched_nodes)))
            continue
        for n in could[:short]:
            ours[n].sort(key=lambda jg: jg[1])
            while idle[n] < per_node:
                job_id, gpus = ours[n].pop()
                out[job_id] = job.job_id
                idle[n] += gpus
        for n in ready[: job.nodes - short] + could[:short]:
            idle[n] -= per_node
    return out


@pytest.mark.parametrize("seed", range(40))
def test_indexed_give_way_decides_exactly_like_the_plain_scan(seed):
    import random

    from hpcrl.slurm.backfill.give_way import rollout_jobs_to_yield

    rng = random.Random(seed)
    names = [f"n{i}" for i in range(rng.randint(1, 12))]
    members = {"gpu": tuple(names), "big": tuple(names[: max(1, len(names) // 2)])}
    idle = {n: rng.choice([0, 0, 0, 1, 2, 4]) for n in names}
    ours = {n: [(f"r{n}-{k}", rng.choice([1, 1, 2])) for k in range(rng.randint(0, 3))] for n in names}
    pending = []
    for i in range(rng.randint(0, 40)):
        nodes = rng.choice([1, 1, 1, 2])
        start = NOW + dt.timedelta(seconds=rng.randint(0, 900)) if rng.random() < 0.7 else None
        pending.append(
            PendingJob(
                f"j{i}",
                rng.choice(["gpu", "gpu", "big"]),
                "other",
                "x",
                nodes,
                1,
                nodes * rng.choice([1, 2, 4, 8]),
                rng.choice([60, 600, 3600, None]),
                start,
                rng.choice(["Resources", "Priority", "Priority", "JobHeldUser"]),
                rng.randint(0, 5),
                tuple(rng.sample(names, k=min(len(names), nodes))) if start and rng.random() < 0.8 else (),
            )
        )
    for now in (NOW, None):
        assert rollout_jobs_to_yield(pending, idle, ours, members, now) == _yield_by_scanning(
            pending, idle, ours, members, now
        )
