"""The policy: a Hugging Face causal LM and its tokenizer, from a local folder or built tiny here.

    policy = Policy.load(cfg.policy, seed=0)           # PolicyConfig; nothing is downloaded
    ids = policy.encode("3+4=")                        # list[int]
    lp = token_logprobs(policy.model, input_ids, attention_mask)   # [B, T-1], float32

`cfg.policy.path` names a folder with `config.json`, weights and a tokenizer (what a cluster
keeps on its parallel filesystem); it is read with `local_files_only=True`. With `path: null`
a tiny Llama (a few layers, hidden 64-128) and a character-level tokenizer are built from code,
deterministically from the seed: that is the CPU configuration CI and laptops train.

Weights travel between learner and generators as sharded versions (rl/weights/shards.py);
`copy_state` copies one into a model, checking names and shapes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from hpcrl.core.config import PolicyConfig, TinyModelConfig
from hpcrl.rl.model.logprobs import token_logprobs

__all__ = [
    "SPECIAL_TOKENS",
    "CHARSET",
    "build_char_tokenizer",
    "build_tiny_model",
    "Policy",
    "token_logprobs",
    "full_state_dict",
    "copy_state",
    "resolve_device",
]

# Order fixes the ids: pad 0, bos 1, eos 2, unk 3; characters follow.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Printable ASCII plus newline and tab covers every built-in domain (arithmetic and Python code).
CHARSET = "\n\t" + "".join(chr(c) for c in range(32, 127))


def build_char_tokenizer(charset: str = CHARSET):
    """A `PreTrainedTokenizerFast` with one token per character of `charset` plus the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(charset)) != len(charset):
        raise ValueError("build_char_tokenizer: charset has repeated characters; each may appear once")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # One pre-token per character, and no spaces inserted when decoding (Fuse joins as-is).
    tok.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.hpcrl_char_ids = {ch: vocab[ch] for ch in charset}  # Policy.encode's fast path
    return fast


def build_tiny_model(tiny: TinyModelConfig, vocab_size: int, seed: int, pad_id: int, bos_id: int, eos_id: int):
    """A freshly initialised small Llama; the same seed gives the same weights on every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        max_position_embeddings=tiny.max_context,
        # Tied, the published weight file holds the shared tensor once (full_state_dict), and
        # copy_state accepts that.
        tie_word_embeddings=tiny.tie_embeddings,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        use_cache=True,
    )
    # Seed locally so building a model does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def resolve_device(device: str) -> torch.device:
    """'auto' is cuda when a GPU is visible, else cpu; 'cuda' without a GPU is an error."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("policy.device is 'cuda' but torch sees no GPU; set policy.device: auto or cpu")
    return torch.device(device)


def cap_gpu_memory(share: float) -> bool:
    """Hold this process's CUDA allocations to `share` of its GPU's memory: a generator on GPU
    shards (slurm.generator.gpu_shards) leaves the rest to the jobs holding the other shards, and
    fails with an out-of-memory error rather than taking theirs. False where there is no GPU."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.set_per_process_memory_fraction(share, torch.cuda.current_device())
    return True


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Policy:
    """A causal LM, its tokenizer and the ids the generator and learner need."""

    def __init__(self, model, tokenizer, device: torch.device, chat_template: bool = False, extra_eos=()):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        if tokenizer.eos_token_id is None:
            raise ValueError("policy tokenizer has no eos token; set eos_token in its tokenizer_config.json")
        self.eos_id: int = int(tokenizer.eos_token_id)
        # Every id that ends a sequence: the tokenizer's eos, the model's generation_config and
        # config (chat models list several: end of turn and end of text).
        self.eos_ids: frozenset[int] = frozenset({self.eos_id, *(int(i) for i in extra_eos)})
        self.pad_id: int = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.bos_id: int | None = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        self.chat_template = bool(chat_template)
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("policy.chat_template is true but the tokenizer has no chat template")
        # The built-in character tokenizer maps each character to one id: a dict lookup is ~30x
        # faster than the tokenizers call, and the generator encodes every prompt and observation.
        self._chars: dict[str, int] | None = getattr(tokenizer, "hpcrl_char_ids", None)
        self._unk = tokenizer.unk_token_id
        self._turn: tuple[str, str] | None = None

    @classmethod
    def load(cls, cfg: PolicyConfig, seed: int, device: str | torch.device | None = None, build_model: bool = True):
        """The configured policy on `device` (default: cfg.device). `build_model=False` skips the
        model (the learner builds it itself inside `deepspeed.zero.Init`)."""
        dev = resolve_device(cfg.device) if device is None else torch.device(device)
        tokenizer = load_tokenizer(cfg)
        model = build_policy_model(cfg, tokenizer, seed).to(dev) if build_model else None
        return cls(model, tokenizer, dev, chat_template=cfg.chat_template, extra_eos=model_eos_ids(cfg, model))

    def encode(self, text: str) -> list[int]:
        if self._chars is not None:
            chars, unk = self._chars, self._unk
            return [chars.get(c, unk) for c in text]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def decode_after(self, context, ids) -> str:
        """The text `ids` add after `context` (token ids), exactly: decoded together with the
        last few context tokens, so a token that continues a multi-byte character or a
        SentencePiece word decodes as it does in place (each token on its own would not)."""
        ids = [int(i) for i in ids if int(i) not in self.eos_ids]
        if not ids:
            return ""
        if self._chars is not None:
            return self.decode(ids)
        tail = list(context[-4:])
        before = self.decode(tail)
        both = self.decode(tail + ids)
        if both.startswith(before):
            return both[len(before) :]
        return self.decode(ids)  # the context's tail itself decodes differently in company: rare

    def prompt_ids(self, prompt) -> list[int]:
        """A task prompt as the first turn sees it. Chat messages ([{role, content}, ...]) go
        through the tokenizer's chat template, with the assistant turn opened; text does too
        when `policy.chat_template` is on (as one user message), else it is bos + text."""
        if not isinstance(prompt, str):
            messages = [dict(m) for m in prompt]
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(
                    "a domain gave chat messages as its prompt but the policy's tokenizer has no chat template"
                )
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        if self.chat_template:
            return self.prompt_ids([{"role": "user", "content": prompt}])
        ids = self.encode(prompt)
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def observation_ids(self, text: str, chat: bool, action_ended_with_eos: bool) -> list[int]:
        """An environment's feedback as the next context tokens. In a chat episode it becomes a
        user turn (closing the assistant's turn first, then opening the next one), rendered by
        the tokenizer's own template; otherwise it is the text's tokens as they are."""
        if not chat:
            return self.encode(text)
        close, open_user = self._turn_pieces()
        if action_ended_with_eos and close.startswith(self.tokenizer.decode([self.eos_id])):
            close = close[len(self.tokenizer.decode([self.eos_id])) :]
        user_open, user_close = open_user.split("\x00")
        return self.encode(close + user_open) + self.encode(text) + self.encode(user_close)

    def _turn_pieces(self) -> tuple[str, str]:
        """(what closes an assistant turn, a user turn + the next assistant opening with a NUL
        where the user's text goes), derived from the chat template by rendering around markers."""
        if self._turn is None:
            tpl = self.tokenizer
            first = [{"role": "user", "content": "\x01"}, {"role": "assistant", "content": "\x02"}]
            a = tpl.apply_chat_template(first, tokenize=False)
            b = tpl.apply_chat_template(
                first + [{"role": "user", "content": "\x00"}], tokenize=False, add_generation_prompt=True
            )
            if not b.startswith(a) or "\x02" not in a:
                raise ValueError(
                    "the tokenizer's chat template does not render turns incrementally; cannot continue a chat episode"
                )
            close = a[a.index("\x02") + 1 :]
            self._turn = (close, b[len(a) :])
        return self._turn


def model_eos_ids(cfg: PolicyConfig, model=None) -> list[int]:
    """End-of-sequence ids the model folder declares (generation_config.json, config.json)."""
    ids: list[int] = []
    sources = []
    if model is not None:
        sources += [getattr(model, "generation_config", None), model.config]
    elif cfg.path is not None:
        import json

        for name in ("generation_config.json", "config.json"):
            f = _local_folder(cfg.path) / name
            if f.is_file():
                sources.append(json.loads(f.read_text()))
    for src in sources:
        value = src.get("eos_token_id") if isinstance(src, dict) else getattr(src, "eos_token_id", None)
        if value is None:
            continue
        ids += [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return ids


def load_tokenizer(cfg: PolicyConfig):
    if cfg.path is None:
        # "auto" is resolved against the run's domains where the run is launched (rl/model/alphabet.py);
        # unresolved (a learner or generator built directly) it means printable ASCII.
        charset = cfg.tiny.charset
        return build_char_tokenizer(CHARSET if charset in ("auto", "printable") else charset)
    from transformers import AutoTokenizer

    path = _local_folder(cfg.path)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def build_policy_model(cfg: PolicyConfig, tokenizer, seed: int):
    """The model in cfg.dtype, on the CPU (callers move it). Inside `deepspeed.zero.Init` its
    parameters are created partitioned."""
    dtype = _DTYPES[cfg.dtype]
    if cfg.path is None:
        model = build_tiny_model(
            cfg.tiny,
            vocab_size=len(tokenizer),
            seed=seed,
            pad_id=tokenizer.pad_token_id,
            bos_id=tokenizer.bos_token_id,
            eos_id=tokenizer.eos_token_id,
        )
        return model.to(dtype)
    import transformers
    from transformers import AutoModelForCausalLM

    path = _local_folder(cfg.path)
    # transformers 5 calls it `dtype`; 4.x `torch_dtype`.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **{key: dtype})


def _local_folder(path: str) -> Path:
    p = Path(os.path.expanduser(path))
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"policy.path {path!r}: no config.json there; point it at a local Hugging Face model folder "
            "(hpcrl never downloads), or set policy.path: null for the tiny built-in model"
        )
    return p


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer once, detached on the CPU (tied weights appear once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[name] = p.detach().to("cpu").contiguous().clone()
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name in persistent and name not in out:
            out[name] = b.detach().to("cpu").contiguous().clone()
    return out


def copy_state(model, state: Mapping[str, torch.Tensor], where: str, share: bool = False) -> None:
    """Copy a full state (as `full_state_dict` names it) into `model`, checking names and shapes
    first (nothing is changed when a check fails). With `share`, a parameter of the same dtype and
    device as its given tensor is not copied but made a view of it (its `.data` rebound; a tied
    parameter stays one object, so stays tied): the caller leaves that memory unchanged while the
    model uses it."""
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(
            f"{where}: weights for {unknown[:5]} do not exist in the model; was it saved from another architecture?"
        )
    expected = set(full_state_dict_names(model))
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{where}: no weights for {missing[:5]}; the file is incomplete or from another architecture")
    for name, tensor in state.items():
        if own[name].shape != tensor.shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(own[name].shape)}"
            )
    params = dict(model.named_parameters()) if share else {}
    with torch.no_grad():
        for name, tensor in state.items():
            p = params.get(name)
            if p is not None and p.dtype == tensor.dtype and p.device == tensor.device:
                p.data = tensor
            else:
                own[name].copy_(tensor.to(own[name].dtype), non_blocking=True)


def full_state_dict_names(model) -> list[str]:
    names: list[str] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            names.append(name)
    persistent = set(model.state_dict().keys())
    names += [n for n, _ in model.named_buffers() if n in persistent and n not in names]
    return names
