"""`hpcrl report RUN`: what a run cost: GPU-, CPU- and wall-hours and queue wait per role and per domain.

    hpcrl report runs/quickstart-20261202-120000-ab12     # a table per role, then per domain
    hpcrl report quickstart-20261202-120000-ab12 --jobs   # a run id under config.yaml's run_root; every job life too
    hpcrl report RUN --json                               # one JSON object, for tools

A Slurm run is read from one `sacct -X -D` over every job id in its jobs.json (restarts,
requeued lives, hetjob groups, array tasks); the hours of each role are then split across the
domains by the costs the trajectories record (generator: generate_s, sandbox: sandbox time,
learner: trained tokens, store and coordinator: trajectories). A local run has no Slurm
accounting and says so: only its component processes' wall time. jobs/accounting.py holds every
rule. Exit status 1 when sacct fails (run it where the run's cluster answers: SLURM_CONF).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="GPU-/CPU-hours and queue wait of a run per role and per domain (sacct + the trajectories' costs)",
        description=__doc__.split("\n\n")[0],
    )
    add_run_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (roles, total, jobs, domains, rules)")
    p.add_argument("--jobs", action="store_true", help="also list every job life (sacct row) of a Slurm run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from hpcrl.jobs.accounting import account_run, accounting_text
    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.slurm.command import SlurmCommandError

    run_dir = resolve_run_dir(args.run, args.config)
    try:
        acct = account_run(run_dir)
    except SlurmCommandError as exc:
        hint = "" if exc.hint else "; run it where the run's cluster answers (SLURM_CONF)"
        print(f"hpcrl report: error: sacct failed for run {run_dir.name}: {exc.summary()}{hint}", file=sys.stderr)
        return 1
    print(json.dumps(acct) if args.json else accounting_text(acct, jobs=args.jobs))
    return 0
