"""The run's rollout jobs on Slurm: their record, and the rounds that keep it (live and simulated).

    rollouts = SlurmRollouts(cluster, settings, own_job_ids, yield_after_s=0, withdraw_after_s=6)
    rollouts.plan(jobs, now, jobs_free, gpus_free, episode_s, submit, why_not)   # into the window
    rollouts.reap(jobs, now)          # started, ended; withdraw the ones Slurm left pending; give way
    rollouts.stop_all(jobs, now)      # the run is over: cancel ours, by id
    counts = rollout_job_counts(jobs, starts, ends)   # submitted, started, withdrawn, gave_way, ...

`jobs` is the run's record, {name: record} (the `jobs` of <run>/rollout.json): job id, GPUs,
the --time and --time-min it was submitted with, the window it was sized to (its end, the job
ending it, `window_key`), when it was submitted and started, and how it ended (`slurm_state`,
`withdrawn`, `yielded_to`, `preempted`). Every decision comes from a `QueueSnapshot` through the
pure functions of planner.py and give_way.py; `cluster` is where snapshots come from and where
cancellations go: `live.LiveCluster` (squeue, scontrol, scancel) for a run, the simulated
controller (slurm/sim/slurm.py) for `hpcrl sim`. Both run this same code.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Protocol

from hpcrl.slurm.backfill.give_way import jobs_to_give_way, overdue
from hpcrl.slurm.backfill.planner import PlanDecision, PlanSettings, RolloutJobSize, jobs_to_withdraw, plan_rollout_jobs
from hpcrl.slurm.backfill.snapshot import QueueSnapshot

__all__ = ["Cluster", "SlurmRollouts", "submitted_record", "rollout_job_counts", "active", "GONE"]

log = logging.getLogger("hpcrl.rollout")

# squeue states of a job whose processes are gone (it will not run again: rollout jobs are not requeued)
GONE = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}
    | {"OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}
)


class Cluster(Protocol):
    """Where the rounds read the queue and act on it."""

    def snapshot(self) -> QueueSnapshot: ...

    def job_states(self, job_ids: list[str]) -> dict[str, str]:
        """{job id: squeue state} of those still in the queue; raises when the controller cannot say."""
        ...

    def preempt_time(self, job_id: str) -> str | None:
        """When Slurm preempted this ended job (PreemptTime), or None."""
        ...

    def cancel(self, job_ids: list[str]) -> None: ...


def active(jobs: dict) -> dict[str, dict]:
    return {n: j for n, j in jobs.items() if j["state"] == "active"}


def submitted_record(job_id: str, decision: PlanDecision, now: float) -> dict:
    """The record of a rollout job just submitted into `decision`'s window (JSON-able)."""
    size, window = decision.size, decision.window
    return {
        "job_id": job_id,
        "gpus": size.gpus_per_job,
        "time_limit_min": size.time_limit_min,
        "time_min_min": size.time_min_min,
        "window_s": None if math.isinf(size.window_s) else size.window_s,
        "window_end": None if window.end is None else window.end.timestamp(),
        "blocked_by": window.blocked_by,
        "window_key": decision.key,
        "submitted": now,
        "pending": True,
        "state": "active",
    }


class SlurmRollouts:
    """The Slurm side of the run's planner (jobs/rollout_plan.py `RolloutPlanner` holds the record
    and the caps; the simulator's run holds them in `hpcrl sim`)."""

    def __init__(
        self,
        cluster: Cluster,
        settings: PlanSettings,
        own_job_ids: Callable[[], Iterable[str]] = tuple,
        *,
        yield_after_s: float = 0.0,
        withdraw_after_s: float = math.inf,
        rollout_partition: str = "",
    ):
        self.cluster, self.settings, self.own_job_ids = cluster, settings, own_job_ids
        self.yield_after_s = yield_after_s  # > 0: Slurm preempts them; give way only if it has not by then
        self.withdraw_after_s = withdraw_after_s  # a rollout job pending this long is withdrawn
        self.rollout_partition = rollout_partition  # its jobs are no one to give way to
        self.blocking: dict[str, float] = {}  # rollout job id -> since when it blocks a pending job
        self.snapshots = 0  # snapshots decided on (one per plan, one per reap with work to do)

    def snapshot(self) -> QueueSnapshot:
        self.snapshots += 1
        return self.cluster.snapshot()

    def plan(
        self,
        jobs: dict,
        now: float,
        jobs_free: int,
        gpus_free: int,
        episode_s: float,
        submit: Callable[[RolloutJobSize], tuple[str, str]],
        why_not: Callable[..., None] = lambda why, key=None: None,
    ) -> bool:
        """Size rollout jobs to the window the queue shows now and submit them (`submit(size)` ->
        (name, job id)); `why_not(why, key)` hears why none was. True when any was submitted."""
        if any(j.get("pending") for j in active(jobs).values()):
            why_not("a rollout job is still pending")
            return False  # one not started yet: Slurm has not taken it, a new window would be guessed
        # every job the run ever submitted: a withdrawn one may linger in squeue a moment
        own = set(self.own_job_ids()) | {j["job_id"] for j in jobs.values()}
        d = plan_rollout_jobs(self.snapshot(), self.settings, jobs, own, episode_s, jobs_free, gpus_free)
        if d.size is None:
            why_not(d.why, d.why_key)
            return False
        why_not("")
        for _ in range(d.size.jobs):
            name, job_id = submit(d.size)
            jobs[name] = submitted_record(job_id, d, now)
            log.info(
                "rollout: %s as job %s, --time %d --time-min %d (window %s s, before job %s)",
                name,
                job_id,
                d.size.time_limit_min,
                d.size.time_min_min,
                "inf" if math.isinf(d.size.window_s) else f"{d.size.window_s:.0f}",
                d.window.blocked_by,
            )
        return True

    def reap(self, jobs: dict, now: float) -> bool:
        """Which rollout jobs started or ended; then withdraw and give way on one snapshot."""
        act = active(jobs)
        if not act:
            return False
        # job_states raises when squeue fails: a controller hiccup must not look like every
        # rollout job ended (the caps would be counted free and more jobs submitted).
        states = self.cluster.job_states([j["job_id"] for j in act.values()])
        changed = False
        for rec in act.values():
            state = states.get(rec["job_id"])
            if state is None or state in GONE:
                rec.update(state="ended", ended=now, slurm_state=state or "left the queue")
                # One that exits within its GraceTime ends COMPLETED: only the controller's
                # PreemptTime (kept MinJobAge after the end) says that Slurm preempted it.
                preempted = self.cluster.preempt_time(rec["job_id"])
                if preempted:
                    rec["preempted"] = preempted
                changed = True
            elif rec.get("pending") and state == "RUNNING":
                rec.update(pending=False, started=now)
                changed = True
        act = active(jobs)
        late = any(r.get("pending") and now - r["submitted"] >= self.withdraw_after_s for r in act.values())
        running = any(not r.get("pending") for r in act.values())
        if not (late or running):
            return changed
        snap = self.snapshot()
        return self.withdraw(jobs, now, snap) | self.give_way(jobs, now, snap) | changed

    def withdraw(self, jobs: dict, now: float, snap: QueueSnapshot) -> bool:
        """Cancel the rollout jobs that Slurm looked at and left pending past withdraw_after_s
        (planner.py `jobs_to_withdraw`); the next plan sizes a job to the window as it is then."""
        late = jobs_to_withdraw(snap, jobs, now, self.withdraw_after_s)
        if not late:
            return False
        self.cluster.cancel(sorted(late))  # should one start meanwhile: SIGTERM, it hands back
        for rec in active(jobs).values():
            reason = late.get(rec["job_id"])
            if reason is None:
                continue
            rec.update(state="ended", ended=now, slurm_state=f"withdrawn: pending ({reason})", withdrawn=now)
            log.info(
                "rollout: job %s withdrawn after %.0f s pending (%s); its window is sized again",
                rec["job_id"],
                now - rec["submitted"],
                reason,
            )
        return True

    def give_way(self, jobs: dict, now: float, snap: QueueSnapshot) -> bool:
        """Cancel (ours, by id) the running rollout jobs that keep a pending job from starting now.

        Sized to the window of Slurm's plan, a rollout job delays no one as planned; but jobs
        that end before their limit pull a pending job's start earlier, into GPUs a rollout job
        holds. Such a job is handed back (scancel: it returns its episodes, which are re-issued)
        at once, so the pending job waits about one look plus KillWait, or, in a preemptible
        rollout partition, only after `yield_after_s` of blocking it (the fallback for Slurm
        not preempting it)."""
        blocking = jobs_to_give_way(snap, jobs, self.own_job_ids(), self.rollout_partition)
        self.blocking, give = overdue(blocking, self.blocking, now, self.yield_after_s)
        if not give:
            return False
        self.cluster.cancel(sorted(give))
        by_id = {r["job_id"]: r for r in active(jobs).values()}
        for job_id, other in give.items():
            by_id[job_id].update(yielded_to=other, yielded=now)
            log.info("rollout: job %s gives its GPUs back to pending job %s", job_id, other)
        return True

    def stop_all(self, jobs: dict, now: float) -> None:
        act = active(jobs)
        self.cluster.cancel([j["job_id"] for j in act.values()])  # SIGTERM: each hands back what it holds
        for rec in act.values():
            rec.update(state="ended", ended=now, slurm_state="cancelled at the run's end")


def rollout_job_counts(jobs: dict, starts: dict, ends: dict) -> dict[str, int]:
    """How many rollout jobs were submitted, started, withdrawn, gave way, were preempted, and ended
    within the window they were sized to (pure). `starts`, `ends`: {job id: epoch seconds or
    None} from accounting (sacct for a run, the simulated controller in `hpcrl sim`)."""
    started = [r for r in jobs.values() if starts.get(r["job_id"]) is not None]
    return {
        "submitted": len(jobs),
        "started": len(started),
        "withdrawn": sum(1 for r in jobs.values() if r.get("withdrawn")),  # pended too long: never ran
        "gave_way": sum(1 for r in jobs.values() if r.get("yielded_to")),
        "preempted": sum(1 for r in jobs.values() if r.get("preempted")),
        "ended_in_window": sum(
            1
            for r in started
            if ends.get(r["job_id"]) is not None
            and (r.get("window_end") is None or ends[r["job_id"]] <= r["window_end"])
        ),
    }
