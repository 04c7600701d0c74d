"""Shared-prompt packing (rl/learner/packing.py): which groups pack and how, and that a packed forward
pass gives every action token the log-probability, entropy and gradient it gets in a row of its
own, under both attention implementations that take a mask."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpcrl.rl.learner.batch import collate_rows
from hpcrl.rl.learner.packing import MIN_SAVED, Unit, attention_mask, pack, plan_units
from hpcrl.rl.model.logprobs import PolicyHead

PAD = 0


def row(ids: list[int], first_action: int, shape=None):
    """layout() of a one-step trajectory: tokens from `first_action` on are actions, drawn with
    sampling parameters `shape` (temperature, top_p, top_k), None: the model's own."""
    mask = [1.0 if t + 1 >= first_action else 0.0 for t in range(len(ids) - 1)]
    arr = None
    if shape is not None:
        arr = np.tile(np.float32([1.0, 1.0, 0.0]), (len(mask), 1))
        arr[np.asarray(mask) > 0] = shape
    return ids, mask, [-0.5 * m for m in mask], arr


def test_plan_units_packs_groups_that_share_a_prompt_and_splits_over_the_budget():
    rows = [
        row([1, 5, 6, 7, 2], 3),  # group A: prompt 1 5 6, answers 7 2 / 7 3 / 8
        row([1, 5, 6, 7, 3], 3),
        row([1, 5, 6, 8], 3),
        row([1, 9, 2], 2),  # group B: only token 1 in common: 1 of 7 tokens saved, not packed
        row([1, 4, 3, 3], 2),
    ]
    units = plan_units(rows, [[0, 1, 2], [3, 4]])
    # A shares "1 5 6" (3 tokens): 3 + 2 + 2 + 1 = 8 tokens against 14.
    assert Unit((0, 1, 2), 3, 8) in units
    assert Unit((3,), 0, 3) in units and Unit((4,), 0, 4) in units
    assert [u.length for u in units] == sorted((u.length for u in units), reverse=True)
    # Identical first answers share too: "1 5 6 7" is common to rows 0 and 1.
    assert plan_units(rows, [[0, 1]]) == [Unit((0, 1), 4, 6)]
    # A budget of 6 tokens: the prefix goes with every unit the group is split into.
    assert plan_units(rows, [[0, 1, 2]], budget_tokens=6) == [Unit((1, 2), 3, 6), Unit((0,), 3, 5)]
    # At most 2 trajectories a unit (learner.micro_batch): the same split by count.
    assert plan_units(rows, [[0, 1, 2]], max_members=2) == [Unit((0, 1), 3, 7), Unit((2,), 3, 4)]
    assert MIN_SAVED > 1 / 7  # group B's case above


def test_pack_lays_out_prefix_members_positions_and_gather_indices():
    rows = [row([1, 5, 6, 7, 2], 3), row([1, 5, 6, 8], 3), row([1, 9], 1)]
    pb = pack([Unit((0, 1), 3, 6), Unit((2,), 0, 2)], rows, PAD)
    assert pb.input_ids.tolist() == [[1, 5, 6, 7, 2, 8], [1, 9, PAD, PAD, PAD, PAD]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 0, 0, 0, 0]]
    assert pb.segment.tolist() == [[0, 0, 0, 1, 1, 2], [1, 1, -1, -1, -1, -1]]
    assert (pb.members, pb.width) == (3, 4)
    # Row 0 predicts 7 at the prefix's end (2) and 2 at its own 7 (3); row 1 predicts 8 at 2;
    # row 2 predicts 9 at 0 of the second packed row (flat 6).
    assert pb.targets.tolist() == [7, 2, 8, 9]
    assert pb.src.tolist() == [2, 3, 2, 6]
    assert pb.dest.tolist() == [0 * 4 + 2, 0 * 4 + 3, 1 * 4 + 2, 2 * 4 + 0]
    allowed = attention_mask(pb.segment, "sdpa", torch.float32)[0, 0]
    # Member 2's token (position 5) sees the prefix and itself, not member 1's tokens.
    assert allowed[5].tolist() == [True, True, True, False, False, True]
    assert allowed[4].tolist() == [True, True, True, True, True, False]
    eager = attention_mask(pb.segment, "eager", torch.float32)[0, 0]
    assert torch.equal(eager == 0, allowed)
    with pytest.raises(ValueError, match="flash_attention_2"):
        attention_mask(pb.segment, "flash_attention_2", torch.float32)


def _groups(rng: random.Random, vocab: int):
    """Groups of 4 with prompts of 2-7 tokens; answers of 1-5 tokens, some alike, some repeated,
    some drawn at another temperature or truncated."""
    rows, groups = [], []
    for _ in range(6):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 7))]
        members = []
        for _ in range(4):
            answer = [rng.randrange(3, 6) for _ in range(rng.randrange(1, 6))]
            shape = rng.choice([None, None, (1.7, 1.0, 0), (1.0, 0.8, 0), (0.7, 0.9, 3)])
            r = row(prompt + answer, len(prompt), shape)
            if rng.random() < 0.3:  # a token of the answer not trained (loss_mask 0)
                mask = list(r[1])
                mask[-1] = 0.0
                r = (r[0], mask, r[2], r[3])
            members.append(len(rows))
            rows.append(r)
        groups.append(members)
    return rows, groups


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_forward_matches_one_row_per_trajectory(impl):
    torch.manual_seed(0)
    vocab = 12
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation=impl)  # fmt: skip
    head = PolicyHead(LlamaForCausalLM(cfg).float())
    rows, groups = _groups(random.Random(1), vocab)
    units = plan_units(rows, groups)
    assert any(u.prefix > 0 and len(u.members) > 1 for u in units), "want packed groups"
    members = [i for u in units for i in u.members]
    tb = collate_rows([rows[i] for i in members], torch.zeros(len(members)), PAD)
    on = tb.action_mask > 0

    assert tb.shaping is not None and (tb.shaping.temperature[on] != 1).any()

    def run(packed: bool):
        head.zero_grad()
        if packed:
            pb = pack(units, rows, PAD)
            lp, ent, own = head(pb.input_ids, attention_mask(pb.segment, impl, torch.float32), packed=pb,
                                shaping=pb.shaping)  # fmt: skip
        else:
            lp, ent, own = head(tb.input_ids, tb.attention_mask, shaping=tb.shaping)
        weights = torch.linspace(-1.0, 1.0, on.sum().item())  # a different weight per token
        ((lp[on] * weights).sum() + 0.1 * ent[on].sum() + 0.3 * own[on].sum()).backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters()}
        return lp.detach(), ent.detach(), own.detach(), grads

    lp_p, ent_p, own_p, g_p = run(True)
    lp_r, ent_r, own_r, g_r = run(False)
    torch.testing.assert_close(lp_p[on], lp_r[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_p[on], ent_r[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(own_p[on], own_r[on], atol=1e-5, rtol=1e-5)
    assert (lp_p[~on] == 0).all() and (ent_p[~on] == 0).all()
    shaped = on & (tb.shaping.temperature != 1)
    assert (lp_r[shaped] != own_r[shaped]).all()  # scored under the distribution that drew them
    for name in g_r:
        torch.testing.assert_close(g_p[name], g_r[name], atol=1e-5, rtol=1e-4, msg=name)


def test_rows_of_their_own_take_the_plain_padding_mask():
    """Units without a shared prefix (what plan_units makes of a group not worth packing) go
    through the packed pass with the 2-D padding mask, as the learner sends them: no [L, L]
    tensor, the same log-probabilities as one row per trajectory."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)  # fmt: skip
    head = PolicyHead(LlamaForCausalLM(cfg).float())
    rows = [row([1, 4, 5, 6, 2], 2), row([1, 7, 3], 2), row([1, 8, 8, 9, 9, 3], 3)]
    units = [Unit((i,), 0, len(r[0])) for i, r in enumerate(rows)]
    pb = pack(units, rows, PAD)
    tb = collate_rows(rows, torch.zeros(3), PAD)
    on = tb.action_mask > 0
    with torch.no_grad():
        lp_p, _ = head(pb.input_ids, (pb.segment >= 0).long(), packed=pb)
        lp_r, _ = head(tb.input_ids, tb.attention_mask)
    torch.testing.assert_close(lp_p[on], lp_r[on], atol=1e-5, rtol=1e-5)


def test_a_micro_batch_without_action_tokens_still_backpropagates():
    """Every loss mask 0 (nothing to train in this micro-batch): the packed pass still scores
    one token, into a slot the mask ignores, so backward runs (ZeRO-3 needs every rank's)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)  # fmt: skip
    head = PolicyHead(LlamaForCausalLM(cfg).float())
    rows = [([1, 4, 5, 6], [0.0] * 3, [0.0] * 3, None), ([1, 4, 5, 7], [0.0] * 3, [0.0] * 3, None)]
    units = plan_units(rows, [[0, 1]])
    pb = pack(units, rows, PAD)
    lp, _ = head(pb.input_ids, attention_mask(pb.segment, "sdpa", torch.float32), packed=pb)
    tb = collate_rows(rows, torch.zeros(2), PAD)
    (lp * tb.action_mask).sum().backward()
    assert all(p.grad is not None for p in head.parameters())
