"""A site domain for the end-to-end sandbox-fault test (tests/test_session_faults_run.py), named
in a config as `session_probe:make_domain` (the test copies this file next to its config).

`session-probe`: session-repair's projects, tool calls and sessions (rl/domains/session_env.py),
with one change that makes an untrained policy's episodes touch the sandbox at every step. An
untrained model almost never writes a well-formed tool call: most of its actions hold none (a
step that runs nothing) or a malformed one (answered without a session operation), so a sandbox
server killed mid-episode would go unnoticed until the episode's session close, and neither
`resume` nor `reissue` would ever be exercised. Here every step first writes a note of the
environment's own (`notes/K.txt` at step K) through the session, then runs the model's calls as
session-repair does. Step `STEPS` ends the episode with the environment's check instead of a
submit: it reads every note and the project's files back, reward 1 when the workspace holds
them all as written, else 0. A resumed episode therefore earns 1 only when its workspace was
restored on the other server (notes written before the fault included), and a fault scored as
the model's failure would show up as a 0, a short episode or a sandbox truncation.

Each session operation waits at most `CLIENT_TIMEOUT_S` for its server (the environment's
`client_timeout_s`): the time a killed server takes to be noticed.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from hpcrl.rl.domains.base import ActionSpec, Environment, StepResult, Task
from hpcrl.rl.domains.session_env import SessionEnv
from hpcrl.rl.domains.session_repair import SessionRepairDomain
from hpcrl.rl.domains.toolcalls import SYNTAX, Write

STEPS = 4  # steps per episode; the last one is the check (below generators.max_turns: 8)
CLIENT_TIMEOUT_S = 10.0
_OBS_CHARS = 100  # of the model's calls' observation, per step


def note(k: int, task_id: str) -> tuple[str, str]:
    """The note step `k` writes: (path, content)."""
    return f"notes/{k}.txt", f"note {k} of {task_id}\n"


class ProbeEnv(SessionEnv):
    def __init__(self, *args: Any, steps: int = STEPS, **kw: Any):
        super().__init__(*args, **kw)
        self.steps, self.turns = steps, 0

    def reset(self) -> str:
        self.turns, self.tag = 0, secrets.token_hex(6)
        return super().reset()

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        self.turns += 1  # only a step that returned: a faulted attempt is retried as the same step
        self._progress("done" if result.done else str(self.turns))
        return result

    def _progress(self, what: str) -> None:
        """One line per finished step into $HPCRL_PROBE_LOG (the test's kill condition): which
        server the episode's session is on and how far it got."""
        path = os.environ.get("HPCRL_PROBE_LOG")
        if path:
            with open(path, "a") as fh:  # O_APPEND: whole short lines from many threads
                fh.write(f"{self.tag} {self._service} {what}\n")

    def _step(self, action: str) -> StepResult:
        # Runs again, whole, on the reopened session when a fault is resumed.
        k = self.turns + 1
        path, content = note(k, self.task.id)
        text, _ = self._call(Write(path, content))
        result = super()._step(action)
        if result.done or k < self.steps:
            # The model's part cut short: an untrained model's is the syntax error with the whole
            # syntax (~250 tokens), and STEPS of those would not fit the tiny model's context.
            return result._replace(observation=f"{text}\n{result.observation[:_OBS_CHARS]}\n")
        self.done = True
        return StepResult("", float(self._intact(k)), True, dict(result.info or {}))

    def _intact(self, k: int) -> bool:
        """Every note up to step k and every project file read back as written."""
        expected = [note(j, self.task.id) for j in range(1, k + 1)]
        expected += [(str(p), str(c)) for p, c in self.task.data["files"]]
        for path, content in expected:
            self._step_calls.append(f"read {path}")
            r = self._op({"op": "read", "path": path})
            if not r["ok"] or bytes(r["content"]).decode("utf-8", "replace") != content:
                return False
        return True


class ProbeDomain(SessionRepairDomain):
    """`session-probe`: see the module docstring."""

    # A short action: the model's text only has to reach the parser, and the test runs many episodes.
    action = ActionSpec(max_tokens=16, stop=("<submit/>",))

    def __init__(self, label: str):
        super().__init__(None, client_timeout_s=CLIENT_TIMEOUT_S)
        self.name = label

    def task(self, index: int) -> Task:
        t = super().task(index)
        prompt = f"Act on the project with tool calls ({SYNTAX}); files: {', '.join(p for p, _ in t.data['files'])}\n"
        return Task(t.domain, t.id, prompt, t.data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return ProbeEnv(task, executor, self.max_ops, self.run_timeout_s, self.client_timeout_s)


def make_domain(label: str) -> ProbeDomain:
    return ProbeDomain(label)
