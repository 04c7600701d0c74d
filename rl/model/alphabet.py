"""`policy.tiny.charset: auto`: the tiny model's character vocabulary from the run's domains.

    cfg = resolve_charset(cfg, domains)     # {name: Domain}; once, where the run is launched
    cfg.policy.tiny.charset                 # e.g. "+0123456789=" for `sum`: 16 tokens with the specials

A model trained from scratch explores by sampling its whole vocabulary. With printable ASCII
(97 characters) most of the probability a fresh model spreads goes to characters no answer
can contain, and an answer of several tokens becomes too rare to be ever sampled: on `a+b=`
no two-digit sum was found in 384k samples with 101 tokens, and all of them were found with the
task's 16 (docs/learning.md). `auto` therefore takes the union of the configured domains'
`alphabet`s, and falls back to printable ASCII when any domain declares none (code, free
text). The launching process resolves it once (`hpcrl run`, `hpcrl submit`, the in-process
loop), so every component builds the same tokenizer and `config.resolved.yaml` shows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hpcrl.core.config import Config

__all__ = ["domain_charset", "resolve_charset"]


def domain_charset(domains: Mapping[str, Any]) -> str:
    """The sorted union of the domains' alphabets and the characters of their stop strings and
    one-character eos tokens, or "printable" if a domain has no alphabet."""
    chars: set[str] = set()
    for d in domains.values():
        alphabet = getattr(d, "alphabet", None)
        if not alphabet:
            return "printable"
        chars |= set(alphabet)
        # A stop string or a one-character eos made of unknown characters would never match.
        action = getattr(d, "action", None)
        if action is not None:
            chars |= set("".join(action.stop)) | {e for e in action.eos if len(e) == 1}
    return "".join(sorted(chars))


def resolve_charset(cfg: Config, domains: Mapping[str, Any]) -> Config:
    """`cfg` with `policy.tiny.charset: auto` replaced by the domains' charset (anything else,
    and a model loaded from `policy.path`, is left as it is)."""
    tiny = cfg.policy.tiny
    if cfg.policy.path is not None or tiny.charset != "auto":
        return cfg
    tiny = dataclasses.replace(tiny, charset=domain_charset(domains))
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, tiny=tiny))
