"""`hpcrl supervise RUN`: make sure a Slurm run has a live supervisor job; submit one if not.

    hpcrl supervise runs/quickstart-20261202-120000-ab12
    */10 * * * * hpcrl supervise /lustre/me/runs/RUN       # a crontab line: the supervisor of the supervisor

Idempotent: under the run's lock it looks the recorded supervisor job up in squeue and submits
a new one only when it is gone (killed, its node failed, out of requeues), or with `--stale-s S`
also when it is RUNNING but its heartbeat is older than S seconds (hung: cancelled first). Every
component of a Slurm run calls it so when the supervisor's heartbeat goes stale. The new supervisor
re-reads jobs.json (components, restart times) and carries on. A finished, failed or cancelled
run is left alone (`hpcrl resume` continues failed and cancelled ones).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "supervise",
        help="submit a supervisor job for a Slurm run that has none alive",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_run_args(p)
    p.add_argument(
        "--stale-s",
        type=float,
        help="also replace a RUNNING supervisor whose heartbeat is older than this many seconds (hung)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.jobs.resume import RunLocked, ensure_supervisor

    run_dir = resolve_run_dir(args.run, args.config)
    try:
        print(ensure_supervisor(run_dir, stale_s=args.stale_s))
    except (RunLocked, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return 0
