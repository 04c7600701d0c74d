"""Gap packing: short rollout tasks into idle windows of GPU allocations, never delaying the owner.

An allocation's *owner* (a learner rank, a generator, a rollout job that Slurm backfilled)
announces when its GPU goes idle and when it expects to need it back; the packer fills the
window with pending rollout tasks whose estimated duration fits, and hands the GPU back the
moment the owner asks, preempting whatever borrowed task still runs there (the task is
re-queued with its original priority, so a preempted episode is re-issued, not lost).

    packer = GapPacker(margin_s=1.0)
    packer.submit(RolloutTask(7, "code-17", est_s=12.0, version=3), now)   # -> Placement | None
    p = packer.open_window("n1:gpu0", now, until=now + 40.0)                # learner waits for data
    packer.finish("n1:gpu0", now, until=now + 30.0)  # task done; owner's estimate -> maybe the next
    packer.finish("n1:gpu0", now, close=True)        # task done; owner takes the GPU at this boundary
    r = packer.close_window("n1:gpu0", now) # the owner needs it now: kill r.preempted, start r.replacement
    packer.withdraw_older_than(version - max_staleness)  # episodes too stale to train on
    packer.pop_oldest()                     # a generator adopts the oldest pending episode as its own

Every method that decides takes `now` and the packer keeps no clock, so the simulator
(slurm/sim/run.py) drives it with simulated seconds and the real components (backfill/worker.py,
the generators and learner) with wall-clock seconds. It is single-threaded: call it from one
event loop (the coordinator's, or a worker's).

Decisions cost O(C + log n) for n pending tasks or free windows and C occupied estimate
classes (at most 160, a few dozen in practice); the bench measures them at 10,000 tasks x
10,000 GPUs:
* a GPU frees up -> the oldest pending task (lowest policy version, then submission order)
  whose estimate fits the rest of its window. Oldest-first keeps policy staleness low.
  A divisible task (min_chunk_s > 0: generation that stops at a token budget and resumes
  elsewhere) fits any window of min_chunk_s and runs for the placement's budget_s.
* a task arrives -> the free window with the *earliest* end that still fits it (best fit),
  which leaves long windows for long tasks.
Estimates are rounded up to a 2^(1/4) grid (at most 19 % more conservative); pending tasks
sit in one heap per grid class and free windows in a sorted index by end time.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["RolloutTask", "Placement", "Preemption", "Reclaim", "GapPacker", "fit_length"]

# Estimate grid: class k covers (EDGES[k-1], EDGES[k]]; from about 1 ms to about 34 years.
_MIN_EST_S = 2.0**-10
_STEPS_PER_OCTAVE = 4
_CLASSES = 160
EDGES = tuple(_MIN_EST_S * 2.0 ** (k / _STEPS_PER_OCTAVE) for k in range(_CLASSES))


def _est_class(est_s: float) -> int:
    if not (est_s > 0 and math.isfinite(est_s)):
        raise ValueError(f"task estimate must be a finite number of seconds > 0 (got {est_s!r})")
    k = bisect.bisect_left(EDGES, est_s)
    if k >= _CLASSES:
        raise ValueError(f"task estimate {est_s:g} s is beyond the packer's grid ({EDGES[-1]:.3g} s)")
    return k


def fit_length(est_s: float) -> float:
    """The duration the packer reserves for a task with this estimate (rounded up to the grid)."""
    return EDGES[_est_class(est_s)]


@dataclass(frozen=True)
class RolloutTask:
    """One unit of rollout work: a generation turn of an episode, or a batch of them."""

    task_id: int
    domain: str
    est_s: float  # estimated duration: a high quantile of the domain's history
    version: int = 0  # policy version the episode started with; lower runs first
    episode: int = -1  # the caller's handle for re-issue bookkeeping
    # > 0: divisible work (a generation turn that can stop at a token budget and resume on
    # another GPU): it fits any window of min(est_s, min_chunk_s) and runs until the
    # placement's deadline; the caller re-submits what is left. 0: runs to completion.
    min_chunk_s: float = 0.0

    @property
    def fit_s(self) -> float:
        return min(self.est_s, self.min_chunk_s) if self.min_chunk_s > 0 else self.est_s


@dataclass(frozen=True)
class Placement:
    task: RolloutTask
    gpu: Hashable
    start: float
    deadline: float  # the window's end: the owner expects its GPU back then
    budget_s: float  # run time that ends margin_s before the deadline (math.inf: open-ended)


@dataclass(frozen=True)
class Preemption:
    task: RolloutTask
    gpu: Hashable
    started: float
    at: float

    @property
    def ran_s(self) -> float:
        return self.at - self.started


@dataclass(frozen=True)
class Reclaim:
    """What closing a window did: the borrowed task it preempted (kill it; it is re-queued)
    and, when that task fit another free window right away, where it runs now."""

    preempted: Preemption | None
    replacement: Placement | None


class _SortedWindows:
    """Free windows as (until, gpu index) pairs in sorted chunks: O(log n) search and
    O(sqrt n)-bounded insert/delete without a third-party sorted container."""

    _LOAD = 256

    def __init__(self) -> None:
        self._chunks: list[list[tuple[float, int]]] = []
        self._maxes: list[tuple[float, int]] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, item: tuple[float, int]) -> None:
        self._len += 1
        if not self._chunks:
            self._chunks.append([item])
            self._maxes.append(item)
            return
        i = bisect.bisect_left(self._maxes, item)
        if i == len(self._chunks):
            i -= 1
        chunk = self._chunks[i]
        bisect.insort(chunk, item)
        self._maxes[i] = chunk[-1]
        if len(chunk) > 2 * self._LOAD:
            half = chunk[self._LOAD :]
            del chunk[self._LOAD :]
            self._chunks.insert(i + 1, half)
            self._maxes[i] = chunk[-1]
            self._maxes.insert(i + 1, half[-1])

    def remove(self, item: tuple[float, int]) -> None:
        i = bisect.bisect_left(self._maxes, item)
        chunk = self._chunks[i] if i < len(self._chunks) else None
        j = bisect.bisect_left(chunk, item) if chunk else 0
        if chunk is None or j == len(chunk) or chunk[j] != item:
            raise KeyError(item)
        del chunk[j]
        self._len -= 1
        if not chunk:
            del self._chunks[i]
            del self._maxes[i]
        else:
            self._maxes[i] = chunk[-1]

    def first_at_least(self, key: tuple[float, int]) -> tuple[float, int] | None:
        i = bisect.bisect_left(self._maxes, key)
        if i == len(self._chunks):
            return None
        chunk = self._chunks[i]
        return chunk[bisect.bisect_left(chunk, key)]


class GapPacker:
    """Places borrowed rollout tasks into owners' idle GPU windows. See the module docstring."""

    def __init__(self, margin_s: float = 0.0):
        if not margin_s >= 0:
            raise ValueError(f"GapPacker: margin_s must be >= 0 (got {margin_s!r})")
        self.margin_s = float(margin_s)
        # GPU keys are the caller's (ints, "node:gpu" strings...); internally dense ints, so
        # the window index compares floats and ints only.
        self._index: dict[Hashable, int] = {}
        self._keys: list[Hashable] = []
        self._until: dict[int, float] = {}  # open windows, free or running a borrowed task
        self._running: dict[int, tuple[Placement, int]] = {}  # gpu -> (placement, seq)
        self._free = _SortedWindows()
        # Pending tasks: one heap per estimate class of (version, seq, token, task_id); an entry
        # is live while _pending[task_id][0] == token (withdrawals leave dead entries behind).
        self._heaps: list[list[tuple[int, int, int, int]]] = [[] for _ in range(_CLASSES)]
        self._live = [0] * _CLASSES
        self._mask = 0  # bit k set <=> class k has live entries
        self._pending: dict[int, tuple[int, int, RolloutTask, int]] = {}  # id -> (token, class, task, seq)
        self._seq_of: dict[int, int] = {}  # submission order, kept across re-issues
        self._next_seq = 0
        self._next_token = 0
        self.decisions = 0
        self.placements = 0
        self.preemptions = 0

    # ---------------------------------------------------------------- owner side
    def open_window(self, gpu: Hashable, now: float, until: float) -> Placement | None:
        """The owner will not need `gpu` until `until` (math.inf: no known end)."""
        g = self._gpu(gpu)
        if g in self._until:
            raise ValueError(f"GapPacker.open_window: {gpu!r} already has an open window")
        if not until >= now:
            raise ValueError(f"GapPacker.open_window: window of {gpu!r} ends ({until!r}) before now ({now!r})")
        self._until[g] = until
        return self._fill(g, now)

    def move_window(self, gpu: Hashable, now: float, until: float) -> Placement | None:
        """The owner's estimate of when it needs `gpu` back changed. A running borrowed task keeps
        running (only close_window preempts); a free GPU may now fit a task."""
        g = self._open(gpu, "move_window")
        old = self._until[g]
        self._until[g] = max(until, now)
        if g in self._running:
            return None
        self._free.remove((old, g))
        return self._fill(g, now)

    def close_window(self, gpu: Hashable, now: float) -> Reclaim:
        """The owner takes `gpu` back now. A borrowed task still running there is preempted and
        re-queued; the caller must stop it (its partial output is discarded)."""
        g = self._open(gpu, "close_window")
        until = self._until.pop(g)
        run = self._running.pop(g, None)
        if run is None:
            self._free.remove((until, g))
            return Reclaim(None, None)
        placement, seq = run
        self.preemptions += 1
        preempted = Preemption(placement.task, gpu, placement.start, now)
        return Reclaim(preempted, self._enqueue(placement.task, seq, now))

    def window_of(self, gpu: Hashable) -> float | None:
        g = self._index.get(gpu)
        return self._until.get(g) if g is not None else None

    # ---------------------------------------------------------------- task side
    def submit(self, task: RolloutTask, now: float) -> Placement | None:
        """Queue a task; returns its placement when a free window fits it now."""
        if task.task_id in self._seq_of:
            raise ValueError(f"GapPacker.submit: task {task.task_id} is already pending or running")
        seq = self._next_seq
        self._next_seq += 1
        self._seq_of[task.task_id] = seq
        return self._enqueue(task, seq, now)

    def finish(self, gpu: Hashable, now: float, *, until: float | None = None, close: bool = False) -> Placement | None:
        """The borrowed task on `gpu` completed. The GPU takes the next fitting task, if any;
        `until` updates the owner's estimate first; `close=True` hands the GPU back to the
        owner at this task boundary instead (e.g. to load new weights)."""
        g = self._open(gpu, "finish")
        run = self._running.pop(g, None)
        if run is None:
            raise ValueError(f"GapPacker.finish: no borrowed task runs on {gpu!r}")
        del self._seq_of[run[0].task.task_id]
        if close:
            del self._until[g]
            return None
        if until is not None:
            self._until[g] = max(until, now)
        return self._fill(g, now)

    def withdraw(self, task_id: int) -> RolloutTask | None:
        """Remove a pending task (its episode was dropped); None when it is not pending."""
        entry = self._pending.pop(task_id, None)
        if entry is None:
            return None
        _, k, task, _ = entry
        del self._seq_of[task_id]
        self._dec(k)
        return task

    def withdraw_older_than(self, version: int) -> list[RolloutTask]:
        """Remove and return pending tasks of episodes started before `version` (too stale to
        train on). O(removed * log n) plus one pass over the classes."""
        out = []
        bits = self._mask
        while bits:
            low = bits & -bits
            bits ^= low
            k = low.bit_length() - 1
            heap = self._heaps[k]
            while heap:
                head = self._clean_head(k)
                if head is None or head[0] >= version:
                    break
                heapq.heappop(heap)
                task = self._pending.pop(head[3])[2]
                del self._seq_of[task.task_id]
                self._dec(k)
                out.append(task)
        return out

    def _oldest_head(self, bits: int):
        """(oldest head, bucket) over the non-empty buckets set in `bits`, or None."""
        best = None
        while bits:
            low = bits & -bits
            bits ^= low
            k = low.bit_length() - 1
            head = self._clean_head(k)
            if head is not None and (best is None or head < best[0]):
                best = (head, k)
        return best

    def pop_oldest(self) -> RolloutTask | None:
        """Take the oldest pending task regardless of size (an owner adopting it as its own work)."""
        best = self._oldest_head(self._mask)
        if best is None:
            return None
        head, k = best
        heapq.heappop(self._heaps[k])
        task = self._pending.pop(head[3])[2]
        del self._seq_of[task.task_id]
        self._dec(k)
        return task

    def running_on(self, gpu: Hashable) -> Placement | None:
        g = self._index.get(gpu)
        run = self._running.get(g) if g is not None else None
        return run[0] if run else None

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def free_windows(self) -> int:
        return len(self._free)

    def is_pending(self, task_id: int) -> bool:
        return task_id in self._pending

    # ---------------------------------------------------------------- internals
    def _gpu(self, gpu: Hashable) -> int:
        g = self._index.get(gpu)
        if g is None:
            g = self._index[gpu] = len(self._keys)
            self._keys.append(gpu)
        return g

    def _open(self, gpu: Hashable, what: str) -> int:
        g = self._index.get(gpu)
        if g is None or g not in self._until:
            raise ValueError(f"GapPacker.{what}: {gpu!r} has no open window")
        return g

    def _dec(self, k: int) -> None:
        self._live[k] -= 1
        if not self._live[k]:
            self._mask &= ~(1 << k)
            self._heaps[k].clear()  # only dead entries remain

    def _clean_head(self, k: int) -> tuple[int, int, int, int] | None:
        heap = self._heaps[k]
        pending = self._pending
        while heap:
            head = heap[0]
            entry = pending.get(head[3])
            if entry is not None and entry[0] == head[2]:
                return head
            heapq.heappop(heap)
        return None

    def _enqueue(self, task: RolloutTask, seq: int, now: float) -> Placement | None:
        """A task becomes placeable: best-fit free window now, else into its class heap."""
        self.decisions += 1
        k = _est_class(task.fit_s)
        hit = self._free.first_at_least((now + EDGES[k] + self.margin_s, -1))
        if hit is not None:
            self._free.remove(hit)
            return self._start(hit[1], task, seq, now)
        token = self._next_token
        self._next_token += 1
        self._pending[task.task_id] = (token, k, task, seq)
        heapq.heappush(self._heaps[k], (task.version, seq, token, task.task_id))
        self._live[k] += 1
        self._mask |= 1 << k
        return None

    def _fill(self, g: int, now: float) -> Placement | None:
        """GPU g is free inside its window: start the oldest pending task that fits, or index it."""
        self.decisions += 1
        until = self._until[g]
        kmax = bisect.bisect_right(EDGES, until - now - self.margin_s) - 1
        bits = self._mask & ((1 << (kmax + 1)) - 1) if kmax >= 0 else 0
        best = self._oldest_head(bits)
        if best is None:
            self._free.add((until, g))
            return None
        head, k = best
        heapq.heappop(self._heaps[k])
        _, _, task, seq = self._pending.pop(head[3])
        self._dec(k)
        return self._start(g, task, seq, now)

    def _start(self, g: int, task: RolloutTask, seq: int, now: float) -> Placement:
        until = self._until[g]
        placement = Placement(task, self._keys[g], now, until, until - self.margin_s - now)
        self._running[g] = (placement, seq)
        self.placements += 1
        return placement
