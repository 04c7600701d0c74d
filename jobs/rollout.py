"""A backfill rollout job: the run's real generator, for as long as its window lasts.

    comp = RolloutComponent.like(gen0_component, "rollout-3", seed, deadline=None, sched=cfg.scheduler)
    executor.submit(comp)        # jobs/rollout_plan.py does this, locally or on Slurm

A rollout job is a `GeneratorComponent` (same weights, coordinator over the same CURVE path,
sandbox servers, store) under role `rollout` and a name of its own (rollout-<n>), so its leases
and trajectory ids (run/rollout-<n>/episode) are its own. What differs is that it knows when
its window ends: on Slurm the job's EndTime, asked once at start (`scontrol show job`; Slurm may
have cut --time down to --time-min), locally the deadline it was given. Then:

- it leases new episodes only while the time left exceeds one episode (a `fit_quantile` of its
  own recent episode durations, `scheduler.prior_s` before it has `min_samples` of them) plus
  `scheduler.rollout_drain_s` (slurm/backfill/lending.py `may_lease`, `must_end`: the
  simulator's rollout jobs decide with the same functions);
- it ends when the time left reaches `rollout_drain_s`, or earlier once it stopped leasing and
  nothing is in flight: the generator component then hands the unfinished episodes back to the
  coordinator (re-issued at once), waits for the store's acknowledgements, and returns
  {"stopped_by": "window"}. SIGTERM (scancel, preemption) ends it the same way, earlier.
- it is never requeued: the end of its window is its normal end, not a failure.

Preempted (scheduler.rollout_partition; measured on the dev cluster, Slurm 22.05,
PreemptMode=CANCEL, GraceTime=5): Slurm sends the job step SIGTERM and SIGCONT within a second
of the preemptor's submission and moves the job's EndTime to now + GraceTime; SIGTERM stops it
as scancel does (episodes handed back first, then the store's acknowledgements), and the job
ends COMPLETED or FAILED by its own exit, PREEMPTED only when Slurm had to kill it after
GraceTime (its record's PreemptTime says either way). The EndTime it read at start is not read
again, so the moved one changes nothing; SIGUSR2 (ignored here) is not part of preemption unless
the site sets PreemptParameters=send_user_signal: then, by Slurm's preempt.html (not tried here),
USR2 replaces the first SIGTERM, and the SIGTERM at GraceTime's end starts the hand-back,
KillWait before SIGKILL.

`rollout/<name>.json` records its deadline for `hpcrl status` (window left).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from hpcrl.core.config import SchedulerConfig
from hpcrl.core.files import atomic_write_json
from hpcrl.jobs.components import GeneratorComponent, exit_now
from hpcrl.slurm import parse, queries
from hpcrl.slurm.backfill.estimates import DurationEstimator
from hpcrl.slurm.backfill.lending import may_lease, must_end

__all__ = ["RolloutComponent", "WindowedSource", "slurm_deadline", "ROLLOUT_DIR"]

ROLLOUT_DIR = "rollout"  # <run>/rollout/<name>.json: each rollout job's deadline, as it knows it
log = logging.getLogger("hpcrl.rollout")


def slurm_deadline(job_id: str) -> float:
    """The job's EndTime (unix seconds) as the controller has it now."""

    rec = queries.show_job(job_id) or {}
    end = parse.parse_timestamp(rec.get("EndTime", ""))
    if end is None:
        raise RuntimeError(f"rollout job {job_id}: scontrol show job gave no EndTime ({rec.get('EndTime')!r})")
    return end.timestamp()


class WindowedSource:
    """A RemoteTaskSource that stops leasing when one more episode would not fit the window.

    Everything else (sink acknowledgements, release, finish, should_stop) is the wrapped
    source's; this counts the episodes it let through until each is stored or failed."""

    def __init__(
        self, inner, deadline: float, drain_s: float, estimator: DurationEstimator, quantile: float, clock=time.time
    ):
        self.inner, self.deadline, self.drain_s = inner, deadline, drain_s
        self.estimator, self.quantile, self.clock = estimator, quantile, clock
        self.leasing = True  # once it stops, it stays stopped: no episode started that cannot finish
        self._open: dict[int, float] = {}  # episode -> when taken
        self.produced = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def time_left_s(self) -> float:
        return self.deadline - self.clock()

    def episode_s(self) -> float:
        return self.estimator.quantile("episode", self.quantile)

    def take(self, n: int):
        if self.leasing and not may_lease(self.time_left_s(), self.episode_s(), self.drain_s):
            self.leasing = False
            log.warning(
                "%.1f s of the window left, one episode takes ~%.1f s: no new episodes (%d in flight)",
                self.time_left_s(),
                self.episode_s(),
                len(self._open),
            )
        tickets = self.inner.take(n if self.leasing else 0)  # take(0) still syncs and reports
        now = time.monotonic()
        for t in tickets:
            self._open[t.episode] = now
        return tickets

    def sink(self, traj) -> None:
        taken = self._open.pop(traj.episode, None)
        if taken is not None:
            self.estimator.record("episode", time.monotonic() - taken)
        self.produced += 1
        self.inner.sink(traj)

    def failed(self, ticket, reason: str, permanent: bool = False) -> None:
        self._open.pop(ticket.episode, None)
        self.inner.failed(ticket, reason, permanent)

    def over(self) -> bool:
        if not must_end(self.time_left_s(), self.drain_s, self.leasing, len(self._open)):
            return False
        log.warning("window ends in %.1f s: handing back %d episodes", self.time_left_s(), len(self._open))
        return True


class RolloutComponent(GeneratorComponent):
    """A generator with a window deadline (see the module doc); `deadline` None: the Slurm job's EndTime."""

    role = "rollout"

    def __init__(self, *args, deadline: float | None, sched: SchedulerConfig, **kw):
        super().__init__(*args, **kw)
        self.deadline, self.sched = deadline, sched
        self._source: WindowedSource | None = None

    @classmethod
    def like(
        cls, gen: GeneratorComponent, name: str, seed: int, deadline: float | None, sched: SchedulerConfig
    ) -> RolloutComponent:
        """A rollout job running what the fixed generator `gen` runs, under `name`."""
        comp = cls(
            gen.run_dir,
            name,
            gen.cfg,
            gen.policy,
            gen.domains,
            gen.sandbox_services,
            seed,
            gen.search_path,
            gen.sandbox_slots,
            gen.torch_threads,
            deadline=deadline,
            sched=sched,
        )
        comp.metrics = getattr(gen, "metrics", None)
        return comp

    def wrap_source(self, source):
        est = DurationEstimator(self.sched.history, self.sched.min_samples, self.sched.prior_s)
        self._source = WindowedSource(source, self.deadline, self.sched.rollout_drain_s, est, self.sched.fit_quantile)
        return self._source

    def should_end(self) -> bool:
        return self._source is not None and self._source.over()

    def __call__(self) -> dict:
        job = os.environ.get("SLURM_JOB_ID")
        if job:  # the limit Slurm actually granted (between --time-min and --time)
            self.deadline = slurm_deadline(job)
        if self.deadline is None:
            raise ValueError(f"{self.name}: a rollout job outside Slurm needs a deadline")
        folder = Path(self.run_dir) / ROLLOUT_DIR
        folder.mkdir(exist_ok=True)
        atomic_write_json(
            folder / f"{self.name}.json",
            {"name": self.name, "job_id": job, "pid": os.getpid(), "deadline": self.deadline, "started": time.time()},
        )
        result = super().__call__()
        if job:
            # Handed back, stored, acknowledged: once submitit has written this result nothing is
            # left to save, and whoever preempted the job waits for its exit. The interpreter's
            # teardown (torch and the rest) kept the job alive ~2 s past submitit's last line
            # (measured on the dev cluster); atexit runs this first, then the process ends.
            import atexit

            atexit.register(exit_now)
        return result
