"""`hpcrl plot RUN`: reward, throughput, staleness and a per-component utilisation timeline as PNGs.

    hpcrl plot runs/quickstart-20261202-120000-ab12      # writes RUN/plots/*.png, prints their paths
    hpcrl plot quickstart-20261202-120000-ab12 --json    # a run id under config.yaml's run_root

Everything is read from the run's own records (metrics.jsonl, coordinator/timeline.jsonl,
config.resolved.yaml), so it works on a live run and on a finished one; jobs/plots.py says how
each timeline is built. The printed shares are each component's time by state over the run.
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="write a run's reward, throughput, staleness and utilisation PNGs into RUN/plots/",
        description=__doc__.split("\n\n")[0],
    )
    add_run_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object: paths and shares")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.jobs.plots import write_plots

    run_dir = resolve_run_dir(args.run, args.config)
    try:
        paths, summary = write_plots(run_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"plots": [str(p) for p in paths], **summary}, indent=1, sort_keys=True))
        return 0
    for p in paths:
        print(p)
    print(f"{summary['steps']} steps over {summary['minutes']:.1f} min; share of each component's time:")
    for name, share in summary["share"].items():
        parts = "  ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))
        print(f"  {name:<10} {parts}")
    return 0
