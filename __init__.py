"""hpcrl: reinforcement-learning post-training of LLMs on Slurm clusters.

The repository root is the package (see pyproject.toml), in floors that import downwards only:
`hpcrl.core` (config, schema, transport, rpc, files) at the bottom; `hpcrl.sandbox` (isolated
execution, judging) and `hpcrl.slurm` (the Slurm command layer, backfill scheduling, the
simulator, the dev cluster) on it; `hpcrl.rl` (policy, generator, learner, domains, the
trajectory store) above them; `hpcrl.jobs` (CLI, launching, supervision) on top.
"""

__version__ = "0.1.0"
