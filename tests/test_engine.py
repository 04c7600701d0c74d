"""The decode engine: continuous batching (a finished row's slot is taken at the next step), KV
caches kept across an episode's turns (only the new tokens are prefilled, the same
log-probabilities come out), per-domain sampling parameters, and max_context."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from hpcrl.core.config import GeneratorConfig, PolicyConfig, TinyModelConfig
from hpcrl.rl.coordinator.tasks import EpisodeFailed, LocalTaskSource, TaskSampler
from hpcrl.rl.domains import ActionSpec, PromptDomain, get_domain
from hpcrl.rl.model.logprobs import token_logprobs
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.engine import ContextTooLong, DecodeEngine, SamplingSpec
from hpcrl.rl.rollout.generator import Generator

TINY = PolicyConfig(
    tiny=TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_context=256), device="cpu"
)


@pytest.fixture(scope="module")
def policy():
    p = Policy.load(TINY, seed=0)
    p.eos_ids = frozenset()  # rows end by length only: lengths are what these tests control
    return p


def run_to_end(engine):
    out = {}
    while engine.busy:
        out.update(engine.step())
    return out


def test_a_finished_row_is_refilled_at_the_next_step(policy):
    e = DecodeEngine(policy, seed=0)
    e.submit("short", policy.prompt_ids("a"), max_new=2)
    e.submit("long", policy.prompt_ids("bb"), max_new=12)
    assert e.step() == [] and len(e.rows) == 2
    assert [k for k, _ in e.step()] == ["short"] and [r.key for r in e.rows] == ["long"]
    e.submit("next", policy.prompt_ids("a longer prompt"), max_new=3)
    e.step()  # decodes "long" and admits "next" in the same step
    assert [r.key for r in e.rows] == ["long", "next"]
    out = run_to_end(e)
    assert len(out["long"].tokens) == 12 and len(out["next"].tokens) == 3
    for key, ctx in (("long", "bb"), ("next", "a longer prompt")):
        c = policy.prompt_ids(ctx)
        ref = token_logprobs(policy.model, torch.tensor([c + list(out[key].tokens)]))[0, len(c) - 1 :]
        assert torch.allclose(ref, torch.tensor(out[key].logprobs), atol=1e-4)


def test_kept_cache_prefills_only_the_new_tokens_and_gives_the_same_logprobs(policy):
    e = DecodeEngine(policy, seed=0, kv_keep_bytes=1 << 30)
    ctx = {k: policy.prompt_ids(f"episode {k}:" * (k + 1)) for k in range(3)}
    for k, c in ctx.items():
        e.submit(k, c, max_new=5)
    first = run_to_end(e)
    assert set(e.kept) == {0, 1, 2}
    prefilled = e.prefilled_tokens
    obs = policy.encode(" no, again:")
    for k in ctx:
        ctx[k] = ctx[k] + list(first[k].tokens) + obs
        e.submit(k, ctx[k], max_new=4)
    second = run_to_end(e)
    # Only the last action token (never fed yet) and the observation went through prefill.
    assert e.prefilled_tokens - prefilled == 3 * (1 + len(obs))
    for k, c in ctx.items():
        ref = token_logprobs(policy.model, torch.tensor([c + list(second[k].tokens)]))[0, len(c) - 1 :]
        assert torch.allclose(ref, torch.tensor(second[k].logprobs), atol=1e-4), k
    e.forget(0)
    assert 0 not in e.kept and e.kept_bytes == sum(s for _, _, s in e.kept.values())
    # A budget too small for a row keeps nothing: that episode re-prefills its context.
    small = DecodeEngine(policy, seed=0, kv_keep_bytes=1)
    small.submit(0, ctx[0], max_new=2)
    run_to_end(small)
    assert not small.kept


def test_sampling_parameters(policy):
    ctx = policy.prompt_ids("x")
    e = DecodeEngine(policy, seed=0)
    greedy = [SamplingSpec(temperature=0.0), SamplingSpec(top_k=1), SamplingSpec(top_p=1e-6, temperature=2.0)]
    for i, spec in enumerate(greedy):
        e.submit(i, ctx, max_new=6, spec=spec)
    e.submit("free", ctx, max_new=6)
    out = run_to_end(e)
    tokens = {k: out[k].tokens for k in out}
    assert tokens[0] == tokens[1] == tokens[2]  # all three are argmax decoding
    # ... from a point mass: greedy, or a truncation that keeps one token, draws with probability 1
    assert out[0].logprobs == out[1].logprobs == out[2].logprobs == (0.0,) * 6
    full = token_logprobs(policy.model, torch.tensor([ctx + list(out["free"].tokens)]))[0, len(ctx) - 1 :]
    assert torch.allclose(full, torch.tensor(out["free"].logprobs), atol=1e-4)  # temperature 1: the model's own
    # top_k=3 only ever draws one of the 3 likeliest tokens
    e.submit("k3", ctx, max_new=1, spec=SamplingSpec(top_k=3))
    for _ in range(20):
        e.submit("k3", ctx, max_new=1, spec=SamplingSpec(top_k=3, temperature=5.0))
        t = run_to_end(e)["k3"].tokens[0]
        logits = policy.model(torch.tensor([ctx])).logits[0, -1]
        assert t in logits.topk(3).indices.tolist()
    with pytest.raises(ValueError, match="top_p"):
        ActionSpec(4, top_p=0)


def test_a_shaped_sample_records_the_distribution_that_drew_it_as_the_learner_scores_it(policy):
    """Hot, cool-and-truncated, top-k: each token's recorded log-probability is log q of the
    distribution it was drawn from, which the learner's head recomputes from the full context
    under the same parameters (on-policy ratio 1), and not the model's own log p."""
    from hpcrl.rl.model.logprobs import PolicyHead, Shaping

    specs = {"hot": SamplingSpec(temperature=2.0), "cool": SamplingSpec(temperature=0.6, top_p=0.9),
             "k": SamplingSpec(temperature=1.3, top_k=5)}  # fmt: skip
    e = DecodeEngine(policy, seed=0)
    ctx = policy.prompt_ids("ab")
    for key, spec in specs.items():
        e.submit(key, ctx, max_new=8, spec=spec)
    out = run_to_end(e)
    head = PolicyHead(policy.model)
    for key, spec in specs.items():
        ids = torch.tensor([ctx + list(out[key].tokens)])
        n = ids.shape[1] - 1
        shaping = Shaping(torch.full((1, n), spec.temperature), torch.full((1, n), spec.top_p),
                          torch.full((1, n), spec.top_k))  # fmt: skip
        with torch.no_grad():
            lq, _, own = head(ids, shaping=shaping)
        got = torch.tensor(out[key].logprobs)
        assert torch.allclose(lq[0, len(ctx) - 1 :], got, atol=1e-4), key
        assert not torch.allclose(own[0, len(ctx) - 1 :], got, atol=1e-2), key


def test_context_longer_than_max_context_is_a_clear_error(policy):
    e = DecodeEngine(policy, seed=0, max_context=32)
    with pytest.raises(ContextTooLong, match="does not fit max_context 32 .generators.max_context"):
        e.submit(0, list(range(5, 40)), max_new=4)
    e.submit(1, policy.prompt_ids("x" * 28), max_new=50)  # clamped to the room left
    assert len(run_to_end(e)[1].tokens) == 32 - 29
    gen = Generator(
        GeneratorConfig(max_context=20),
        policy,
        {"long": PromptDomain("long", [("x" * 40, "1")])},
        run="r",
        name="g",
        seed=0,
    )
    # A prompt that cannot fit fails the same way every time: it is given up at its first failure,
    # not retried max_attempts times.
    source = LocalTaskSource(TaskSampler({"long": 1.0}, 2, 0), max_attempts=3)
    with pytest.raises(EpisodeFailed, match="failed 1 times; last: prompt of 41 tokens does not fit max_context 20"):
        gen.run(source, lambda t: None)
    assert source.reissued == 0
    gen.close()


def test_weight_swap_restart_drops_actions_in_flight(tmp_path):
    from hpcrl.rl.model.policy import full_state_dict
    from hpcrl.rl.weights.shards import WeightStore

    store = WeightStore(tmp_path)
    p = Policy.load(TINY, seed=0)
    store.publish(full_state_dict(p.model), 0)
    dom = PromptDomain("slow", [("go:", "1")], max_tokens=40)
    gen = Generator(GeneratorConfig(weight_swap="restart", episodes_in_flight=4), p, {"slow": dom},
                    run="r", name="g", seed=0, weights=store)  # fmt: skip
    source = LocalTaskSource(TaskSampler({"slow": 1.0}, 2, 0))
    gen.run(source, lambda t: None, stop=lambda: gen.engine.rows and len(gen.engine.rows[0].toks) > 3)
    store.publish(full_state_dict(p.model), 1)
    assert gen.maybe_update_weights() and not gen.engine.busy and all(e.ready for e in gen.episodes)
    trajs = []
    gen.run(source, trajs.append, stop=lambda: len(trajs) >= 4)
    gen.close()
    assert all(t.policy_versions == (1,) for t in trajs[:4])


def test_multi_turn_generator_keeps_caches_and_matches_full_recompute():
    p = Policy.load(TINY, seed=0)
    domains = {"arith/max3-retry4": get_domain("arith/max3-retry4")}
    runs = {}
    for gb in (0.0, 1.0):
        gen = Generator(GeneratorConfig(episodes_in_flight=16, kv_cache_gb=gb), p, domains, run="r", name="g", seed=0)
        trajs: list = []
        gen.run(LocalTaskSource(TaskSampler({n: 1.0 for n in domains}, 4, 0)), trajs.append,
                stop=lambda trajs=trajs: len(trajs) >= 48)  # fmt: skip
        gen.close()
        runs[gb] = (trajs, gen.engine.prefilled_tokens)
    assert runs[1.0][1] < runs[0.0][1]  # kept caches: fewer tokens prefilled for the same work
    multi = [t for t in runs[1.0][0] if len(t.steps) > 2]
    assert multi
    import numpy as np

    for t in multi[:5]:
        ids = np.concatenate(
            [np.concatenate([s.prompt_tokens, s.action_tokens, s.observation_tokens]) for s in t.steps]
        )
        lp = token_logprobs(p.model, torch.tensor(ids[None].astype(np.int64)))[0]
        pos, got = 0, []
        for s in t.steps:
            pos += len(s.prompt_tokens)
            got.extend(lp[pos - 1 : pos - 1 + len(s.action_tokens)].tolist())
            pos += len(s.action_tokens) + len(s.observation_tokens)
        assert np.allclose(got, np.concatenate([s.action_logprobs for s in t.steps]), atol=1e-4)


def test_draws_follow_the_probabilities_and_never_pick_a_zero():
    from hpcrl.rl.rollout.engine import _draw

    # Unnormalised rows with zeros at both ends and inside (what top-k/top-p cuts leave).
    p = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 3.0], [2.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    n = 6000
    gen = torch.Generator().manual_seed(0)
    draws = _draw(p.repeat(n, 1), gen).view(n, 3)
    for r in range(3):
        freq = torch.bincount(draws[:, r], minlength=6).double() / n
        assert (freq[p[r] == 0] == 0).all(), (r, freq)
        # 4 standard deviations of a frequency at p = 0.5 over 6000 draws
        assert torch.allclose(freq, (p[r] / p[r].sum()).double(), atol=0.026), (r, freq)


def test_decode_steps_write_the_cache_in_place_and_it_grows_past_its_room(policy):
    e = DecodeEngine(policy, seed=0)
    ctx = policy.prompt_ids("ab")
    e.submit("r", ctx, max_new=150)  # more than the room allocated ahead (max(64, length))
    e.step()
    layer = e.cache.layers[0]
    moves, ptr, steps, out = 0, layer.keys.data_ptr(), 0, {}
    while e.busy:
        out.update(e.step())
        if e.busy:
            steps += 1
            moves += e.cache.layers[0].keys.data_ptr() != ptr
            ptr = e.cache.layers[0].keys.data_ptr()
    assert 1 <= moves <= 2 and steps >= 140  # a decode step copies the cache only when it outgrows it
    tokens = list(out["r"].tokens)
    ref = token_logprobs(policy.model, torch.tensor([ctx + tokens]))[0, len(ctx) - 1 :]
    assert len(tokens) == 150 and torch.allclose(ref, torch.tensor(out["r"].logprobs), atol=1e-4)


def test_rows_of_very_different_lengths_prefill_in_groups_with_the_same_logprobs(policy):
    from hpcrl.rl.rollout.engine import _groups

    assert _groups([65, 257, 250, 70, 240]) == [[1, 2, 4], [3, 0]]
    assert _groups([33, 33, 33]) == [[0, 1, 2]]
    e = DecodeEngine(policy, seed=0, kv_keep_bytes=1 << 30)
    e.submit("kept", policy.prompt_ids("k" * 150), max_new=3)
    first = run_to_end(e)["kept"]
    ctx = {"short": policy.prompt_ids("s"), "long": policy.prompt_ids("l" * 200)}
    ctx["kept"] = policy.prompt_ids("k" * 150) + list(first.tokens) + policy.encode(" more:")
    for k, c in ctx.items():
        e.submit(k, c, max_new=4)
    forwards = []
    forward = e._forward
    e._forward = lambda ids, *a: forwards.append(ids.shape) or forward(ids, *a)
    e.step()
    # Two forwards: the long prompt's 201 tokens alone; the kept episode's 7 new ones beside the
    # short prompt's 2 (5 columns of padding), not both padded to 201.
    assert sorted(forwards) == [(1, 201), (2, 7)]
    out = run_to_end(e)
    for k, c in ctx.items():
        ref = token_logprobs(policy.model, torch.tensor([c + list(out[k].tokens)]))[0, len(c) - 1 :]
        assert torch.allclose(ref, torch.tensor(out[k].logprobs), atol=1e-4), k
