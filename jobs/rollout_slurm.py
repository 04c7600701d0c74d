"""A Slurm run's rollout jobs (the backend of jobs/rollout_plan.py's `RolloutPlanner`).

    backend = SlurmBackend(executor_factory, own_job_ids, yield_after_s, params, withdraw_after_s, need)
    backend.plan(planner, now, jobs_free, gpus_free)   # size jobs to the window and submit them
    backend.reap(planner, now)                         # started / ended; withdraw; give way
    backend.stop_all(planner)                          # the run is over: scancel, by id

The decisions and the record are slurm/backfill's (`book.SlurmRollouts` over the live
controller, `live.LiveCluster`): the simulator runs the same code. What is here is the run's
side: a rollout job is the run's generator (`RolloutComponent`) submitted through submitit.
"""

from __future__ import annotations

import math
import time

from hpcrl.slurm.backfill.book import SlurmRollouts
from hpcrl.slurm.backfill.live import LiveCluster
from hpcrl.slurm.backfill.planner import PlanSettings, RolloutJobSize

__all__ = ["SlurmBackend"]


class SlurmBackend:
    """Windows from squeue --start; rollout jobs through submitit's SlurmExecutor.
    Each method's `p` is the run's RolloutPlanner (jobs/rollout_plan.py): its record and caps."""

    def __init__(
        self,
        executor_factory,
        own_job_ids,
        yield_after_s: float = 0.0,
        params: dict[str, str] | None = None,
        withdraw_after_s: float = math.inf,
        need=None,
        cluster=None,
    ):
        self.executor_factory = executor_factory  # (name, RolloutJobSize) -> a submitit executor
        self.own_job_ids = own_job_ids  # () -> the run's job ids (they end no window)
        self.yield_after_s = yield_after_s
        self.withdraw_after_s = withdraw_after_s
        self.need = need  # one rollout job's request (slurm/sbatch.Resources): windows count whole jobs of it
        self.cluster = cluster or LiveCluster(params)
        self._rounds: SlurmRollouts | None = None

    def rounds(self, p) -> SlurmRollouts:
        if self._rounds is None:
            settings = PlanSettings(
                partition=p.cfg.slurm.generator.partition,
                gpus_per_job=p.gpus_per_job,
                unbounded_min=p.cfg.slurm.generator.time_min,
                sched=p.sched,
                need=self.need,
            )
            self._rounds = SlurmRollouts(
                self.cluster,
                settings,
                self.own_job_ids,
                yield_after_s=self.yield_after_s,
                withdraw_after_s=self.withdraw_after_s,
                rollout_partition=p.sched.rollout_partition,
            )
        return self._rounds

    def plan(self, p, now: float, jobs_free: int, gpus_free: int) -> bool:
        def submit(size: RolloutJobSize) -> tuple[str, str]:
            name, comp = p.new_component(None)
            return name, self.executor_factory(name, size).submit(comp).job_id

        return self.rounds(p).plan(p.record["jobs"], now, jobs_free, gpus_free, p.episode_s(), submit, p.why_not)

    def signature(self, p) -> tuple:
        parts = {p.cfg.slurm.generator.partition, p.sched.rollout_partition} - {""}
        return self.cluster.signature(sorted(parts))

    def reap(self, p, now: float) -> bool:
        return self.rounds(p).reap(p.record["jobs"], now)

    def stop_all(self, p) -> None:
        self.rounds(p).stop_all(p.record["jobs"], time.time())
