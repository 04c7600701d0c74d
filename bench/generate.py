"""Generation tokens/s: hpcrl's generator against transformers' own `generate`.

    python bench/generate.py [--episodes 16] [--action 32] [--hidden 256 --layers 4] [--rounds 3]
                             [--hf-cache dynamic|static] [--json]

One model built here (a random Llama with a byte-level BPE tokenizer, rl/model/models.py), the same
prompts (64-256 tokens of local text), the same action lengths (exactly `--action` tokens: no
eos is allowed to end one early, in either system), sampling at temperature 1, one torch thread:

* single-turn: every episode one action. transformers: one `generate` call over the
  left-padded batch. hpcrl: a `Generator` (continuous batching) running the episodes;
* multi-turn: episode i takes 2 + i % 4 turns, each observation 32 tokens of feedback.
  transformers: a `generate` call per round over the episodes still going, each re-prefilling
  its whole context (prompt + earlier turns), as a generate-based rollout loop does. hpcrl:
  the same episodes through the `Generator`, whose decode engine refills a finished row at
  once and keeps each episode's KV cache across its turns.

Both systems run exactly the same `--episodes` episodes per round (hpcrl's task source issues
no more), with a fresh `Generator` each round (cold: nothing learnt about the domain yet).
hpcrl's side also detokenizes every action and tokenizes every observation (what a real
environment loop needs); transformers' side appends pre-tokenized observations.
`--hf-cache static` gives `generate` transformers' preallocated StaticCache instead of its
default DynamicCache (on par with it on this model, measured 2026-12-05).

Figures: tokens/s = action tokens / wall seconds, median of `--rounds`; ratios hpcrl / transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build(args):
    from hpcrl.core.config import PolicyConfig
    from hpcrl.rl.model.models import build_tiny_hf, local_corpus
    from hpcrl.rl.model.policy import Policy

    folder = Path(tempfile.mkdtemp(prefix="hpcrl-bench-gen-")) / "model"
    build_tiny_hf(folder, "llama", args.vocab, hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                  kv_heads=max(1, args.hidden // 128), intermediate=int(args.hidden * 2.75), max_context=4096,
                  max_chars=1_000_000)  # fmt: skip
    policy = Policy.load(PolicyConfig(path=str(folder), device="cpu"), seed=0)
    policy.eos_ids = frozenset()  # fixed action lengths in both systems
    text = "".join(local_corpus(200_000))
    ids = policy.encode(text)
    prompts, at = [], 0
    for i in range(args.episodes):
        n = 64 + (i * 37) % 193
        prompts.append(policy.tokenizer.decode(ids[at : at + n]))  # text: both systems tokenize it the same
        at += n
    feedback = policy.tokenizer.decode(ids[at : at + 32])
    return policy, prompts, feedback


def hf_rollout(policy, prompts, turns, action, obs_ids, cache="dynamic"):
    """transformers' generate, round by round over the episodes still going."""
    import torch

    model = policy.model
    contexts = [policy.prompt_ids(p) for p in prompts]
    left = list(turns)
    tokens = 0
    while any(left):
        live = [i for i, t in enumerate(left) if t > 0]
        width = max(len(contexts[i]) for i in live)
        ids = torch.full((len(live), width), policy.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, i in enumerate(live):
            ids[j, width - len(contexts[i]) :] = torch.tensor(contexts[i])
            mask[j, width - len(contexts[i]) :] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=action,
                             min_new_tokens=action, top_k=0, top_p=1.0, temperature=1.0,
                             pad_token_id=policy.pad_id, eos_token_id=None,
                             **({"cache_implementation": "static"} if cache == "static" else {}))  # fmt: skip
        for j, i in enumerate(live):
            new = out[j, width:].tolist()
            tokens += len(new)
            left[i] -= 1
            contexts[i] += new + (obs_ids if left[i] else [])
    return tokens


def hpcrl_rollout(policy, prompts, turns, action, feedback):
    """The same episodes through hpcrl's Generator."""
    from hpcrl.core.config import GeneratorConfig
    from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
    from hpcrl.rl.domains import ActionSpec, Domain, Environment, StepResult, Task
    from hpcrl.rl.rollout.generator import Generator

    class Env(Environment):
        def __init__(self, prompt, n):
            self.prompt, self.n, self.turn = prompt, n, 0

        def reset(self):
            return self.prompt

        def step(self, a):
            self.turn += 1
            return StepResult(feedback, 0.0, self.turn >= self.n, {})

    spec = ActionSpec(max_tokens=action)  # the class body below cannot read `action` (it binds that name)

    class Dom(Domain):
        name, action = "bench", spec

        def task(self, index):
            return Task("bench", str(index), "", {"i": index % len(prompts)})

        def make_env(self, task, executor=None):
            i = task.data["i"]
            return Env(prompts[i], turns[i])

    class Exactly(LocalTaskSource):
        """Episodes 0..n-1 and no more: the ones transformers' side runs (an open-ended source
        would start further episodes whose unfinished work is timed but not counted)."""

        def take(self, n):
            return super().take(min(n, len(prompts) - self.issued))

    cfg = GeneratorConfig(episodes_in_flight=len(prompts), max_new_tokens=action, max_turns=16, kv_cache_gb=4.0)
    gen = Generator(cfg, policy, {"bench": Dom()}, run="b", name="g", seed=0)
    out: list = []
    gen.run(Exactly(TaskSampler({"bench": 1.0}, group_size=1, seed=0)), out.append,
            stop=lambda: len(out) >= len(prompts))  # fmt: skip
    gen.close()
    return sum(len(s.action_tokens) for t in out for s in t.steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--action", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hf-cache", choices=("dynamic", "static"), default="dynamic")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    policy, prompts, feedback = build(args)
    obs_ids = policy.encode(feedback)
    results = {}
    for name, turns in (("single_turn", [1] * len(prompts)), ("multi_turn", [2 + i % 4 for i in range(len(prompts))])):
        rates = {"hf": [], "hpcrl": []}
        for _ in range(args.rounds):
            for system in ("hf", "hpcrl"):
                t0 = time.perf_counter()
                if system == "hf":
                    n = hf_rollout(policy, prompts, turns, args.action, obs_ids, args.hf_cache)
                else:
                    n = hpcrl_rollout(policy, prompts, turns, args.action, feedback)
                rates[system].append(n / (time.perf_counter() - t0))
        hf, ours = statistics.median(rates["hf"]), statistics.median(rates["hpcrl"])
        results[name] = {"hf_tok_s": round(hf, 1), "hpcrl_tok_s": round(ours, 1), "ratio": round(ours / hf, 3)}
    out = {
        "multi_turn_ratio": results["multi_turn"]["ratio"],
        "single_turn_ratio": results["single_turn"]["ratio"],
        "model_params": sum(p.numel() for p in policy.model.parameters()),
        "detail": results,
        "episodes": args.episodes,
        "action_tokens": args.action,
        "hf_cache": args.hf_cache,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['model_params'] / 1e6:.1f}M parameters, {args.episodes} episodes, {args.action}-token actions")
        for name, r in results.items():
            print(f"  {name:12s} transformers {r['hf_tok_s']:8.1f} tok/s   hpcrl {r['hpcrl_tok_s']:8.1f} tok/s   "
                  f"ratio {r['ratio']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
