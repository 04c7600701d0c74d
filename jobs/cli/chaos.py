"""`hpcrl chaos RUN`: kill and stall a live run's components at random, then check what it kept.

    hpcrl run config.yaml --run-id drill &                       # or hpcrl submit (executor: slurm)
    hpcrl chaos drill --duration 30m --every 60s                 # faults for 30 minutes, then the checks
    hpcrl chaos runs/drill --duration 5m --every 20s --kinds kill --targets learner,gen --json

Every `--every` a live component (coordinator, store, learner rank, generator, sandbox server, or
the supervisor: locally the `hpcrl run` launcher, which the drill then resumes) is killed with
SIGKILL or stalled with SIGSTOP for `--stall` (default: 5 s past the longest lease). After
`--duration` the drill waits for the run to end and checks that the learner never went back
past a checkpoint, the published policy version only grew, no trajectory was trained twice,
every stored trajectory was trained or dropped with a reason (none lost), the run reached
max_steps, and the reward did not collapse (against the steps before the first fault, or
`--baseline`, a fault-free run). Exit 0 when every invariant holds, 1 when one does not.
A drill spends restarts: give the run a `supervise.restarts` budget that fits the faults.
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chaos",
        help="inject faults into a live run, then check its invariants",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_run_args(p)
    p.add_argument("--duration", default="30m", help="how long to inject faults, e.g. 30m, 90s (default 30m)")
    p.add_argument("--every", default="60s", help="time between faults, e.g. 60s (default 60s)")
    p.add_argument("--stall", help="how long a stalled component stays stopped (default: longest lease + 5 s)")
    p.add_argument("--kinds", default="kill,stall", help="fault kinds to draw from: kill,stall (default both)")
    p.add_argument(
        "--targets",
        default="coordinator,store,learner,gen,sandbox,supervisor",
        help="roles to draw targets from (default all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the fault draws (default 0)")
    p.add_argument("--baseline", help="a finished fault-free run of the same config, for the reward check")
    p.add_argument("--tolerance", type=float, default=0.1, help="reward drop that counts as a collapse (default 0.1)")
    p.add_argument("--wait-end", default="60m", help="after the drill, how long to wait for the run to end")
    p.add_argument("--json", action="store_true", help="end with one JSON object (faults, restarts, invariants, ok)")
    p.set_defaults(func=run)


def _list(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    from hpcrl.jobs.cli import UsageError

    items = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise UsageError(f"{flag} {text!r}: choose from {','.join(allowed)}")
    return items


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    from pathlib import Path

    from hpcrl.jobs.chaos import KINDS, TARGETS, Drill, parse_duration
    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.jobs.resume import load_run_config

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = resolve_run_dir(args.run, args.config)
    try:
        duration, every = parse_duration(args.duration), parse_duration(args.every)
        stall = parse_duration(args.stall) if args.stall else None
        wait_end = parse_duration(args.wait_end)
    except ValueError as exc:
        raise UsageError(f"hpcrl chaos: {exc}") from None
    baseline = None
    if args.baseline:
        baseline = resolve_run_dir(args.baseline, args.config)
        if not (Path(baseline) / "metrics.jsonl").exists():
            raise UsageError(f"--baseline {args.baseline}: no metrics.jsonl in {baseline}; give a finished run")
    if not 0 <= args.tolerance < float("inf"):
        raise UsageError(f"--tolerance {args.tolerance}: give a reward difference >= 0")
    drill = Drill(
        run_dir,
        load_run_config(run_dir),
        duration_s=duration,
        every_s=every,
        seed=args.seed,
        kinds=_list(args.kinds, KINDS, "--kinds"),
        targets=_list(args.targets, TARGETS, "--targets"),
        stall_s=stall,
        baseline=baseline,
        collapse_tolerance=args.tolerance,
        wait_end_s=wait_end,
    )
    try:
        report = drill.run(print_line=lambda line: print(line, flush=True))
    except TimeoutError as exc:
        print(f"hpcrl chaos: {exc}", flush=True)
        return 1
    (run_dir / "chaos").mkdir(exist_ok=True)
    (run_dir / "chaos" / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    acct = report["accounting"]
    print(
        f"chaos: {len(report['faults'])} faults, restarts {report['restarts'] or 'none'}, "
        f"recovery mean {report['recovered_s']['mean']} s max {report['recovered_s']['max']} s; "
        f"step {acct['last_step']}, {acct['trained']} trained, {acct['dropped']} dropped "
        f"{acct['dropped_by_reason']}, {acct['lost']} lost, {acct['trained_twice']} trained twice"
    )
    for name, ok in report["invariants"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    if args.json:
        print(json.dumps(report))
    return 0 if report["ok"] else 1
