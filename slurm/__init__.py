"""Slurm: the command layer, and the two wings built on it.

    from hpcrl.slurm.command import run_slurm       # the one door to sbatch, squeue, sinfo, scontrol, sacct
    from hpcrl.slurm import parse, queries          # pure parsers; what the cluster looks like now
    from hpcrl.slurm.sbatch import render_script    # plain and heterogeneous sbatch scripts

`command` runs every Slurm tool (timeouts, hints on failure); `parse` holds pure functions from
their parsable output to data; `queries` asks the cluster (partitions, nodes, pending jobs,
start estimates, accounting); `sbatch` renders scripts. `backfill/` packs rollout work into
idle GPU time; `sim/` simulates the rollout policies on traces; `devcluster/` starts a real
single-machine Slurm for tests and development (`make devcluster`).
"""
