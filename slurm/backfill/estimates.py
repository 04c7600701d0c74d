"""Duration estimates from history: quantiles of recent durations per domain.

    est = DurationEstimator(history=256, min_samples=8, prior_s=30.0)
    est.record("code-17", 12.4)            # a task of that domain took 12.4 s
    est.quantile("code-17", 0.9)           # 90th percentile of its recent durations

A rollout job (jobs/rollout.py) leases a new episode only while the `fit_quantile` of its own
recent episode durations still fits before its window's end (`scheduler.fit_quantile`); the
simulator's rollout jobs decide with the same estimator, and its `sync` baseline starts the
longest expected domains first with it. Domains differ by orders of magnitude (a unit-test
sandbox run vs. a full build), so one global number would either waste windows or overrun them.

A domain with fewer than `min_samples` recorded durations borrows the pooled history of all
domains; with none at all the estimate is `prior_s`. Only completed work is recorded: a cut-off
one's duration is unknown (it would have been longer than what it ran).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

__all__ = ["DurationEstimator"]


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

    def domains(self) -> list[str]:
        return sorted(self._domains)
