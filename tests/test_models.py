"""Real Hugging Face models built here (Llama and Qwen2, byte-level BPE trained on local text):
loading, chat templates, several eos ids, chunked log-probabilities that equal the full
log_softmax (values and gradients), and exact detokenization through sampling and feedback."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses
import json

import pytest
import torch

from hpcrl.core.config import GeneratorConfig, PolicyConfig
from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
from hpcrl.rl.domains import ActionSpec, Domain, Environment, StepResult, Task
from hpcrl.rl.model.logprobs import chunked_logprobs, full_logprobs, token_logprobs
from hpcrl.rl.model.models import build_tiny_hf
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.generator import Generator
from hpcrl.rl.rollout.sampler import Sampler

TEXT = "  héllo wörld — 日本語 🙂 naïve\n    def f(x):\n\treturn {'k': x}  # ünïcode ∑\n"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp(request.param), arch=request.param, vocab=8192, max_chars=1_500_000)


def load(path, **kw) -> Policy:
    return Policy.load(PolicyConfig(path=str(path), device="cpu", **kw), seed=0)


def test_built_folder_loads_with_its_tokenizer_and_chat_template(model_dir):
    info = json.loads((model_dir / "hpcrl-build.json").read_text())
    p = load(model_dir)
    assert len(p.tokenizer) == info["vocab"] >= 8192
    assert p.model.config.model_type == info["arch"]
    # Two end-of-sequence ids (end of turn, end of text) from generation_config.json.
    assert len(p.eos_ids) == 2 and p.eos_id in p.eos_ids
    assert p.decode(p.encode(TEXT)) == TEXT
    assert len(p.encode("日本語")) > 1  # multi-byte characters span tokens at this vocabulary
    ids = p.prompt_ids([{"role": "user", "content": "hi"}])
    assert p.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # With policy.chat_template, a text prompt is one user message.
    assert load(model_dir, chat_template=True).prompt_ids("hi") == ids
    assert (p.bos_id is not None) == (info["arch"] == "llama")


def test_chunked_logprobs_equal_the_full_log_softmax(model_dir):
    p = load(model_dir)
    ids = torch.tensor([p.encode(TEXT)[:40], p.encode(TEXT[::-1])[:40]])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    full = full_logprobs(p.model, ids, mask)
    chunked = token_logprobs(p.model, ids, mask, chunk_tokens=7)
    assert torch.allclose(full, chunked, atol=1e-5)
    # Gradients agree too (chunks are recomputed in the backward pass).
    p.model.zero_grad()
    (full * mask[:, 1:]).sum().backward()
    want = {n: q.grad.clone() for n, q in p.model.named_parameters()}
    p.model.zero_grad()
    (token_logprobs(p.model, ids, mask, chunk_tokens=7) * mask[:, 1:]).sum().backward()
    for n, q in p.model.named_parameters():
        assert torch.allclose(q.grad, want[n], atol=1e-5), n


def test_chunked_entropy_matches_and_peak_is_one_chunk():
    torch.manual_seed(0)
    h = torch.randn(3, 50, 16, requires_grad=True)
    w = torch.randn(1000, 16, requires_grad=True)
    y = torch.randint(0, 1000, (3, 50))
    lp, ent = chunked_logprobs(h, w, y, chunk_tokens=16)
    logits = (h @ w.T).float()
    ref_lp = torch.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-4)
    # Autograd keeps no [tokens, vocab] tensor: the saved tensors are the inputs, per chunk.
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        lp2, ent2 = chunked_logprobs(h, w, y, chunk_tokens=16)
    assert max(saved) <= max(w.numel(), h.numel()), saved
    (lp2.sum() + ent2.sum()).backward()
    assert h.grad is not None and w.grad is not None


class Forced(torch.nn.Module):
    """The real model, but the next token at absolute position p is script[p + 1] (eos past it)."""

    def __init__(self, model, script: dict[int, int], eos: int):
        super().__init__()
        self.inner, self.script, self.eos = model, script, eos
        self.config = model.config

    def forward(self, **kw):
        out = self.inner(**kw)
        last = kw["position_ids"][:, -1].tolist()
        logits = torch.full_like(out.logits[:, -1:, :], -1e9)
        for b, pos in enumerate(last):
            logits[b, 0, self.script.get(pos + 1, self.eos)] = 0.0
        out.logits = logits
        return out


class Echo(Environment):
    """Turn 1: the action comes back inside the observation; turn 2 ends the episode."""

    seen: list[str] = []

    def __init__(self, prompt):
        self.prompt, self.turn = prompt, 0

    def reset(self):
        return self.prompt

    def step(self, action: str) -> StepResult:
        Echo.seen.append(action)
        self.turn += 1
        return StepResult(f"you said «{action}»", 1.0, self.turn >= 2, {})


class EchoDomain(Domain):
    def __init__(self, prompt, stop=()):
        self.name, self.prompt = "echo", prompt
        self.action = ActionSpec(max_tokens=200, stop=tuple(stop))

    def task(self, index):
        return Task("echo", str(index), self.prompt, {})

    def make_env(self, task, executor=None):
        return Echo(self.prompt)


@pytest.mark.parametrize("chat", [False, True])
def test_detokenization_round_trips_through_sampling_and_feedback(model_dir, chat):
    p = load(model_dir)
    prompt = [{"role": "user", "content": "Say it:"}] if chat else "Say it:"
    ctx = p.prompt_ids(prompt)
    action = p.encode(TEXT)
    p.model = Forced(p.model, {len(ctx) + i: t for i, t in enumerate(action)}, p.eos_id)

    out = Sampler(p, seed=0).sample([ctx], max_new=[200], stops=[()])[0]
    assert out.text == TEXT and out.finish == "eos" and list(out.tokens) == action + [p.eos_id]
    # A stop string inside a multi-byte run of tokens is found on exact text.
    stopped = Sampler(p, seed=0).sample([ctx], max_new=[200], stops=[("🙂",)])[0]
    assert stopped.finish == "stop" and stopped.text == TEXT[: TEXT.index("🙂") + 1]

    Echo.seen = []
    gen = Generator(GeneratorConfig(episodes_in_flight=1), p, {"echo": EchoDomain(prompt)}, run="r", name="g", seed=0)
    trajs = []
    gen.run(LocalTaskSource(TaskSampler({"echo": 1.0}, 2, 0)), trajs.append, stop=lambda: len(trajs) >= 1)
    gen.close()
    assert Echo.seen[0] == TEXT  # the environment received exactly the text
    step = trajs[0].steps[0]
    obs = p.tokenizer.decode(step.observation_tokens.tolist())
    if chat:  # feedback is a user turn; the assistant's turn was closed by its eos already
        assert obs == f"\n<|im_start|>user\nyou said «{TEXT}»<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert obs == f"you said «{TEXT}»"
    assert p.decode(step.action_tokens) == TEXT


def test_build_tiny_cli(tmp_path, capsys):
    from hpcrl.jobs.cli import main

    assert main(["model", "build-tiny", str(tmp_path / "m"), "--arch", "qwen2", "--vocab", "1024"]) == 0
    assert "qwen2" in capsys.readouterr().out
    p = load(tmp_path / "m")
    assert len(p.tokenizer) == 1024 and p.model.config.tie_word_embeddings
    assert main(["model", "build-tiny", str(tmp_path / "x"), "--vocab", "100"]) == 2


def test_generator_uses_per_domain_eos_from_the_model(model_dir):
    p = load(model_dir)
    other = next(i for i in p.eos_ids if i != p.eos_id)
    ctx = p.prompt_ids("x")
    p.model = Forced(p.model, {len(ctx): p.encode("a")[0], len(ctx) + 1: other}, p.eos_id)
    out = Sampler(p, seed=0).sample([ctx], max_new=[50], stops=[()])[0]
    assert out.finish == "eos" and out.tokens[-1] == other and out.text == "a"
    assert dataclasses.replace(PolicyConfig(), path=str(model_dir)).path
