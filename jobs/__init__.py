"""The top floor: the CLI, launching a run's roles as jobs, supervising them, and what a run shows.

    hpcrl run config.yaml             # jobs/cli/run.py -> launch.plan -> localrun.LocalRun
    hpcrl submit config.yaml executor=slurm   # -> supervise.submit_run (jobs + a supervisor job)

`checks` is what `validate`, `run` and `submit` check before anything starts (model, sandbox,
run_root, optional packages, Slurm partitions and GRES); `components` are the picklable
callables each job runs (store, coordinator, sandbox server, learner, generator); `launch`
knows a run's roles and turns each into Slurm options and a submitit executor (the one
translation), and links each job's logs by component name; `boot` is the first thing every job's python runs (it
holds an early SIGUSR2 until the component can drain on it); `supervise` watches the jobs and
restarts what dies, on Slurm (`SupervisorComponent`) and, through `localrun`, on this machine
(`LocalRun`), deciding as `restarts` says (budgets that refill, backoff, hangs from heartbeats,
a component failing twice at start the same way stops the run), and feeds TensorBoard/W&B;
`rollout_plan` submits backfill rollout jobs (`rollout`) into idle-GPU windows (on Slurm through
`rollout_slurm`, which runs slurm/backfill's decisions: window, size, withdrawal, give-way);
`scripts` renders plain sbatch scripts and is the command they run; `rundir`
creates run directories; `report` and `slurmstatus` are what `hpcrl run` and `hpcrl status`
print, `plots` draws `hpcrl plot`'s pictures and `accounting` is `hpcrl report`'s sacct and cost
figures; `chaos` is the fault drill; `cli/` has one module per verb.
"""
