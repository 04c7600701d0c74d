"""Duration estimates from history: quantiles of recent task durations per domain.

    est = DurationEstimator(history=256, min_samples=8, prior_s=30.0)
    est.record("code-17", 12.4)            # a task of that domain took 12.4 s
    est.quantile("code-17", 0.9)           # 90th percentile of its recent durations

The gap packer fits a task into an idle window with a *high* quantile of the task's domain
(an overrun means preempting it), and predicts when an owner comes back with a *low*
quantile (an owner that returns early also means preempting). Slurm rollout jobs get their
--time from the same numbers. Domains differ by orders of magnitude (a unit-test sandbox
run vs. a full build), so one global number would either waste windows or overrun them.

A domain with fewer than `min_samples` recorded durations borrows the pooled history of all
domains; with none at all the estimate is `prior_s`. Only completed tasks are recorded: a
preempted task's duration is unknown (it would have been longer than what it ran).

The decisions an owner makes from these numbers live here too, so that the simulator
(slurm/sim/backfill.py) and the live components take them with the same code:

    est.task_estimate("code-17", 0.9, done_s=40.0, resume_s=1.0)   # what the packer is told a turn takes
    est.next_return(now, [("code-17", started), ("agent-3", None)], 0.25)  # when a sandbox-waiting owner is back
    arrival_eta(now, recent_completion_times, missing=12, q=0.25)  # when a learner's batch is full
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

__all__ = ["DurationEstimator", "DomainSummary", "arrival_eta"]


@dataclass(frozen=True)
class DomainSummary:
    domain: str
    samples: int
    p50_s: float
    p90_s: float
    p99_s: float


class _Window:
    """The last `size` samples in arrival order plus the same samples sorted."""

    __slots__ = ("order", "sorted")

    def __init__(self, size: int):
        self.order: deque[float] = deque(maxlen=size)
        self.sorted: list[float] = []

    def add(self, value: float) -> None:
        if len(self.order) == self.order.maxlen:
            old = self.order[0]
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.order.append(value)
        bisect.insort(self.sorted, value)

    def quantile(self, q: float) -> float:
        # Nearest rank: the smallest sample with at least q of the samples at or below it.
        n = len(self.sorted)
        return self.sorted[min(n - 1, max(0, math.ceil(q * n) - 1))]


class DurationEstimator:
    """Per-domain rolling quantiles of task durations (seconds): O(history) per record, O(1) per query."""

    def __init__(self, history: int = 256, min_samples: int = 8, prior_s: float = 30.0):
        if history < 1 or min_samples < 1 or not prior_s > 0:
            raise ValueError("DurationEstimator: history and min_samples must be >= 1 and prior_s > 0")
        self.history = history
        self.min_samples = min_samples
        self.prior_s = float(prior_s)
        self._domains: dict[str, _Window] = {}
        # The pooled window keeps more samples so that hundreds of domains all leave a trace in it.
        self._pooled = _Window(history * 4)

    def record(self, domain: str, duration_s: float) -> None:
        if not (duration_s >= 0 and math.isfinite(duration_s)):
            raise ValueError(
                f"DurationEstimator.record: duration must be finite and >= 0 (got {duration_s!r} for {domain!r})"
            )
        window = self._domains.get(domain)
        if window is None:
            window = self._domains[domain] = _Window(self.history)
        window.add(float(duration_s))
        self._pooled.add(float(duration_s))

    def samples(self, domain: str) -> int:
        window = self._domains.get(domain)
        return len(window.order) if window else 0

    def quantile(self, domain: str, q: float) -> float:
        """q-quantile (0 < q <= 1) of the domain's recent durations, falling back as documented."""
        if not 0 < q <= 1:
            raise ValueError(f"DurationEstimator.quantile: q must be in (0, 1] (got {q!r})")
        window = self._domains.get(domain)
        if window is not None and len(window.order) >= self.min_samples:
            value = window.quantile(q)
        elif len(self._pooled.order) >= self.min_samples:
            value = self._pooled.quantile(q)
        else:
            value = self.prior_s
        return value

    def remaining_quantile(self, domain: str, elapsed_s: float, q: float) -> float:
        """q-quantile of the time still to go for a task of `domain` that has run `elapsed_s`.

        Conditioning matters with heavy tails: a sandbox run that is already past its domain's
        median is likely to be one of the long ones. With F the empirical distribution, the
        answer is F^-1(F(e) + q (1 - F(e))) - e. Past every recorded sample the history says
        nothing, and the estimate is q * elapsed (a heavy tail's remaining time grows with age).
        """
        if not 0 < q <= 1:
            raise ValueError(f"DurationEstimator.remaining_quantile: q must be in (0, 1] (got {q!r})")
        window = self._domains.get(domain)
        if window is None or len(window.order) < self.min_samples:
            window = self._pooled if len(self._pooled.order) >= self.min_samples else None
        if window is None:
            return max(self.prior_s - elapsed_s, q * elapsed_s, 0.0)
        data = window.sorted
        n = len(data)
        below = bisect.bisect_right(data, elapsed_s)
        if below >= n:
            return q * elapsed_s
        p = below / n + q * (1.0 - below / n)
        return max(data[min(n - 1, max(below, math.ceil(p * n) - 1))] - elapsed_s, 0.0)

    def task_estimate(self, domain: str, q: float, *, done_s: float = 0.0, resume_s: float = 0.0) -> float:
        """The estimate a rollout task is submitted to the packer with (always > 0).

        The q-quantile of the domain's durations; for a divisible task that already ran
        `done_s` seconds in earlier chunks (a generation turn cut at a window's end), what is
        left of that quantile, at least a tenth of it, plus `resume_s` of re-prefill.
        """
        est = self.quantile(domain, q)
        if done_s > 0 or resume_s > 0:
            est = max(est - done_s, est * 0.1) + resume_s
        return max(est, 1e-3)

    def next_return(self, now: float, waits: Iterable[tuple[str, float | None]], q: float) -> float:
        """When the first of several tasks of this estimator's kind is expected to end (never
        before `now`): `waits` holds (domain, started) pairs, started None for a task still
        queued (its whole duration is ahead). A generator whose episodes all wait on sandboxes
        lends its GPU until then, at a low q (an early return preempts the borrowed task)."""
        back = math.inf
        for domain, started in waits:
            if started is None:
                t = now + self.quantile(domain, q)
            else:
                t = now + self.remaining_quantile(domain, now - started, q)
            back = min(back, t)
        return max(back, now)

    def summary(self, domain: str) -> DomainSummary:
        return DomainSummary(
            domain,
            self.samples(domain),
            self.quantile(domain, 0.5),
            self.quantile(domain, 0.9),
            self.quantile(domain, 0.99),
        )

    def domains(self) -> list[str]:
        return sorted(self._domains)


def arrival_eta(now: float, times: Sequence[float], missing: int, q: float) -> float:
    """When `missing` more arrivals are expected, at the q-quantile, given recent arrival `times`
    (ascending): math.inf while there is no rate yet (fewer than 2 times, or all at once).

    Arrivals as a Poisson stream at the recent rate: the wait for k more is Gamma(k, 1/rate),
    its quantile by the Wilson-Hilferty approximation. A learner waiting for a batch lends its
    GPUs until then, at a low q (fewer borrowed tasks are cut off when the batch fills).
    """
    if len(times) < 2 or times[-1] <= times[0]:
        return math.inf
    rate = (len(times) - 1) / (times[-1] - times[0])
    z = _normal_quantile(min(max(q, 1e-6), 1 - 1e-6))
    k = max(missing, 1)
    cube = 1.0 - 1.0 / (9.0 * k) + z / (3.0 * math.sqrt(k))
    return now + k / rate * max(cube, 0.0) ** 3


@lru_cache(maxsize=64)
def _normal_quantile(p: float) -> float:
    return NormalDist().inv_cdf(p)
