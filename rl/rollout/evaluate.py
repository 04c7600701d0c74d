"""Held-out evaluation: pass@k of a policy version on the tasks training never samples.

    policy, version = load_run_policy(run_dir, cfg.policy, version=None)   # latest published
    result = evaluate(policy, get_domain("humaneval"), judge, ks=(1, 5), version=version)
    result.to_json()     # {"domain": "humaneval", "version": 12, "n": 5, "pass@1": 0.03, "pass@5": 0.1}
    evaluator = PeriodicEvaluator(run_dir, cfg.learner.eval, cfg.policy, make_judge)   # every N steps
    evaluator.submit(step, version); evaluator.results()   # {"eval/humaneval/pass@1": ..., ...}

Tasks are the domain's `eval_indices()` (rl/domains/base.py: a held-out split, or indices the
training sampler never reaches), played as `domain.for_eval()` says (HumanEval: one attempt).
A domain without held-out tasks (session-repair's five projects, a one-problem variant) would
be evaluated on what it trains on: `evaluate` refuses it unless asked (`allow_train`, `hpcrl
eval --train-tasks`), and a periodic evaluation refuses it when the run starts.
Samples come from the project's own Generator and DecodeEngine, judged by the same environments
and sandbox as training: `n` samples per task, a sample is correct when its episode's reward
reaches 1 (a sample whose prompt does not fit the model's context counts as wrong: `unfit`), and
pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) averaged over tasks.

`PeriodicEvaluator` runs in the learner's rank-0 process on a thread of its own, with its own copy
of the policy read from the published weights: training goes on while it samples (it only
competes for CPU), and a step's metrics carry the results of the last evaluation that finished.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcrl.core.config import EvalConfig, GeneratorConfig, PolicyConfig
from hpcrl.rl.coordinator.tasks import EpisodeTicket
from hpcrl.rl.domains import Domain, get_domain
from hpcrl.rl.model.policy import Policy, copy_state
from hpcrl.rl.rollout.generator import Generator
from hpcrl.rl.weights.shards import WeightStore

__all__ = ["pass_at_k", "EvalResult", "EvalError", "evaluate", "load_run_policy", "PeriodicEvaluator"]

log = logging.getLogger("hpcrl.eval")


class EvalError(ValueError):
    """An evaluation that cannot run as asked (no such version, k above the samples); the message says why."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task from n samples of which c are correct: 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    domain: str
    version: int
    samples: int  # per task (the estimator's n)
    tasks: int
    pass_at: dict[int, float]  # k -> mean pass@k over the tasks
    heldout: bool  # False: the domain has no held-out split, its training tasks were evaluated
    wall_s: float
    unfit: int = 0  # samples counted wrong because the prompt did not fit the model's context

    def to_json(self) -> dict:
        return {
            "domain": self.domain,
            "version": self.version,
            "n": self.samples,
            **{f"pass@{k}": round(v, 6) for k, v in sorted(self.pass_at.items())},
        }

    def metrics(self) -> dict:
        """The keys a metrics.jsonl row carries: eval/<domain>/pass@k, and the version evaluated."""
        out = {f"eval/{self.domain}/pass@{k}": v for k, v in sorted(self.pass_at.items())}
        out[f"eval/{self.domain}/version"] = self.version
        return out


def load_run_policy(
    run_dir: str | Path, policy_cfg: PolicyConfig, version: int | None = None, seed: int = 0, device: str | None = None
) -> tuple[Policy, int]:
    """The run's policy with the weights it published as `version` (None: the latest), on
    `device` (None: the policy config's)."""
    store = WeightStore(run_dir)
    kept = sorted(int(p.name[1:]) for p in store.dir.glob("v*") if p.name[1:].isdigit() and (p / "index.json").exists())
    if version is None:
        latest = store.latest()
        if latest is None:
            raise EvalError(f"{run_dir}: no published weights yet (weights/latest.json); evaluate once it has trained")
        version = latest[0]
    if version not in kept:
        raise EvalError(
            f"{run_dir}: no published weights of version {version}; kept: {kept or 'none'} "
            "(learner.keep_weights sets how many are kept)"
        )
    policy = Policy.load(policy_cfg, seed=seed, device=device)
    try:
        state = store.read(version)
    except FileNotFoundError:
        raise EvalError(f"{run_dir}: version {version} was pruned while being read; give a newer --version") from None
    copy_state(policy.model, state, f"{store.version_dir(version)}")
    policy.model.eval()
    return policy, version


class _EvalSource:
    """A TaskSource of `samples` episodes per task index; a failed episode is issued again, up to 3 times."""

    def __init__(self, domain: str, indices: Sequence[int], samples: int):
        self.queue = [
            EpisodeTicket(domain, idx, t * samples + s, t) for t, idx in enumerate(indices) for s in range(samples)
        ]
        self.index = {t.episode: t.task_index for t in self.queue}
        self.left = len(self.queue)
        self.unfit = 0  # samples whose prompt is longer than the model's context: failures, not errors

    def take(self, n: int) -> list[EpisodeTicket]:
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def done(self, ticket: EpisodeTicket) -> None:
        self.left -= 1

    def failed(self, ticket: EpisodeTicket, reason: str, permanent: bool = False) -> None:
        if permanent:  # the prompt does not fit max_context: the policy cannot answer it, a wrong sample
            self.unfit += 1
            self.left -= 1
            return
        if ticket.attempt + 1 >= 3:
            raise EvalError(f"{ticket.domain} task {ticket.task_index}: an episode failed 3 times; last: {reason}")
        self.queue.insert(0, dataclasses.replace(ticket, attempt=ticket.attempt + 1))


def evaluate(
    policy: Policy,
    domain: Domain,
    judge: Any,
    ks: Sequence[int] = (1,),
    *,
    samples: int | None = None,
    tasks: int | None = None,
    version: int = 0,
    gen_cfg: GeneratorConfig | None = None,
    seed: int = 0,
    allow_train: bool = False,
) -> EvalResult:
    """pass@k for each k in `ks` from `samples` (default max k) samples of each of up to `tasks`
    held-out tasks of `domain`, sampled by `policy` as it is (its weights are not changed).
    A domain with no held-out tasks is refused (EvalError) unless `allow_train`: its training tasks."""
    samples = samples or max(ks)
    if max(ks) > samples:
        raise EvalError(f"k={max(ks)} needs at least that many samples per task; got {samples} (raise --n)")
    if not domain.has_heldout and not allow_train:
        raise EvalError(_no_heldout(domain.name))
    dom = domain.for_eval()
    indices = dom.eval_indices(tasks)
    if not indices:
        raise EvalError(f"domain {domain.name!r} has no tasks to evaluate")
    cfg = gen_cfg or GeneratorConfig()
    gen = Generator(cfg, policy, {dom.name: dom}, run="eval", name="eval", seed=seed, executor=judge)
    source = _EvalSource(dom.name, indices, samples)
    correct: dict[int, int] = {idx: 0 for idx in indices}

    def sink(traj) -> None:
        if traj.final_reward >= 1.0 - 1e-9:
            correct[source.index[traj.episode]] += 1

    t0 = time.perf_counter()
    try:
        gen.run(source, sink, stop=lambda: source.left <= 0)
    finally:
        gen.close()
    pass_at = {k: sum(pass_at_k(samples, c, k) for c in correct.values()) / len(indices) for k in ks}
    wall_s = time.perf_counter() - t0
    return EvalResult(dom.name, version, samples, len(indices), pass_at, dom.has_heldout, wall_s, source.unfit)


def _no_heldout(name: str) -> str:
    return (
        f"domain {name!r} keeps no held-out tasks: evaluating it would reuse its training tasks; "
        "evaluate a domain with a held-out split (hpcrl eval --train-tasks evaluates the training tasks, labelled)"
    )


class PeriodicEvaluator:
    """Evaluates published versions on a thread: `submit` returns at once (a submit while one is
    running replaces the waiting one), `results` hands over what finished since the last call."""

    def __init__(self, run_dir: str | Path, cfg: EvalConfig, policy_cfg: PolicyConfig, make_judge: Callable[[], Any]):
        self.run_dir, self.cfg, self.policy_cfg, self.make_judge = Path(run_dir), cfg, policy_cfg, make_judge
        self.domains = [get_domain(name) for name in cfg.domains]  # fails at start, not at the first evaluation
        for d in self.domains:
            if not d.has_heldout:
                raise EvalError(f"learner.eval.domains: {_no_heldout(d.name)}")
        self._judge = None
        self._want: tuple[int, int] | None = None
        self._done: dict = {}
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hpcrl-eval", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def submit(self, step: int, version: int) -> None:
        with self._cv:
            self._want = (step, version)
            self._cv.notify()

    def results(self) -> dict:
        with self._cv:
            out, self._done = self._done, {}
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is waiting or running (tests; the in-process loop evaluates in line)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._want is None and not self._busy, timeout_s)

    _busy = False

    def run_now(self, step: int, version: int) -> dict:
        """Evaluate `version` on this thread; the metrics of every configured domain."""
        if self._judge is None and any(d.needs_executor for d in self.domains):
            self._judge = self.make_judge()
        version = self._published(version)
        policy, version = load_run_policy(self.run_dir, self.policy_cfg, version, seed=step)
        out: dict = {"eval/step": step}
        for d in self.domains:
            r = evaluate(policy, d, self._judge, self.cfg.k, samples=self.cfg.samples or None, tasks=self.cfg.tasks,
                         version=version, seed=step)  # fmt: skip
            out |= r.metrics()
            log.info("eval step %d version %d %s: %s (%.1f s)", step, version, d.name, r.to_json(), r.wall_s)
        return out

    def _published(self, version: int, timeout_s: float = 120.0) -> int:
        """`version` once its files are complete (the learner writes them on a thread); if it is
        never published (learner.publish_every > 1), the newest version announced by then."""
        store = WeightStore(self.run_dir)
        deadline = time.monotonic() + timeout_s
        while True:
            if (store.version_dir(version) / "index.json").exists():
                return version
            latest = store.latest()
            if (latest is not None and latest[0] > version) or time.monotonic() >= deadline:
                if latest is None:
                    raise EvalError(f"{self.run_dir}: no weights published within {timeout_s:g} s")
                return latest[0]
            time.sleep(0.1)  # polling the filesystem, as generators do: no announcement reaches this thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._want is not None or self._closed)
                if self._closed:
                    return
                (step, version), self._want, self._busy = self._want, None, True
            try:
                got = self.run_now(step, version)
            except Exception as exc:  # an evaluation must never stop training: log it and go on
                log.warning("evaluation of version %d failed: %s: %s", version, type(exc).__name__, exc)
                got = {}
            with self._cv:
                self._done |= got
                self._busy = False
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
