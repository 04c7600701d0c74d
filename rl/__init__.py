"""Reinforcement learning: the policy, rollout generation, the learner, and what connects them.

    from hpcrl.rl.policy import Policy               # a Hugging Face causal LM and its tokenizer
    from hpcrl.rl.generator import Generator         # many episodes in flight, batched sampling
    from hpcrl.rl.learner_service import run_learner # DeepSpeed ZeRO-3: read the store, train, publish

`trajectory` is the record of one episode; `store/` keeps them (HDF5 shards, the wire form,
acknowledged delivery). `domains/` are the task families and their environments and rewards;
`tasks` hands out episodes and `coordinator` leases them across generators with flow control.
`models` builds local Hugging Face checkpoints and tokenizers, `policy` loads them; `alphabet`
is the tiny model's vocabulary from the domains. `engine` decodes with continuous batching and
KV caches (`sampler` is a one-call batch sampler over it), `generator` produces trajectories,
`remote` links a generator to the run (coordinator, store, sandboxes, policy versions).
`batch` groups trajectories, `packing` lays a group out so its shared prompt is computed once,
`algorithms` holds the losses, `logprobs` the chunked log-probabilities and entropy they use,
`reference` the KL penalty's reference model, `schedule` the learning rate, `diagnostics` the
per-step statistics of a batch; `learner` is the DeepSpeed engine (`dsconfig` its config,
`collectives` its reductions on the backend's device, `distenv` its ranks and the run's
authenticated rendezvous store (the direct path's too), `checkpoints` which
checkpoint to resume from) and `learner_service` its loop. `weights` publishes policy
versions as per-rank shards, `weight_direct` also sends them over torch.distributed; `meter`
measures busy fractions; `inprocess` runs generator and learner in one process for debugging;
`synth` makes synthetic trajectories for benchmarks and drills. What a run recorded of itself:
`audit` (the learner's lineage, checked against the store), `events` (the coordinator's lease
and timeline logs) and `trace` (one trajectory's life, for `hpcrl traj trace`).
"""
