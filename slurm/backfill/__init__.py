"""The run's rollout decisions: rollout jobs in Slurm's backfill windows, and lending inside a generator.

    from hpcrl.slurm.backfill.planner import plan_rollout_jobs   # size rollout jobs to a window
    from hpcrl.slurm.backfill.book import SlurmRollouts          # plan, reap, withdraw, give way

Every decision is a pure function of a `QueueSnapshot` (`snapshot`: nodes with idle GPUs, CPUs
and memory, running jobs with their planned ends, pending jobs with Slurm's expected starts and
priorities) and of the run's record of its rollout jobs: `planner` finds the window and sizes
rollout jobs to it (--time, --time-min, how many) and says which pending ones to withdraw;
`give_way` which running ones keep another user's job from starting; `lending` what a generator
and a rollout job decide about episodes; `estimates` the duration quantiles they decide with.
`book` keeps the record and runs the rounds (plan; reap, withdraw, give way) against a cluster:
`live` reads the real controller through slurm/queries.py and cancels through it, for the run's
supervisor (jobs/rollout_plan.py, jobs/rollout_slurm.py); the simulator (slurm/sim/) runs the
same rounds against its simulated controller.
"""
