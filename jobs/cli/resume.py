"""`hpcrl resume RUN`: continue a run whose launcher (local) or supervisor (Slurm) is gone.

    hpcrl resume runs/quickstart-20261202-120000-ab12        # local: starts its components again
    hpcrl resume quickstart-20261202-120000-ab12 --quiet     # a run id under the config's run_root

Every component resumes from the run directory (the learner from its newest whole checkpoint,
the store writer from its shard, the coordinator from its state file), so nothing trained is
trained again and nothing stored is lost. A local run (`hpcrl run`, killed or its machine
rebooted) runs in the foreground again exactly as under `hpcrl run`, once the old launcher's
components have stopped; a second `hpcrl resume` of a run already being driven fails. A Slurm
run gets a new supervisor job, which restarts every component no longer in the queue; a failed
or cancelled run is continued too, with its restart budgets afresh (`hpcrl supervise` leaves
those alone).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "resume",
        help="continue a run whose launcher or supervisor is gone",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_run_args(p)
    p.add_argument("--timeout-min", type=float, help="local: give up (exit 1) if not done after this many minutes")
    p.add_argument("--quiet", action="store_true", help="local: no progress line, only the summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from hpcrl.jobs.checks import check_run
    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.cli.run import drive, stop_on_signals
    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.jobs.resume import (
        RunLocked,
        ensure_supervisor,
        load_run_config,
        local_resume_check,
        read_launch,
        run_lock,
    )
    from hpcrl.rl.domains import DomainError, load_domains

    stop_on_signals()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = resolve_run_dir(args.run, args.config)
    if (run_dir / "jobs.json").exists():
        try:
            print(ensure_supervisor(run_dir, revive=True))
        except (RunLocked, ValueError) as exc:
            raise UsageError(str(exc)) from None
        return 0
    cfg = load_run_config(run_dir)
    search = read_launch(run_dir).get("search_path") or []
    try:
        domains = load_domains(cfg.domains, search)
    except DomainError as exc:
        raise UsageError(f"{exc} (search path {search} from {run_dir}/launch.json)") from None
    check_run(cfg, domains, run_root=False)  # what changed on this machine since: a moved model, a sandbox
    try:
        with run_lock(run_dir):
            why = local_resume_check(run_dir, cfg)
            if why is not None:
                raise UsageError(why)
            print(f"resuming run {run_dir.name}", flush=True)
            return drive(cfg, run_dir, search, domains, args)
    except RunLocked as exc:
        raise UsageError(str(exc)) from None
