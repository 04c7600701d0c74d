"""`hpcrl submit CONFIG [KEY=VALUE ...]`: start a run on Slurm and return; the jobs keep running.

    hpcrl submit config.yaml executor=slurm                       # or `executor: slurm` in the file
    hpcrl submit config.yaml executor=slurm learner.max_steps=50 --run-id smoke
    hpcrl submit config.yaml executor=slurm --dry-run             # print the sbatch scripts only

Creates the run directory, submits the store writer and coordinator (slurm.coordinator), the
sandbox servers as one job array (slurm.sandbox; only when a domain executes code), the learner
(slurm.learner), one job per generator (slurm.generator) and a small supervisor job that
restarts components that die or hang (within the budgets of `supervise.*`: restarts per hour,
with backoff; past that the run fails and cancels its jobs). Prints the run id and every
component's job id; <run>/jobs.json keeps them for `hpcrl status`, `hpcrl cancel` and `hpcrl
logs`. Warns first about cluster settings that break requeue or the time-limit signal
(`scontrol show config`: JobRequeue=0, a short KillWait, ...).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_config_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="start a run as Slurm jobs (executor: slurm) and return",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_config_args(p, run_id=True)
    p.add_argument("--dry-run", action="store_true", help="print each component's sbatch script; submit nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from hpcrl.jobs.checks import RunCheckError, check_cluster
    from hpcrl.jobs.cli import load_experiment
    from hpcrl.jobs.launch import dry_run_scripts, plan, preflight
    from hpcrl.jobs.rollout_plan import check_rollout_partition, rollout_summary
    from hpcrl.jobs.rundir import check_run_id, create_run_dir
    from hpcrl.jobs.supervise import submit_run

    cfg, search, domains = load_experiment(args, "submit", slurm=True)
    if args.dry_run:
        # Scripts name the run directory a submission would create; nothing is created or queued.
        run_dir = Path(cfg.experiment.run_root) / (args.run_id or "RUN_ID")
        for name, text in dry_run_scripts(cfg, run_dir, plan(cfg, run_dir, domains, search)).items():
            print(f"# ===== {name} =====\n{text}")
        return 0
    # The cluster is asked before the run directory exists, so one that does not answer leaves
    # nothing behind; a bad --run-id is still refused first, without asking it.
    check_run_id(cfg, args.run_id)
    # Partitions, GRES, CPUs, memory, nodes and time limits against the cluster (jobs/checks.py).
    why = check_cluster(cfg, domains)
    if why:
        raise RunCheckError(why)
    check_rollout_partition(cfg)  # one Slurm would not preempt: refused, nothing created
    warnings = preflight(cfg)
    run_dir = create_run_dir(cfg, args.run_id)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    record = submit_run(cfg, run_dir, plan(cfg, run_dir, domains, search), search)
    print(f"run {run_dir.name}  ({run_dir})")
    for name, c in record["components"].items():
        print(f"  {name:<12} job {c['job_id']:<10} partition {getattr(cfg.slurm, c['role']).partition}")
    print(f"  {'supervisor':<12} job {record['supervisor']['job_id']:<10} partition {cfg.slurm.coordinator.partition}")
    print(f"  {rollout_summary(cfg)}")
    print(f"follow it with `hpcrl status {run_dir}`; stop it with `hpcrl cancel {run_dir}`")
    return 0
