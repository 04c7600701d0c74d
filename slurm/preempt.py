"""Is a partition preemptible by another? The check behind `scheduler.rollout_partition`.

    problem = preemption_problem("scavenger", "gpu", queries.partitions(), queries.show_config())
    check_preemptible("scavenger", "gpu")    # the same on the live cluster; ValueError naming what to set

Backfill rollout jobs (jobs/rollout_plan.py) may run in a "scavenger" partition so that Slurm
itself preempts them the moment a job of the GPU partition can use their GPUs: with
`PreemptType=preempt/partition_prio` a pending job of a partition with a higher `PriorityTier`
preempts running jobs of a lower tier on the nodes it needs, within one scheduling pass. A
preempted job gets SIGCONT and SIGTERM, its EndTime becomes now + the partition's `GraceTime`,
and it is killed (SIGTERM, KillWait, SIGKILL) once that passes (at Slurm's next periodic time
check, measured up to ~13 s late on the dev cluster). A job that exits first ends COMPLETED; a
killed one PREEMPTED.

That only holds when the rollout partition's jobs are preemptible by the GPU partition's: the
cluster preempts by partition tier, the rollout partition's tier is lower, its nodes are the GPU
partition's (a rollout job elsewhere is preempted by nobody the planner watches), and its
PreemptMode ends jobs (CANCEL, or REQUEUE: rollout jobs are submitted --no-requeue, so Slurm
cancels them instead). SUSPEND would freeze a rollout job holding its leases and GPU memory, and
OFF never preempts: both are refused.

Preemption does not make the windows unnecessary: Slurm 22.05 does not start a lower-tier job in
resources it reserved for a higher tier's pending job, preemptible or not (measured on the dev
cluster: a scavenger job whose --time ran past a pending gpu job's planned start stayed PENDING,
"reserved for jobs in higher priority partitions", one that ended before it started at once).
Rollout jobs are still sized to `squeue --start` windows; preemption covers what the plan could
not see: jobs that end early and pull a pending job's start into the window.
"""

from __future__ import annotations

from hpcrl.slurm import queries

# hpcrl imports inside functions here would load yaml for every importer of this module (start-up speed).

__all__ = ["preemption_problem", "check_preemptible"]

_ENDS_JOBS = ("CANCEL", "REQUEUE")


def preemption_problem(rollout: str, gpu: str, partitions, config: dict[str, str]) -> str | None:
    """Why jobs of partition `rollout` are not preempted for jobs of `gpu` (pure), or None when they are.

    `partitions`: queries.PartitionState list; `config`: queries.show_config()."""
    by_name = {p.name: p for p in partitions}
    fix = (
        "set scheduler.rollout_partition to a partition that slurm.generator.partition's jobs preempt, "
        'or to "" (rollout jobs then give way themselves)'
    )
    for name in (rollout, gpu):
        if name not in by_name:
            return f"partition {name!r} does not exist (partitions: {', '.join(sorted(by_name))}); {fix}"
    if rollout == gpu:
        return f"scheduler.rollout_partition is slurm.generator.partition ({gpu!r}): nothing preempts it; {fix}"
    ptype = config.get("PreemptType", "preempt/none")
    if ptype != "preempt/partition_prio":
        return (
            f"the cluster's PreemptType is {ptype}, so partition tiers preempt nothing "
            f"(preempt/partition_prio is needed); {fix}"
        )
    r, g = by_name[rollout], by_name[gpu]
    if r.priority_tier >= g.priority_tier:
        return (
            f"partition {rollout!r} has PriorityTier={r.priority_tier}, not below that of {gpu!r} "
            f"({g.priority_tier}): {gpu!r} jobs cannot preempt its jobs; {fix}"
        )
    outside = sorted(set(r.nodes) - set(g.nodes))
    if outside or not r.nodes:
        where = f"nodes {','.join(outside)} are not in {gpu!r}" if outside else "it has no nodes"
        return f"partition {rollout!r} is not over the nodes of {gpu!r} ({where}); {fix}"
    mode = r.preempt_mode.upper()
    if not any(m in mode.split(",") for m in _ENDS_JOBS):
        return f"partition {rollout!r} has PreemptMode={mode}: preemption must end its jobs (CANCEL or REQUEUE); {fix}"
    return None


def check_preemptible(rollout: str, gpu: str) -> None:
    """Raise ConfigError on scheduler.rollout_partition (one line: what is wrong, what to set)
    unless the live cluster preempts `rollout`'s jobs for `gpu`'s."""
    from hpcrl.core.schema import ConfigError

    problem = preemption_problem(rollout, gpu, queries.partitions(), queries.show_config())
    if problem:
        raise ConfigError("scheduler.rollout_partition", f"{rollout!r}: {problem}")
