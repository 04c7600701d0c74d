"""The backfill planner's pure decisions (slurm/backfill/, used by jobs/rollout_plan.py and
jobs/rollout.py): when a rollout job leases and ends, whether the coordinator has work for one
more generator, how rollout jobs are sized to a Slurm backfill window, which pending ones are
withdrawn, and the --time/--time-min they are submitted with."""

from __future__ import annotations

import datetime as dt
import math

from hpcrl.core.config import SchedulerConfig, load_config
from hpcrl.jobs.launch import slurm_parameters
from hpcrl.jobs.rollout_plan import RolloutPlanner, coordinator_has_work, rollout_job_parameters, rollout_summary
from hpcrl.jobs.rollout_slurm import SlurmBackend
from hpcrl.slurm.backfill.give_way import give_way_interval_s, overdue
from hpcrl.slurm.backfill.lending import episodes_to_take, may_lease, must_end
from hpcrl.slurm.backfill.planner import (
    ClusterWindow,
    RolloutJobSize,
    margin_s,
    minutes_that_fit,
    no_window_reason,
    size_rollout_jobs,
    withdraw_after_s,
)
from hpcrl.slurm.backfill.snapshot import QueueSnapshot, backfill_parameters
from hpcrl.slurm.preempt import preemption_problem
from hpcrl.slurm.queries import PartitionState

NOW = dt.datetime(2026, 1, 1, 12, 0, 0)


def window(end_s: float | None, idle=(("n1", 2), ("n2", 1)), bf_resolution_s: int = 60) -> ClusterWindow:
    end = None if end_s is None else NOW + dt.timedelta(seconds=end_s)
    return ClusterWindow("gpu", NOW, tuple(idle), end, None if end is None else "77", bf_resolution_s)


def test_a_rollout_job_leases_while_one_more_episode_fits_before_its_drain():
    assert may_lease(time_left_s=100, episode_s=30, drain_s=10)
    assert not may_lease(time_left_s=40, episode_s=30, drain_s=10)  # exactly one episode + drain: no
    assert not must_end(time_left_s=40, drain_s=10, leasing=False, open_episodes=3)  # in flight: finish them
    assert must_end(time_left_s=40, drain_s=10, leasing=False, open_episodes=0)  # nothing left to do
    assert not must_end(time_left_s=40, drain_s=10, leasing=True, open_episodes=0)  # still leasing
    assert must_end(time_left_s=10, drain_s=10, leasing=True, open_episodes=5)  # drain: hand back


def test_a_generator_lends_rows_only_while_episodes_wait_on_environments():
    assert episodes_to_take(cap=8, open_=0, waiting=0, lend=4) == 8  # fill the batch
    assert episodes_to_take(cap=8, open_=8, waiting=0, lend=4) == 0  # every row decodes
    assert episodes_to_take(cap=8, open_=8, waiting=3, lend=4) == 3  # 3 rows idle: 3 more
    assert episodes_to_take(cap=8, open_=11, waiting=6, lend=4) == 1  # at most cap + lend open
    assert episodes_to_take(cap=8, open_=8, waiting=3, lend=0) == 0  # lending off
    assert episodes_to_take(cap=8, open_=12, waiting=0, lend=4) == 0  # never negative


def test_rollout_jobs_only_when_flow_control_has_room_and_weights_exist():
    running = {"state": "running", "learner": {"version": 3, "trained_groups": 60, "dropped_groups": 4}}
    assert coordinator_has_work({**running, "groups_issued": 100, "queued": 0}, max_ahead_groups=64)  # 36 out
    assert not coordinator_has_work({**running, "groups_issued": 128, "queued": 0}, max_ahead_groups=64)  # full
    assert coordinator_has_work({**running, "groups_issued": 128, "queued": 5}, max_ahead_groups=64)  # re-issues
    assert not coordinator_has_work({**running, "state": "stopping", "groups_issued": 0}, 64)
    assert not coordinator_has_work({"state": "running", "learner": {}, "groups_issued": 0}, 64)  # no weights yet
    assert not coordinator_has_work(None, 64)


def test_submit_says_whether_rollout_jobs_will_run_and_which_caps_to_set():
    cfg = load_config(None, ["executor=slurm"])
    assert rollout_summary(cfg) == (
        "rollout jobs: none (scheduler.max_rollout_jobs and max_rollout_gpus are 0); set scheduler.max_rollout_jobs "
        "and scheduler.max_rollout_gpus above 0 to run rollout jobs in the partition's idle GPUs"
    )
    one = load_config(None, ["executor=slurm", "scheduler.max_rollout_jobs=2"])
    assert "(scheduler.max_rollout_gpus is 0)" in rollout_summary(one)
    on = load_config(None, ["executor=slurm", "scheduler.max_rollout_jobs=2", "scheduler.max_rollout_gpus=3"])
    assert rollout_summary(on).startswith("rollout jobs: up to 2 (3 GPUs) in backfill windows of gpu,")
    off = load_config(None, ["executor=slurm", "scheduler.policy=async", "scheduler.max_rollout_jobs=2"])
    assert rollout_summary(off) == "rollout jobs: none (scheduler.policy is async)"


def test_rollout_jobs_are_sized_to_the_backfill_window_and_the_caps():
    s = SchedulerConfig(job_overhead_s=20, slurm_margin_s=30, rollout_drain_s=10)
    kw = dict(gpus_per_job=1, jobs_free=4, gpus_free=4, unbounded_min=60)
    # A pending GPU job expected in 10 min: backfill accepts jobs ending by then minus the margin.
    size = size_rollout_jobs(window(600), s, episode_s=30, **kw)
    assert (size.jobs, size.time_limit_min, size.time_min_min) == (3, 9, 8)  # 3 idle GPUs; (600-30)//60
    assert size.window_s == 600
    # The caps: jobs, then GPUs (2 GPUs per job on n1 only).
    assert size_rollout_jobs(window(600), s, 30, **{**kw, "jobs_free": 1}).jobs == 1
    assert size_rollout_jobs(window(600), s, 30, **{**kw, "gpus_per_job": 2}).jobs == 1
    assert size_rollout_jobs(window(600), s, 30, **{**kw, "gpus_free": 1, "gpus_per_job": 2}) is None
    # An episode of 5 min does not fit a 5-minute window with overhead and drain; 2 min does, --time-min 3.
    assert size_rollout_jobs(window(300), s, episode_s=300, **kw) is None
    assert size_rollout_jobs(window(300), s, episode_s=120, **kw).time_min_min == 3
    # No pending GPU job: the generator role's limit. No idle GPU: nothing.
    assert size_rollout_jobs(window(None), s, 30, **kw).time_limit_min == 60
    assert math.isinf(size_rollout_jobs(window(None), s, 30, **kw).window_s)
    assert size_rollout_jobs(window(600, idle=()), s, 30, **kw) is None


def test_rollout_jobs_go_through_the_generator_roles_slurm_options_with_time_min():
    cfg = load_config(None, ["slurm.generator.partition=gpu", "slurm.generator.gpus_per_node=1"])
    fixed = slurm_parameters(cfg.slurm, "generator", "g")
    assert fixed["time"] == cfg.slurm.generator.time_min and "time_min" not in fixed.get("additional_parameters", {})
    p = slurm_parameters(cfg.slurm, "generator", "r", time_limit_min=9, shrink_to_min=2)
    assert p["time"] == 9 and p["additional_parameters"]["time_min"] == "2"
    assert p["partition"] == "gpu" and p["gpus_per_node"] == 1
    assert slurm_parameters(cfg.slurm, "generator", "r", 9, 8, partition="scavenger")["partition"] == "scavenger"


def test_a_rollout_job_is_submitted_never_requeued_and_last_in_priority(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    size = RolloutJobSize(jobs=1, gpus_per_job=1, time_limit_min=9, time_min_min=8, window_s=560.0)
    cfg = load_config(None, ["slurm.generator.partition=gpu", "scheduler.rollout_drain_s=5"])
    p = rollout_job_parameters(cfg, "hpcrl-run-rollout-0", size)
    assert (p["time"], p["partition"], p["signal_delay_s"]) == (9, "gpu", 5)
    sbatch = _make_sbatch_string(command="true", folder=tmp_path, **p).splitlines()
    for line in ("--time=9", "--time-min=8", "--no-requeue", "--nice=2147483645", "--job-name=hpcrl-run-rollout-0"):
        assert f"#SBATCH {line}" in sbatch, (line, sbatch)
    off = load_config(None, ["scheduler.rollout_nice=0", "scheduler.rollout_partition=scavenger"])
    p = rollout_job_parameters(off, "r", size)
    assert "nice" not in p["additional_parameters"] and p["partition"] == "scavenger"


def _part(name: str, tier: int, mode: str, nodes=("n1", "n2")) -> PartitionState:
    return PartitionState(name, True, nodes, None, 16, 0, 16, 8, 0, 8, tier, mode, 5)


def test_a_rollout_partition_must_be_preemptible_by_the_gpu_partition():
    prio = {"PreemptType": "preempt/partition_prio"}
    parts = [_part("gpu", 1, "REQUEUE"), _part("scavenger", 0, "CANCEL")]
    assert preemption_problem("scavenger", "gpu", parts, prio) is None
    assert preemption_problem("scavenger", "gpu", [parts[0], _part("scavenger", 0, "REQUEUE")], prio) is None
    # What is wrong, and what to set, in one line.
    cases = {
        "does not exist": ("nope", parts, prio),
        "is slurm.generator.partition": ("gpu", parts, prio),
        "PreemptType is preempt/none": ("scavenger", parts, {}),
        "PriorityTier=1, not below": ("scavenger", [parts[0], _part("scavenger", 1, "CANCEL")], prio),
        "nodes n3 are not in": ("scavenger", [parts[0], _part("scavenger", 0, "CANCEL", ("n2", "n3"))], prio),
        "PreemptMode=OFF": ("scavenger", [parts[0], _part("scavenger", 0, "OFF")], prio),
        "PreemptMode=SUSPEND,GANG": ("scavenger", [parts[0], _part("scavenger", 0, "SUSPEND,GANG")], prio),
    }
    for why, (name, ps, conf) in cases.items():
        problem = preemption_problem(name, "gpu", ps, conf)
        assert problem and why in problem and "scheduler.rollout_partition" in problem, (why, problem)
        assert "\n" not in problem


def test_in_a_preemptible_partition_the_planner_gives_way_only_after_slurm_did_not():
    # No rollout partition: a blocking rollout job gives way at the first poll that sees it.
    assert overdue({"r0": "b"}, {}, now=100.0, after_s=0.0) == ({"r0": 100.0}, {"r0": "b"})
    # With one, Slurm preempts it first; the planner cancels it only once it blocked for after_s.
    since, give = overdue({"r0": "b", "r1": "b"}, {}, now=100.0, after_s=60.0)
    assert since == {"r0": 100.0, "r1": 100.0} and give == {}
    since, give = overdue({"r0": "b"}, since, now=159.0, after_s=60.0)  # r1 was preempted: forgotten
    assert since == {"r0": 100.0} and give == {}
    assert overdue({"r0": "c", "r1": "b"}, since, now=160.0, after_s=60.0) == ({"r0": 100.0, "r1": 160.0}, {"r0": "c"})


def test_give_way_is_watched_within_a_quarter_of_slurms_backfill_interval():
    assert give_way_interval_s(0.0, {"bf_interval": "1", "bf_continue": ""}) == 0.25
    assert give_way_interval_s(0.0, {"bf_interval": "60"}) == 15.0
    assert give_way_interval_s(0.0, {}) == 7.5  # Slurm's default bf_interval, 30 s
    assert give_way_interval_s(0.0, {"bf_interval": "0.4"}) == 0.25  # never a busy loop on squeue
    assert give_way_interval_s(2.0, {"bf_interval": "1"}) == 2.0  # configured: as asked


def test_the_margin_is_one_backfill_pass_plus_slack_unless_set():
    # 70 s before a job expected at 12:02:00 (a whole minute: bf_resolution does not cut it).
    def w(bf_interval_s):
        now = NOW + dt.timedelta(seconds=50)
        return ClusterWindow("gpu", now, (("n1", 1),), NOW + dt.timedelta(seconds=120), "77", 60, bf_interval_s)

    derived = SchedulerConfig()  # slurm_margin_s 0: bf_interval + 4 s
    assert margin_s(derived, w(1)) == 5.0 and margin_s(derived, w(30)) == 34.0
    assert minutes_that_fit(w(1), margin_s(derived, w(1))) == 1  # dev cluster: 70 - 5 s hold one minute
    assert minutes_that_fit(w(30), margin_s(derived, w(30))) == 0  # Slurm's default pass: 70 - 34 s do not
    fixed = SchedulerConfig(slurm_margin_s=20)
    assert margin_s(fixed, w(1)) == 20 and minutes_that_fit(w(1), 20) == 0  # as configured
    assert "after a 5-s margin" in no_window_reason(w(1), SchedulerConfig(), 1).replace("1 whole", "")
    # SchedulerParameters as scontrol prints them; Slurm's defaults where absent or unreadable
    assert backfill_parameters({"bf_interval": "1", "bf_resolution": "60", "bf_continue": ""}) == (60, 1.0)
    assert backfill_parameters({}) == (60, 30.0)
    assert backfill_parameters({"bf_interval": "x", "bf_resolution": "y"}) == (60, 30.0)


def test_a_rollout_job_pending_past_two_backfill_passes_is_withdrawn():
    assert withdraw_after_s(0.0, 1.0) == 6.0  # the dev cluster
    assert withdraw_after_s(0.0, 30.0) == 64.0  # Slurm's default bf_interval, 30 s
    assert withdraw_after_s(15.0, 1.0) == 15.0  # configured: as asked


class _Cluster:
    """A controller that answers with a fixed snapshot and records what it is told to cancel."""

    def __init__(self, pending=(), running=()):
        self.pending, self.running, self.cancelled = tuple(pending), tuple(running), []

    def snapshot(self):
        return QueueSnapshot(NOW, (), (), self.pending, self.running, 60, 1.0)

    def job_states(self, ids):
        return {j: "PENDING" for j in ids}

    def preempt_time(self, job_id):
        return None

    def cancel(self, ids):
        self.cancelled.extend(ids)


def test_withdrawn_pending_jobs_end_and_let_the_planner_size_again(tmp_path):
    from hpcrl.slurm import queries

    reasons = {"41": "Resources", "42": "Priority", "44": "None"}  # squeue's reason; None: not looked at yet
    cluster = _Cluster(queries.PendingJob(j, "gpu", "me", "r", 1, 1, 1, 60, None, r, 1, ()) for j, r in reasons.items())
    backend = SlurmBackend(None, lambda: (), withdraw_after_s=6.0, cluster=cluster)
    p = RolloutPlanner(load_config(None, []), tmp_path, None, backend)
    rounds, jobs = backend.rounds(p), p.record["jobs"]
    jobs["rollout-0"] = {"job_id": "41", "state": "active", "gpus": 1, "pending": True, "submitted": 100.0}
    jobs["rollout-1"] = {"job_id": "42", "state": "active", "gpus": 1, "pending": True, "submitted": 103.0}
    jobs["rollout-2"] = {"job_id": "43", "state": "active", "gpus": 1, "pending": False, "submitted": 90.0}
    assert not rounds.withdraw(jobs, 105.9, cluster.snapshot()) and cluster.cancelled == []  # none pends 6 s yet
    assert rounds.withdraw(jobs, 106.0, cluster.snapshot()) and cluster.cancelled == ["41"]  # only the late one
    assert jobs["rollout-0"]["state"] == "ended" and jobs["rollout-0"]["withdrawn"] == 106.0
    assert jobs["rollout-1"]["state"] == jobs["rollout-2"]["state"] == "active"  # running: give-way's business
    assert p.free() == (p.sched.max_rollout_jobs - 2, p.sched.max_rollout_gpus - 2)  # its GPU counts free again
    # A controller that has not looked at a job yet (reason None) is waited for, however long.
    jobs["rollout-3"] = {"job_id": "44", "state": "active", "gpus": 1, "pending": True, "submitted": 0.0}
    assert backend.reap(p, now=109.0) and cluster.cancelled == ["41", "42"]  # reap withdraws too
    assert jobs["rollout-3"]["state"] == "active" and "Priority" in jobs["rollout-1"]["slurm_state"]


class _Backend:
    """Counts full checks; `jobs` is what one squeue of the partitions would show."""

    def __init__(self):
        self.jobs, self.looks, self.checks = (("5", "RUNNING"),), 0, 0

    def signature(self, p):
        self.looks += 1
        return self.jobs

    def reap(self, p, now):
        self.checks += 1
        return False


def test_between_polls_a_full_check_runs_only_when_a_job_started_or_ended(tmp_path):
    cfg = load_config(None, ["scheduler.plan_interval_s=1000"])
    backend = _Backend()
    p = RolloutPlanner(cfg, tmp_path, None, backend, clock=lambda: 0.0)
    p._next_plan = math.inf  # planning is the poll's business, not watch()'s
    p.watch()
    assert backend.looks == 0, "nothing of ours runs: no squeue at all"
    p.record["jobs"]["rollout-0"] = {"state": "active", "gpus": 1, "pending": True}
    p.watch()
    assert backend.looks == 0, "ours still pending: it is in no one's way"
    p.record["jobs"]["rollout-0"]["pending"] = False
    p.watch()
    p.watch()
    assert (backend.looks, backend.checks) == (2, 1)  # first look: a check; the same jobs: none
    backend.jobs = (("5", "COMPLETING"),)  # another job ended: its GPUs may start someone now
    p.watch()
    p.watch()
    assert (backend.looks, backend.checks) == (4, 2)


def test_the_supervisor_watches_for_give_way_between_its_polls(monkeypatch):
    import types

    from hpcrl.jobs import supervise

    clock = [100.0]
    monkeypatch.setattr(supervise.time, "monotonic", lambda: clock[0])

    class Stop:  # time passes only while the supervisor waits
        def __init__(self, set_after: int = 99):
            self.waits, self.set_after = [], set_after

        def wait(self, timeout):
            self.waits.append(round(timeout, 6))
            clock[0] += timeout
            return len(self.waits) > self.set_after

    planner = types.SimpleNamespace(watch_interval_s=0.5, looks=0)
    planner.watch = lambda: setattr(planner, "looks", planner.looks + 1)
    sup = supervise.SupervisorComponent.__new__(supervise.SupervisorComponent)
    sup.poll_s, sup.rollouts = 2.0, planner
    stop = Stop()
    sup.between_polls(stop)
    assert stop.waits == [0.5, 0.5, 0.5, 0.5] and planner.looks == 3  # the 4th wait ends at the next poll
    sup.between_polls(stop := Stop(set_after=1))  # one look, then a stop while waiting: no more
    assert planner.looks == 4 and len(stop.waits) == 2
    sup.rollouts = None  # no rollout jobs configured: one plain wait
    sup.between_polls(stop := Stop())
    assert stop.waits == [2.0]


def test_the_log_says_why_no_rollout_job_was_submitted():
    s = SchedulerConfig(job_overhead_s=20, slurm_margin_s=20, rollout_drain_s=5)
    assert "no node of gpu has 2 idle GPU(s)" in no_window_reason(window(600, idle=(("n1", 1),)), s, 2)
    assert "may start now" in no_window_reason(window(0), s, 1)  # or Slurm has not planned it
    # Expected 119 s from now at :00 + 119 = 12:01:59, floored to 12:01:00 by bf_resolution: 60 s,
    # less the 20-s margin: no whole minute.
    why = no_window_reason(window(119), s, 1)
    assert "window 119 s before job 77" in why and "0 whole minutes" in why and "60 s steps" in why, why


def test_the_reason_is_logged_once_while_it_holds(tmp_path, caplog):
    import logging

    p = RolloutPlanner(load_config(None, []), tmp_path, None, _Backend())
    with caplog.at_level(logging.INFO, logger="hpcrl.rollout"):
        for left_s in (94, 92, 90):  # the same window, shrinking: one line
            p.why_not(f"window {left_s} s before job 826", key=("826", "15:29:21"))
        p.why_not("no node of gpu has 1 idle GPU(s)")
        p.why_not("no node of gpu has 1 idle GPU(s)")
        p.why_not("")  # a job was submitted: the next reason is news again
        p.why_not("no node of gpu has 1 idle GPU(s)")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "rollout: none submitted: window 94 s before job 826",
        "rollout: none submitted: no node of gpu has 1 idle GPU(s)",
        "rollout: none submitted: no node of gpu has 1 idle GPU(s)",
    ], lines
