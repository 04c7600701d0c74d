"""The rollout generator: many episodes in flight, batched sampling, environments stepped beside it.

    gen = Generator(cfg.generators, policy, domains, run="r1", name="gen-0", seed=0,
                    executor=SandboxJudge(backend), weights=WeightStore(run_dir))
    gen.run(source, sink=store.append, stop=lambda: time.time() > t_end)

Each loop iteration: take newer weights if the learner announced some (between steps, never
inside one); top the in-flight set up to `episodes_in_flight` from the task source (plus up to
`lend_episodes` while episodes wait on sandboxes: their rows would idle); sample one action for
every episode that is waiting for the model, at most `episodes_in_flight` in one batch; hand each
action to its environment. Environments that execute code (`domain.needs_executor`) step on a
thread pool, so the generator keeps sampling for the other episodes while one waits for the
sandbox; the rest step inline, which is cheaper than a thread hop. A finished episode becomes a `Trajectory`
(every step tagged with the policy version that sampled it and the sampling parameters it was
drawn with; its log-probabilities are those of that distribution) passed to `sink`.

Tokens: the first step's prompt is the task prompt as `policy.prompt_ids` encodes it (bos +
text, or the chat template's turns); each observation is appended to the
context, and the next step's prompt is empty (the context is prompt, action, observation, ...,
exactly what the learner rebuilds from the steps). The trajectory's final reward is the sum of
its step rewards.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcrl.core.config import GeneratorConfig
from hpcrl.rl.coordinator.tasks import EpisodeTicket, TaskSource
from hpcrl.rl.domains import Domain, Environment, ExecFeedback, StepResult
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.record.trajectory import SandboxOutcome, Step, Trajectory
from hpcrl.rl.rollout.engine import ContextTooLong, DecodeEngine, SamplingSpec
from hpcrl.rl.rollout.explore import StuckTasks
from hpcrl.sandbox.result import SandboxError
from hpcrl.slurm.backfill.lending import episodes_to_take

__all__ = ["Generator", "GeneratorStats"]

log = logging.getLogger(__name__)


@dataclass
class GeneratorStats:
    trajectories: int = 0
    steps: int = 0
    action_tokens: int = 0
    failed: int = 0
    weight_loads: int = 0
    busy_s: float = 0.0  # sampling (the accelerator's work)
    wall_s: float = 0.0  # inside run()
    sandbox_s: float = 0.0  # environment steps of domains that execute code (sandbox time)
    source_s: float = 0.0  # in the task source and sink: coordination, sending, acknowledgements
    weights_s: float = 0.0  # checking for and loading new weights
    idle_s: float = 0.0  # nothing to do: no weights yet, or no episode to run (flow control, no tasks)
    env_wait_s: float = 0.0  # nothing to decode, waiting for environment steps (sandboxes) to finish
    batches: int = 0  # sampling calls
    batch_rows: int = 0  # episodes sampled over all calls (rows / batches = mean batch size)
    overlap_batches: int = 0  # sampling calls made while an environment step (a sandbox run) was in flight
    lent: int = 0  # episodes taken beyond episodes_in_flight while others waited on environments (lend_episodes)
    reward_sum: float = 0.0

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(eq=False)  # an episode is itself: the decode engine keys its cache by it
class _Episode:
    ticket: EpisodeTicket
    domain: Domain
    env: Environment
    task_id: str
    started_at: float
    context: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # this step's new context tokens
    steps: list[Step] = field(default_factory=list)
    pending: Any = None  # (Step fields) while the environment is stepping
    spec: Any = None  # the SamplingSpec its current action is drawn with
    future: cf.Future | None = None
    ready: bool = False  # waiting for the model
    sampling: bool = False  # a row in the decode engine
    version: int = -1  # the policy version its current action started under
    chat: bool = False  # prompt and feedback are chat turns
    fault: str = ""  # the last sandbox infrastructure fault its environment resumed after
    temperature: float = 1.0  # its sampling temperature (the domain's, or hotter: rl/rollout/explore.py)


class Generator:
    def __init__(
        self,
        cfg: GeneratorConfig,
        policy: Policy,
        domains: Mapping[str, Domain],
        *,
        run: str,
        name: str,
        seed: int,
        executor: Any = None,
        weights=None,
    ):
        self.cfg, self.policy, self.domains = cfg, policy, dict(domains)
        self.run_name, self.name = run, name
        self.executor, self.weights = executor, weights
        # With a weight store, nothing is sampled before the learner's first weights arrived
        # (version -1 = none yet); without one (benchmarks, tests) the local weights are v0.
        self.version = -1 if weights is not None else 0
        model_max = int(getattr(policy.model.config, "max_position_embeddings", 1 << 30))
        self.max_context = min(cfg.max_context or model_max, model_max)
        self.engine = DecodeEngine(policy, seed, int(cfg.kv_cache_gb * 2**30), self.max_context)
        self.weight_swap = cfg.weight_swap
        self._multi_turn: set[str] = set()  # domains whose episodes were seen to continue
        self._stepped: set[str] = set()  # domains with an episode that has had a step result
        # Resolved once, so a domain eos that is no token stops the generator at start, not mid-run.
        self._domain_eos = {d.name: self._eos_ids(d.action.eos) for d in self.domains.values()}
        self.pool = cf.ThreadPoolExecutor(max_workers=cfg.env_threads, thread_name_prefix=f"{name}-env")
        self.episodes: list[_Episode] = []
        self.stats = GeneratorStats()
        self.stuck = StuckTasks(cfg.explore_temperature, {n: d.size for n, d in self.domains.items()})
        missing = [d for d, dom in self.domains.items() if dom.needs_executor and executor is None]
        if missing:
            raise ValueError(f"generator {name}: domains {missing} run code but no executor (sandbox) was given")

    # -- weights -------------------------------------------------------------------------

    def maybe_update_weights(self) -> bool:
        if self.weights is None:
            return False
        t0 = time.perf_counter()
        v = self.weights.load_if_newer(self.policy.model, self.version)
        self.stats.weights_s += time.perf_counter() - t0
        if v is None:
            return False
        self.version = v
        self.stats.weight_loads += 1
        if self.weight_swap == "restart":
            # Nothing sampled or cached under the old weights goes on: actions in flight start
            # over and every context is prefilled again by the new weights (exactly on-policy).
            for ep in self.episodes:
                if ep.sampling:
                    ep.sampling, ep.ready = False, True
            self.engine.clear()
        return True

    # -- the loop ------------------------------------------------------------------------

    def run(
        self, source: TaskSource, sink: Callable[[Trajectory], None], stop: Callable[[], bool] = lambda: False
    ) -> None:
        """Generate until `stop()` is true (checked every iteration). Episodes still in flight stay
        for the next call; `close()` abandons them."""
        last = time.perf_counter()
        try:
            while not stop():
                self.maybe_update_weights()
                if self.version < 0:
                    t0 = time.perf_counter()
                    time.sleep(0.05)  # waiting for the learner's first weights
                    self.stats.idle_s += time.perf_counter() - t0
                elif not self._iterate(source, sink):
                    # The source had nothing for us: a remote one waits for its sync's answer.
                    t0 = time.perf_counter()
                    getattr(source, "idle", time.sleep)(0.01)
                    self.stats.idle_s += time.perf_counter() - t0
                now = time.perf_counter()
                self.stats.wall_s += now - last  # kept current: a remote source reports it while we run
                last = now
        finally:
            self.stats.wall_s += time.perf_counter() - last

    def _iterate(self, source: TaskSource, sink) -> bool:
        """One round: new episodes, finished environment steps, rows into the decode engine and
        one decode step for all of them. False when idle."""
        self._fill(source)
        self._collect(source, sink, timeout=0.0)
        # At most episodes_in_flight rows decode at once (lent episodes make more open); the
        # oldest ready episodes first, so a lent one never holds back one that came back.
        room = self.cfg.episodes_in_flight - len(self.engine.rows) - len(self.engine.pending)
        for ep in [e for e in self.episodes if e.ready][: max(room, 0)]:
            self._submit(ep, source)
        if self.engine.busy:
            self._decode(source, sink)
        elif any(e.future is not None for e in self.episodes):
            self._collect(source, sink, timeout=0.05)
        return bool(self.episodes)

    def _fill(self, source: TaskSource) -> None:
        # Lending (scheduler's view: a generator whose episodes wait on sandboxes lends its
        # accelerator): an episode in an environment step leaves its row idle, so up to
        # lend_episodes more are taken to keep the batch's rows busy meanwhile.
        cap, open_ = self.cfg.episodes_in_flight, len(self.episodes)
        waiting = sum(1 for e in self.episodes if e.future is not None)
        free = episodes_to_take(cap, open_, waiting, self.cfg.lend_episodes)  # the simulator's rule too
        t0 = time.perf_counter()
        tickets = source.take(free)  # also called with 0: a remote source syncs and reports then
        self.stats.source_s += time.perf_counter() - t0
        self.stats.lent += max(0, open_ + len(tickets) - cap) - max(0, open_ - cap)
        for ticket in tickets:
            domain = self.domains.get(ticket.domain)
            if domain is None:
                source.failed(ticket, f"generator {self.name} has no domain {ticket.domain!r}")
                continue
            task = domain.task(ticket.task_index)
            try:
                env = domain.make_env(task, self.executor) if domain.needs_executor else domain.make_env(task)
            except Exception as exc:  # a broken site domain fails its episode, not the generator
                source.failed(ticket, f"make_env: {type(exc).__name__}: {exc}")
                continue
            if hasattr(env, "on_fault"):  # a session environment: what its sandbox faults do
                env.on_fault = self.cfg.session_fault
            ep = _Episode(ticket, domain, env, task.id, time.time())
            ep.temperature = self.stuck.temperature(ticket, domain.action.temperature)
            self.episodes.append(ep)
            if domain.needs_executor:
                ep.future = self.pool.submit(_timed, env.reset)
            else:
                self._apply_reset(ep, _timed(env.reset), source)

    def _apply_reset(self, ep: _Episode, outcome, source: TaskSource) -> None:
        result, _, exc = outcome
        if exc is not None:
            self._fail(ep, source, f"reset: {type(exc).__name__}: {exc}")
            return
        ids = self.policy.prompt_ids(result)
        ep.chat = self.policy.chat_template or not isinstance(result, str)
        if len(ids) + 1 >= self.max_context:
            self._fail(
                ep,
                source,
                f"prompt of {len(ids)} tokens does not fit max_context {self.max_context} "
                "(generators.max_context, or the model's max_position_embeddings)",
                permanent=True,
            )
            return
        ep.context, ep.prompt, ep.ready = list(ids), list(ids), True

    def _submit(self, ep: _Episode, source: TaskSource) -> None:
        a = ep.domain.action
        room = self.max_context - len(ep.context)
        spec = SamplingSpec(ep.temperature, a.top_p, a.top_k, a.stop, self._domain_eos[ep.domain.name])
        max_new = min(self.cfg.max_new_tokens, a.max_tokens, room)
        # Keep the cache for its next turn where episodes of this domain do have one, and while
        # nothing is known yet (a domain's first actions): waiting for the first step result
        # would re-prefill every context of a multi-turn domain's first batch at its turn 2.
        name = ep.domain.name
        keep = (name in self._multi_turn or name not in self._stepped) and len(ep.steps) + 1 < self.cfg.max_turns
        try:
            self.engine.submit(ep, ep.context, max_new, spec, keep=keep)
        except ContextTooLong as exc:
            self._fail(ep, source, str(exc))
            return
        ep.ready, ep.sampling, ep.version, ep.spec = False, True, self.version, spec

    def _eos_ids(self, names: tuple[str, ...]) -> frozenset[int]:
        out = set()
        for n in names:
            i = self.policy.tokenizer.convert_tokens_to_ids(n)
            if i is None or i == self.policy.tokenizer.unk_token_id:
                raise ValueError(f"domain eos token {n!r} is not a token of the policy's tokenizer")
            out.add(int(i))
        return frozenset(out)

    def _decode(self, source: TaskSource, sink) -> None:
        t0 = time.perf_counter()
        rows = len(self.engine.rows) + len(self.engine.pending)
        if any(e.future is not None and not e.future.done() for e in self.episodes):
            self.stats.overlap_batches += 1
        finished = self.engine.step()
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.batches += 1
        self.stats.batch_rows += rows
        for ep, s in finished:
            ep.sampling = False
            self.stats.action_tokens += len(s.tokens)
            ep.pending = (ep.version, ep.prompt, s, s.seconds, ep.spec)
            ep.context.extend(s.tokens)
            if ep.domain.needs_executor:
                ep.future = self.pool.submit(_timed, ep.env.step, s.text)
            else:
                self._apply_step(ep, _timed(ep.env.step, s.text), source, sink)

    def _collect(self, source: TaskSource, sink, timeout: float) -> None:
        futures = {e.future: e for e in self.episodes if e.future is not None}
        if not futures:
            return
        t0 = time.perf_counter()
        done, _ = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        self.stats.env_wait_s += time.perf_counter() - t0  # blocked only when called with a timeout
        for fut in done:
            ep = futures[fut]
            ep.future = None
            if ep.pending is None:
                self._apply_reset(ep, fut.result(), source)
            else:
                self._apply_step(ep, fut.result(), source, sink)

    def _apply_step(self, ep: _Episode, outcome, source: TaskSource, sink) -> None:
        result, env_s, exc = outcome
        version, prompt, sample, gen_s, spec = ep.pending
        ep.pending = None
        if exc is not None:
            # An infrastructure fault is never the model's reward: the attempt is dropped
            # (not stored, not trained) and the coordinator issues the episode again.
            tag = "sandbox_error: " if isinstance(exc, SandboxError) else ""
            self._fail(ep, source, f"{tag}step {len(ep.steps) + 1}: {type(exc).__name__}: {exc}")
            return
        if not isinstance(result, StepResult):
            result = StepResult(*result)  # a plain 4-tuple from a site environment
        obs_ids = (
            self.policy.observation_ids(result.observation, ep.chat, sample.finish == "eos")
            if result.observation and not result.done
            else []
        )
        fb = result.info.get("feedback") if result.info else None
        n = len(sample.tokens)
        ep.steps.append(
            Step(
                policy_version=version,
                prompt_tokens=np.asarray(prompt, np.int32),
                action_tokens=np.asarray(sample.tokens, np.int32),
                action_logprobs=np.asarray(sample.logprobs, np.float32),
                # A greedy action is a point mass: nothing to learn from its log-probability.
                loss_mask=np.full(n, spec.temperature > 0, np.uint8),
                observation_tokens=np.asarray(obs_ids, np.int32),
                reward=float(result.reward),
                sandbox=_outcome(fb, result.info),
                generate_s=gen_s,
                env_s=env_s,
                temperature=spec.temperature,
                top_p=spec.top_p,
                top_k=spec.top_k,
            )
        )
        self.stats.steps += 1
        self._stepped.add(ep.domain.name)
        if ep.domain.needs_executor:
            self.stats.sandbox_s += env_s
        if result.info and result.info.get("fault"):
            ep.fault = str(result.info["fault"])
        ep.context.extend(obs_ids)
        ep.prompt = []
        truncation = str(result.info.get("truncation", "none")) if result.info else "none"
        if not result.done:
            if len(ep.steps) >= self.cfg.max_turns:
                result, truncation = result._replace(done=True), "max_steps"
            elif len(ep.context) + 1 >= self.max_context:
                result, truncation = result._replace(done=True), "max_tokens"
        if result.done:
            self._finish(ep, truncation, source, sink)
        else:
            self._multi_turn.add(ep.domain.name)
            ep.ready = True

    def _finish(self, ep: _Episode, truncation: str, source: TaskSource, sink) -> None:
        self.episodes.remove(ep)
        self.engine.forget(ep)
        _close(ep.env)
        reward = float(sum(s.reward for s in ep.steps))
        traj = Trajectory(
            run=self.run_name,
            domain=ep.ticket.domain,
            task=ep.task_id,
            episode=ep.ticket.episode,
            generator=self.name,
            steps=tuple(ep.steps),
            final_reward=reward,
            truncation=truncation,
            started_at=ep.started_at,
            finished_at=time.time(),
            fault=ep.fault,
        )
        self.stats.trajectories += 1
        self.stats.reward_sum += reward
        self.stuck.record(ep.ticket, reward)
        t0 = time.perf_counter()
        sink(traj)
        source.done(ep.ticket)
        self.stats.source_s += time.perf_counter() - t0

    def _fail(self, ep: _Episode, source: TaskSource, reason: str, permanent: bool = False) -> None:
        self.episodes.remove(ep)
        self.engine.forget(ep)
        _close(ep.env)
        self.stats.failed += 1
        log.warning("generator %s: episode %d (%s) failed: %s", self.name, ep.ticket.episode, ep.ticket.domain, reason)
        source.failed(ep.ticket, reason, permanent)

    def close(self) -> None:
        """Abandon the episodes in flight (their tickets are not reported) and stop the threads."""
        for ep in list(self.episodes):
            if ep.future is not None:
                ep.future.cancel()
            _close(ep.env)
        self.episodes.clear()
        self.engine.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)

    def in_flight(self) -> list[EpisodeTicket]:
        return [e.ticket for e in self.episodes]


def _timed(fn, *args):
    """(result, seconds, exception): run on the pool, so errors come back as values."""
    t0 = time.perf_counter()
    try:
        return fn(*args), time.perf_counter() - t0, None
    except Exception as exc:  # reported per episode by the caller
        return None, time.perf_counter() - t0, exc


def _outcome(fb: Any, info: Mapping | None = None) -> SandboxOutcome:
    """The step's sandbox outcome: its feedback's, and what a session environment reports
    (`command`, `resumes`)."""
    info = info or {}
    extra = {"command": str(info.get("command", "")), "resumes": min(int(info.get("resumes", 0)), 255)}
    if isinstance(fb, ExecFeedback):
        total = max(int(fb.total), 0)
        passed = min(max(int(fb.passed), 0), total)
        return SandboxOutcome(fb.status, fb.exit_code, fb.duration_s, tests_passed=passed, tests_total=total, **extra)
    return SandboxOutcome(**extra)


def _close(env: Environment) -> None:
    try:
        env.close()
    except Exception as exc:  # cleanup must not take the generator down
        log.warning("environment close failed: %s", exc)
