"""Trace-driven simulator of GPU utilization under the rollout policies (`hpcrl sim`).

    from hpcrl.slurm.sim.run import simulate
    from hpcrl.slurm.sim.trace import load_trace
    result = simulate(load_trace("slurm/sim/traces/heavy-tail-300.yaml"), "backfill")

`trace` reads a cluster, a training loop, hundreds of task domains and (optionally) the Slurm
partition the run shares with other users from YAML (examples in `traces/`), or replays the
measured episodes of a run (`replay`); `engine` is the discrete-event machinery and the books
(GPU time per role; busy time split into useful, dropped and open work); `policies` the
baselines (`sync`: every GPU generates, then every GPU trains; `sync-split`: the weaker
split-cluster one; `async`: AReaL's staleness bound, no rollout jobs); `backfill` the live
run, deciding with the live code; `slurm` the simulated controller its rollout jobs are
planned against (`profile`: a node's free resources over time in a backfill pass) and
`workload` the other users' jobs there; `shared` several experiments'
generators on shared GPUs against split ones; `run` runs a policy and formats, plots and
checks the result; `report` is `hpcrl sim`'s one function.

What `backfill` takes from the live run, unchanged: the planner's rounds (slurm/backfill/book.py:
window from the queue's expected starts, whole jobs by GPUs, CPUs and memory, --time and
--time-min, withdrawal, give-way, the record and its counts), on the supervisor's clock (a tick
every poll, a look for give-way between); a rollout job's lease and end rule and its estimator
(slurm/backfill/lending.py, estimates.py); the generator's lending rule; the coordinator's
flow-control bound. What it models rather than runs: the generator and learner themselves (a
turn is a GPU-exclusive task of its trace duration; episodes in flight are taken one turn at a
time; a training step takes the trace's time), sandboxes (a pool of slots, FIFO), the weights'
sync and reload (fixed times), a rollout job's start-up (a fixed time), and Slurm (slurm.py's
module doc says which of its scheduling it reproduces: the main scheduler, backfill passes at
bf_interval booking by time limits aligned to bf_resolution, --time-min; and which not:
multi-node jobs, fairshare and QOS, preemption by partition tiers, the limits and run time of a
pass, KillWait). Not modelled at all: failures and restarts of components, the network and the
trajectory store, memory limits of a generator, and the time the planner's own Slurm commands
take. Other users' jobs are drawn from the trace's workload; their start delays are measured
against the same simulation without rollout jobs.
"""
