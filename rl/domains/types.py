"""The plain data a domain hands around: a task instance, a step's result, the action format,
what executing an action gave. Rewards (rewards.py) and domains (base.py) both build on these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Task", "StepResult", "ActionSpec", "ExecFeedback"]


@dataclass(frozen=True)
class Task:
    """One task instance. `id` is unique within the domain for the life of a run (it carries the
    index the coordinator handed out); the learner names a trajectory's GRPO group by (domain,
    task, episode // group_size), so a site domain whose ids repeat still gets its groups apart."""

    domain: str
    id: str
    prompt: str | tuple[Mapping[str, str], ...]  # text, or chat messages ({role, content}, ...)
    data: Mapping[str, Any] = field(default_factory=dict)


class StepResult(NamedTuple):
    observation: str
    reward: float
    done: bool
    info: Mapping[str, Any]


@dataclass(frozen=True)
class ActionSpec:
    """How one action is sampled: its length limit, the strings that end it early (kept in the
    action), extra end-of-sequence tokens (by name, beyond the model's own), and the sampling
    parameters (temperature 0: greedy; top_p 1 and top_k 0: no truncation). The recorded
    log-probabilities are those of the distribution these make, and the learner scores the
    policy under the same ones (rl/rollout/engine.py); greedy actions are never trained."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"ActionSpec.max_tokens: must be an int >= 1 (got {self.max_tokens!r})")
        if not self.temperature >= 0:
            raise ValueError(f"ActionSpec.temperature: must be >= 0 (got {self.temperature!r})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"ActionSpec.top_p: must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"ActionSpec.top_k: must be an int >= 0 (got {self.top_k!r})")


@dataclass(frozen=True)
class ExecFeedback:
    """What executing an action gave, in sandbox-neutral terms (see rl/domains/code.py).

    `status` uses the trajectory store's sandbox vocabulary: ok, error, timeout, oom, crash.
    """

    passed: int
    total: int
    status: str
    exit_code: int
    duration_s: float
    message: str

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total
