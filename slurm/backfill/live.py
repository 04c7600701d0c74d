"""The live cluster as the rollout decisions see it: snapshots read, cancellations sent (slurm/queries.py).

    snap = read_snapshot(params)                        # squeue --start, squeue, scontrol show node/partition
    window = live_window("gpu", exclude=own_ids, need=Resources(...))   # find_window on a fresh snapshot
    cluster = LiveCluster(params)                       # what book.SlurmRollouts reads and acts through

`params`: the controller's SchedulerParameters when the caller has read them already (they
change only with a reconfigure); otherwise `scontrol show config` is asked here.
"""

from __future__ import annotations

import datetime as dt

from hpcrl.slurm import queries
from hpcrl.slurm.backfill.planner import ClusterWindow, find_window
from hpcrl.slurm.backfill.snapshot import QueueSnapshot, backfill_parameters
from hpcrl.slurm.sbatch import Resources

__all__ = ["read_snapshot", "live_window", "LiveCluster"]


def read_snapshot(params: dict[str, str] | None = None) -> QueueSnapshot:
    """The queue as the controller has it now: four commands, pending jobs first (their
    expected starts age fastest), and the pending jobs indexed (QueueSnapshot.index)."""
    resolution, interval = backfill_parameters(queries.scheduler_parameters() if params is None else params)
    now = dt.datetime.now().replace(microsecond=0)
    pending = queries.pending_jobs()
    nodes = queries.nodes()
    parts = queries.partitions(nodes)
    running = queries.running_jobs()
    snap = QueueSnapshot(now, tuple(nodes), tuple(parts), tuple(pending), tuple(running), resolution, interval)
    _ = snap.index  # sorted once here: the decisions on it then look at as few jobs as they need
    return snap


def live_window(
    partition: str,
    exclude: tuple[str, ...] = (),
    params: dict[str, str] | None = None,
    need: Resources | None = None,
) -> ClusterWindow:
    """`find_window` on what the controller says now."""
    s = read_snapshot(params)
    return find_window(
        partition, s.nodes, s.partitions, s.pending, s.now, exclude, s.bf_resolution_s, s.bf_interval_s, need
    )


class LiveCluster:
    """book.Cluster over the live controller."""

    def __init__(self, params: dict[str, str] | None = None):
        self.params = params

    def snapshot(self) -> QueueSnapshot:
        return read_snapshot(self.params)

    def job_states(self, job_ids: list[str]) -> dict[str, str]:
        return queries.job_states(job_ids)

    def preempt_time(self, job_id: str) -> str | None:
        info = queries.show_job(job_id) or {}
        when = info.get("PreemptTime", "None")
        return None if when in ("None", "Unknown", "") else when

    def cancel(self, job_ids: list[str]) -> None:
        queries.cancel(job_ids)

    def signature(self, partitions: list[str]) -> tuple:
        """(job id, state) of every job in these partitions: it changes when one started, ended or was queued."""
        return queries.partition_jobs(partitions)
