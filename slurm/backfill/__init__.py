"""Backfill-aware scheduling: short rollout work packed into idle GPU time, never delaying an owner.

    from hpcrl.slurm.backfill.packer import GapPacker             # tasks into idle windows of allocations
    from hpcrl.slurm.backfill.planner import BackfillPlanner      # rollout jobs sized to Slurm's backfill holes

`packer` decides which rollout task goes into which idle window (a learner waiting for data, a
generator waiting for a sandbox, a backfilled rollout job), with `estimates` of task durations
from history; `planner` reads the partition (`squeue --start`, sinfo) and sizes rollout jobs
to the windows Slurm's backfill scheduler leaves; `taskqueue` leases tasks to them through the
shared filesystem; `worker` is the process inside such a job. The simulator (slurm/sim/)
drives the same packer and estimator with simulated time.
"""
