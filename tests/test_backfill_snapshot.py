"""The live planner and the simulator decide alike on one queue snapshot of the dev Slurm cluster.

A snapshot is read from the live controller (slurm/backfill/live.py). The live path decides on
it as the run's supervisor does (book.SlurmRollouts: withdraw, give way, plan). The simulator's
path rebuilds the same state in its simulated controller (slurm/sim/slurm.py: the nodes, the
running jobs and their planned ends, the pending jobs in priority order, no estimates), lets its
backfill pass plan the pending jobs (expected starts, planned nodes, reasons), and the same
rounds decide on the snapshot it shows. The decisions (which rollout jobs are withdrawn, which
give way to whom, what is submitted with which --time and --time-min) must be the same; neither
side acts on them, so both tick on the state they read. The scenario, with the test's own jobs: one job holds a node's
four GPUs for three minutes, another user's job and one of our rollout jobs share the other
node; a 4-GPU job waits for the first node, a 3-GPU job of lower priority could start at once on
the second with our rollout job's GPU, and one of our rollout jobs was left pending. Jobs of
other sessions may share the cluster: both paths see them alike. Also: the window as the live
planner reads it counts whole rollout jobs by memory too, and a rollout job Slurm left pending is
withdrawn by id.
"""

from __future__ import annotations

import pytest

from hpcrl.core.config import SchedulerConfig
from hpcrl.slurm import queries
from hpcrl.slurm.backfill.book import SlurmRollouts
from hpcrl.slurm.backfill.live import live_window, read_snapshot
from hpcrl.slurm.backfill.planner import PlanSettings, no_window_reason, withdraw_after_s
from hpcrl.slurm.sbatch import Resources, render_script, submit_script, write_script
from hpcrl.slurm.sim.slurm import SimSlurm

from conftest import wait_for

pytestmark = pytest.mark.slurm

NEED = Resources(partition="gpu", gpus_per_node=1, mem_mb=256)


def submit(tmp_path, name: str, gpus: int, time_min: int, *args: str) -> str:
    text = render_script(
        [Resources(partition="gpu", time_min=time_min, nodes=1, gpus_per_node=gpus, mem_mb=256)],
        ["sleep 600"],
        job_name=name,
        output=str(tmp_path / f"{name}-%j.out"),
    )
    return submit_script(write_script(text, tmp_path / f"{name}.sh"), list(args))


class Recorded:
    """A cluster that answers from one snapshot and records what it is told to cancel."""

    def __init__(self, snap):
        self.snap, self.cancelled = snap, []

    def snapshot(self):
        return self.snap

    def job_states(self, ids):
        states = {j.job_id: "PENDING" for j in self.snap.pending} | {j.job_id: "RUNNING" for j in self.snap.running}
        return {j: states[j] for j in ids if j in states}

    def preempt_time(self, job_id):
        return None

    def cancel(self, ids):
        self.cancelled += list(ids)


def decide(cluster, records: dict, bf_interval_s: float, now: float) -> tuple:
    """One supervisor tick of the live planner's rounds: reap (withdraw, give way), then plan."""
    jobs = {name: dict(rec) for name, rec in records.items()}
    settings = PlanSettings("gpu", 1, 60, SchedulerConfig(), NEED)
    rounds = SlurmRollouts(cluster, settings, withdraw_after_s=withdraw_after_s(0.0, bf_interval_s))
    rounds.reap(jobs, now)
    sizes, why = [], []
    rounds.plan(jobs, now, 4, 4, SchedulerConfig().prior_s, lambda size: sizes.append(size) or ("x", "0"), why_not)
    withdrawn = sorted(r["job_id"] for r in jobs.values() if r.get("withdrawn"))
    gave_way = {r["job_id"]: r["yielded_to"] for r in jobs.values() if r.get("yielded_to")}
    return withdrawn, gave_way, [(s.jobs, s.time_limit_min, s.time_min_min) for s in sizes[:1]], why


def why_not(why, key=None):
    pass


def test_the_simulator_and_the_live_planner_decide_alike_on_one_queue_snapshot(slurm_cluster, tmp_path):
    ids = {}
    try:
        ids["holder"] = submit(tmp_path, "snap-holder", 4, 3)
        wait_for(lambda: queries.job_states([ids["holder"]]).get(ids["holder"]) == "RUNNING", 60, what="the holder")
        ids["other"] = submit(tmp_path, "snap-other", 1, 5)
        ids["rollout"] = submit(tmp_path, "snap-rollout", 1, 2, "--nice=2147483645")
        mine = [ids["other"], ids["rollout"]]
        wait_for(lambda: set(queries.job_states(mine).values()) == {"RUNNING"}, 60, what="the second node's jobs")
        ids["big"] = submit(tmp_path, "snap-big", 4, 2)  # waits for the holder's node
        ids["three"] = submit(tmp_path, "snap-three", 3, 1)  # could start at once with our rollout job's GPU
        ids["pending"] = submit(tmp_path, "snap-pending", 4, 2, "--nice=2147483645")  # ours, left pending

        def settled():
            """A snapshot in which Slurm's backfill has planned every pending GPU job."""
            snap = read_snapshot()
            pending = {j.job_id: j for j in snap.pending}
            if not all(j in pending for j in (ids["big"], ids["three"], ids["pending"])):
                return None
            planned = all(j.expected_start is not None and j.reason != "None" for j in snap.pending if j.gpus > 0)
            return snap if planned else None

        snap = wait_for(settled, 60, interval_s=0.5, what="Slurm's backfill to plan the pending jobs")
        records = {
            "rollout-0": {"job_id": ids["rollout"], "state": "active", "gpus": 1, "pending": False, "submitted": 0.0},
            "rollout-1": {"job_id": ids["pending"], "state": "active", "gpus": 1, "pending": True, "submitted": 0.0},
        }
        now = snap.now.timestamp()
        live = decide(Recorded(snap), records, snap.bf_interval_s, now)
        try:
            ctl = SimSlurm.from_snapshot(snap, ours={ids["rollout"], ids["pending"]})
        except NotImplementedError as exc:  # another session's multi-node job is queued
            pytest.skip(f"the simulator cannot rebuild this queue: {exc}")
        ctl.backfill_pass(0.0)
        sim_snap = ctl.snapshot()
        assert sim_snap.now == snap.now
        # The simulated pass plans every pending job where Slurm did, to within its resolution step.
        real = {j.job_id: j for j in snap.pending}
        for j in sim_snap.pending:
            if j.gpus > 0 and j.job_id in real:
                gap = abs((j.expected_start - real[j.job_id].expected_start).total_seconds())
                assert gap < snap.bf_resolution_s, (j.job_id, j.expected_start, real[j.job_id].expected_start)
        sim = decide(Recorded(sim_snap), records, sim_snap.bf_interval_s, now)
        assert sim == live
        foreign = [j for j in (*snap.pending, *snap.running) if j.job_id not in ids.values()]
        if not foreign:  # the cluster was ours alone: every decision was taken, not only agreed on
            withdrawn, gave_way, sizes, _ = live
            assert withdrawn == [ids["pending"]] and gave_way == {ids["rollout"]: ids["three"]}
            assert sizes and sizes[0][0] >= 1
    finally:
        queries.cancel(list(ids.values()))
    wait_for(lambda: not queries.job_states(list(ids.values())), 60, what="the test's jobs to leave the queue")


def test_a_live_window_counts_whole_jobs_and_a_job_slurm_leaves_pending_is_withdrawn(slurm_cluster, tmp_path):
    """The window as the planner reads it from the live controller counts only rollout jobs that
    fit a node's memory too; and a job Slurm has looked at and left pending (here: held) is
    withdrawn by id, once it has pended withdraw_after_s, by the live rounds."""
    from hpcrl.slurm.backfill.live import LiveCluster

    gpus_only = live_window("gpu")
    small = live_window("gpu", need=NEED)
    assert small.gpus_idle <= gpus_only.gpus_idle  # 256 MB and one CPU per GPU: at most every idle GPU
    biggest = max(n.real_memory_mb for n in queries.nodes())
    huge = live_window("gpu", need=Resources(partition="gpu", gpus_per_node=1, mem_mb=biggest + 1))
    assert huge.jobs_that_fit(1) == 0
    assert "has room for a rollout job (1 GPU, 1 CPU" in no_window_reason(huge, SchedulerConfig(), 1)

    held = submit(tmp_path, "hpcrl-rollout-held", 1, 1, "--hold")
    other = submit(tmp_path, "someone-else", 1, 1, "--hold")
    try:
        wait_for(
            lambda: next((j.reason for j in queries.pending_jobs() if j.job_id == held), "None") != "None",
            30,
            what="Slurm's reason for the held job",
        )
        rounds = SlurmRollouts(LiveCluster(), PlanSettings("gpu", 1, 60, SchedulerConfig(), NEED), withdraw_after_s=6.0)
        jobs = {"rollout-0": {"job_id": held, "state": "active", "gpus": 1, "pending": True, "submitted": 0.0}}
        assert rounds.reap(jobs, now=5.0) is False and jobs["rollout-0"]["state"] == "active"  # not 6 s yet
        assert rounds.reap(jobs, now=6.0) is True and jobs["rollout-0"]["withdrawn"] == 6.0
        wait_for(lambda: queries.job_states([held]).get(held) in (None, "CANCELLED"), 30, what="the withdrawal")
        assert queries.job_states([other]).get(other) == "PENDING", "only our own job is withdrawn, by id"
    finally:
        queries.cancel([held, other])
    wait_for(lambda: not queries.job_states([held, other]), 30, what="the held jobs to leave the queue")
