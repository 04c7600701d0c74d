"""The generator: many episodes in flight, sandbox waits overlapped with sampling, every step tagged
with its policy version, new weights taken between steps, failed episodes handed back."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses

import numpy as np
import pytest
import torch

from hpcrl.core.config import GeneratorConfig, PolicyConfig, TinyModelConfig
from hpcrl.rl.coordinator.tasks import EpisodeFailed, LocalTaskSource, TaskSampler
from hpcrl.rl.domains import ActionSpec, Domain, Environment, PromptDomain, StepResult, Task, get_domain
from hpcrl.rl.model.policy import Policy, full_state_dict, token_logprobs
from hpcrl.rl.rollout.generator import Generator
from hpcrl.rl.weights.shards import WeightStore

TINY = PolicyConfig(
    tiny=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_context=512), device="cpu"
)


def collect(gen, source, n):
    out = []
    gen.run(source, out.append, stop=lambda: len(out) >= n)
    return out


def test_single_and_multi_step_episodes_make_valid_trajectories():
    policy = Policy.load(TINY, seed=0)
    domains = {n: get_domain(n) for n in ("arith/copy", "arith/max2-retry3")}
    gen = Generator(GeneratorConfig(episodes_in_flight=32), policy, domains, run="r", name="g0", seed=0)
    source = LocalTaskSource(TaskSampler({n: 1.0 for n in domains}, group_size=4, seed=0))
    trajs = collect(gen, source, 64)
    gen.close()
    assert len({t.episode for t in trajs}) == len(trajs)  # episode numbers never repeat
    multi = [t for t in trajs if t.domain == "arith/max2-retry3" and len(t.steps) > 1]
    assert multi, "an untrained policy should need several tries on some retry tasks"
    for t in trajs:
        assert t.final_reward == pytest.approx(sum(s.reward for s in t.steps))
        assert t.policy_versions == (0,) * len(t.steps)
        assert len(t.steps[0].prompt_tokens) > 0 and all(len(s.prompt_tokens) == 0 for s in t.steps[1:])
        assert all(len(s.action_tokens) == 1 for s in t.steps)  # arith actions are one token
    t = multi[0]
    # The recorded logprobs are the policy's: recompute over the whole multi-step context.
    ids = np.concatenate([np.concatenate([s.prompt_tokens, s.action_tokens, s.observation_tokens]) for s in t.steps])
    lp = token_logprobs(policy.model, torch.tensor(ids[None].astype(np.int64)))[0]
    pos, got = 0, []
    for s in t.steps:
        pos += len(s.prompt_tokens)
        got.extend(lp[pos - 1 : pos - 1 + len(s.action_tokens)].tolist())
        pos += len(s.action_tokens) + len(s.observation_tokens)
    assert np.allclose(got, np.concatenate([s.action_logprobs for s in t.steps]), atol=1e-4)
    assert policy.decode(t.steps[0].observation_tokens).startswith(" no\n")


def test_each_step_records_its_sampling_parameters_and_greedy_steps_are_never_trained():
    """A domain's temperature and truncation are stored with each step beside the log-probabilities
    of that distribution; a greedy domain's steps (a point mass) carry loss mask 0 and log-probability
    0, and the learner's layout masks them whatever their mask says."""
    import dataclasses as dc

    from hpcrl.rl.learner.batch import layout, trained_tokens

    policy = Policy.load(TINY, seed=0)
    cool = PromptDomain("cool", [("1+1=", "2")], max_tokens=3)
    cool.action = dc.replace(cool.action, temperature=0.7, top_p=0.9, top_k=5)
    greedy = PromptDomain("greedy", [("2+2=", "4")], max_tokens=3)
    greedy.action = dc.replace(greedy.action, temperature=0.0)
    gen = Generator(GeneratorConfig(episodes_in_flight=8, explore_temperature=1.0), policy,
                    {"cool": cool, "greedy": greedy}, run="r", name="g", seed=0)  # fmt: skip
    trajs = collect(gen, LocalTaskSource(TaskSampler({"cool": 1.0, "greedy": 1.0}, 2, 0)), 16)
    gen.close()
    by = {d: [t for t in trajs if t.domain == d] for d in ("cool", "greedy")}
    assert by["cool"] and by["greedy"]
    for t in by["cool"]:
        s = t.steps[0]
        assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 5) and s.loss_mask.all() and not s.plain
        assert layout(t)[3] is not None and trained_tokens(t) == len(s.action_tokens)
    for t in by["greedy"]:
        s = t.steps[0]
        assert s.greedy and not s.loss_mask.any() and not s.action_logprobs.any()
        forced = dc.replace(t, steps=(dc.replace(s, loss_mask=np.ones_like(s.loss_mask)),))
        assert not any(layout(forced)[1]) and trained_tokens(forced) == 0


def test_new_weights_are_taken_between_steps(tmp_path):
    store = WeightStore(tmp_path)
    learner_side = Policy.load(TINY, seed=5)
    store.publish(full_state_dict(learner_side.model), version=0)
    policy = Policy.load(TINY, seed=0)  # different init: must be replaced by v0 before sampling
    gen = Generator(
        GeneratorConfig(episodes_in_flight=8),
        policy,
        {"arith/min3-retry4": get_domain("arith/min3-retry4")},
        run="r",
        name="g0",
        seed=0,
        weights=store,
    )
    source = LocalTaskSource(TaskSampler({"arith/min3-retry4": 1.0}, group_size=4, seed=0))
    first: list = []
    # Stop while some episode is between steps, so it straddles the update below.
    gen.run(source, first.append, stop=lambda: len(first) >= 8 and any(e.steps for e in gen.episodes))
    assert gen.version == 0
    assert all(torch.equal(v, full_state_dict(policy.model)[k]) for k, v in full_state_dict(learner_side.model).items())
    with torch.no_grad():
        for p in learner_side.model.parameters():
            p.mul_(0.5)
    store.publish(full_state_dict(learner_side.model), version=1)
    later = collect(gen, source, 24)
    gen.close()
    assert gen.version == 1 and gen.stats.weight_loads == 2
    assert {v for t in first for v in t.policy_versions} == {0}
    assert any(1 in t.policy_versions for t in later)
    straddling = [t for t in later if t.min_policy_version != t.max_policy_version]
    assert straddling, "episodes in flight during the update continue with the new weights"
    assert all(list(t.policy_versions) == sorted(t.policy_versions) for t in later)


def test_sandbox_waits_overlap_with_sampling(judge):
    policy = Policy.load(TINY, seed=0)
    names = ("code-repair", "synth", "arith/copy")
    domains = {n: get_domain(n) for n in names}
    cfg = GeneratorConfig(episodes_in_flight=16, env_threads=4, max_new_tokens=24, max_turns=2)
    gen = Generator(cfg, policy, domains, run="r", name="g0", seed=0, executor=judge)
    source = LocalTaskSource(TaskSampler({n: 1.0 for n in names}, group_size=2, seed=0))
    trajs = collect(gen, source, 40)
    gen.close()
    code = [t for t in trajs if t.domain != "arith/copy"]
    assert code and any(t.domain == "arith/copy" for t in trajs)
    for t in code:
        assert all(s.sandbox.status != "none" and s.env_s > 0 for s in t.steps)
        assert len(t.steps) == 2 or t.final_reward > 0  # an untrained model gets a second try
    assert any(t.truncation == "max_steps" for t in code if t.domain == "code-repair")  # repair allows 3 turns
    # Sampling went on while sandboxes ran (serially, no sampling call would see one in flight).
    # Counted, not timed: a wall-clock ratio of the two moves with the machine's load.
    assert gen.stats.overlap_batches > 0, gen.stats


class _Flaky(Domain):
    """A site domain whose environment fails on every even task: a broken site module."""

    name = "flaky"

    def __init__(self):
        self.inner = PromptDomain("flaky", [("copy 1:", "1")], max_tokens=1)
        self.action = self.inner.action

    def task(self, index):
        return dataclasses.replace(self.inner.task(index), domain="flaky")

    def make_env(self, task, executor=None):
        if int(task.id) % 2 == 0:
            return _Broken()
        return self.inner.make_env(task)


class _Broken(Environment):
    def reset(self):
        return "copy 2:"

    def step(self, action):
        raise KeyError("site bug")


def test_failed_episodes_are_reissued_then_stop_the_run():
    policy = Policy.load(TINY, seed=0)
    gen = Generator(GeneratorConfig(episodes_in_flight=4), policy, {"flaky": _Flaky()}, run="r", name="g0", seed=0)
    source = LocalTaskSource(TaskSampler({"flaky": 1.0}, group_size=2, seed=0), max_attempts=3)
    with pytest.raises(EpisodeFailed, match=r"\(flaky task 0\) failed 3 times; last: step 1: KeyError: 'site bug'"):
        collect(gen, source, 100)
    assert gen.stats.failed >= 3 and source.reissued >= 2
    gen.close()


def test_generator_refuses_code_domains_without_a_sandbox():
    with pytest.raises(ValueError, match=r"run code but no executor"):
        Generator(
            GeneratorConfig(), Policy.load(TINY, seed=0), {"synth": get_domain("synth")}, run="r", name="g", seed=0
        )
    assert StepResult("", 1.0, True, {}).done


class _Turns(Domain):
    """Every episode takes `turns` actions of 3 tokens, each answered with the same feedback."""

    def __init__(self, name, turns):
        self.name, self.turns = name, turns
        self.action = ActionSpec(max_tokens=3)

    def task(self, index):
        return Task(self.name, str(index), "", {})

    def make_env(self, task, executor=None):
        return _TurnsEnv(self.turns)


class _TurnsEnv(Environment):
    def __init__(self, turns):
        self.turns, self.turn = turns, 0

    def reset(self):
        return "count to three:"

    def step(self, action):
        self.turn += 1
        return StepResult(" again:", 0.0, self.turn >= self.turns, {})


class _Exactly(LocalTaskSource):
    """The first `n` episodes and no more."""

    def __init__(self, sampler, n):
        super().__init__(sampler)
        self.n = n

    def take(self, k):
        return super().take(min(k, self.n - self.issued))


def test_a_fresh_generator_keeps_first_turn_caches_until_a_domain_shows_single_turns():
    policy = Policy.load(TINY, seed=0)
    policy.eos_ids = frozenset()  # every action is exactly 3 tokens
    domains = {"three": _Turns("three", 3), "one": _Turns("one", 1)}
    gen = Generator(GeneratorConfig(episodes_in_flight=8), policy, domains, run="r", name="g0", seed=0)
    source = _Exactly(TaskSampler({"three": 1.0, "one": 1.0}, group_size=4, seed=0), 24)
    trajs = collect(gen, source, 24)
    gen.close()
    assert {len(t.steps) for t in trajs if t.domain == "three"} == {3} and any(t.domain == "one" for t in trajs)
    prompt, obs = len(policy.prompt_ids("count to three:")), len(policy.encode(" again:"))
    # Every episode prefilled its prompt once; each later turn only its last action token and
    # the observation, from the very first batch on (no context re-prefilled at turn 2).
    later_turns = sum(len(t.steps) - 1 for t in trajs)
    assert gen.engine.prefilled_tokens == 24 * prompt + later_turns * (1 + obs)
    assert gen._stepped == {"three", "one"} and gen._multi_turn == {"three"}


class _Gated(Domain):
    """A code domain (stepped on the pool, like a sandbox) whose steps all wait for `gate`."""

    name = "gated"
    needs_executor = True

    def __init__(self, gate):
        self.gate = gate
        self.action = ActionSpec(max_tokens=2)

    def task(self, index):
        return Task(self.name, str(index), "", {})

    def make_env(self, task, executor=None):
        return _GatedEnv(self.gate)


class _GatedEnv(Environment):
    def __init__(self, gate):
        self.gate = gate

    def reset(self):
        return "wait:"

    def step(self, action):
        assert self.gate.wait(600), "the test never opened the gate"
        return StepResult("", 1.0, True, {})


@pytest.mark.parametrize("lend", [0, 3])
def test_episodes_waiting_on_sandboxes_lend_their_rows_to_more_episodes(lend):
    """With lend_episodes, a generator whose episodes all wait on sandboxes takes that many more
    and samples them meanwhile; never more than episodes_in_flight rows decode at once."""
    import threading

    gate = threading.Event()
    policy = Policy.load(TINY, seed=0)
    cfg = GeneratorConfig(episodes_in_flight=2, lend_episodes=lend, env_threads=8)
    gen = Generator(cfg, policy, {"gated": _Gated(gate)}, run="r", name="g0", seed=0, executor=object())
    rows, step = [], gen.engine.step

    def counted():
        rows.append(len(gen.engine.rows) + len(gen.engine.pending))
        return step()

    gen.engine.step = counted
    source = LocalTaskSource(TaskSampler({"gated": 1.0}, group_size=1, seed=0))
    in_sandbox = lambda: [e for e in gen.episodes if e.pending is not None and e.future is not None]
    gen.run(source, lambda t: None, stop=lambda: len(in_sandbox()) >= 2 + lend)
    for _ in range(50):  # more rounds take no more: every row's episode waits on its sandbox
        gen._iterate(source, lambda t: None)
    assert len(gen.episodes) == len(in_sandbox()) == 2 + lend and gen.stats.lent == lend
    gate.set()
    trajs = collect(gen, source, 20)
    gen.close()
    assert len({t.episode for t in trajs}) == len(trajs) >= 20 and max(rows) <= 2, rows
