"""Losses: group-relative advantages, GRPO clipping with stale behaviour policies, truncated IS,
the algorithm registry, and the token layout the learner trains on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hpcrl.core.config import AlgorithmConfig, load_config
from hpcrl.rl.algorithms import ALGORITHMS, TokenBatch, group_advantages, make_algorithm
from hpcrl.rl.batch import GroupBuffer, collate, layout
from hpcrl.rl.registry import UnknownName
from hpcrl.rl.trajectory import Step, Trajectory


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    adv = group_advantages(r, g, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    norm = group_advantages(r, g, normalize_std=True)
    std = torch.tensor([1.0, 0, 0, 0]).std()  # unbiased, as torch.std
    assert torch.allclose(norm[:4], adv[:4] / std, atol=1e-5)
    assert torch.equal(norm[4:], torch.zeros(4))  # all-equal groups teach nothing


def batch_of(behaviour: float, adv: float) -> TokenBatch:
    return TokenBatch(
        input_ids=torch.zeros(1, 3, dtype=torch.long),
        attention_mask=torch.ones(1, 3, dtype=torch.long),
        action_mask=torch.tensor([[0.0, 1.0]]),
        behaviour_logprobs=torch.tensor([[0.0, behaviour]]),
        advantages=torch.tensor([adv]),
    )


def grad_of(algo, logprob_now: float, behaviour: float, adv: float) -> float:
    lp = torch.tensor([[-5.0, logprob_now]], requires_grad=True)
    loss, stats = algo.token_loss(lp, batch_of(behaviour, adv))
    loss.backward()
    assert stats["tokens"] == 1.0
    return float(lp.grad[0, 1]), float(lp.grad[0, 0]), stats


def test_grpo_on_policy_is_the_policy_gradient():
    algo = make_algorithm(AlgorithmConfig(name="grpo"))
    g, g_masked, stats = grad_of(algo, -1.0, -1.0, adv=2.0)
    assert g == pytest.approx(-2.0)  # d(-r A)/d logp at r = 1
    assert g_masked == 0.0  # prompt tokens are not trained
    assert stats["ratio_sum"] == pytest.approx(1.0) and stats["clipped_sum"] == 0.0


def test_grpo_corrects_and_clips_stale_samples():
    algo = make_algorithm(AlgorithmConfig(name="grpo", clip_low=0.2, clip_high=0.3, max_ratio=4.0))
    # Slightly stale: ratio e^0.1 = 1.105 inside the trust region -> gradient -r A.
    g, _, _ = grad_of(algo, -0.9, -1.0, adv=1.0)
    assert g == pytest.approx(-np.exp(0.1), rel=1e-5)
    # Positive advantage, ratio 1.65 above 1 + clip_high: no push further up.
    g, _, stats = grad_of(algo, -0.5, -1.0, adv=1.0)
    assert g == 0.0 and stats["clipped_sum"] == 1.0
    # Negative advantage, ratio 0.6 below 1 - clip_low: no push further down.
    g, _, _ = grad_of(algo, -1.5, -0.99, adv=-1.0)
    assert g == 0.0
    # Negative advantage, ratio 2 (between 1 and max_ratio): the surrogate keeps -r A.
    g, _, _ = grad_of(algo, -1.0 + np.log(2.0), -1.0, adv=-1.0)
    assert g == pytest.approx(2.0, rel=1e-5)
    # Very stale token with negative advantage, ratio e^3 = 20 > max_ratio: dual clip, constant loss.
    g, _, stats = grad_of(algo, -1.0, -4.0, adv=-1.0)
    assert g == 0.0 and stats["clipped_sum"] == 1.0


def test_reinforce_truncates_the_importance_weight():
    algo = make_algorithm(AlgorithmConfig(name="reinforce", max_ratio=2.0))
    g, _, _ = grad_of(algo, -1.0, -1.0 - np.log(1.5), adv=1.0)
    assert g == pytest.approx(-1.5, rel=1e-5)  # weight r = 1.5, held constant
    g, _, _ = grad_of(algo, -1.0, -4.0, adv=1.0)
    assert g == pytest.approx(-2.0, rel=1e-5)  # r = e^3 truncated at 2


def test_algorithm_registry_and_config():
    assert {"grpo", "reinforce"} <= set(ALGORITHMS.names())
    with pytest.raises(UnknownName, match=r"unknown algorithm 'ppo'; registered: grpo, reinforce"):
        make_algorithm(AlgorithmConfig(name="ppo"))
    cfg = load_config(None, ["learner.algorithm.name=reinforce", "learner.algorithm.max_ratio=3"])
    assert make_algorithm(cfg.learner.algorithm).cfg.max_ratio == 3.0


def traj(task: str, episode: int, reward: float, versions=(0,), domain="arith/copy") -> Trajectory:
    steps = []
    for i, v in enumerate(versions):
        steps.append(
            Step(
                policy_version=v,
                prompt_tokens=[1, 10 + i] if i == 0 else [],
                action_tokens=[20 + i, 2],
                action_logprobs=[-0.5 - i, -0.25],
                loss_mask=[1, 0 if i else 1],
                observation_tokens=[30 + i] if i < len(versions) - 1 else [],
                reward=reward if i == len(versions) - 1 else 0.0,
            )
        )
    return Trajectory(
        run="r", domain=domain, task=task, episode=episode, generator="g", steps=tuple(steps), final_reward=reward
    )


def test_layout_aligns_actions_with_logprob_positions():
    t = traj("a", 0, 1.0, versions=(0, 1))
    ids, mask, behav = layout(t)
    # prompt [1, 10], action [20, 2], obs [30], (no prompt), action [21, 2]
    assert ids == [1, 10, 20, 2, 30, 21, 2]
    # slot k describes token k+1: tokens 20, 2 (step 1) and 21 (step 2; its eos has loss_mask 0)
    assert mask == [0, 1, 1, 0, 1, 0]
    assert behav == [0, -0.5, -0.25, 0, -1.5, -0.25]
    tb = collate([t, traj("b", 1, 0.0)], torch.tensor([0.5, -0.5]), pad_id=0)
    assert tb.input_ids.shape == (2, 7) and tb.action_mask.shape == (2, 6)
    assert tb.input_ids[1].tolist() == [1, 10, 20, 2, 0, 0, 0] and tb.attention_mask[1].tolist() == [
        1,
        1,
        1,
        1,
        0,
        0,
        0,
    ]
    assert tb.n_action_tokens == 5


def test_group_buffer_completes_groups_and_drops_stale_ones():
    buf = GroupBuffer(group_size=2)
    buf.add(traj("t1", 0, 1.0, versions=(3,)))
    buf.add(traj("t2", 2, 1.0, versions=(1,)))
    buf.add(traj("t1", 1, 0.0, versions=(4,)))
    assert buf.complete_groups == 1 and buf.open_trajectories == 1
    buf.add(traj("t2", 2, 1.0, versions=(1,)))  # the same episode again: dropped
    assert buf.duplicates == 1 and buf.drained() == ["r/g/2"]
    buf.add(traj("t2", 3, 0.0, versions=(5,)))
    buf.add(traj("t3", 4, 0.0, versions=(2,)))  # open, and already too stale to be trained
    # Learner at version 5, staleness 2: group t2's oldest step (v1) is too old, t1's (v3) is fine.
    assert buf.pop(2, version=5, max_staleness=2) is None
    assert buf.dropped_stale == 3 and sorted(buf.drained()) == ["r/g/2", "r/g/3", "r/g/4"]
    state = buf.state_dict()
    groups = buf.pop(1, version=5, max_staleness=2)
    assert [[t.episode for t in g] for g in groups] == [[0, 1]]
    buf.add(traj("t1", 9, 1.0, versions=(5,)))  # a late copy for a group already trained
    assert buf.drained() == ["r/g/9"]

    # A restored buffer holds the same groups, and still refuses what was closed before.
    again = GroupBuffer(group_size=2)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.complete_groups == 1 and again.dropped_stale == 3
    again.add(traj("t2", 7, 0.0, versions=(5,)))
    assert again.drained() == ["r/g/7"]
    assert [[t.episode for t in g] for g in again.pop(1, version=5, max_staleness=2)] == [[0, 1]]
