"""`hpcrl status RUN`: where a run stands, from the status.json its coordinator keeps writing.

    hpcrl status runs/quickstart-20261202-120000-ab12     # a run directory
    hpcrl status quickstart-20261202-120000-ab12          # a run id under config.yaml's run_root
    hpcrl status --json RUN                               # the raw status.json
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a run's step, reward, throughput and components",
                       description="Summarise RUN's status.json (written by its coordinator every second), "
                                   "its processes and its reward curve.")
    p.add_argument("run", help="run directory, or a run id under the config's run_root")
    p.add_argument("--config", default="config.yaml", help="config whose run_root holds run ids (default config.yaml)")
    p.add_argument("--json", action="store_true", help="print status.json as it is")
    p.set_defaults(func=run)


def resolve_run_dir(run: str, config: str):
    from pathlib import Path

    from hpcrl.jobs.cli import UsageError

    p = Path(run)
    if (p / "config.resolved.yaml").exists():
        return p
    from hpcrl.jobs.config import load_config

    try:
        root = Path(load_config(config).experiment.run_root)
    except Exception:  # noqa: BLE001 - no usable config: only paths work
        root = None
    if root is not None and (root / run / "config.resolved.yaml").exists():
        return root / run
    where = f" or under {root}" if root is not None else ""
    raise UsageError(f"{run!r} is not a run directory{where} (a run directory holds config.resolved.yaml)")


def run(args: argparse.Namespace) -> int:
    import json

    from hpcrl.jobs.report import status_text
    from hpcrl.jobs.runner import pids
    from hpcrl.rl.coordinator import read_status

    run_dir = resolve_run_dir(args.run, args.config)
    status = read_status(run_dir)
    if args.json:
        print(json.dumps(status, indent=1))
        return 0 if status else 1
    print(status_text(run_dir, status))
    alive = {role: pids(run_dir, role) for role in ("coordinator", "store", "learner", "gen", "sandbox")}
    print("processes  " + "  ".join(f"{role} {len(p)}" for role, p in alive.items()) + " alive on this host")
    return 0 if status else 1
