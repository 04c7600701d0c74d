"""Free GPUs, CPUs and memory of one simulated node over time, as a backfill pass plans them.

prof = Profile(node, now)                 # from the running jobs' planned ends
t = prof.earliest((gpus, cpus, mem_mb), limit_s)   # the earliest start that holds them for the limit
prof.book(start, end, (gpus, cpus, mem_mb))         # a job booked there: the next ones plan around it
"""

from __future__ import annotations

import bisect
import math

__all__ = ["Profile"]


class Profile:
    """Free GPUs, CPUs and memory of one node from `now` on: free[i] holds from times[i] to times[i + 1]."""

    __slots__ = ("times", "free")

    def __init__(self, node, now: float):  # a slurm.SimNode
        free = [node.gpus - node.gpus_alloc, node.cpus - node.cpus_alloc, node.mem_mb - node.mem_alloc]
        self.times, self.free = [now], [tuple(free)]
        for e, g, c, m in sorted((j.planned_end, j.gpus, j.cpus, j.mem_mb) for j in node.jobs):
            if not math.isfinite(e):
                break
            free = [free[0] + g, free[1] + c, free[2] + m]
            if e <= self.times[-1]:
                self.free[-1] = tuple(free)
            else:
                self.times.append(e)
                self.free.append(tuple(free))

    def earliest(self, need: tuple[int, int, int], length: float) -> float | None:
        """The earliest breakpoint from which `need` is free for `length` seconds."""
        times, free, n = self.times, self.free, len(self.times)
        g, c, m = need
        i = 0
        while i < n:
            f = free[i]
            if f[0] >= g and f[1] >= c and f[2] >= m:
                t, j = times[i], i + 1
                while j < n and times[j] < t + length:
                    f = free[j]
                    if not (f[0] >= g and f[1] >= c and f[2] >= m):
                        break
                    j += 1
                else:
                    return t
                i = j + 1
            else:
                i += 1
        return None

    def book(self, a: float, b: float, need: tuple[int, int, int]) -> None:
        """`need` held over [a, b)."""
        for x in (a, b):
            i = bisect.bisect_right(self.times, x) - 1
            if i >= 0 and self.times[i] != x:
                self.times.insert(i + 1, x)
                self.free.insert(i + 1, self.free[i])
        lo, hi = bisect.bisect_left(self.times, a), bisect.bisect_left(self.times, b)
        g, c, m = need
        for i in range(lo, hi):
            f = self.free[i]
            self.free[i] = (f[0] - g, f[1] - c, f[2] - m)
