"""Rollout jobs sized to the windows Slurm's backfill scheduler leaves open (pure decisions).

    d = plan_rollout_jobs(snap, settings, records, exclude, episode_s, jobs_free=2, gpus_free=2)
    d.size                                 # RolloutJobSize (jobs, --time, --time-min) or None (d.why)
    late = jobs_to_withdraw(snap, records, now_s, withdraw_after_s)   # pending too long: withdraw

Slurm starts a lower-priority job ahead of the queue only if it cannot delay the expected start
of any job before it. Idle GPUs are therefore usable until the earliest expected start of a
pending job that could claim them: that is the *window* (`find_window`). A rollout job whose
--time fits the window (minus a margin: Slurm plans at whole bf_resolution steps, considers a
new job at its next pass, and estimates move) is backfilled at once; one with the role's long
limit waits behind the whole queue. A node's idle GPUs count only in whole rollout jobs that
its idle CPUs and free memory hold too.

Rollout jobs are submitted with Slurm's largest --nice, so one still pending holds no
reservation ahead of anyone. A job Slurm has looked at and left pending past
`withdraw_after_s` did not fit after all (the window shrank, another job took the GPUs): it
holds no episodes yet and is withdrawn, and the same window is not tried again until it
changes (`window_key`). Every function here takes a `QueueSnapshot` (snapshot.py) and the
run's record of its rollout jobs (book.py); the live run and the simulator call the same ones.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from hpcrl.core.config import SchedulerConfig
from hpcrl.slurm.backfill.snapshot import QueueSnapshot
from hpcrl.slurm.queries import NodeState, PartitionState, PendingJob
from hpcrl.slurm.sbatch import Resources

__all__ = [
    "ClusterWindow",
    "find_window",
    "jobs_fitting",
    "describe",
    "minutes_that_fit",
    "margin_s",
    "RolloutJobSize",
    "size_rollout_jobs",
    "withdraw_after_s",
    "window_key",
    "no_window_reason",
    "PlanSettings",
    "PlanDecision",
    "plan_rollout_jobs",
    "jobs_to_withdraw",
    "SUBMIT_SLACK_S",
]

# Seconds between reading a window and Slurm's backfill pass seeing our job, besides waiting
# for that pass: the age of the squeue/scontrol answers, sbatch, and the pass's own run time.
# Measured on the dev cluster (bf_interval 1 s): a one-minute job in a 95-s window planned
# with bf_interval + 4 s started 1.0 s after submission.
SUBMIT_SLACK_S = 4.0


@dataclass(frozen=True)
class ClusterWindow:
    partition: str
    now: dt.datetime
    # nodes of the partition with idle GPUs: how many, or with a job shape (`need`) only as many
    # as whole jobs of it fit beside what runs there (its CPUs and memory count too)
    idle_by_node: tuple[tuple[str, int], ...]
    end: dt.datetime | None  # earliest expected start of a pending GPU job there; None: none pending
    blocked_by: str | None  # that job's id
    bf_resolution_s: int = 60  # Slurm's backfill plans in steps of this (SchedulerParameters)
    bf_interval_s: float = 30.0  # ... and runs a pass this often (SchedulerParameters)
    need: str = ""  # the job shape idle_by_node was counted for, for the log ("": GPUs only)

    @property
    def gpus_idle(self) -> int:
        return sum(n for _, n in self.idle_by_node)

    def jobs_that_fit(self, gpus_per_job: int) -> int:
        """Single-node jobs of `gpus_per_job` GPUs that the idle GPUs can hold at once."""
        return sum(n // gpus_per_job for _, n in self.idle_by_node)

    @property
    def length_s(self) -> float:
        return math.inf if self.end is None else max((self.end - self.now).total_seconds(), 0.0)


def find_window(
    partition: str,
    nodes: list[NodeState] | tuple[NodeState, ...],
    partitions: list[PartitionState] | tuple[PartitionState, ...],
    pending: list[PendingJob] | tuple[PendingJob, ...],
    now: dt.datetime,
    exclude: tuple[str, ...] | set[str] | frozenset[str] = (),
    bf_resolution_s: int = 60,
    bf_interval_s: float = 30.0,
    need: Resources | None = None,
    by_start: tuple[PendingJob, ...] | None = None,
) -> ClusterWindow:
    """The backfill window for GPU jobs in `partition` now (pure: tested on captured states).

    A pending GPU job of any partition sharing these nodes ends the window at its expected
    start. One without an estimate yet (Slurm's backfill pass has not planned it) ends it
    now: wait a backfill cycle rather than guess. Jobs in `exclude` (our own) do not count.
    With `need` (one rollout job's request), a node's idle GPUs count only as far as whole jobs
    of that shape fit its idle CPUs and free memory too: an idle GPU on a node whose memory the
    run's own learner holds takes no job, and Slurm would leave one sized to it pending.
    `by_start`: the same jobs sorted by expected start (QueueSnapshot.index), so that the scan
    stops at the first job that ends the window instead of looking at every one.
    """
    by_name = {p.name: p for p in partitions}
    if partition not in by_name:
        raise ValueError(f"partition {partition!r} does not exist; partitions: {', '.join(sorted(by_name))}")
    members = set(by_name[partition].nodes)
    per_job = 1 if need is None else max(need.gpus_per_node, 1)
    excluded = exclude if isinstance(exclude, set | frozenset) else set(exclude)
    idle_by_node = []
    for n in nodes:
        if n.name in members:
            usable = n.gpus_idle if need is None else jobs_fitting(n, need) * per_job
            if usable > 0:
                idle_by_node.append((n.name, usable))
    sharing = {p.name for p in partitions if members.intersection(p.nodes)}
    if by_start is None:
        end, blocked_by = _window_end(pending, sharing, excluded, now)
    else:
        end, blocked_by = _window_end_sorted(pending, by_start, sharing, excluded, now)
    shape = "" if need is None else describe(need)
    return ClusterWindow(partition, now, tuple(idle_by_node), end, blocked_by, bf_resolution_s, bf_interval_s, shape)


def _window_end(pending, sharing, excluded, now) -> tuple[dt.datetime | None, str | None]:
    """The earliest expected start of a GPU job that ends the window (one not planned yet, or
    overdue, ends it now), and that job; the first in `pending`'s order among equals."""
    end, blocked_by = None, None
    for job in pending:
        if job.gpus <= 0 or job.partition not in sharing or job.job_id in excluded:
            continue
        start = now if job.expected_start is None or job.expected_start < now else job.expected_start
        if end is None or start < end:
            end, blocked_by = start, job.job_id
    return end, blocked_by


def _window_end_sorted(pending, by_start, sharing, excluded, now) -> tuple[dt.datetime | None, str | None]:
    """`_window_end` from the jobs sorted by expected start (those without one last): the first
    job that counts is the answer, unless one without an estimate counts too (then, as one
    overdue, the window ends now, and the job is the first such in `pending`'s order)."""

    def counts(job) -> bool:
        return job.gpus > 0 and job.partition in sharing and job.job_id not in excluded

    planned = next((j for j in by_start if j.expected_start is not None and counts(j)), None)
    unplanned = None
    for j in reversed(by_start):  # the unplanned sit at the end: stop at the first planned one
        if j.expected_start is not None:
            break
        if counts(j):
            unplanned = j
            break
    if unplanned is None and (planned is None or planned.expected_start > now):
        return (None, None) if planned is None else (planned.expected_start, planned.job_id)
    first = next(j for j in pending if counts(j) and (j.expected_start is None or j.expected_start <= now))
    return now, first.job_id


def jobs_fitting(node: NodeState, need: Resources) -> int:
    """How many single-node jobs of `need` the node's idle GPUs, idle CPUs and free memory hold
    at once (pure). Where memory is not a consumable resource AllocMem stays 0, so RealMemory
    alone bounds it, as Slurm bounds a job's --mem."""
    counts = [node.cpus_idle // max(need.ntasks_per_node * need.cpus_per_task, 1)]
    if need.gpus_per_node:
        counts.append(node.gpus_idle // need.gpus_per_node)
    if need.mem_mb:
        counts.append(max(node.real_memory_mb - node.alloc_memory_mb, 0) // need.mem_mb)
    return max(min(counts), 0)


def describe(need: Resources) -> str:
    """One job's request as the log says it: '1 GPU, 2 CPUs, 4096 MB'."""
    cpus = need.ntasks_per_node * need.cpus_per_task
    parts = [f"{need.gpus_per_node} GPU{'s' * (need.gpus_per_node != 1)}"] if need.gpus_per_node else []
    parts.append(f"{cpus} CPU{'s' * (cpus != 1)}")
    if need.mem_mb:
        parts.append(f"{need.mem_mb} MB")
    return ", ".join(parts)


def margin_s(sched: SchedulerConfig, window: ClusterWindow) -> float:
    """scheduler.slurm_margin_s, or (0) Slurm's bf_interval plus SUBMIT_SLACK_S: the next
    backfill pass that can start our job comes up to bf_interval after we read the window."""
    return sched.slurm_margin_s or window.bf_interval_s + SUBMIT_SLACK_S


def minutes_that_fit(window: ClusterWindow, margin: float) -> int:
    """The longest whole-minute --time that backfill accepts ahead of the job that ends the window.

    Backfill aligns the blocking job's reservation down to bf_resolution, and considers our
    job at its next pass (up to bf_interval after submission). So a job fits iff now + margin
    + limit <= floor_r(window.end), the margin standing for that delay. This matches all four
    cases measured on the dev cluster (1-minute jobs 119 and 119 s before a reservation started
    at once, 103 and 103 s before, at other offsets to the minute, waited).
    """
    r = window.bf_resolution_s
    end = window.end.timestamp()
    latest_end = end - end % r if r > 0 else end
    return max(int((latest_end - window.now.timestamp() - margin) // 60), 0)


@dataclass(frozen=True)
class RolloutJobSize:
    jobs: int
    gpus_per_job: int
    time_limit_min: int  # --time: the longest limit backfill accepts before the window's end
    time_min_min: int  # --time-min: down to which Slurm may cut it (one minute less, at least one episode)
    window_s: float  # math.inf: no pending GPU job ends the window


def size_rollout_jobs(
    window: ClusterWindow,
    sched: SchedulerConfig,
    episode_s: float,
    *,
    gpus_per_job: int,
    jobs_free: int,
    gpus_free: int,
    unbounded_min: int,
) -> RolloutJobSize | None:
    """Rollout jobs for `window` (pure): None when no job fits (no idle GPUs, caps spent, too short)."""
    gpus_per_job = max(gpus_per_job, 1)
    jobs = min(window.jobs_that_fit(gpus_per_job), jobs_free, gpus_free // gpus_per_job)
    if jobs < 1:
        return None
    limit = unbounded_min if window.end is None else minutes_that_fit(window, margin_s(sched, window))
    need_min = math.ceil((sched.job_overhead_s + episode_s + sched.rollout_drain_s) / 60)
    if limit < need_min:
        return None
    # --time-min one minute (Slurm's bf_resolution step) under --time, never under one episode's
    # worth: Slurm 22.05 grants a job with --time-min exactly that, whatever else fits (measured
    # on the dev cluster, idle or not: --time 3 --time-min 1 ran with a 1-minute limit), so
    # --time-min one episode threw most of each window away; one minute of slack still lets
    # backfill start a job whose window shrank a step since squeue --start was read.
    return RolloutJobSize(jobs, gpus_per_job, limit, max(need_min, limit - 1), window.length_s)


def withdraw_after_s(configured_s: float, bf_interval_s: float) -> float:
    """How long a rollout job may pend before the planner withdraws it (pure): `configured_s`, or
    two of Slurm's backfill passes plus SUBMIT_SLACK_S. Sized to a window, a job that fits starts
    at the first pass that sees it (within bf_interval + SUBMIT_SLACK_S); one more pass covers a
    pass already under way when it was submitted. Dev cluster 6 s; Slurm's default 64 s."""
    if configured_s > 0:
        return configured_s
    return 2 * bf_interval_s + SUBMIT_SLACK_S


def window_key(window: ClusterWindow) -> list:
    """What identifies a window apart from when it is read (pure, JSON-able): the job ending it,
    that job's expected start, and the GPUs free on each node."""
    end = None if window.end is None else window.end.timestamp()
    return [window.blocked_by, end, [list(n) for n in window.idle_by_node]]


def no_window_reason(window: ClusterWindow, sched: SchedulerConfig, gpus_per_job: int) -> str:
    """Why `size_rollout_jobs` found no room in `window` (pure; for the log)."""
    if window.jobs_that_fit(gpus_per_job) < 1:
        if window.need:
            return f"no node of {window.partition} has room for a rollout job ({window.need} free)"
        return f"no node of {window.partition} has {gpus_per_job} idle GPU(s)"
    if window.end is None:
        return "the rollout caps are spent"
    at = window.end.strftime("%H:%M:%S")
    if window.length_s <= 0:
        return f"pending job {window.blocked_by} may start now (or Slurm has not planned it yet)"
    margin = margin_s(sched, window)
    return (
        f"window {window.length_s:.0f} s before job {window.blocked_by} (expected {at}, planned by Slurm in "
        f"{window.bf_resolution_s} s steps): {minutes_that_fit(window, margin)} whole minutes after a "
        f"{margin:g}-s margin, too short"
    )


@dataclass(frozen=True)
class PlanSettings:
    """What the planner takes of the run's config: where rollout jobs go and what each asks for."""

    partition: str  # slurm.generator.partition: whose windows are read
    gpus_per_job: int  # slurm.generator.gpus_per_node (at least 1)
    unbounded_min: int  # slurm.generator.time_min: --time when no pending GPU job ends the window
    sched: SchedulerConfig
    need: Resources | None = None  # one rollout job's request: windows count whole jobs of it


@dataclass(frozen=True)
class PlanDecision:
    """What to submit into the window of a snapshot, or why nothing (for the log, once per `why_key`)."""

    window: ClusterWindow
    key: list  # window_key(window)
    size: RolloutJobSize | None
    why: str = ""
    why_key: object = None


def plan_rollout_jobs(
    snap: QueueSnapshot,
    settings: PlanSettings,
    records: dict,
    exclude,
    episode_s: float,
    jobs_free: int,
    gpus_free: int,
) -> PlanDecision:
    """Rollout jobs for the window `snap` shows (pure). `records`: every rollout job the run ever
    submitted (book.py), so that a window Slurm left one pending in is not tried again;
    `exclude`: job ids that end no window (the run's own and every rollout job)."""
    window = find_window(
        settings.partition,
        snap.nodes,
        snap.partitions,
        snap.pending,
        snap.now,
        exclude,
        snap.bf_resolution_s,
        snap.bf_interval_s,
        settings.need,
        snap.index.by_start,
    )
    key = window_key(window)
    if any(r.get("withdrawn") and r.get("window_key") == key for r in records.values()):
        why = f"Slurm left a rollout job pending in this window (before job {window.blocked_by})"
        return PlanDecision(window, key, None, why, key)
    size = size_rollout_jobs(
        window,
        settings.sched,
        episode_s,
        gpus_per_job=settings.gpus_per_job,
        jobs_free=jobs_free,
        gpus_free=gpus_free,
        unbounded_min=settings.unbounded_min,
    )
    if size is None:
        # keyed by what ends the window, not its shrinking length: one log line per window
        why = no_window_reason(window, settings.sched, settings.gpus_per_job)
        return PlanDecision(window, key, None, why, (window.blocked_by, window.end))
    return PlanDecision(window, key, size)


def jobs_to_withdraw(snap: QueueSnapshot, records: dict, now_s: float, after_s: float) -> dict[str, str]:
    """{job id: Slurm's reason} of the run's rollout jobs to withdraw (pure): still pending
    `after_s` after submission, and looked at by Slurm (its reason is no longer None) on `snap`.

    Sized to a window that Slurm's backfill would have started it in at its next pass, one
    still pending did not fit after all; it holds no episodes yet, and while it pends the
    planner submits nothing. A controller too busy to have looked at it yet is waited for."""
    late = {
        r["job_id"]
        for r in records.values()
        if r["state"] == "active" and r.get("pending") and now_s - r["submitted"] >= after_s
    }
    by_id = snap.index.by_id
    seen = (by_id[j] for j in late if j in by_id)
    return {j.job_id: j.reason for j in seen if j.reason not in ("", "None")}
