"""A Slurm run's rollout jobs (the backend of jobs/rollout_plan.py's `RolloutPlanner`).

    size = size_rollout_jobs(window, sched, episode_s, gpus_per_job=1, jobs_free=2, gpus_free=2, unbounded_min=60)
    backend = SlurmBackend(executor_factory, own_job_ids, yield_after_s, params, withdraw_after_s, need)
    backend.plan(planner, now, jobs_free, gpus_free)   # size jobs to live_window and submit them
    backend.reap(planner, now)                         # started / ended; withdraw; give way
    backend.stop_all(planner)                          # the run is over: scancel, by id

Windows come from `squeue --start` (slurm/backfill/planner.py `live_window`), counted in whole
rollout jobs of the generator role's shape (GPUs, CPUs, memory). A job Slurm looked at and left
pending past `withdraw_after_s` is withdrawn, and that window is not tried again until it
changes. A running one that keeps another user's pending job from starting is cancelled
(jobs/give_way.py), at once or, in a preemptible rollout partition, after `yield_after_s`.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from dataclasses import dataclass

from hpcrl.core.config import SchedulerConfig
from hpcrl.jobs.give_way import overdue, rollout_jobs_to_yield
from hpcrl.slurm.backfill.planner import (
    SUBMIT_SLACK_S,
    BackfillPlanner,
    ClusterWindow,
    backfill_parameters,
    no_window_reason,
)

__all__ = ["RolloutJobSize", "size_rollout_jobs", "SlurmBackend", "window_key", "withdraw_after_s"]

log = logging.getLogger("hpcrl.rollout")


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
    limit = unbounded_min if window.end is None else BackfillPlanner(sched).minutes_that_fit(window)
    need_min = math.ceil((sched.job_overhead_s + episode_s + sched.rollout_drain_s) / 60)
    if limit < need_min:
        return None
    # --time-min one minute (Slurm's bf_resolution step) under --time, never under one episode's
    # worth: Slurm 22.05 grants a job with --time-min exactly that, whatever else fits (measured
    # on the dev cluster, idle or not: --time 3 --time-min 1 ran with a 1-minute limit), so
    # --time-min one episode threw most of each window away; one minute of slack still lets
    # backfill start a job whose window shrank a step since squeue --start was read.
    return RolloutJobSize(jobs, gpus_per_job, limit, max(need_min, limit - 1), window.length_s)


def withdraw_after_s(configured_s: float, scheduler_parameters: dict[str, str]) -> float:
    """How long a rollout job may pend before the planner withdraws it (pure): `configured_s`, or
    two of Slurm's backfill passes plus SUBMIT_SLACK_S. Sized to a window, a job that fits starts
    at the first pass that sees it (within bf_interval + SUBMIT_SLACK_S); one more pass covers a
    pass already under way when it was submitted. Dev cluster 6 s; Slurm's default 64 s."""
    if configured_s > 0:
        return configured_s
    return 2 * backfill_parameters(scheduler_parameters)[1] + SUBMIT_SLACK_S


def window_key(window: ClusterWindow) -> list:
    """What identifies a window apart from when it is read (pure, JSON-able): the job ending it,
    that job's expected start, and the GPUs free on each node."""
    end = None if window.end is None else window.end.timestamp()
    return [window.blocked_by, end, [list(n) for n in window.idle_by_node]]


class SlurmBackend:
    """Windows from squeue --start (live_window); rollout jobs through submitit's SlurmExecutor.
    Each method's `p` is the run's RolloutPlanner (jobs/rollout_plan.py): its record and caps."""

    def __init__(
        self,
        executor_factory,
        own_job_ids,
        yield_after_s: float = 0.0,
        params: dict[str, str] | None = None,
        withdraw_after_s: float = math.inf,
        need=None,
    ):
        self.executor_factory = executor_factory  # (name, RolloutJobSize) -> a submitit executor
        self.own_job_ids = own_job_ids  # () -> the run's job ids (they end no window)
        self.yield_after_s = yield_after_s  # > 0: Slurm preempts them; give way only if it has not by then
        self.blocking: dict[str, float] = {}  # rollout job id -> since when it blocks a pending job
        self.params = params  # the controller's SchedulerParameters, read once (None: ask each plan)
        self.withdraw_after_s = withdraw_after_s  # a rollout job pending this long is withdrawn
        self.need = need  # one rollout job's request (slurm/sbatch.Resources): windows count whole jobs of it

    def plan(self, p, now: float, jobs_free: int, gpus_free: int) -> bool:
        from hpcrl.slurm.backfill.planner import live_window

        if any(j.get("pending") for j in p.active().values()):
            p.why_not("a rollout job is still pending")
            return False  # one not started yet: Slurm has not taken it, a new window would be guessed
        # every job the run ever submitted: a withdrawn one may linger in squeue a moment
        own = tuple(self.own_job_ids()) + tuple(j["job_id"] for j in p.record["jobs"].values())
        window = live_window(p.cfg.slurm.generator.partition, exclude=own, params=self.params, need=self.need)
        key = window_key(window)
        if any(r.get("withdrawn") and r.get("window_key") == key for r in p.record["jobs"].values()):
            # Slurm left a job sized to this very window pending: it would again, until it changes.
            p.why_not(f"Slurm left a rollout job pending in this window (before job {window.blocked_by})", key=key)
            return False
        size = size_rollout_jobs(
            window,
            p.sched,
            p.episode_s(),
            gpus_per_job=p.gpus_per_job,
            jobs_free=jobs_free,
            gpus_free=gpus_free,
            unbounded_min=p.cfg.slurm.generator.time_min,
        )
        if size is None:
            # keyed by what ends the window, not its shrinking length: one line per window
            p.why_not(no_window_reason(window, p.sched, p.gpus_per_job), key=(window.blocked_by, window.end))
            return False
        p.why_not("")
        for _ in range(size.jobs):
            name, comp = p.new_component(None)
            job = self.executor_factory(name, size).submit(comp)
            p.record["jobs"][name] = {
                "job_id": job.job_id,
                "gpus": size.gpus_per_job,
                "time_limit_min": size.time_limit_min,
                "time_min_min": size.time_min_min,
                "window_s": None if math.isinf(size.window_s) else size.window_s,
                "window_end": None if window.end is None else window.end.timestamp(),
                "blocked_by": window.blocked_by,
                "window_key": key,
                "submitted": now,
                "pending": True,
                "state": "active",
            }
            log.info(
                "rollout: %s as job %s, --time %d --time-min %d (window %s s, before job %s)",
                name,
                job.job_id,
                size.time_limit_min,
                size.time_min_min,
                "inf" if math.isinf(size.window_s) else f"{size.window_s:.0f}",
                window.blocked_by,
            )
        return True

    def signature(self, p) -> tuple:
        from hpcrl.slurm import queries

        parts = {p.cfg.slurm.generator.partition, p.sched.rollout_partition} - {""}
        return queries.partition_jobs(sorted(parts))

    def reap(self, p, now: float) -> bool:
        from hpcrl.slurm import queries

        act = p.active()
        if not act:
            return False
        # job_states raises when squeue fails: a controller hiccup must not look like every
        # rollout job ended (the caps would be counted free and more jobs submitted).
        states = queries.job_states([j["job_id"] for j in act.values()])
        changed = False
        for rec in act.values():
            state = states.get(rec["job_id"])
            if state is None or state in _GONE:
                rec.update(state="ended", ended=now, slurm_state=state or "left the queue")
                # One that exits within its GraceTime ends COMPLETED: only the controller's
                # PreemptTime (kept MinJobAge after the end) says that Slurm preempted it.
                info = queries.show_job(rec["job_id"]) or {}
                if info.get("PreemptTime", "None") not in ("None", "Unknown", ""):
                    rec["preempted"] = info["PreemptTime"]
                changed = True
            elif rec.get("pending") and state == "RUNNING":
                rec.update(pending=False, started=now)
                changed = True
        return self.withdraw(p, now) | self.give_way(p, now) | changed

    def withdraw(self, p, now: float) -> bool:
        """Cancel the rollout jobs still pending `withdraw_after_s` after submission that Slurm has
        looked at (squeue's reason is no longer None) and left pending.

        Sized to a window that Slurm's backfill would have started it in at its next pass, one
        still pending did not fit after all (the window shrank, another job took the GPUs
        first); it holds no episodes yet, and while it pends the planner submits nothing.
        Withdrawn, the next plan sizes a job to the window as it is then. A controller too busy
        to have looked at it yet (reason None) is waited for."""
        from hpcrl.slurm import queries

        late = {
            r["job_id"]: r
            for r in p.active().values()
            if r.get("pending") and now - r["submitted"] >= self.withdraw_after_s
        }
        if not late:
            return False
        seen = [j for j in queries.pending_jobs() if j.job_id in late and j.reason not in ("", "None")]
        if not seen:
            return False
        queries.cancel([j.job_id for j in seen])  # should one start meanwhile: SIGTERM, it hands back
        for j in seen:
            rec = late[j.job_id]
            rec.update(state="ended", ended=now, slurm_state=f"withdrawn: pending ({j.reason})", withdrawn=now)
            log.info(
                "rollout: job %s withdrawn after %.0f s pending (%s); its window is sized again",
                j.job_id,
                now - rec["submitted"],
                j.reason,
            )
        return True

    def give_way(self, p, now: float) -> bool:
        """Cancel (ours, by id) the running rollout jobs that keep a pending job from starting now.

        Sized to the window of Slurm's plan, a rollout job delays no one as planned; but jobs
        that end before their limit pull a pending job's start earlier, into GPUs a rollout job
        holds. Such a job is handed back (scancel: it returns its episodes, which are re-issued)
        at once, so the pending job waits about one supervisor poll plus KillWait, or, in a
        preemptible rollout partition, only after `yield_after_s` of blocking it (the fallback
        for Slurm not preempting it: see the module doc)."""
        from hpcrl.slurm import queries

        running = {r["job_id"]: r for r in p.active().values() if not r.get("pending")}
        if not running:
            return False
        own = set(self.own_job_ids()) | {r["job_id"] for r in p.record["jobs"].values()}
        # Another job in the rollout partition is no one to give way to: Slurm plans it below ours.
        pending = [
            j
            for j in queries.pending_jobs()
            if j.job_id not in own and j.gpus > 0 and j.partition != p.sched.rollout_partition
        ]
        if not pending:
            return False
        members = {part.name: part.nodes for part in queries.partitions()}
        idle = {n.name: n.gpus_idle for n in queries.nodes()}
        ours: dict[str, list[tuple[str, int]]] = {}
        for row in queries.queue(job_ids=list(running)):
            if row["state"] == "RUNNING" and row["job_id"] in running:
                ours.setdefault(row["reason_or_nodelist"], []).append((row["job_id"], running[row["job_id"]]["gpus"]))
        blocking = rollout_jobs_to_yield(pending, idle, ours, members, dt.datetime.now())
        self.blocking, give = overdue(blocking, self.blocking, now, self.yield_after_s)
        if not give:
            return False
        queries.cancel(sorted(give))
        for job_id, other in give.items():
            running[job_id].update(yielded_to=other, yielded=now)
            log.info("rollout: job %s gives its GPUs back to pending job %s", job_id, other)
        return True

    def stop_all(self, p) -> None:
        from hpcrl.slurm import queries

        act = p.active()
        queries.cancel([j["job_id"] for j in act.values()])  # SIGTERM: each hands back what it holds
        for rec in act.values():
            rec.update(state="ended", ended=time.time(), slurm_state="cancelled at the run's end")


# squeue states of a job whose processes are gone (it will not run again: rollout jobs are not requeued)
_GONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}
_GONE |= {"OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}
