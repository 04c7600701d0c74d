"""Reward functions by name: `reward(action, task, feedback) -> float in [0, 1]`.

    REWARDS.get("exact")("7", task, None)         # 1.0 when the stripped action is task.data["answer"]
    REWARDS.get("tests_passed")("...", task, fb)  # fraction of the sandbox's tests that passed

Text rewards read `task.data["answer"]`; test rewards read the `ExecFeedback` of the run.
A site registers its own with `@REWARDS.register("name")` in the module its config names.
"""

from __future__ import annotations

from collections.abc import Callable

from hpcrl.rl.common.registry import Registry
from hpcrl.rl.domains.types import ExecFeedback, Task

__all__ = ["REWARDS", "RewardFn", "exact", "prefix", "tests_passed", "all_tests"]

RewardFn = Callable[[str, Task, "ExecFeedback | None"], float]
REWARDS: Registry[RewardFn] = Registry("reward")


def _answer(task: Task) -> str:
    try:
        return str(task.data["answer"])
    except KeyError:
        raise ValueError(f"task {task.domain}/{task.id} has no 'answer' in its data; a text reward needs one") from None


@REWARDS.register("exact")
def exact(action: str, task: Task, feedback: ExecFeedback | None = None) -> float:
    """1 when the action, stripped of surrounding whitespace, equals the answer."""
    return 1.0 if action.strip() == _answer(task) else 0.0


@REWARDS.register("prefix")
def prefix(action: str, task: Task, feedback: ExecFeedback | None = None) -> float:
    """1 when the action starts with the answer (the model may keep talking after it)."""
    return 1.0 if action.lstrip().startswith(_answer(task)) else 0.0


def _need(feedback: ExecFeedback | None, name: str) -> ExecFeedback:
    if feedback is None:
        raise ValueError(f"reward {name!r} needs sandbox feedback; use it only in domains that execute the action")
    return feedback


@REWARDS.register("tests_passed")
def tests_passed(action: str, task: Task, feedback: ExecFeedback | None = None) -> float:
    """The fraction of tests that passed (partial credit)."""
    fb = _need(feedback, "tests_passed")
    return fb.passed / fb.total if fb.total else 0.0


@REWARDS.register("all_tests")
def all_tests(action: str, task: Task, feedback: ExecFeedback | None = None) -> float:
    """1 when every test passed, else 0."""
    return 1.0 if _need(feedback, "all_tests").all_passed else 0.0
