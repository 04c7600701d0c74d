"""What the rollout decisions see of the cluster: one snapshot of the queue (typed, frozen).

    snap = QueueSnapshot(now, nodes, partitions, pending, running, bf_resolution_s=60, bf_interval_s=30)

Every decision in this package (slurm/backfill/planner.py, give_way.py) is a pure function of
a snapshot and of the run's own record of its rollout jobs (book.py). The live run reads one
through `slurm/backfill/live.py` (squeue --start, squeue, scontrol show node and partition);
the simulator builds one from its simulated controller (slurm/sim/slurm.py). Nodes, partitions
and pending jobs are the `slurm.queries` types the live queries return.
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass

from hpcrl.slurm.queries import NodeState, PartitionState, PendingJob, RunningJob

__all__ = [
    "QueueSnapshot",
    "PendingIndex",
    "NodeState",
    "PartitionState",
    "PendingJob",
    "RunningJob",
    "backfill_parameters",
]


@dataclass(frozen=True)
class PendingIndex:
    """The pending jobs sorted once per snapshot, so that a decision need not look at all of them."""

    by_start: tuple[PendingJob, ...]  # earliest expected start first, those without one last
    by_priority: tuple[PendingJob, ...]  # highest priority first, ties in the snapshot's order
    by_id: dict[str, PendingJob]


@dataclass(frozen=True)
class QueueSnapshot:
    """The controller's view at `now` (Slurm's local time, as squeue prints it)."""

    now: dt.datetime
    nodes: tuple[NodeState, ...]  # idle GPUs, CPUs and memory per node
    partitions: tuple[PartitionState, ...]  # which nodes each partition has
    pending: tuple[PendingJob, ...]  # with Slurm's expected starts, reasons and priorities
    running: tuple[RunningJob, ...]  # with their nodes and planned ends (start + time limit)
    bf_resolution_s: int = 60  # Slurm's backfill plans in steps of this (SchedulerParameters)
    bf_interval_s: float = 30.0  # ... and runs a pass this often

    @functools.cached_property
    def index(self) -> PendingIndex:
        """Sorted once (O(n log n), n pending jobs; about linear where squeue's order already holds)."""
        far = dt.datetime.max
        pending = self.pending
        by_start = tuple(sorted(pending, key=lambda j: j.expected_start or far))
        order = sorted(range(len(pending)), key=lambda i: -pending[i].priority)
        return PendingIndex(by_start, tuple(pending[i] for i in order), {j.job_id: j for j in pending})


def backfill_parameters(params: dict[str, str]) -> tuple[int, float]:
    """(bf_resolution, bf_interval) in seconds from SchedulerParameters (pure); Slurm's
    defaults, 60 and 30 s, where absent or unreadable."""
    try:
        resolution = int(params.get("bf_resolution") or 60)
    except ValueError:
        resolution = 60
    try:
        interval = float(params.get("bf_interval") or 30)
    except ValueError:
        interval = 30.0
    return resolution, interval
