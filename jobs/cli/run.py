"""`hpcrl run CONFIG [KEY=VALUE ...]`: train, with every component a submitit job (local or Slurm).

    hpcrl run config.yaml                      # the default: everything on this machine
    hpcrl run config.yaml learner.max_steps=50 --run-id smoke

Creates the run directory, submits the store writer, coordinator, sandbox servers (when a
domain executes code), the learner and the generators, shows one progress line (step, reward,
trajectories/s, busy fraction per role), restarts components that die, and at the end stops
everything cleanly and writes reward.png and diagnostics.png (entropy, zero-variance groups,
advantages, importance ratio, staleness, completion length, per-prompt success: jobs/diagnostics.py)
into the run directory. Ctrl-C (SIGINT), SIGTERM or SIGHUP stop the run the same way however
it was started (a script's `hpcrl run ... &` too, which is handed SIGINT ignored; `nohup` keeps
SIGHUP ignored): generators hand back their episodes and the learner checkpoints, and every
component is gone within 3 minutes (60 s for each of three stages: generators and learner,
sandboxes, coordinator and store; what still runs then is killed). If this process is killed
outright, its jobs notice and stop by themselves. An interrupted or failed run ends with the
`hpcrl resume` and `hpcrl logs` lines to type. Exit code 0 when the learner reached
learner.max_steps.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from hpcrl.jobs.cli import add_config_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).

# The signals that stop a run. SIGHUP only where it is not ignored: `nohup hpcrl run` asks to
# outlive the terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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

    stop_on_signals()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Every mistake a component would meet later (jobs/checks.py) fails here, before anything is created.
    cfg, search, domains = load_experiment(args, "run")
    run_dir = create_run_dir(cfg, args.run_id)
    write_launch(run_dir, cfg.executor, search)
    with run_lock(run_dir):  # one driver per run; `hpcrl resume` takes it over once this is gone
        return drive(cfg, run_dir, search, domains, args)


def stop_on_signals() -> list[int]:
    """SIGINT, SIGTERM and (unless ignored, as under nohup) SIGHUP raise KeyboardInterrupt from
    here on, whatever this process inherited: a non-interactive shell starts `hpcrl run ... &`
    with SIGINT ignored, and Python then installs no Ctrl-C handler of its own. The signals
    installed."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    out = []
    for sig in STOP_SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        signal.signal(sig, interrupt)
        out.append(sig)
    return out


def drive(cfg, run_dir, search, domains, args: argparse.Namespace) -> int:
    """Run (or resume) the run's jobs on this machine until the learner is done; the summary."""
    from hpcrl.jobs.diagnostics import write_diagnostics_png
    from hpcrl.jobs.launch import plan
    from hpcrl.jobs.localrun import LocalRun
    from hpcrl.jobs.report import MetricsFollower, next_steps, progress_line, typed_path, write_reward_png
    from hpcrl.jobs.supervise import RunFailed

    jobs = LocalRun(cfg, run_dir, plan(cfg, run_dir, domains, search))
    print(f"run directory {run_dir}", flush=True)
    tty = sys.stdout.isatty()
    last_print = [0.0]
    follower = MetricsFollower(run_dir)
    warned = [False]

    def show(status: dict | None) -> None:
        sig = follower.poll()
        if sig.warning and not warned[0]:
            # Its own line on stderr, once a streak: the progress line is overwritten (and cut) on a terminal.
            print(("\n" if tty and not args.quiet else "") + f"warning: {sig.warning}", file=sys.stderr, flush=True)
        warned[0] = bool(sig.warning)
        if args.quiet:
            return
        line = progress_line(status, cfg.learner.max_steps, sig)
        if tty:
            print("\r" + line[:200].ljust(120), end="", flush=True)
        elif time.monotonic() - last_print[0] >= 5.0:
            print(line, flush=True)
            last_print[0] = time.monotonic()

    def already_stopping(signum, frame):
        print(
            f"\n{signal.Signals(signum).name}: already stopping the run; it is waiting for the components "
            "to checkpoint and flush (kill -9 leaves them to stop by themselves)",
            file=sys.stderr,
        )

    handled = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
    t0 = time.monotonic()
    ok = False
    failed = None
    interrupted = False
    try:
        jobs.start()
        ok = jobs.wait(show, timeout_s=args.timeout_min * 60 if args.timeout_min else None)
    except RunFailed as exc:
        failed = exc
        print(f"\nhpcrl run: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping the run", file=sys.stderr)
    finally:
        # A second signal must not cut the shutdown short and leave components running.
        for sig in handled:
            signal.signal(sig, already_stopping)
        if tty and not args.quiet:
            print()
        jobs.shutdown()
    png = write_reward_png(run_dir)
    diag = write_diagnostics_png(run_dir)
    rows = follower.rows()
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
    if cfg.metrics.tensorboard:
        print(f"TensorBoard: tensorboard --logdir {typed_path(run_dir / 'tensorboard')}")
    if cfg.metrics.wandb.mode == "offline":
        print(f"W&B (offline): wandb sync {typed_path(run_dir / 'wandb')}/offline-run-*")
    if not ok:
        where = f"at step {rows[-1]['step']} of {cfg.learner.max_steps}" if rows else "before its first step"
        why = "failed" if failed else "interrupted" if interrupted else "timed out"
        steps = next_steps(run_dir, failed.component if failed is not None else None)
        print(f"run {why} {where}; {steps}", file=sys.stderr)
    return 0 if ok else 1
