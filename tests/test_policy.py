"""The policy: char tokenizer, tiny model, local-folder loading, logprobs, weight files, KV-cached sampling."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import dataclasses

import pytest
import torch

from hpcrl.core.config import PolicyConfig, TinyModelConfig, load_config
from hpcrl.rl.model.policy import (
    CHARSET,
    SPECIAL_TOKENS,
    Policy,
    build_char_tokenizer,
    copy_state,
    full_state_dict,
    token_logprobs,
)
from hpcrl.rl.rollout.sampler import Sampler

TINY = PolicyConfig(
    tiny=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_context=256), device="cpu"
)


def test_char_tokenizer_round_trips_every_character():
    tok = build_char_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARSET)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    text = "def f(x):\n\treturn x + 1  # ~ok {}[]|\\"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.encode("\u00e9", add_special_tokens=False) == [tok.unk_token_id]
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("aa")


def test_tiny_model_is_deterministic_per_seed():
    a, b, c = (Policy.load(TINY, seed=s) for s in (0, 0, 1))
    sa, sb, sc = (full_state_dict(p.model) for p in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert a.prompt_ids("1+1=")[0] == a.bos_id and a.decode(a.encode("1+1=")) == "1+1="
    text = "def f(x):\n\treturn {x: 1} # \u00e9"  # the fast path agrees with the tokenizer, unknowns too
    assert a.encode(text) == a.tokenizer.encode(text, add_special_tokens=False)


def test_logprobs_do_not_depend_on_padding_side():
    p = Policy.load(TINY, seed=0)
    seq = torch.tensor([p.prompt_ids("max 3 8:7")])
    plain = token_logprobs(p.model, seq)
    pad = torch.full((1, 3), p.pad_id)
    left = token_logprobs(
        p.model, torch.cat([pad, seq], 1), torch.cat([torch.zeros(1, 3), torch.ones_like(seq)], 1).long()
    )
    right = token_logprobs(
        p.model, torch.cat([seq, pad], 1), torch.cat([torch.ones_like(seq), torch.zeros(1, 3)], 1).long()
    )
    assert torch.allclose(left[:, 3:], plain, atol=1e-5)
    assert torch.allclose(right[:, : plain.shape[1]], plain, atol=1e-5)
    assert (plain <= 0).all()


def test_copy_state_round_trip_and_errors():
    src, dst = Policy.load(TINY, seed=0), Policy.load(TINY, seed=1)
    copy_state(dst.model, full_state_dict(src.model), "v7")
    assert all(torch.equal(v, full_state_dict(dst.model)[k]) for k, v in full_state_dict(src.model).items())

    other = Policy.load(dataclasses.replace(TINY, tiny=dataclasses.replace(TINY.tiny, hidden_size=16)), seed=0)
    with pytest.raises(ValueError, match="has shape"):
        copy_state(other.model, full_state_dict(src.model), "v7")
    partial = full_state_dict(src.model)
    partial.pop(next(iter(partial)))
    with pytest.raises(ValueError, match="no weights for"):
        copy_state(dst.model, partial, "part")


def test_loads_a_local_hugging_face_folder(tmp_path):
    src = Policy.load(TINY, seed=3)
    src.model.save_pretrained(tmp_path / "m")
    src.tokenizer.save_pretrained(tmp_path / "m")
    cfg = dataclasses.replace(TINY, path=str(tmp_path / "m"))
    loaded = Policy.load(cfg, seed=0)  # the seed does not matter: the weights come from the folder
    ids = torch.tensor([src.prompt_ids("copy 5:")])
    assert torch.allclose(token_logprobs(loaded.model, ids), token_logprobs(src.model, ids), atol=1e-6)
    assert loaded.eos_id == src.eos_id and loaded.encode("x y") == src.encode("x y")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Policy.load(dataclasses.replace(TINY, path=str(tmp_path / "nothing")), seed=0)


def test_sampler_logprobs_match_a_full_forward_pass():
    p = Policy.load(TINY, seed=0)
    s = Sampler(p, seed=0)
    # Six one-token rows finish at once: the batch (and its KV cache) shrinks to the other two.
    contexts = [p.prompt_ids(f"copy {i}:") for i in range(6)] + [
        p.prompt_ids("a much longer prompt here:"),
        p.prompt_ids("x"),
    ]
    max_new = [1] * 6 + [12, 5]
    out = s.sample(contexts, max_new=max_new, stops=[()] * 8)
    assert all(len(o.tokens) <= m for o, m in zip(out, max_new))
    assert len(out[0].tokens) == 1 and out[0].finish in ("length", "eos")
    assert len(out[6].tokens) > 1 or out[6].finish == "eos"
    for ctx, o in zip(contexts, out):
        full = torch.tensor([list(ctx) + list(o.tokens)])
        ref = token_logprobs(p.model, full)[0, len(ctx) - 1 :]
        assert torch.allclose(ref, torch.tensor(o.logprobs), atol=1e-4), (ref, o.logprobs)
        if o.finish == "eos":
            assert o.tokens[-1] == p.eos_id
        else:
            assert p.eos_id not in o.tokens


def test_sampler_stops_on_stop_strings_and_is_seeded():
    p = Policy.load(TINY, seed=0)
    # Every character is a stop's last character here, so the first sampled non-eos token stops.
    stops = tuple(CHARSET)
    out = Sampler(p, seed=1).sample([p.prompt_ids("go:")] * 8, max_new=[50] * 8, stops=[stops] * 8)
    for o in out:
        assert o.finish in ("stop", "eos") and len(o.tokens) == 1
    again = Sampler(p, seed=1).sample([p.prompt_ids("go:")] * 8, max_new=[50] * 8, stops=[stops] * 8)
    assert [o.tokens for o in out] == [o.tokens for o in again]
    with pytest.raises(ValueError, match="at least one token"):
        Sampler(p, seed=0).sample([[]], [1], [()])


def test_policy_config_section_in_default_config():
    cfg = load_config(None)
    assert cfg.policy.path is None and cfg.policy.tiny.hidden_size % cfg.policy.tiny.num_heads == 0
    from hpcrl.core.schema import ConfigError

    with pytest.raises(ConfigError, match="must divide hidden_size"):
        load_config(None, ["policy.tiny.num_heads=3"])
