"""Cluster backfill: size rollout jobs to the windows Slurm's backfill scheduler leaves open.

    window = live_window("gpu")                      # sinfo/scontrol + squeue --start
    plan = BackfillPlanner(cfg.scheduler, estimator).plan(window, queue.pending_tasks())
    planner.resources_free_at(plan)                  # sbatch --test-only: a valid request, GPUs idle?
    jobs = RolloutJobs(queue, partition="gpu", log_dir=run_dir / "logs")
    jobs.submit(plan)                                # ... later, periodically:
    reissued = jobs.poll()                           # jobs that ended: their unfinished tasks go back

Slurm starts a lower-priority job ahead of the queue only if it cannot delay the expected
start of any job before it. Idle GPUs are therefore usable until the earliest expected start
of a pending job that could claim them: that is the *window*. A rollout job whose --time fits
the window (minus slurm_margin_s, since Slurm plans at whole minutes and estimates move) is
backfilled at once; a job with the config's long default limit waits behind the whole queue.
--time asks for what the pending work needs; --time-min lets Slurm shrink the limit down to
one task's worth when the window is tighter than we measured. Backfill plans in
bf_resolution steps and rounds a candidate's end up, which `minutes_that_fit` accounts for. The worker inside reads the
limit it actually got (worker.py) and only starts tasks that fit before it.

Task estimates are per-domain quantiles of history (estimates.py). When a job is reclaimed,
preempted or cancelled, `RolloutJobs.poll` re-issues its unfinished tasks; results exist only
for tasks that completed (taskqueue.py).
"""

from __future__ import annotations

import datetime as dt
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from hpcrl.core.config import SchedulerConfig
from hpcrl.slurm import queries
from hpcrl.slurm.backfill.estimates import DurationEstimator
from hpcrl.slurm.backfill.packer import RolloutTask
from hpcrl.slurm.backfill.taskqueue import DirTaskQueue
from hpcrl.slurm.queries import NodeState, PartitionState, PendingJob
from hpcrl.slurm.sbatch import Resources, render_script, submit_script, write_script

__all__ = [
    "ClusterWindow",
    "backfill_parameters",
    "find_window",
    "jobs_fitting",
    "live_window",
    "RolloutJobPlan",
    "BackfillPlanner",
    "RolloutJobs",
    "SubmittedJob",
    "no_window_reason",
]

# Seconds between reading a window and Slurm's backfill pass seeing our job, besides waiting
# for that pass: the age of the squeue/scontrol answers, sbatch, and the pass's own run time.
# Measured on the dev cluster (bf_interval 1 s): a one-minute job in a 95-s window planned
# with bf_interval + 4 s started 1.0 s after submission (docs/benchmarks.md, run 18).
SUBMIT_SLACK_S = 4.0

# States in which a job's processes are gone for good (its claims can be re-issued).
_ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "PREEMPTED",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "SPECIAL_EXIT",
    "REVOKED",
)


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
    nodes: list[NodeState],
    partitions: list[PartitionState],
    pending: list[PendingJob],
    now: dt.datetime,
    exclude: tuple[str, ...] = (),
    bf_resolution_s: int = 60,
    bf_interval_s: float = 30.0,
    need: Resources | None = None,
) -> ClusterWindow:
    """The backfill window for GPU jobs in `partition` now (pure: tested on captured states).

    A pending GPU job of any partition sharing these nodes ends the window at its expected
    start. One without an estimate yet (Slurm's backfill pass has not planned it) ends it
    now: wait a backfill cycle rather than guess. Jobs in `exclude` (our own) do not count.
    With `need` (one rollout job's request), a node's idle GPUs count only as far as whole jobs
    of that shape fit its idle CPUs and free memory too: an idle GPU on a node whose memory the
    run's own learner holds takes no job, and Slurm would leave one sized to it pending.
    """
    by_name = {p.name: p for p in partitions}
    if partition not in by_name:
        raise ValueError(f"partition {partition!r} does not exist; partitions: {', '.join(sorted(by_name))}")
    members = set(by_name[partition].nodes)
    per_job = 1 if need is None else max(need.gpus_per_node, 1)  # as BackfillPlanner/RolloutPlanner count GPUs
    usable = {n.name: (n.gpus_idle if need is None else jobs_fitting(n, need) * per_job) for n in nodes}
    idle = [n for n in nodes if n.name in members and usable[n.name] > 0]
    sharing = {p.name for p in partitions if members & set(p.nodes)}
    end, blocked_by = None, None
    for job in pending:
        if job.job_id in exclude or job.gpus <= 0 or job.partition not in sharing:
            continue
        start = max(job.expected_start or now, now)
        if end is None or start < end:
            end, blocked_by = start, job.job_id
    idle_by_node = tuple((n.name, usable[n.name]) for n in idle)
    shape = "" if need is None else describe(need)
    return ClusterWindow(partition, now, idle_by_node, end, blocked_by, bf_resolution_s, bf_interval_s, shape)


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


def backfill_parameters(params: dict[str, str]) -> tuple[int, float]:
    """(bf_resolution, bf_interval) in seconds from SchedulerParameters (pure); Slurm's
    defaults, 60 and 30 s, where absent or unreadable."""
    try:
        resolution = int(params.get("bf_resolution") or 60)
    except ValueError:
        resolution = 60
    try:
        interval = float(params.get("bf_interval") or 30)
    except ValueError:
        interval = 30.0
    return resolution, interval


def live_window(
    partition: str,
    exclude: tuple[str, ...] = (),
    params: dict[str, str] | None = None,
    need: Resources | None = None,
) -> ClusterWindow:
    """`find_window` on what the controller says now (scontrol show node/partition, squeue --start).

    `params`: the controller's SchedulerParameters when the caller has read them already (they
    change only with a reconfigure); otherwise `scontrol show config` is asked here."""
    resolution, interval = backfill_parameters(queries.scheduler_parameters() if params is None else params)
    now = dt.datetime.now().replace(microsecond=0)
    pending = queries.pending_jobs()
    nodes, parts = queries.nodes(), queries.partitions()
    return find_window(partition, nodes, parts, pending, now, exclude, resolution, interval, need)


@dataclass(frozen=True)
class RolloutJobPlan:
    partition: str
    jobs: int
    gpus_per_job: int
    time_limit_min: int  # --time
    time_min_min: int  # --time-min: Slurm may cut the limit down to this to fit a window
    est_work_s: float  # estimated task time the jobs are expected to get through
    tasks_fitting: int
    window_s: float

    def sbatch_args(self, time_limit_min: int | None = None) -> list[str]:
        return [
            f"--partition={self.partition}",
            f"--gpus-per-node={self.gpus_per_job}",
            "--nodes=1",
            f"--time={time_limit_min or self.time_limit_min}",
        ]


class BackfillPlanner:
    """How many rollout jobs, with which --time and --time-min, for a window and pending tasks."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        estimator: DurationEstimator | None = None,
        *,
        gpus_per_job: int = 1,
        unbounded_time_min: int = 60,
    ):
        if gpus_per_job < 1 or unbounded_time_min < 1:
            raise ValueError("BackfillPlanner: gpus_per_job and unbounded_time_min must be >= 1")
        self.cfg = cfg
        self.estimator = estimator
        self.gpus_per_job = gpus_per_job
        self.unbounded_time_min = unbounded_time_min

    def estimate(self, task: RolloutTask) -> float:
        """The fit_quantile of the task's domain once history knows it, else the task's own estimate."""
        est = self.estimator
        if est is not None and est.samples(task.domain) >= est.min_samples:
            return est.quantile(task.domain, self.cfg.fit_quantile)
        return task.est_s

    def minutes_that_fit(self, window: ClusterWindow) -> int:
        """The longest whole-minute --time that backfill accepts ahead of the job that ends the window.

        Backfill aligns the blocking job's reservation down to bf_resolution, and considers our
        job at its next pass (up to bf_interval after submission) with its end rounded up. So a
        job fits iff now + margin + limit <= floor_r(window.end), the margin standing for that
        delay (`margin_s`). This matches all four cases measured on the dev cluster (1-minute
        jobs 119 and 119 s before a reservation started at once, 103 and 103 s before, at other
        offsets to the minute, waited).
        """
        r = window.bf_resolution_s
        end = window.end.timestamp()
        latest_end = end - end % r if r > 0 else end
        return max(int((latest_end - window.now.timestamp() - self.margin_s(window)) // 60), 0)

    def margin_s(self, window: ClusterWindow) -> float:
        """scheduler.slurm_margin_s, or (0) Slurm's bf_interval plus SUBMIT_SLACK_S: the next
        backfill pass that can start our job comes up to bf_interval after we read the window."""
        return self.cfg.slurm_margin_s or window.bf_interval_s + SUBMIT_SLACK_S

    def plan(self, window: ClusterWindow, tasks: list[RolloutTask]) -> RolloutJobPlan | None:
        """None when no job can be started in the window (no idle GPUs, too short, nothing fits)."""
        overhead = self.cfg.job_overhead_s
        max_jobs = window.jobs_that_fit(self.gpus_per_job)
        if not max_jobs or not tasks:
            return None
        limit_min = self.unbounded_time_min if window.end is None else self.minutes_that_fit(window)
        if limit_min < 1:
            return None
        ests = [self.estimate(t) for t in sorted(tasks, key=lambda t: (t.version, t.task_id))]
        fitting = [e for e in ests if overhead + e <= limit_min * 60]
        if not fitting:
            return None
        total = sum(fitting)
        # Spread the work over the idle GPUs, but give each job at least Slurm's smallest limit
        # (one minute) of work, so start-up overhead does not dominate.
        jobs = max(1, min(max_jobs, len(fitting), math.ceil(total / max(60.0 - overhead, 1.0))))
        # Ask for what the work needs (spread over the jobs), at least one whole task, at most the window.
        need_min = math.ceil((overhead + max(total / jobs, max(fitting))) / 60)
        time_min = min(limit_min, math.ceil((overhead + min(fitting)) / 60))
        time_limit = max(time_min, min(limit_min, need_min))
        return RolloutJobPlan(
            window.partition,
            jobs,
            self.gpus_per_job,
            time_limit,
            time_min,
            min(total, jobs * (time_limit * 60 - overhead)),
            len(fitting),
            window.length_s,
        )

    def resources_free_at(self, plan: RolloutJobPlan) -> dt.datetime:
        """`sbatch --test-only` for one job of the plan: when are its resources free?

        An invalid request (partition, GRES, node shape) fails here with Slurm's message. The
        answer is not the window: measured on Slurm 22.05 (the dev cluster), it ignores the
        reservation backfill holds for a queued job that needs all GPUs (a 60-minute and a
        1-minute job both get "now + 60 s", bf_resolution), yet with another lower-priority
        job queued it can answer half an hour out for a job backfill starts at once. The
        window comes from squeue --start (find_window); this is a cross-check that the GPUs
        exist and are idle. Each question spends a job id.
        """
        return queries.expected_start(plan.sbatch_args()).start


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    time_limit_min: int
    time_min_min: int

    @property
    def owner_prefix(self) -> str:
        return f"slurm-{self.job_id}-r"

    @property
    def owner(self) -> str:
        """The claim name of the job's first run; a requeued run N claims as slurm-<id>-rN."""
        return f"{self.owner_prefix}0"


def _restart(owner: str) -> int:
    return int(owner.rsplit("-r", 1)[1])


class RolloutJobs:
    """Submits rollout jobs that drain a DirTaskQueue, watches them, re-issues what they leave."""

    def __init__(
        self,
        queue: DirTaskQueue,
        *,
        partition: str,
        log_dir: str | Path,
        account: str | None = None,
        qos: str | None = None,
        runner: str = "hpcrl.slurm.backfill.worker:synthetic",
        worker_margin_s: float = 5.0,
        job_name: str = "hpcrl-rollout",
        python: str = sys.executable,
        mem_mb: int = 512,
    ):
        self.queue = queue
        self.partition = partition
        self.log_dir = Path(log_dir)
        self.account, self.qos = account, qos
        self.runner = runner
        self.worker_margin_s = worker_margin_s
        self.job_name = job_name
        self.python = python
        self.mem_mb = mem_mb
        self.active: dict[str, SubmittedJob] = {}
        self._ran: set[str] = set()  # jobs seen running (a requeued one pends again with stale claims)

    def submit(self, plan: RolloutJobPlan) -> list[SubmittedJob]:
        out = []
        for _ in range(plan.jobs):
            out.append(self.submit_one(plan.time_limit_min, plan.time_min_min, plan.gpus_per_job))
        return out

    def submit_one(self, time_limit_min: int, time_min_min: int | None = None, gpus: int = 1) -> SubmittedJob:
        extra = {"time_min": str(time_min_min)} if time_min_min else {}
        res = Resources(
            partition=self.partition,
            time_min=time_limit_min,
            gpus_per_node=gpus,
            cpus_per_task=1,
            mem_mb=self.mem_mb,
            account=self.account,
            qos=self.qos,
            extra=extra,
        )
        # Each run of the job claims under its own name, so a requeued run's claims are never
        # mistaken for the (killed) previous run's.
        body = [
            f"exec {self.python} -m hpcrl.slurm.backfill.worker --queue {self.queue.root} "
            f"--owner slurm-$SLURM_JOB_ID-r${{SLURM_RESTART_COUNT:-0}} --runner {self.runner} "
            f"--margin-s {self.worker_margin_s:g}"
        ]
        text = render_script(
            [res],
            body,
            job_name=self.job_name,
            output=str(self.log_dir / "rollout-%j.out"),
            header_comment="hpcrl rollout job: drains the task queue until its time limit",
        )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        script = write_script(text, self.log_dir / f"{self.job_name}.sh")
        job_id = submit_script(script)
        job = SubmittedJob(job_id, time_limit_min, time_min_min or time_limit_min)
        self.active[job_id] = job
        return job

    def poll(self) -> list[int]:
        """Re-issue the unfinished tasks of runs that are gone; returns their ids.

        A job that left the queue (any end state) gives back everything it claimed. A job that
        was preempted or requeued keeps its id: when it pends again, or when a newer run of it
        has started claiming (the restart count in the claim name), the older runs' claims
        are given back.
        """
        if not self.active:
            return []  # (squeue -j with no ids would list every job)
        states = {r["job_id"]: r["state"] for r in queries.queue(job_ids=tuple(self.active))}
        reissued = []
        for job_id, job in list(self.active.items()):
            state = states.get(job_id)
            owners = sorted(self.queue.owners(job.owner_prefix), key=_restart)
            if state is None or state in _ENDED:
                gone = owners
                del self.active[job_id]
            elif state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED"):
                self._ran.add(job_id)
                gone = owners[:-1]  # only the newest run can still be working
            elif job_id in self._ran:  # pending again after a requeue: no run of it is alive
                gone = owners
                self._ran.discard(job_id)
            else:
                continue
            for owner in gone:
                reissued += self.queue.release(owner)
        return reissued

    def cancel(self, job_ids: list[str] | None = None) -> None:
        """Cancel our rollout jobs (all of them by default) by id; never anyone else's."""
        ids = [j for j in (job_ids if job_ids is not None else list(self.active)) if j in self.active]
        queries.cancel(ids)


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
    fit = BackfillPlanner(sched).minutes_that_fit(window)
    return (
        f"window {window.length_s:.0f} s before job {window.blocked_by} (expected {at}, planned by Slurm in "
        f"{window.bf_resolution_s} s steps): {fit} whole minutes after a {BackfillPlanner(sched).margin_s(window):g}-s "
        "margin, too short"
    )
