"""`hpcrl validate CONFIG [KEY=VALUE ...]`: load a config strictly and report the first error."""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check a config file (and overrides) against the schema",
        description=(
            "Load CONFIG strictly: unknown keys, wrong types, out-of-range values and unknown choices "
            "fail with one line naming the dotted key, and exit code 2. KEY=VALUE overrides "
            "(e.g. learner.lr=3e-4 executor=slurm) go through the same schema."
        ),
    )
    add_config_args(p)
    p.add_argument("--print", dest="print_resolved", action="store_true", help="print the resolved config as YAML")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcrl.core.config import dump_config, load_config
    from hpcrl.jobs.cli import check_experiment

    cfg = load_config(args.config, args.overrides)
    check_experiment(cfg)
    if args.print_resolved:
        print(dump_config(cfg), end="")
    else:
        print(
            f"config OK: {args.config} (experiment {cfg.experiment.name!r}, executor {cfg.executor}, "
            f"{len(cfg.domains)} domain(s))"
        )
    return 0
