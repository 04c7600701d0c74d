"""Peak memory of the learner's log-probability pass, full log_softmax vs chunked.

    python bench/learner_memory.py [--vocab 32768] [--batch 8] [--tokens 512] [--chunk 1024] [--json]

One forward and backward pass of a small Llama (hidden 64, 2 layers) over batch x tokens with
a `vocab`-token head, scored as the learner scores it: `full` is the old path (float32
log_softmax over [B, T, V], kept for backward), `chunked` is rl/model/logprobs.py (`chunk` tokens at a
time, recomputed in backward). Each variant runs in its own process; the figure is its peak
resident memory (ru_maxrss) above the same process's after the model was built, in MiB. On a
GPU the figure to compare would be torch.cuda.max_memory_allocated (not measured here: no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys


def _child(variant: str, vocab: int, batch: int, tokens: int, chunk: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpcrl.rl.model.logprobs import full_logprobs, token_logprobs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens + 1)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (batch, tokens))
    mask = torch.ones_like(ids)
    # Warm-up at a tiny size (allocator pools, kernels), then the baseline.
    token_logprobs(model, ids[:1, :8], mask[:1, :8]).sum().backward()
    model.zero_grad(set_to_none=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if variant == "full":
        lp = full_logprobs(model, ids, mask)
    else:
        lp = token_logprobs(model, ids, mask, chunk_tokens=chunk)
    lp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"variant": variant, "peak_mib": (peak - base) / 1024}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.vocab, a.batch, a.tokens, a.chunk)
        return 0
    out = {"vocab": a.vocab, "batch": a.batch, "tokens": a.tokens, "chunk": a.chunk}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for variant in ("full", "chunked"):
        args = [sys.executable, __file__, "--child", variant]
        for k in ("vocab", "batch", "tokens", "chunk"):
            args += [f"--{k}", str(getattr(a, k))]
        res = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
        out[f"{variant}_peak_mib"] = round(json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"], 1)
    logits_mib = a.batch * a.tokens * a.vocab * 4 / 2**20
    out["fp32_logits_mib"] = round(logits_mib, 1)
    if a.json:
        print(json.dumps(out))
    else:
        print(f"vocab {a.vocab}, {a.batch} x {a.tokens} tokens (one fp32 logits tensor: {logits_mib:.0f} MiB)")
        print(f"  full log_softmax: peak +{out['full_peak_mib']:.0f} MiB")
        print(f"  chunked ({a.chunk} tokens): peak +{out['chunked_peak_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
