"""`hpcrl validate CONFIG [KEY=VALUE ...]`: load a config strictly and report the first error."""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_config_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check a config file (and overrides) against the schema",
        description=(
            "Load CONFIG strictly: unknown keys, wrong types, out-of-range values and unknown choices "
            "fail with one line naming the dotted key, and exit code 2. KEY=VALUE overrides "
            "(e.g. learner.lr=3e-4 executor=slurm) go through the same schema. Then what `hpcrl run` "
            "and `submit` check before they start anything: domain names and variants, built task "
            "lists, policy.path (model and tokenizer), the sandbox backend for code domains, the "
            "run_root's write access, TensorBoard/W&B packages when enabled, and with executor: slurm "
            "the partitions, GPUs (GRES), CPUs, memory and time limits of the cluster."
        ),
    )
    add_config_args(p)
    p.add_argument("--print", dest="print_resolved", action="store_true", help="print the resolved config as YAML")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shutil

    from hpcrl.core.config import dump_config, load_config
    from hpcrl.jobs.cli import load_experiment

    # The cluster is asked only where there is one: a Slurm config is validated on a laptop too.
    cfg = load_config(args.config, args.overrides)  # printed as given: `auto` values stay `auto`
    slurm = cfg.executor == "slurm"
    cluster = slurm and shutil.which("scontrol") is not None
    load_experiment(args, "validate", cluster=cluster)
    if args.print_resolved:
        print(dump_config(cfg), end="")
    else:
        note = "; Slurm partitions not checked: no scontrol on PATH" if slurm and not cluster else ""
        print(
            f"config OK: {args.config} (experiment {cfg.experiment.name!r}, executor {cfg.executor}, "
            f"{len(cfg.domains)} domain(s){note})"
        )
    return 0
