"""Busy fractions over a sliding window, from cumulative seconds.

    m = BusyMeter(window_s=10)
    m.fraction(busy_s_so_far)     # busy seconds added over the last ~10 s, divided by the time passed

Reports of per-interval fractions flicker between 0 and 1 when the interval is one loop
iteration; over a window of seconds they say how loaded a role is.
"""

from __future__ import annotations

import collections
import time

__all__ = ["BusyMeter"]


class BusyMeter:
    def __init__(self, window_s: float = 10.0, clock=time.perf_counter):
        self.window_s = window_s
        self.clock = clock
        self._samples: collections.deque[tuple[float, float]] = collections.deque([(clock(), 0.0)])

    def rate(self, cumulative_s: float) -> float:
        """Seconds accumulated per second over the window (can exceed 1 for parallel work)."""
        now = self.clock()
        self._samples.append((now, cumulative_s))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, c0 = self._samples[0]
        return max(0.0, (cumulative_s - c0) / (now - t0)) if now > t0 else 0.0

    def fraction(self, cumulative_s: float) -> float:
        return min(1.0, self.rate(cumulative_s))
