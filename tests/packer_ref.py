"""A linear-scan packer that decides exactly like `GapPacker`: the tests' oracle, the bench's baseline.

    ref = ReferencePacker(margin_s=1.0)      # same methods and answers as GapPacker

Every decision scans all pending tasks or all free windows (O(n)); nothing is indexed. It
shares only the estimate grid (`fit_length`) with the real packer, so a bug in the heaps,
the class bitmask or the sorted window index shows up as a different answer in
tests/test_scheduler.py, and bench/scheduler.py prints how much the indices buy.
"""

from __future__ import annotations

from collections.abc import Hashable

from hpcrl.slurm.backfill.packer import Placement, Preemption, Reclaim, RolloutTask, fit_length


class ReferencePacker:
    def __init__(self, margin_s: float = 0.0):
        self.margin_s = float(margin_s)
        self._until: dict[Hashable, float] = {}
        self._order: dict[Hashable, int] = {}  # first-seen order of GPUs breaks ties like GapPacker
        self._running: dict[Hashable, tuple[Placement, int]] = {}
        self._pending: list[tuple[RolloutTask, int]] = []
        self._seq_of: dict[int, int] = {}
        self._next_seq = 0
        self.preemptions = 0

    def open_window(self, gpu: Hashable, now: float, until: float) -> Placement | None:
        if gpu in self._until:
            raise ValueError(f"{gpu!r} already has an open window")
        self._order.setdefault(gpu, len(self._order))
        self._until[gpu] = until
        return self._fill(gpu, now)

    def move_window(self, gpu: Hashable, now: float, until: float) -> Placement | None:
        self._until[gpu] = max(until, now)
        return None if gpu in self._running else self._fill(gpu, now)

    def close_window(self, gpu: Hashable, now: float) -> Reclaim:
        del self._until[gpu]
        run = self._running.pop(gpu, None)
        if run is None:
            return Reclaim(None, None)
        placement, seq = run
        self.preemptions += 1
        return Reclaim(Preemption(placement.task, gpu, placement.start, now), self._enqueue(placement.task, seq, now))

    def submit(self, task: RolloutTask, now: float) -> Placement | None:
        if task.task_id in self._seq_of:
            raise ValueError(f"task {task.task_id} is already pending or running")
        seq = self._next_seq
        self._next_seq += 1
        self._seq_of[task.task_id] = seq
        return self._enqueue(task, seq, now)

    def finish(self, gpu: Hashable, now: float, *, until: float | None = None, close: bool = False) -> Placement | None:
        placement, _ = self._running.pop(gpu)
        del self._seq_of[placement.task.task_id]
        if close:
            del self._until[gpu]
            return None
        if until is not None:
            self._until[gpu] = max(until, now)
        return self._fill(gpu, now)

    def withdraw(self, task_id: int) -> RolloutTask | None:
        for i, (task, _) in enumerate(self._pending):
            if task.task_id == task_id:
                del self._pending[i]
                del self._seq_of[task_id]
                return task
        return None

    def withdraw_older_than(self, version: int) -> list[RolloutTask]:
        old = [t for t, _ in self._pending if t.version < version]
        for t in old:
            self.withdraw(t.task_id)
        return old

    def pop_oldest(self) -> RolloutTask | None:
        if not self._pending:
            return None
        i = min(range(len(self._pending)), key=lambda j: (self._pending[j][0].version, self._pending[j][1]))
        task, _ = self._pending.pop(i)
        del self._seq_of[task.task_id]
        return task

    def running_on(self, gpu: Hashable) -> Placement | None:
        run = self._running.get(gpu)
        return run[0] if run else None

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def free_windows(self) -> int:
        return sum(1 for g in self._until if g not in self._running)

    def _fits(self, task: RolloutTask, now: float, until: float) -> bool:
        return now + fit_length(task.fit_s) + self.margin_s <= until

    def _enqueue(self, task: RolloutTask, seq: int, now: float) -> Placement | None:
        free = [g for g in self._until if g not in self._running and self._fits(task, now, self._until[g])]
        if free:
            best = min(free, key=lambda g: (self._until[g], self._order[g]))
            return self._start(best, task, seq, now)
        self._pending.append((task, seq))
        return None

    def _fill(self, gpu: Hashable, now: float) -> Placement | None:
        until = self._until[gpu]
        fitting = [i for i, (t, _) in enumerate(self._pending) if self._fits(t, now, until)]
        if not fitting:
            return None
        i = min(fitting, key=lambda j: (self._pending[j][0].version, self._pending[j][1]))
        task, seq = self._pending.pop(i)
        return self._start(gpu, task, seq, now)

    def _start(self, gpu: Hashable, task: RolloutTask, seq: int, now: float) -> Placement:
        until = self._until[gpu]
        placement = Placement(task, gpu, now, until, until - self.margin_s - now)
        self._running[gpu] = (placement, seq)
        return placement
