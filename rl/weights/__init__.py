"""Policy versions from the learner to the generators.

`shards` publishes each version as per-rank safetensors shards in the run directory, written
off the training step's critical path and read by generators while they keep sampling;
`direct` also sends them over a torch.distributed group of their own (`policy.weight_sync:
direct`).
"""
