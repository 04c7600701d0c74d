"""Small real Hugging Face models built here: a random Llama or Qwen2 with a byte-level BPE
tokenizer trained on local text, saved as a model folder `policy.path` can point at.

    build_tiny_hf("/tmp/m", arch="qwen2", vocab=8192)     # config.json, model.safetensors, tokenizer files
    hpcrl model build-tiny /tmp/m --arch llama --vocab 8192

Nothing is downloaded: the tokenizer is trained with the `tokenizers` library on the Python
standard library's sources (text every machine with Python has), the weights are a seeded
random init. The tokenizer is what real chat models ship: byte-level BPE (multi-byte
characters span several tokens), a ChatML chat template, `<|im_end|>` and `<|endoftext|>` as
end-of-sequence ids, a pad token; the Llama variant also has a bos token and untied embeddings,
the Qwen2 one ties them (as Qwen2's small models do). Tests and benchmarks use these to run the
path a site's 7B-70B folder takes, at a size a CPU trains.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Literal

__all__ = ["ARCHS", "CHATML_TEMPLATE", "train_bpe_tokenizer", "build_tiny_hf", "local_corpus"]

ARCHS = ("llama", "qwen2")

# The ChatML template (Qwen2 and many others); `add_generation_prompt` opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|begin_of_text|>"]


def local_corpus(max_chars: int = 3_000_000) -> list[str]:
    """Python standard library sources, in a fixed order, up to `max_chars` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for p in sorted(root.glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    # A few non-ASCII lines, so merges over multi-byte characters exist too.
    texts.append("héllo wörld — naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский текст\n" * 50)
    return texts


def train_bpe_tokenizer(vocab: int, bos: bool, max_chars: int = 3_000_000):
    """A `PreTrainedTokenizerFast`: byte-level BPE of `vocab` tokens trained on `local_corpus()`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 512:
        raise ValueError(f"build-tiny: --vocab must be >= 512 (got {vocab}); byte-level BPE starts from 256 bytes")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(local_corpus(max_chars), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token="<|begin_of_text|>" if bos else None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_hf(
    out: str | Path,
    arch: Literal["llama", "qwen2"] = "llama",
    vocab: int = 8192,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_context: int = 2048,
    seed: int = 0,
    max_chars: int = 3_000_000,
) -> Path:
    """Write a random `arch` causal LM and its trained tokenizer to `out`; returns the folder."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"build-tiny: --arch must be one of {', '.join(ARCHS)} (got {arch!r})")
    out = Path(out)
    tok = train_bpe_tokenizer(vocab, bos=arch == "llama", max_chars=max_chars)
    eos_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_context,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos_ids,
    )
    if arch == "llama":
        config, cls = LlamaConfig(tie_word_embeddings=False, **common), LlamaForCausalLM
    else:
        config, cls = Qwen2Config(tie_word_embeddings=True, use_sliding_window=False, **common), Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "hpcrl-build.json").write_text(
        json.dumps(
            {"arch": arch, "vocab": len(tok), "params": sum(p.numel() for p in model.parameters()), "seed": seed}
        )
    )
    return out
