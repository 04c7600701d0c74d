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
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

__all__ = ["DurationEstimator", "DomainSummary"]


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
