"""Reinforcement learning: the policy, rollout generation, the learner, and what connects them.

    from hpcrl.rl.model.policy import Policy            # a Hugging Face causal LM and its tokenizer
    from hpcrl.rl.rollout.generator import Generator    # many episodes in flight, batched sampling
    from hpcrl.rl.learner.service import run_learner    # DeepSpeed ZeRO-3: read the store, train, publish

rl/ is built in wings, each a package whose `__init__` is its map, imported in one direction
only (a wing may import the wings listed before it; tests/test_architecture.py checks it):

    common/       registries, the busy meter, the distributed environment
    record/       the trajectory record, its columnar form and its checks, once
    store/        HDF5 shards, the writer and reader, acknowledged delivery
    model/        the policy model, tiny models built here, log-probabilities
    domains/      task families: environments, rewards, problems
    coordinator/  which episode next, leases to generators, the run's event logs
    audit/        what the run recorded of itself, read back
    weights/      policy versions from the learner to the generators
    rollout/      decoding engine, generator, evaluation
    learner/      losses, batching, the DeepSpeed engine and its service loop
"""
