"""hpcrl: reinforcement-learning post-training of LLMs on Slurm clusters.

The repository root is the package (see pyproject.toml): `hpcrl.jobs` holds the submitit job
components and the CLI, `hpcrl.rl` the policy/generator/learner, `hpcrl.sandbox` the isolated
execution backends, `hpcrl.slurm` the Slurm command layer, scheduler and dev cluster.
"""

__version__ = "0.1.0"
