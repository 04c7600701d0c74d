"""`hpcrl logs RUN [COMPONENT] [-f]`: the stdout/stderr that a Slurm run's components wrote.

    hpcrl logs RUN                     # the last --lines lines of every component's current job
    hpcrl logs RUN learner             # all of the learner's current job (stderr then stdout)
    hpcrl logs RUN gen-0 -f            # follow it, like tail -f (Ctrl-C stops)
    hpcrl logs RUN learner --all       # every job the learner had (restarts included)

The files are submitit's: RUN/submitit/<job id>_0_log.err and .out (a heterogeneous job's
components write <job id>_<component>_log.err and .out).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "logs",
        help="print or follow the logs of a Slurm run's components",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_run_args(p)
    p.add_argument("component", nargs="?", help="store, coordinator, learner, gen-N, sandbox-N or supervisor")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended (Ctrl-C stops)")
    p.add_argument("-n", "--lines", type=int, default=30, help="lines per file without COMPONENT (default 30)")
    p.add_argument("--all", action="store_true", help="also the jobs the component had before its restarts")
    p.set_defaults(func=run)


def log_files(run_dir, name: str, job_id: str) -> list:
    folder = run_dir / "submitit"
    het = job_id.split("+")[0]
    for stem in (f"{job_id}_0_log", f"{het}_{name}_log"):
        files = [folder / f"{stem}.{ext}" for ext in ("err", "out")]
        if any(f.exists() for f in files):
            return [f for f in files if f.exists()]
    return []


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.cli.cancel import slurm_jobs
    from hpcrl.jobs.cli.status import resolve_run_dir

    run_dir = resolve_run_dir(args.run, args.config)
    jobs = slurm_jobs(run_dir)
    comps = dict(jobs["components"])
    if jobs.get("supervisor"):
        comps["supervisor"] = jobs["supervisor"]
    if args.component is not None and args.component not in comps:
        raise UsageError(f"{args.component!r} is not a component of run {run_dir.name}; components: {', '.join(comps)}")
    names = [args.component] if args.component else list(comps)
    files = []
    for name in names:
        ids = comps[name].get("history", [comps[name]["job_id"]]) if args.all else [comps[name]["job_id"]]
        files += [(name, f) for jid in ids for f in log_files(run_dir, name, jid)]
    if not files:
        print(
            f"no log files yet for {', '.join(names)} in {run_dir / 'submitit'} (jobs still pending?)", file=sys.stderr
        )
        return 1
    offsets = {}
    for name, f in files:
        data = f.read_bytes()
        offsets[f] = len(data)
        text = data.decode(errors="replace")
        if not args.component:
            text = "\n".join(text.splitlines()[-args.lines :])
        text = text.rstrip("\n")  # -f continues with whole lines: no blank line in between
        print(f"==> {name}: {f} <==\n{text}", flush=True)
    while args.follow:  # Ctrl-C ends it (exit 130)
        time.sleep(0.5)
        for name, f in files:
            with open(f, "rb") as fh:
                fh.seek(offsets[f])
                new = fh.read()
            if new:
                offsets[f] += len(new)
                for line in new.decode(errors="replace").splitlines():
                    print(f"[{name}] {line}", flush=True)
    return 0
