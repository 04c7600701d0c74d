"""What a domain is: tasks, environments that play one episode of a task, and the action format.

    domain = get_domain("arith/max2")
    task = domain.task(17)                    # deterministic: the same index gives the same task
    env = domain.make_env(task)               # executor=... for domains that run code
    obs = env.reset()
    obs, reward, done, info = env.step("8")   # StepResult, a NamedTuple

Text in, text out: environments never see token ids, so one environment serves any tokenizer.

The code domains also describe their tasks as tools see them (`hpcrl domains tasks|check`):
`task_names()`, `named_task(name)`, the task's initial `workspace(task)` and a known-good fix
`reference(task)` (both {path: text}), and `submit(task, files, executor)`, the check an
episode's submission gets, on those files laid over the workspace.
An episode may run many steps (write code, run the tests, read the errors, fix); the generator
feeds each observation back to the model until `done`. `info` may carry `feedback`
(`ExecFeedback`, what a sandbox run gave) and `truncation` (why the episode stopped early).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from hpcrl.rl.domains.rewards import REWARDS
from hpcrl.rl.domains.types import ActionSpec, ExecFeedback, StepResult, Task

__all__ = [
    "Task",
    "StepResult",
    "ActionSpec",
    "Environment",
    "Domain",
    "SingleTurnEnv",
    "PromptDomain",
    "ExecFeedback",
    "EVAL_BASE",
]

#: task indices from here on are held out for evaluation (`Domain.eval_indices`): a training
#: sampler hands out indices from 0 up and never gets this far (2**40 tasks)
EVAL_BASE = 1 << 40


class Environment(abc.ABC):
    """One episode of one task. Not thread-safe; the generator drives each from one thread at a time."""

    @abc.abstractmethod
    def reset(self) -> str:
        """Start the episode; return the first observation (the prompt the model sees)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's action; after done=True the episode is over."""

    def close(self) -> None:
        """Release what the episode holds (sandbox sessions); called once, also on abort."""
        return None  # optional to override: an environment that holds nothing has nothing to release


class Domain(abc.ABC):
    """A source of tasks and the environment that judges them."""

    #: the full name, e.g. "arith/max2"; set by the family factory
    name: str
    #: the length limit and stop strings of one action
    action: ActionSpec
    #: True when make_env needs an executor (a sandbox)
    needs_executor: bool = False
    #: how many distinct tasks there are when they form a finite list (task `index` is number
    #: index mod size); the sampler then visits them in a seeded random order, pass by pass.
    #: None: every index is a task of its own
    size: int | None = None
    #: every character the domain's prompts, observations and right answers use, when it is a
    #: closed set; `policy.tiny.charset: auto` builds the tiny model's tokenizer from the
    #: configured domains' alphabets. None: any text (printable ASCII)
    alphabet: str | None = None
    #: True when an episode runs many steps (tool calls on a sandbox session); `hpcrl domains list`
    multi_step: bool = False
    #: the programming languages the model writes in this domain; () for none (plain answers)
    languages: tuple[str, ...] = ()

    #: how many held-out tasks a finite domain keeps out of training (its `task(EVAL_BASE + j)`);
    #: None: no split of its own (see eval_indices)
    heldout_size: int | None = None

    @abc.abstractmethod
    def task(self, index: int) -> Task:
        """Task number `index` (>= 0), the same on every process and every call."""

    @property
    def has_heldout(self) -> bool:
        """True when eval_indices() are tasks training never sees: a kept-out split, or a
        domain whose every index is a task of its own (indices from EVAL_BASE on are never sampled)."""
        return bool(self.heldout_size) or self.size is None

    def eval_indices(self, n: int | None = None) -> list[int]:
        """Indices of up to `n` held-out tasks (default: all of a split, or 100), from EVAL_BASE
        on. A finite domain without a split (heldout_size None) gives its training tasks again:
        check has_heldout."""
        count = self.heldout_size or self.size or 100
        return [EVAL_BASE + j for j in range(min(count, n) if n else count)]

    def for_eval(self) -> Domain:
        """The domain as held-out evaluation plays it (e.g. one attempt per sample); default: itself."""
        return self

    @abc.abstractmethod
    def make_env(self, task: Task, executor: Any = None) -> Environment: ...

    # -- tasks as tools see them (the code domains; others have no workspace) --------------------
    def task_names(self) -> list[str]:
        """Every task by name, training and held-out ([]: tasks have no names of their own)."""
        return []

    def named_task(self, name: str) -> Task:
        names = self.task_names()
        if name not in names:
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ValueError(f"{self.name}: no task {name!r}; tasks: {shown or 'none with names'}")
        return self._named_task(names.index(name))

    def _named_task(self, k: int) -> Task:
        raise ValueError(f"{self.name}: tasks have no names")

    def workspace(self, task: Task) -> dict[str, str]:
        """The files the model starts from ({path: text}); for a domain where the model writes one
        file, that file (empty, or the code to fix)."""
        raise ValueError(f"{self.name}: no workspace (the model answers in text)")

    def reference(self, task: Task) -> dict[str, str]:
        """The workspace of a known-good fix: the files it changes, {path: text}."""
        raise ValueError(f"{self.name}: no reference fix")

    def submit(self, task: Task, files: dict[str, str], executor: Any) -> StepResult:
        """The check a submission of `files` (laid over the workspace) gets, as an episode's last
        step: (observation, reward, done, info with `feedback`, and `reason`, the judge's words)."""
        raise ValueError(f"{self.name}: no submit check")


class SingleTurnEnv(Environment):
    """Prompt, one answer, a reward: done after the first step."""

    def __init__(self, task: Task, reward: Callable[..., float]):
        self.task = task
        self._reward = reward
        self._done = False

    def reset(self) -> str:
        self._done = False
        return self.task.prompt

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() after the episode ended; call reset()")
        self._done = True
        return StepResult("", float(self._reward(action, self.task, None)), True, {})


class PromptDomain(Domain):
    """A domain from prompts and a reward function: what a site module most often provides.

        def make_domain(name):
            return PromptDomain(name, prompts=[("2*3=", "6"), ...], reward="exact", max_tokens=4)

    `prompts` is a sequence of (prompt, answer) pairs; task `index` uses pair `index % len`
    (`size` is their number, so the sampler goes through them in a seeded random order).
    `reward` is a registered reward's name (rl/domains/rewards.py) or a callable
    `reward(action, task, feedback)`; it sees the answer as `task.data["answer"]`. `alphabet`
    "auto" is the characters of the prompts and answers; pass the characters when a right
    answer may use others, or None for any text.
    """

    def __init__(
        self,
        name: str,
        prompts,
        reward: str | Callable[..., float] = "exact",
        max_tokens: int = 16,
        stop: tuple[str, ...] = (),
        alphabet: str | None = "auto",
    ):

        pairs = [tuple(p) for p in prompts]
        if not pairs or any(len(p) != 2 or not isinstance(p[0], str) for p in pairs):
            raise ValueError(
                f"PromptDomain {name!r}: prompts must be a non-empty sequence of (prompt text, answer) pairs"
            )
        if isinstance(reward, str):
            reward = REWARDS.get(reward)
        if not callable(reward):
            raise ValueError(
                f"PromptDomain {name!r}: reward must be a reward name or callable as reward(action, task, feedback)"
            )
        self.name = name
        self.action = ActionSpec(max_tokens, tuple(stop))
        self._pairs = pairs
        self._reward = reward
        self.size = len(pairs)
        if alphabet == "auto":
            alphabet = "".join(sorted({c for p, a in pairs for c in p + str(a)}))
        self.alphabet = alphabet

    def task(self, index: int) -> Task:
        prompt, answer = self._pairs[index % len(self._pairs)]
        return Task(self.name, str(index), prompt, {"answer": answer})

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return SingleTurnEnv(task, self._reward)
