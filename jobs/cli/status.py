"""`hpcrl status [RUN]`: where a run stands: its Slurm jobs, step, reward and throughput.

    hpcrl status                                          # recent runs under config.yaml's run_root
    hpcrl status runs/quickstart-20261202-120000-ab12     # a run directory
    hpcrl status quickstart-20261202-120000-ab12          # a run id under config.yaml's run_root
    hpcrl status --json RUN                               # one JSON object with a `components` list
    hpcrl status --watch RUN                              # refresh every 2 s until Ctrl-C

For a Slurm run (`hpcrl submit`, or submit.sh of `hpcrl sbatch`) each component shows its job
id, state (squeue, then sacct once it has left the queue), node, elapsed and time left,
restarts, heartbeat age and throughput; the run shows its policy version, learner step,
trajectories and reward by domain from the status.json its coordinator rewrites every second.
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show a run's jobs, step, reward and throughput (or list recent runs)",
        description="Summarise RUN: its components' Slurm jobs (one squeue, one sacct) and the "
        "status.json its coordinator writes every second. Without RUN: recent runs.",
    )
    add_run_args(p, optional=True, note="; omit to list runs")
    p.add_argument("--json", action="store_true", help="print one JSON object (with a `components` list)")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch (default 2)")
    p.set_defaults(func=run)


def _run_root(config: str):
    from pathlib import Path

    from hpcrl.core.config import load_config

    try:
        return Path(load_config(config).experiment.run_root)
    except Exception:  # no usable config: only paths work
        return None


def resolve_run_dir(run: str, config: str):
    from pathlib import Path

    from hpcrl.jobs.cli import UsageError

    p = Path(run)
    if (p / "config.resolved.yaml").exists():
        return p.resolve()
    root = _run_root(config)
    if root is not None and (root / run / "config.resolved.yaml").exists():
        return root / run
    where = f" or under {root}" if root is not None else ""
    raise UsageError(f"{run!r} is not a run directory{where} (a run directory holds config.resolved.yaml)")


def _once(args: argparse.Namespace, run_dir) -> tuple[str, int]:
    import json

    from hpcrl.jobs.slurmstatus import snapshot, snapshot_text
    from hpcrl.rl.coordinator.report import read_status

    if args.json:
        snap = snapshot(run_dir)
        return json.dumps(snap), 0
    if (run_dir / "jobs.json").exists():
        snap = snapshot(run_dir)
        return snapshot_text(snap), 0
    from hpcrl.jobs.localrun import pids
    from hpcrl.jobs.report import status_text
    from hpcrl.jobs.slurmstatus import prepared

    status = read_status(run_dir)
    submit = prepared(run_dir, None)  # no jobs.json here (that case is above)
    if submit and not status:
        return f"{run_dir.name}: prepared by `hpcrl sbatch`, not submitted yet; submit with: bash {submit}", 1
    alive = {role: pids(run_dir, role) for role in ("coordinator", "store", "learner", "gen", "sandbox", "rollout")}
    text = (
        status_text(run_dir, status)
        + "\nprocesses  "
        + "  ".join(f"{role} {len(p)}" for role, p in alive.items())
        + " alive on this host"
    )
    return text, 0 if status else 1


def _list(args: argparse.Namespace) -> int:
    import json

    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.slurmstatus import recent_runs

    root = _run_root(args.config)
    if root is None:
        raise UsageError(f"no RUN given and {args.config} is not a usable config to find the run_root in")
    runs = recent_runs(root)
    if args.json:
        print(json.dumps({"run_root": str(root), "runs": runs}))
        return 0
    if not runs:
        print(f"no runs under {root}")
    for r in runs:
        print(f"{r['run']:<40} {r['executor']:<6} {r['state']:<10} step {r['step'] if r['step'] is not None else '-'}")
    return 0


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    if args.run is None:
        return _list(args)
    run_dir = resolve_run_dir(args.run, args.config)
    if not args.watch:
        text, code = _once(args, run_dir)
        print(text)
        return code
    tty = sys.stdout.isatty()
    while True:  # Ctrl-C ends it (exit 130 from the CLI's main)
        text, _ = _once(args, run_dir)
        print(("\x1b[H\x1b[2J" if tty and not args.json else "") + text, flush=True)
        time.sleep(args.interval)
