"""`hpcrl model build-tiny DIR --arch llama|qwen2 --vocab N`: a small random Hugging Face model.

    hpcrl model build-tiny /tmp/tiny-qwen2 --arch qwen2 --vocab 8192
    hpcrl run config.yaml policy.path=/tmp/tiny-qwen2

Writes config.json, model.safetensors, generation_config.json and the tokenizer files (byte-level
BPE trained on the Python standard library's sources, ChatML chat template) into DIR, which
`policy.path` can point at like any site's model folder. Nothing is downloaded.
"""

from __future__ import annotations

import argparse

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model folders: build a small random Hugging Face model for tests")
    verbs = p.add_subparsers(dest="model_verb", metavar="VERB", required=True)
    b = verbs.add_parser(
        "build-tiny",
        help="write a small random Llama or Qwen2 with a BPE tokenizer trained on local text",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
    )
    b.add_argument("dir", help="output folder (created)")
    b.add_argument("--arch", choices=("llama", "qwen2"), default="llama", help="architecture (default llama)")
    b.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    b.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    b.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    b.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    b.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (default 2)")
    b.add_argument("--intermediate", type=int, default=128, help="MLP width (default 128)")
    b.add_argument("--max-context", type=int, default=2048, help="max_position_embeddings (default 2048)")
    b.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcrl.jobs.cli import UsageError
    from hpcrl.rl.model.models import build_tiny_hf

    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise UsageError("--heads must divide --hidden and --kv-heads must divide --heads")
    try:
        out = build_tiny_hf(
            args.dir,
            args.arch,
            args.vocab,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            max_context=args.max_context,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    import json

    info = json.loads((out / "hpcrl-build.json").read_text())
    print(f"wrote {out}: {info['arch']}, {info['params']:,} parameters, vocabulary {info['vocab']}")
    return 0
