"""The quick domain family `arith/...`: one-digit answers a tiny CPU model learns by RL in minutes.

    arith/copy              "copy 7:"         -> 7
    arith/add3-mod10        "7+3 mod 10="     -> 0        (k 1..9, m 2..10)
    arith/add-mod7          "4+5 mod 7="      -> 2        (m 2..10)
    arith/max3, arith/min4  "max 3 8 1:"      -> 8        (2..6 numbers)
    any of them + -retry3   wrong answers get " no\\n" and the prompt again, up to 3 turns

Why this shape: the answer is one character out of ten digits and the action is one token, so
an untrained policy (uniform over ~100 tokens) scores about 1%: small but not zero, which is
what a group-relative policy gradient needs to start climbing. Measured in-process on one
core (tiny Llama, hidden 64, GRPO, 32 prompts x 8 samples per step): copy reaches 0.9 after
~70 steps, add1-mod10 ~60, max2 ~115; add-mod10 (a 100-entry table) stays near 0.1 for
thousands of steps, so it is a hard variant, not a default.

Together the variants are a few hundred domains, which is how a run mixes many of them.
"""

from __future__ import annotations

import random
import re
from typing import Any

from hpcrl.rl.domains.base import ActionSpec, Domain, Environment, StepResult, Task
from hpcrl.rl.domains.rewards import exact

__all__ = ["ArithDomain", "make_arith", "ARITH_VARIANT_HELP"]

ARITH_VARIANT_HELP = (
    "copy, add<k>-mod<m> (k 1..9, m 2..10), add-mod<m> (m 2..10), max<n>, min<n> (n 2..6), "
    "each optionally followed by -retry<t> (t 2..9 turns)"
)

_VARIANT_RE = re.compile(
    r"(?P<base>copy|add(?P<k>[1-9])-mod(?P<m1>10|[2-9])|add-mod(?P<m2>10|[2-9])|(?P<mm>max|min)(?P<n>[2-6]))"
    r"(?:-retry(?P<t>[2-9]))?"
)


class ArithDomain(Domain):
    def __init__(self, variant: str):
        m = _VARIANT_RE.fullmatch(variant or "")
        if not m:
            raise ValueError(f"arith: unknown variant {variant!r}; variants: {ARITH_VARIANT_HELP}")
        self.name = f"arith/{variant}"
        self.action = ActionSpec(max_tokens=1)
        self.turns = int(m["t"] or 1)
        self._m = m
        # The characters of every prompt, answer and feedback of the variant (policy.tiny.charset: auto).
        words = "copy:" if m["base"] == "copy" else "+mod=" if m["base"].startswith("add") else f"{m['mm']}:"
        self.alphabet = "".join(sorted(set("0123456789 " + words + (" no\n" if self.turns > 1 else ""))))

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        # A string seed is hashed with SHA-512 by `random`: identical on every process and run.
        rng = random.Random(f"{self.name}:{index}")
        m = self._m
        if m["base"] == "copy":
            a = rng.randrange(10)
            prompt, answer = f"copy {a}:", a
        elif m["k"]:
            k, mod = int(m["k"]), int(m["m1"])
            a = rng.randrange(mod)
            prompt, answer = f"{a}+{k} mod {mod}=", (a + k) % mod
        elif m["m2"]:
            mod = int(m["m2"])
            a, b = rng.randrange(mod), rng.randrange(mod)
            prompt, answer = f"{a}+{b} mod {mod}=", (a + b) % mod
        else:
            xs = [rng.randrange(10) for _ in range(int(m["n"]))]
            prompt = f"{m['mm']} {' '.join(map(str, xs))}:"
            answer = max(xs) if m["mm"] == "max" else min(xs)
        return Task(self.name, str(index), prompt, {"answer": str(answer)})

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return ArithEnv(task, self.turns)


class ArithEnv(Environment):
    """Up to `turns` answers; the first correct one ends the episode with reward 1/turn."""

    def __init__(self, task: Task, turns: int):
        self.task = task
        self.turns = turns
        self.turn = 0
        self.done = False

    def reset(self) -> str:
        self.turn, self.done = 0, False
        return self.task.prompt

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() after the episode ended; call reset()")
        self.turn += 1
        if exact(action, self.task):
            self.done = True
            return StepResult("", 1.0 / self.turn, True, {"turn": self.turn})
        if self.turn >= self.turns:
            self.done = True
            return StepResult("", 0.0, True, {"turn": self.turn})
        # The feedback repeats the question: a tiny model attends to the last few characters.
        return StepResult(f" no\n{self.task.prompt}", 0.0, False, {"turn": self.turn})


def make_arith(variant: str | None) -> ArithDomain:
    if not variant:
        raise ValueError(f"arith needs a variant, e.g. arith/max2; variants: {ARITH_VARIANT_HELP}")
    return ArithDomain(variant)
