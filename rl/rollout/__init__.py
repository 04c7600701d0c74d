"""Rollout: decoding, generating trajectories, evaluating.

    from hpcrl.rl.rollout.generator import Generator   # many episodes in flight, batched sampling

`engine` decodes with continuous batching and KV caches kept across an episode's turns
(`sampler` is a one-call batch sampler over it), `explore` raises the temperature of a task
whose last group was all wrong, `generator` produces trajectories from environments (`report`
what it tells the coordinator and the metrics endpoint),
`remote` links a generator to the run (coordinator, store, sandboxes, policy versions),
`service` runs it as a run component (the loop `jobs.components` wraps) and
`evaluate` measures pass@k of a policy version on held-out tasks.
"""
