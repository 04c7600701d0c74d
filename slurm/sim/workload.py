"""Other users' jobs on the simulated partition: Poisson arrivals of single-node GPU jobs.

    Workload(ctl, others, seed).start(-warmup_s)     # jobs arrive from then on, for ever

Each job draws its GPUs uniformly from `gpus`, its run time from `run_s`, and asks for a time
limit of that run time times a factor from `limit_factor`, in whole minutes (users ask for more
than they use: Slurm plans by the limit, so holes open when jobs end early). Draws come from
`seed` alone, so every policy and every rerun sees the same jobs at the same times.
"""

from __future__ import annotations

import math
import random

from hpcrl.slurm.sim.slurm import SimJob, SimSlurm

__all__ = ["Workload"]


class Workload:
    def __init__(self, ctl: SimSlurm, others, seed: int):
        self.ctl, self.others = ctl, others
        self.rng = random.Random(seed * 1_000_033 + 7)
        self.count = 0

    def start(self, t0: float) -> None:
        self.ctl.loop.at(t0 + self._gap(), self._arrive)

    def _gap(self) -> float:
        return self.rng.expovariate(self.others.jobs_per_h / 3600.0)

    def _arrive(self, _: object, now: float) -> None:
        o, rng = self.others, self.rng
        gpus = rng.choice(o.gpus)
        rs = o.run_s
        if rs.dist == "lognormal":
            run = rs.median_s * math.exp(rs.shape * rng.gauss(0.0, 1.0))
        else:  # Pareto with tail index `shape` and this median
            run = rs.median_s / 2.0 ** (1.0 / rs.shape) / (1.0 - rng.random()) ** (1.0 / rs.shape)
        run = min(max(run, 1.0), rs.cap_s)
        limit_min = max(1, math.ceil(run * rng.uniform(*o.limit_factor) / 60.0))
        job = SimJob(
            f"other-{self.count}",
            "other",
            gpus,
            gpus * o.cpus_per_gpu,
            round(gpus * o.mem_gb_per_gpu * 1024),
            limit_min * 60.0,
            run_s=run,
        )
        self.count += 1
        self.ctl.submit(job, now)
        self.ctl.loop.at(now + self._gap(), self._arrive)
