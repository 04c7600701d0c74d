"""What a running generator reports: the stats each sync carries to the coordinator (status.json,
the timeline) and the series of its metrics endpoint.

    report = GeneratorReport(gen, sandbox_slots)
    RemoteTaskSource(node, name, sender, report.stats)   # sent with every sync
    provide(lambda: report.metrics(sender))              # core/metrics.py: the Prometheus endpoint

Busy fractions are over a sliding window (`BusyMeter`), so a report says how loaded the
generator is now, not since it started.
"""

from __future__ import annotations

from typing import Any

from hpcrl.rl.common.meter import BusyMeter
from hpcrl.rl.rollout.generator import Generator

__all__ = ["GeneratorReport"]


class GeneratorReport:
    def __init__(self, gen: Generator, sandbox_slots: int):
        self.gen, self.sandbox_slots = gen, sandbox_slots
        self.busy, self.sandbox = BusyMeter(), BusyMeter()

    def stats(self) -> dict:
        gen, busy, sandbox = self.gen, self.busy, self.sandbox
        s = gen.stats
        # sandbox_s_rate: sandbox seconds per second (> 1 with several slots busy).
        return {
            "busy_fraction": busy.fraction(s.busy_s),
            "sandbox_s_rate": sandbox.rate(s.sandbox_s),
            "sandbox_slots": self.sandbox_slots,
            "trajectories": s.trajectories,
            "steps": s.steps,
            "failed": s.failed,
            "version": gen.version,
            "in_flight": len(gen.episodes),
            "busy_s": s.busy_s,
            "wall_s": s.wall_s,
            "source_s": s.source_s,
            "weights_s": s.weights_s,
            "idle_s": s.idle_s,
            "env_wait_s": s.env_wait_s,
            "batches": s.batches,
            "batch_rows": s.batch_rows,
            "overlap_batches": s.overlap_batches,
            "lent": s.lent,
            "hot_episodes": gen.stuck.hot_episodes,
            "reward_mean": s.reward_sum / max(s.trajectories, 1),
        }

    def metrics(self, sender: Any) -> dict:
        """`sender`: the generator's TrajectorySender (what the store has yet to acknowledge)."""
        gen = self.gen
        return {
            "generator_trajectories_total": gen.stats.trajectories,
            "generator_steps_total": gen.stats.steps,
            "generator_failed_total": gen.stats.failed,
            "generator_busy_fraction": self.busy.fraction(gen.stats.busy_s),
            "generator_busy_seconds_total": gen.stats.busy_s,
            "generator_sandbox_seconds_total": gen.stats.sandbox_s,
            "generator_weights_seconds_total": gen.stats.weights_s,
            "generator_idle_seconds_total": gen.stats.idle_s,
            "generator_env_wait_seconds_total": gen.stats.env_wait_s,
            "generator_in_flight": len(gen.episodes),
            "generator_version": gen.version,
            "generator_unacked": sender.unacked,
            "generator_resent_total": sender.resent,
        }
