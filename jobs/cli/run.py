"""`hpcrl run CONFIG [KEY=VALUE ...]`: train, with every component a submitit job (local or Slurm).

    hpcrl run config.yaml                      # the default: everything on this machine
    hpcrl run config.yaml learner.max_steps=50 --run-id smoke

Creates the run directory, submits the store writer, coordinator, sandbox servers (when a
domain executes code), the learner and the generators, shows one progress line (step, reward,
trajectories/s, busy fraction per role), restarts components that die, and at the end stops
everything cleanly and writes reward.png and diagnostics.png (entropy, zero-variance groups,
advantages, importance ratio, staleness, completion length, per-prompt success: jobs/diagnostics.py)
into the run directory. Ctrl-C, SIGTERM or SIGHUP
stop the run the same way (the learner checkpoints); if this process is killed outright, its
jobs notice and stop by themselves. Exit code 0 when the learner reached learner.max_steps.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from hpcrl.jobs.cli import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train: run every component (locally by default) and show progress",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    add_config_args(p, run_id=True)
    p.add_argument("--timeout-min", type=float, help="give up (exit 1) if the run is not done after this many minutes")
    p.add_argument("--quiet", action="store_true", help="no progress line, only the summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from hpcrl.jobs.cli import load_experiment
    from hpcrl.jobs.resume import run_lock, write_launch
    from hpcrl.jobs.rundir import create_run_dir

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg, search, domains = load_experiment(args, "run")  # a bad domain fails before anything is created
    run_dir = create_run_dir(cfg, args.run_id)
    write_launch(run_dir, cfg.executor, search)
    with run_lock(run_dir):  # one driver per run; `hpcrl resume` takes it over once this is gone
        return drive(cfg, run_dir, search, domains, args)


def drive(cfg, run_dir, search, domains, args: argparse.Namespace) -> int:
    """Run (or resume) the run's jobs on this machine until the learner is done; the summary."""
    from hpcrl.jobs.diagnostics import write_diagnostics_png
    from hpcrl.jobs.launch import plan
    from hpcrl.jobs.localrun import LocalRun
    from hpcrl.jobs.report import progress_line, read_metrics, write_reward_png
    from hpcrl.jobs.supervise import RunFailed

    jobs = LocalRun(cfg, run_dir, plan(cfg, run_dir, domains, search))
    print(f"run directory {run_dir}", flush=True)
    tty = sys.stdout.isatty()
    last_print = [0.0]

    def show(status: dict | None) -> None:
        if args.quiet:
            return
        line = progress_line(status, cfg.learner.max_steps)
        if tty:
            print("\r" + line[:200].ljust(120), end="", flush=True)
        elif time.monotonic() - last_print[0] >= 5.0:
            print(line, flush=True)
            last_print[0] = time.monotonic()

    def interrupt(signum, frame):
        raise KeyboardInterrupt  # SIGTERM (a batch system, a closed terminal's SIGHUP) stops the run as Ctrl-C does

    def already_stopping(signum, frame):
        print(
            f"\n{signal.Signals(signum).name}: already stopping the run; it is waiting for the components "
            "to checkpoint and flush (kill -9 leaves them to stop by themselves)",
            file=sys.stderr,
        )

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    t0 = time.monotonic()
    ok = False
    try:
        jobs.start()
        ok = jobs.wait(show, timeout_s=args.timeout_min * 60 if args.timeout_min else None)
    except RunFailed as exc:
        print(f"\nhpcrl run: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the run", file=sys.stderr)
    finally:
        # A second signal must not cut the shutdown short and leave components running.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, already_stopping)
        if tty and not args.quiet:
            print()
        jobs.shutdown()
    png = write_reward_png(run_dir)
    diag = write_diagnostics_png(run_dir)
    rows = read_metrics(run_dir)
    if rows:
        first, last = rows[0], rows[-1]
        doms = "  ".join(f"{d} {r:.2f}" for d, r in sorted(last.get("reward_by_domain", {}).items()))
        print(
            f"reward {first['reward']:.3f} (step {first['step']}) -> {last['reward']:.3f} (step {last['step']}) "
            f"in {time.monotonic() - t0:.0f} s; last step by domain: {doms}"
        )
    if png:
        print(f"reward curve: {png}")
    if diag:
        print(f"learner diagnostics: {diag}")
    if not ok:
        print(f"run not finished; `hpcrl status {run_dir}` shows where it stopped", file=sys.stderr)
    return 0 if ok else 1
