"""`hpcrl sbatch CONFIG [KEY=VALUE ...] -o DIR`: write plain sbatch scripts to submit a run by hand.

    hpcrl sbatch config.yaml executor=slurm -o scripts/ && bash scripts/submit.sh
    hpcrl sbatch config.yaml executor=slurm -o scripts/ --hetjob     # one heterogeneous job

Creates the run directory (resolved config), then writes one readable script per component
(store.sbatch, coordinator.sbatch, learner.sbatch, gen-N.sbatch, sandbox.sbatch as a job array
when a domain executes code, supervisor.sbatch) and submit.sh, which submits them and records
the job ids in the run's jobs.json. With --hetjob: one `#SBATCH hetjob` script for every
component in a single allocation (no supervisor: a dead component is not replaced).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_config_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sbatch",
        help="write readable sbatch scripts (and submit.sh) for a run",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_config_args(p, run_id=True)
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="folder the scripts are written to")
    p.add_argument("--hetjob", action="store_true", help="one heterogeneous job for all components")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpcrl.core.files import atomic_write_json
    from hpcrl.jobs.cli import UsageError, load_experiment
    from hpcrl.jobs.launch import plan
    from hpcrl.jobs.rundir import create_run_dir
    from hpcrl.jobs.scripts import write_scripts
    from hpcrl.jobs.slurmstatus import SBATCH_FILE

    cfg, search, domains = load_experiment(args, "sbatch", slurm=True)
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out}: exists and is not a folder")
    run_dir = create_run_dir(cfg, args.run_id)
    try:
        paths = write_scripts(
            cfg,
            run_dir,
            out,
            plan(cfg, run_dir, domains, search),
            search,
            hetjob=args.hetjob,
        )
    except ValueError as exc:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # nothing was submitted: leave no half-made run behind
        raise UsageError(str(exc)) from None
    # `hpcrl status` says so of a run nobody has submitted yet, and where its submit.sh is.
    atomic_write_json(run_dir / SBATCH_FILE, {"submit": str((out / "submit.sh").resolve())})
    print(f"run directory {run_dir}")
    for p in paths:
        print(f"  {p}")
    print(f"submit with: bash {out / 'submit.sh'}")
    return 0
