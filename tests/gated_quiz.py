"""A site domain for tests/test_rollout_local.py, named in a config as `gated_quiz:make_domain`
(the test copies this file next to its config).

`gated-quiz`: one-digit sums, as quick as arith, except that an episode's step waits while the
file named by $HPCRL_GATE is absent. The test removes the file to hold every episode in flight,
so a generator it signals then provably holds unfinished episodes (a clean stop must hand them
back, a kill -9 leaves them to expire), instead of hoping to hit one of arith's millisecond
episodes. Each step that finds the gate closed appends "<pid>" to $HPCRL_GATE.log, once per
episode: the test's evidence that a given process holds one. Steps run on the generator's
environment pool (`needs_executor`), so its main loop, its syncs and its signals go on.
"""

from __future__ import annotations

import os
import time
from typing import Any

from hpcrl.rl.domains.base import Environment, PromptDomain, StepResult, Task

_WAIT_MAX_S = 900.0  # a test that never reopens the gate fails on its own guard, not here


def _wait_gate() -> None:
    gate = os.environ.get("HPCRL_GATE")
    if not gate or os.path.exists(gate):
        return
    with open(gate + ".log", "a") as fh:  # O_APPEND: whole short lines from many threads
        fh.write(f"{os.getpid()}\n")
    give_up = time.monotonic() + _WAIT_MAX_S
    while not os.path.exists(gate) and time.monotonic() < give_up:
        time.sleep(0.02)


class _GatedEnv(Environment):
    def __init__(self, inner: Environment):
        self.inner = inner

    def reset(self) -> str:
        return self.inner.reset()

    def step(self, action: str) -> StepResult:
        _wait_gate()
        return self.inner.step(action)

    def close(self) -> None:
        self.inner.close()


class GatedQuiz(PromptDomain):
    needs_executor = True  # steps on the environment pool (the executor itself is not used)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return _GatedEnv(super().make_env(task))


def make_domain(name: str) -> GatedQuiz:
    pairs = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    return GatedQuiz(name, pairs, reward="exact", max_tokens=3)
