"""`hpcrl eval RUN --domain NAME --k 1,5`: pass@k of a run's policy on held-out tasks.

    hpcrl eval runs/quickstart-20261202-120000-ab12 --domain arith/max2 --k 1,5
    hpcrl eval RUN --domain humaneval --k 1,5 --version 40 --n 10 --tasks 8 --json
        # {"domain": "humaneval", "version": 40, "n": 10, "pass@1": 0.0, "pass@5": 0.0}

The policy is the run's own (config.resolved.yaml) with the weights it published as --version
(default: the latest kept; learner.keep_weights sets how many are kept). Samples come from the
project's generation engine on this machine's CPU, and code domains are judged in a local
sandbox (the run's sandbox config, on a free uid of this host's pool, so a live run is not
disturbed). `n` is the number of samples per task; pass@k is the unbiased estimator over them
(rl/rollout/evaluate.py). Tasks are the domain's held-out split (rl/domains/base.py `eval_indices`);
a domain without one is refused, unless --train-tasks asks for its training tasks (the output
then says so).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="pass@k of a run's policy version on a domain's held-out tasks",
        description=__doc__.split("\n\n")[0],
    )
    add_run_args(p)
    p.add_argument("--domain", required=True, help="registered domain, e.g. humaneval or arith/max2")
    p.add_argument("--k", default="1", help="comma-separated k of each pass@k, e.g. 1,5 (default 1)")
    p.add_argument("--version", type=int, help="published policy version (default: the latest)")
    p.add_argument("--n", type=int, help="samples per task (default: the largest k)")
    p.add_argument("--tasks", type=int, help="evaluate at most this many held-out tasks (default: all, or 100)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--train-tasks",
        action="store_true",
        help="evaluate a domain that keeps no held-out tasks on its training tasks (labelled as such)",
    )
    p.add_argument("--json", action="store_true", help='print {"domain", "version", "n", "pass@K"...} as JSON')
    p.set_defaults(func=run)


def _ks(text: str) -> tuple[int, ...]:
    from hpcrl.jobs.cli import UsageError

    try:
        ks = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise UsageError(f"--k {text!r}: give positive integers separated by commas, e.g. --k 1,5")
    return tuple(sorted(set(ks)))


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from hpcrl.core.config import RESOLVED_NAME, load_config
    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.rl.domains import DomainError, SandboxJudge, get_domain, load_domains
    from hpcrl.rl.rollout.evaluate import EvalError, evaluate, load_run_policy

    ks = _ks(args.k)
    samples = args.n or max(ks)
    if samples < max(ks):
        raise UsageError(f"--k {max(ks)} is more than --n {samples} samples per task; raise --n or lower --k")
    if args.tasks is not None and args.tasks < 1:
        raise UsageError(f"--tasks {args.tasks}: must be >= 1")
    run_dir = resolve_run_dir(args.run, args.config)
    cfg = load_config(run_dir / RESOLVED_NAME)
    try:
        configured = {d.name: d for d in cfg.domains}
        if args.domain in configured and configured[args.domain].module:
            domain = load_domains([configured[args.domain]], [str(run_dir)])[args.domain]
        else:
            domain = get_domain(args.domain)
    except DomainError as exc:
        raise UsageError(str(exc)) from None
    judge = None
    if domain.needs_executor:
        from hpcrl.sandbox.auto import make_backend

        judge = SandboxJudge(make_backend(cfg.sandbox))
    try:
        policy, version = load_run_policy(run_dir, cfg.policy, args.version, seed=cfg.experiment.seed)
        result = evaluate(
            policy, domain, judge, ks, samples=samples, tasks=args.tasks, version=version, seed=args.seed,
            gen_cfg=cfg.generators, allow_train=args.train_tasks,
        )  # fmt: skip
    except EvalError as exc:
        raise UsageError(str(exc)) from None
    if not result.heldout:
        print(f"note: {domain.name} keeps no held-out split; its training tasks were evaluated", file=sys.stderr)
    if result.unfit:
        print(
            f"note: {result.unfit} samples counted as failed: their prompt does not fit the model's context "
            "(policy.tiny.max_context, generators.max_context)",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    scores = "  ".join(f"pass@{k} {v:.3f}" for k, v in sorted(result.pass_at.items()))
    which = "" if result.heldout else " TRAINING"
    print(
        f"{result.domain} version {result.version}: {result.tasks}{which} tasks x {result.samples} samples: {scores} "
        f"({result.wall_s:.1f} s)"
    )
    return 0
