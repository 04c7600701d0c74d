"""Losses: group-relative advantages, GRPO clipping with stale behaviour policies, truncated IS,
the algorithm registry, and the token layout the learner trains on."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from hpcrl.core.config import AlgorithmConfig, load_config
from hpcrl.rl.common.registry import UnknownName
from hpcrl.rl.learner.algorithms import ALGORITHMS, TokenBatch, group_advantages, make_algorithm
from hpcrl.rl.learner.batch import GroupBuffer, collate, layout
from hpcrl.rl.record.trajectory import Step, Trajectory


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
    with pytest.raises(UnknownName, match=r"unknown algorithm 'ppo'; registered: decoupled_ppo, grpo, reinforce"):
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
    ids, mask, behav, shape = layout(t)
    assert shape is None  # drawn from the model's own distribution
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


def test_group_buffer_bounds_a_group_by_its_newest_action_and_keeps_long_episodes():
    buf = GroupBuffer(group_size=2)
    buf.add(traj("t1", 0, 1.0, versions=(3,)))
    buf.add(traj("t2", 2, 1.0, versions=(1, 2, 4)))  # a long episode: it started at v1
    buf.add(traj("t1", 1, 0.0, versions=(4,)))
    assert buf.complete_groups == 1 and buf.open_trajectories == 1
    buf.add(traj("t2", 2, 1.0, versions=(1,)))  # the same episode again: dropped
    assert buf.duplicates == 1 and buf.drained() == [("r/g/2", "duplicate")]
    buf.add(traj("t2", 3, 0.0, versions=(5,)))
    buf.add(traj("t3", 4, 0.0, versions=(1,)))  # open: a member still to come may be fresh
    buf.add(traj("t4", 6, 0.0, versions=(2,)))
    buf.add(traj("t4", 7, 1.0, versions=(1, 3)))  # complete, newest action v3
    # Learner at version 6, bound 2: t1 (newest v4) and t2 (newest v5, though it started at v1,
    # five versions back) are trained; t4's newest action (v3) is too old: dropped, counted once.
    assert buf.pop(3, version=6, max_staleness=2) is None
    assert buf.dropped_stale == 2 and buf.dropped_groups == 1
    assert sorted(buf.drained()) == [("r/g/6", "stale"), ("r/g/7", "stale")]
    assert buf.open_trajectories == 1  # t3 waits: never dropped for its age while incomplete
    state = buf.state_dict()
    groups = buf.pop(2, version=6, max_staleness=2)
    assert [[t.episode for t in g] for g in groups] == [[0, 1], [2, 3]]
    buf.add(traj("t1", 1, 1.0, versions=(5,)))  # a late copy (a re-issued episode) for a group already trained
    assert buf.drained() == [("r/g/1", "late")]
    counts = buf.domain_counts()["arith/copy"]
    assert counts["arrived"] == 7 and counts["trained"] == 4 and counts["dropped_stale"] == 2
    assert counts["trained_turns"] == 1 + 1 + 3 + 1 and counts["arrived_turns"] == 6 + 3 + 1
    assert counts["dropped_duplicate"] == 1 and counts["dropped_late"] == 1

    # The coordinator gave up an episode of t3's group (number 2): what arrived of it is dropped,
    # what arrives later too, and it is consumed once however often the coordinator says so.
    assert buf.abandon([2, 0]) == 1 and buf.abandon([2]) == 0  # group 0 (t1) was trained already
    assert buf.dropped_groups == 2 and buf.open_trajectories == 0
    buf.add(traj("t3", 5, 1.0, versions=(6,)))
    assert buf.drained() == [("r/g/4", "abandoned"), ("r/g/5", "abandoned")]

    # A restored buffer holds the same groups and counts, and still refuses what was closed before.
    again = GroupBuffer(group_size=2)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.complete_groups == 2 and again.dropped_stale == 2 and again.open_trajectories == 1
    assert again.domain_counts()["arith/copy"]["arrived"] == 7
    again.add(traj("t4", 7, 0.0, versions=(5,)))
    assert again.drained() == [("r/g/7", "late")]
    assert [[t.episode for t in g] for g in again.pop(2, version=6, max_staleness=2)] == [[0, 1], [2, 3]]


# -- the researcher's options: loss aggregation, clip-higher, entropy bonus, dynamic sampling ----


def two_rows(adv0: float, adv1: float) -> TokenBatch:
    """Row 0 has one action token (slot 1), row 1 three (slots 1-3); on-policy (ratio 1)."""
    return TokenBatch(
        input_ids=torch.zeros(2, 5, dtype=torch.long),
        attention_mask=torch.ones(2, 5, dtype=torch.long),
        action_mask=torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]),
        behaviour_logprobs=torch.tensor([[0.0, -1.0, 0.0, 0.0], [0.0, -1.0, -1.0, -1.0]]),
        advantages=torch.tensor([adv0, adv1]),
    )


@pytest.mark.parametrize(
    "agg, den, g0, g1",
    [
        # -A w / den with A = 2 (row 0), -1 (row 1); token (DAPO): every token / 4 tokens in the batch
        ("token", 4.0, -2.0 / 4, 1.0 / 4),
        # seq (GRPO): each token / its row's length, / 2 sequences
        ("seq", 2.0, -2.0 / 1 / 2, 1.0 / 3 / 2),
        # constant (Dr. GRPO), L = 8: every token / (2 sequences x 8)
        ("constant", 16.0, -2.0 / 16, 1.0 / 16),
    ],
)
def test_loss_aggregation_gradient_per_token(agg, den, g0, g1):
    algo = make_algorithm(AlgorithmConfig(name="grpo", loss_agg=agg, loss_len=8, entropy_coef=0.0))
    assert algo.denominator([1, 3]) == den
    assert algo.denominator([1]) + algo.denominator([3]) == den  # ranks' shares add up
    lp = torch.full((2, 4), -1.0, requires_grad=True)
    loss_sum, stats = algo.token_loss(lp, two_rows(2.0, -1.0))
    (loss_sum / den).backward()
    # d(-r A w / den)/d logp at r = 1: -A w / den, 0 off the action tokens
    expected = torch.tensor([[0.0, g0, 0.0, 0.0], [0.0, g1, g1, g1]])
    assert torch.allclose(lp.grad, expected, atol=1e-7), lp.grad
    assert stats["tokens"] == 4.0 and stats["rows"] == 2.0


def test_clip_higher_lets_a_rare_good_token_rise_further():
    # Positive advantage, ratio e^0.22 = 1.246: clipped by a symmetric 0.2, not by clip-higher 0.28.
    sym = make_algorithm(AlgorithmConfig(name="grpo", clip_low=0.2, clip_high=0.2))
    high = make_algorithm(AlgorithmConfig(name="grpo", clip_low=0.2, clip_high=0.28))
    g, _, stats = grad_of(sym, -0.78, -1.0, adv=1.0)
    assert g == 0.0 and stats["clipped_sum"] == 1.0
    g, _, stats = grad_of(high, -0.78, -1.0, adv=1.0)
    assert g == pytest.approx(-np.exp(0.22), rel=1e-5) and stats["clipped_sum"] == 0.0
    # The lower bound is still 1 - clip_low: a negative advantage at ratio e^-0.25 = 0.78 is clipped.
    g, _, stats = grad_of(high, -1.25, -1.0, adv=-1.0)
    assert g == 0.0 and stats["clipped_sum"] == 1.0
    # Above 1 + clip_high the positive side is clipped again.
    g, _, _ = grad_of(high, -0.7, -1.0, adv=1.0)
    assert g == 0.0


def test_entropy_bonus_gradient_is_the_entropy_gradient():
    """Through the learner's own head (chunked, recomputed in backward): with an identity output
    projection the hidden states are the logits, so the gradient reaches them directly."""
    from hpcrl.rl.model.logprobs import chunked_logprobs

    z = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, -1.0]]])  # position 1 predicts token 2
    hidden = torch.nn.Parameter(z.clone())
    ids = torch.tensor([[0, 1, 2]])
    batch = TokenBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        action_mask=torch.tensor([[0.0, 1.0]]),  # only token 2 (predicted at position 1) is an action
        behaviour_logprobs=torch.zeros(1, 2),
        advantages=torch.tensor([0.0]),  # no policy gradient: only the bonus acts
    )
    c = 0.1
    algo = make_algorithm(AlgorithmConfig(name="grpo", entropy_coef=c))
    lp, ent = chunked_logprobs(hidden, torch.eye(3), ids[:, 1:], chunk_tokens=1)
    loss_sum, stats = algo.token_loss(lp, batch, ent)
    loss_sum.backward()
    p = torch.softmax(z[0, 1], -1)
    h = -(p * p.log()).sum()
    assert stats["entropy_sum"] == pytest.approx(float(h), rel=1e-6)
    assert stats["entropy_first_sum"] == pytest.approx(float(h), rel=1e-6)
    # loss = -c H; dH/dz_k = -p_k (log p_k + H), so d loss/dz_k = c p_k (log p_k + H)
    assert torch.allclose(hidden.grad[0, 1], c * p * (p.log() + h), atol=1e-6)
    assert torch.equal(hidden.grad[0, 0], torch.zeros(3))  # not an action position
    # entropy_coef 0: the learner detaches the entropy; it is measured and adds no gradient
    hidden.grad = None
    off = make_algorithm(AlgorithmConfig(name="grpo", entropy_coef=0.0))
    lp, ent = chunked_logprobs(hidden, torch.eye(3), ids[:, 1:], chunk_tokens=1)
    loss_sum, stats = off.token_loss(lp, batch, ent.detach())
    loss_sum.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(z)) and stats["entropy_sum"] > 0


def test_copies_of_a_whole_waiting_group_are_dropped_not_swapped_in():
    """A generator killed after its group was stored but before it told the coordinator: the
    coordinator re-issues the episodes, another generator finishes them, and their copies arrive
    while the first group is whole and waiting for a batch. Found in
    test_rollout_processes_fill_local_windows_and_lose_nothing: the copies filled a new group
    under the same key, which replaced the waiting one, and 8 stored trajectories were neither
    trained nor dropped."""
    buf = GroupBuffer(group_size=2)
    first = [traj("t1", 0, 1.0), traj("t1", 1, 0.0)]
    for t in first:
        buf.add(t)
    copies = [dataclasses.replace(t, generator="h") for t in first]
    for t in copies:
        buf.add(t)
    assert buf.complete_groups == 1 and buf.duplicates == 2
    assert sorted(buf.drained()) == [("r/h/0", "duplicate"), ("r/h/1", "duplicate")]
    (group,) = buf.pop(1, version=0, max_staleness=2)
    assert [t.id for t in group] == ["r/g/0", "r/g/1"]


def test_group_buffer_keeps_two_groups_of_one_task_apart_and_counts_dropped_groups_once():
    """Two groups of one task id (a site domain whose ids repeat) stay apart: a second group is
    not taken for late copies of the first. A group dropped as stale is one consumed group
    however many members came: the coordinator's flow control counts it so (counted short, each
    such group held a place in its window for ever, and a run stalled with every issued episode
    stored and nothing to train)."""
    buf = GroupBuffer(group_size=2)
    for episode in (0, 1, 2, 3):  # groups 0 and 1, both of task t1
        buf.add(traj("t1", episode, float(episode % 2), versions=(4,)))
    assert buf.complete_groups == 2 and buf.duplicates == 0
    assert [[t.episode for t in g] for g in buf.pop(2, version=4, max_staleness=2)] == [[0, 1], [2, 3]]
    buf.add(traj("t2", 4, 1.0, versions=(1,)))
    buf.add(traj("t2", 5, 0.0, versions=(1,)))  # group 2 complete, its newest action too old
    assert buf.pop(1, version=4, max_staleness=2) is None
    assert buf.dropped_groups == 1 and buf.dropped_stale == 2
    buf.add(traj("t2", 5, 0.0, versions=(1,)))  # a late copy of a member: refused, not counted again
    assert buf.pop(1, version=4, max_staleness=2) is None
    assert (
        buf.dropped_groups == 1
        and buf.duplicates == 1
        and sorted(buf.drained()) == [("r/g/4", "stale"), ("r/g/5", "late"), ("r/g/5", "stale")]
    )
    again = GroupBuffer(group_size=2)
    again.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert again.dropped_groups == 1
    again.add(traj("t2", 5, 0.0, versions=(1,)))
    assert again.duplicates == 2  # still closed after a restore


def test_dynamic_sampling_drops_zero_variance_groups():
    buf = GroupBuffer(group_size=2, filter_zero_variance=True)
    for t in (traj("flat", 0, 1.0), traj("flat", 1, 1.0), traj("good", 2, 1.0), traj("good", 3, 0.0)):
        buf.add(t)
    assert buf.complete_groups == 1 and buf.filtered == 2
    assert buf.drained() == [("r/g/0", "filtered"), ("r/g/1", "filtered")]  # accounted for in the audit log
    buf.add(traj("flat", 1, 0.0))  # a late copy for the filtered group is refused
    assert buf.drained() == [("r/g/1", "late")] and buf.duplicates == 1 and buf.dropped_groups == 1
    state = json.loads(json.dumps(buf.state_dict()))
    assert [[t.task for t in g] for g in buf.pop(1, version=0, max_staleness=2)] == [["good", "good"]]
    again = GroupBuffer(group_size=2, filter_zero_variance=True)
    again.load_state_dict(state)
    assert again.filtered == 2 and again.complete_groups == 1
    keep = GroupBuffer(group_size=2)  # off (the default): all-equal groups are trained
    keep.add(traj("flat", 0, 1.0))
    keep.add(traj("flat", 1, 1.0))
    assert keep.complete_groups == 1 and keep.filtered == 0


def test_lr_schedule():
    from hpcrl.core.config import LearnerConfig
    from hpcrl.rl.learner.schedule import lr_at, set_lr

    warm = LearnerConfig(lr=1e-3, lr_schedule="constant", lr_warmup_steps=4, max_steps=104)
    assert [lr_at(warm, s) for s in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    # lr_decay_steps 0: the decay runs until max_steps.
    cos = LearnerConfig(
        lr=1e-3, lr_schedule="cosine", lr_warmup_steps=4, lr_min_ratio=0.1, lr_decay_steps=0, max_steps=104
    )
    assert lr_at(cos, 4) == pytest.approx(1e-3)
    assert lr_at(cos, 54) == pytest.approx(0.55e-3)  # half-way: the mean of lr and lr x min_ratio
    assert lr_at(cos, 104) == pytest.approx(1e-4) and lr_at(cos, 500) == pytest.approx(1e-4)
    lin = LearnerConfig(lr=1e-3, lr_schedule="linear", lr_min_ratio=0.0, lr_decay_steps=0, max_steps=100)
    assert lr_at(lin, 0) == pytest.approx(1e-3) and lr_at(lin, 25) == pytest.approx(0.75e-3)
    # A decay of its own length (lr_decay_steps) counts from the end of the warm-up, not to max_steps.
    own = LearnerConfig(
        lr=1e-3, lr_schedule="linear", lr_warmup_steps=10, lr_decay_steps=40, lr_min_ratio=0.1, max_steps=10**7
    )
    assert [lr_at(own, s) for s in (10, 30, 50, 10**6)] == pytest.approx([1e-3, 0.55e-3, 1e-4, 1e-4])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] == 0.25


def test_entropy_coefficient_decay():
    from hpcrl.rl.learner.schedule import entropy_coef_at

    assert entropy_coef_at(AlgorithmConfig(entropy_coef=0.05), 10**6) == 0.05  # 0: constant
    decay = AlgorithmConfig(entropy_coef=0.05, entropy_decay_steps=100)
    assert [entropy_coef_at(decay, s) for s in (0, 50, 100, 500)] == pytest.approx([0.05, 0.025, 0.0, 0.0])
    # The coefficient handed to token_loss is the one used: at 0 the bonus adds no gradient.
    from hpcrl.rl.model.logprobs import chunked_logprobs

    z = torch.nn.Parameter(torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, -1.0]]]))
    ids = torch.tensor([[0, 1, 2]])
    batch = TokenBatch(ids, torch.ones_like(ids), torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.zeros(1))
    p = torch.softmax(z.detach()[0, 1], -1)
    h = -(p * p.log()).sum()
    for step, c in ((50, 0.025), (100, 0.0)):
        z.grad = None
        lp, ent = chunked_logprobs(z, torch.eye(3), ids[:, 1:], chunk_tokens=1)
        make_algorithm(decay).token_loss(lp, batch, ent, entropy_coef_at(decay, step))[0].backward()
        # d(-c H)/dz_k = c p_k (log p_k + H) at the action position, as in the constant case
        assert torch.allclose(z.grad[0, 1], c * p * (p.log() + h), atol=1e-7), (step, z.grad)


@pytest.mark.parametrize("loss_agg", ["token", "seq", "constant"])
def test_reference_kl_is_weighted_as_the_policy_loss(loss_agg):
    """k2 per action token, hand-computed, each weighted by its importance weight; the loss term
    weights each token as the policy loss does (1/|o| per sequence under seq), so beta means the
    same under every loss_agg. The statistic is the weighted k3 (d = ref - lp)."""
    from hpcrl.rl.learner.reference import kl_penalty

    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.5, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, -1.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # three action tokens, then one
    is_w = torch.tensor([[1.0, 2.0, 1.0], [0.5, 1.0, 1.0]])
    algo = make_algorithm(AlgorithmConfig(name="grpo", loss_agg=loss_agg))
    total, stats = kl_penalty(lp, ref, mask, algo.token_weights(mask), is_w)
    k3 = lambda d: math.exp(d) - d - 1  # d = ref - lp
    assert stats["ref_kl_sum"] == pytest.approx(k3(-0.5) + 2 * k3(1.0) + k3(0.0) + 0.5 * k3(0.5), rel=1e-6)
    row0, row1 = [0.5 * 0.25, 2 * 0.5 * 1.0, 0.0], [0.5 * 0.5 * 0.25]
    want = sum(row0) / 3 + sum(row1) if loss_agg == "seq" else sum(row0) + sum(row1)
    assert float(total.detach()) == pytest.approx(want, rel=1e-6)
    total.backward()
    # d k2 / d lp = w (lp - ref) at the action tokens, 0 off them
    w0 = 1 / 3 if loss_agg == "seq" else 1.0
    assert float(lp.grad[0, 1]) == pytest.approx(w0 * 2 * (-2.0 + 1.0), rel=1e-6)
    assert float(lp.grad[1, 0]) == pytest.approx(0.5 * (-1.0 + 0.5), rel=1e-6)
    assert float(lp.grad[1, 2]) == 0.0


def test_drop_reasons_survive_a_checkpoint_and_old_checkpoints_say_unknown():
    buf = GroupBuffer(group_size=2)
    buf.add(traj("t1", 0, 1.0))
    buf.add(traj("t1", 0, 1.0))  # dropped before the checkpoint, audited after the restore
    state = json.loads(json.dumps(buf.state_dict()))
    again = GroupBuffer(group_size=2)
    again.load_state_dict(state)
    assert again.drained() == [("r/g/0", "duplicate")]
    del state["dropped_why"]  # saved by an hpcrl that kept no reasons
    old = GroupBuffer(group_size=2)
    old.load_state_dict(state)
    assert old.drained() == [("r/g/0", "unknown")]
