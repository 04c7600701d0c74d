"""Trace-driven simulator of GPU utilization under the rollout policies (`hpcrl sim`).

    from hpcrl.slurm.sim.run import simulate
    from hpcrl.slurm.sim.trace import load_trace
    result = simulate(load_trace("slurm/sim/traces/heavy-tail-300.yaml"), "backfill")

`trace` reads a cluster, a training loop and hundreds of task domains from YAML (examples in
`traces/`), or replays the measured episodes of a run; `engine` is the discrete-event
machinery and the books (GPU time per role; busy time split into useful, dropped and open
work); `policies` the baselines (`sync`: every GPU generates, then every GPU trains;
`sync-split`: the weaker split-cluster one; `async`), `backfill` ours, which lends idle
windows through the real `slurm.backfill` packer and takes its estimates and lending
decisions from `slurm.backfill.estimates`; `run` runs a policy and formats, plots and checks
the result.
"""
