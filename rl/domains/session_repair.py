"""`session-repair[/problem]`: fix a bug in a small Python project with tool calls, over many steps,
judged by hidden tests. The episodes run on a sandbox session (`session_env`); the projects are
`session_tasks`."""

from __future__ import annotations

import shlex
from typing import Any

from hpcrl.rl.domains.base import ActionSpec, Environment, Task
from hpcrl.rl.domains.session_env import SessionDomain, SessionEnv
from hpcrl.rl.domains.session_tasks import SESSION_PROBLEMS, VISIBLE_CMD, SessionProblem
from hpcrl.rl.domains.toolcalls import SYNTAX

__all__ = ["SessionRepairDomain", "make_session_repair"]


class SessionRepairDomain(SessionDomain):
    """`session-repair[/problem]`: fix a bug in a small project with tool calls, judged by hidden tests."""

    needs_executor = True
    multi_step = True
    languages = ("python",)
    # Several calls per action: room for a rewritten module; stopping at submit saves the rest.
    action = ActionSpec(max_tokens=512, stop=("<submit/>",))

    def __init__(
        self,
        variant: str | None = None,
        max_ops: int = 64,
        run_timeout_s: float = 10.0,
        client_timeout_s: float | None = None,
    ):
        problems = SESSION_PROBLEMS
        if variant:
            problems = tuple(p for p in SESSION_PROBLEMS if p.name == variant)
            if not problems:
                names = ", ".join(p.name for p in SESSION_PROBLEMS)
                raise ValueError(f"session-repair: unknown problem {variant!r}; problems: {names} (or no variant)")
        self.name = f"session-repair/{variant}" if variant else "session-repair"
        self.problems, self.max_ops, self.run_timeout_s = problems, max_ops, run_timeout_s
        self.client_timeout_s = client_timeout_s  # None: the sandbox client's own deadline
        self.size = len(problems)

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        p: SessionProblem = self.problems[index % len(self.problems)]
        prompt = (
            f"Fix the bug in this Python project, then submit. {p.statement}\n"
            f"Files: {', '.join(path for path, _ in p.files)}\n"
            f"Run the visible tests with <run>{shlex.join(VISIBLE_CMD)}</run>; hidden tests judge the submission.\n"
            f"Act with tool calls (up to 8 per message, {self.max_ops} in all): {SYNTAX}\n"
        )
        data = {
            "files": [list(f) for f in p.files],
            "hidden": p.hidden,
            "entry_point": p.entry_point,
            "packages": list(p.packages),
            "problem": p.name,
        }
        return Task(self.name, f"{p.name}-{index}", prompt, data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return SessionEnv(task, executor, self.max_ops, self.run_timeout_s, self.client_timeout_s)

    def task_names(self) -> list[str]:
        return [p.name for p in self.problems]

    def _named_task(self, k: int) -> Task:
        return self.task(k)

    def reference(self, task: Task) -> dict[str, str]:
        p = next(p for p in self.problems if p.name == task.data["problem"])
        return self.workspace(task) | dict(p.reference)


def make_session_repair(variant: str | None) -> SessionRepairDomain:
    return SessionRepairDomain(variant)
