"""Trace-driven simulator of GPU utilization under the rollout policies (`hpcrl sim`).

    from hpcrl.slurm.sim.run import simulate
    from hpcrl.slurm.sim.trace import load_trace
    result = simulate(load_trace("slurm/sim/traces/heavy-tail-300.yaml"), "backfill")

`trace` reads a cluster, a training loop and hundreds of task domains from YAML (examples in
`traces/`); `engine` is the discrete-event machinery and GPU-time accounting; `policies` the
baselines (`sync`, `async`), `backfill` ours, which lends idle windows through the real
`slurm.backfill` packer; `run` runs a policy and formats, plots and checks the result.
"""
