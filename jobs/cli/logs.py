"""`hpcrl logs RUN [COMPONENT] [-f]`: the stdout/stderr that a run's components wrote, local or Slurm.

    hpcrl logs RUN                     # the last --lines lines of every component's current job
    hpcrl logs RUN learner             # all of the learner's current job (stderr then stdout)
    hpcrl logs RUN learner -n 5        # its last 5 lines per file
    hpcrl logs RUN gen-0 -f            # follow it, like tail -f, across restarts (Ctrl-C stops)
    hpcrl logs RUN learner --all       # every job the learner had (restarts included)

The files are submitit's, RUN/submitit/<job id>_<task>_log.err and .out (a heterogeneous job's
components write <job id>_<component>_log.err and .out); which job ids a component had comes
from RUN/jobs.json (Slurm) or RUN/logs/index.json (local). RUN/logs/<component>.err and .out
link to each component's current files.
"""

from __future__ import annotations

import argparse
import re

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "logs",
        help="print or follow the logs of a run's components (local or Slurm)",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_run_args(p)
    p.add_argument("component", nargs="?", help="store, coordinator, learner, gen-N, sandbox-N or supervisor")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended (Ctrl-C stops)")
    p.add_argument(
        "-n", "--lines", type=int, default=None, help="last lines per file (default: 30 without COMPONENT, all with it)"
    )
    p.add_argument("--all", action="store_true", help="also the jobs the component had before its restarts")
    p.set_defaults(func=run)


def log_files(run_dir, name: str, job_id: str) -> list:
    """A job's log files: every task's .err then .out (task 0 first), or a hetjob component's."""
    folder = run_dir / "submitit"
    pattern = re.compile(rf"{re.escape(job_id)}_(\d+)_log\.(err|out)")
    found = []
    for f in folder.glob(f"{job_id}_*_log.*"):
        m = pattern.fullmatch(f.name)
        if m:
            found.append((int(m.group(1)), m.group(2) != "err", f))
    if found:
        return [f for *_, f in sorted(found)]
    het = job_id.split("+")[0]
    return [f for f in (folder / f"{het}_{name}_log.err", folder / f"{het}_{name}_log.out") if f.exists()]


def _files(run_dir, names: list[str], every: bool) -> list[tuple[str, object]]:
    from hpcrl.jobs.launch import component_jobs

    comps = component_jobs(run_dir) or {}
    out = []
    for name in names:
        ids = comps.get(name, [])
        out += [(name, f) for jid in (ids if every else ids[-1:]) for f in log_files(run_dir, name, jid)]
    return out


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.jobs.launch import component_jobs

    run_dir = resolve_run_dir(args.run, args.config)
    comps = component_jobs(run_dir)
    if comps is None:
        raise UsageError(
            f"run {run_dir.name} recorded no jobs (no jobs.json, no logs/index.json): it never started a "
            f"component, or an older hpcrl ran it; its logs are in {run_dir / 'submitit'}"
        )
    if args.component is not None and args.component not in comps:
        raise UsageError(f"{args.component!r} is not a component of run {run_dir.name}; components: {', '.join(comps)}")
    names = [args.component] if args.component else list(comps)
    files = _files(run_dir, names, args.all)
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
        lines = args.lines if args.lines is not None else (None if args.component else 30)
        if lines is not None:
            text = "\n".join(text.splitlines()[-lines:] if lines > 0 else [])
        text = text.rstrip("\n")  # -f continues with whole lines: no blank line in between
        print(f"==> {name}: {f} <==\n{text}", flush=True)
    while args.follow:  # Ctrl-C ends it (exit 130)
        time.sleep(0.5)
        for name, f in _files(run_dir, names, False):  # a restarted component's new job joins in
            if f not in offsets:
                offsets[f] = 0
                files.append((name, f))
                print(f"==> {name}: {f} <==", flush=True)
        for name, f in files:
            try:
                with open(f, "rb") as fh:
                    fh.seek(offsets[f])
                    new = fh.read()
            except FileNotFoundError:
                continue
            if new:
                cut = new.rfind(b"\n") + 1  # whole lines only; the rest waits for its newline
                offsets[f] += cut
                for line in new[:cut].decode(errors="replace").splitlines():
                    print(f"[{name}] {line}", flush=True)
    return 0
