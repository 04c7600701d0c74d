"""Code domains: `synth` (write a program, judged by stdin/stdout tests) and `code-repair` (fix a
buggy function until its unit tests pass). Both are multi-step: a failed attempt comes back as
an observation carrying the sandbox's verdict (wrong output, the error, the failed assertion),
and the model tries again, up to `turns` attempts.

`synth` keeps what it shows apart from what it rewards: a failed turn's observation shows a
failing *feedback* case (input, expected, got), and the reward is the share of *hidden* cases
passed, cases no observation ever shows. A turn before the last runs the hidden cases to their
first failure (all passing ends the episode), then the feedback cases to theirs, for the
observation; the last turn runs every hidden case (partial credit). Both domains keep held-out problems
for evaluation (`task(EVAL_BASE + j)`, problems.SYNTH_HELDOUT and REPAIR_HELDOUT) that
training never samples.

    domain = get_domain("code-repair")            # every problem; or code-repair/wrong-compare
    env = domain.make_env(domain.task(3), executor=SandboxJudge(make_backend(cfg.sandbox)))

The environments talk to a `CodeJudge`: two calls, each returning an `ExecFeedback`.
For tools (`hpcrl domains check`) a task's workspace is the one file the model writes:
`main.py` for synth (empty at first), `solution.py` for code-repair (the buggy function);
`submit` judges it as the episode's last turn does.
`SandboxJudge` adapts a local sandbox backend (hpcrl.sandbox.judge); a remote sandbox client
fits the same protocol. The test code of a repair task runs in the judge, never next to the
candidate, so a candidate cannot pass by printing "ok" or patching the test.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from hpcrl.rl.domains.base import EVAL_BASE, ActionSpec, Domain, Environment, ExecFeedback, StepResult, Task
from hpcrl.rl.domains.problems import (
    REPAIR_HELDOUT,
    REPAIR_PROBLEMS,
    SYNTH_HELDOUT,
    SYNTH_PROBLEMS,
    RepairProblem,
    SynthProblem,
)
from hpcrl.rl.domains.rewards import REWARDS
from hpcrl.sandbox import judge
from hpcrl.sandbox.judge import FunctionTask, IOCase
from hpcrl.sandbox.result import SandboxError

__all__ = ["CodeJudge", "SandboxJudge", "SynthDomain", "RepairDomain", "extract_code", "make_synth", "make_repair"]

# End marker the prompts ask for: the generator stops there instead of running to max_tokens.
END_MARK = "# end"
_MESSAGE_CHARS = 400


class CodeJudge(Protocol):
    """What the code domains need from a sandbox."""

    def judge_io(
        self, language: str, source: str, cases: Sequence[tuple[str, str]], stop_on_fail: bool = False
    ) -> ExecFeedback:
        """Run `source` once per (stdin, expected stdout) case; count the cases that match
        (`stop_on_fail`: stop at the first that does not)."""

    def judge_function(self, program: str, entry_point: str, test: str, prelude: str = "") -> ExecFeedback:
        """Run `test`'s check(candidate) against `entry_point` defined by `program`; 1 of 1 when it
        passes. `prelude` is trusted code the test runs after (HumanEval's prompt: its helpers)."""


# ExecResult statuses (hpcrl.sandbox.result) in the trajectory store's vocabulary.
_STATUS = {
    "ok": "ok",
    "nonzero_exit": "error",
    "compile_error": "error",
    "timeout": "timeout",
    "cpu_limit": "timeout",
    "memory_limit": "oom",
    "output_limit": "crash",
    "killed_by_signal": "crash",
}


def sandbox_outcome(result) -> tuple[str, int, float]:
    if result is None:
        return "error", 0, 0.0
    if result.status == "sandbox_error":
        # Not the model's fault: the generator aborts the episode instead of scoring it.
        raise SandboxError(f"sandbox failed while judging: {result.stderr[-300:].decode('utf-8', 'replace')}")
    code = result.exit_code if result.exit_code is not None else -(result.signal or 0)
    return _STATUS.get(result.status, "crash"), int(code), float(result.wall_s)


def _tail(data: bytes, n: int = _MESSAGE_CHARS) -> str:
    text = data.decode("utf-8", "replace").strip()
    return text if len(text) <= n else "..." + text[-n:]


class SandboxJudge:
    """`CodeJudge` over the sandbox package: a local backend (`make_backend(cfg.sandbox)`) or a
    `SandboxClient` of a sandbox server; both judge the same way (hpcrl.sandbox.judge)."""

    def __init__(self, sandbox, limits=None):

        self.sandbox = sandbox
        self.limits = limits
        if hasattr(sandbox, "judge_function"):  # a SandboxClient: the server runs the judge
            self._io, self._fn = sandbox.judge_io, sandbox.judge_function
        else:
            self._io = lambda *a, **kw: judge.judge_io(sandbox, *a, **kw)
            self._fn = lambda *a, **kw: judge.judge_function(sandbox, *a, **kw)

    def judge_io(
        self, language: str, source: str, cases: Sequence[tuple[str, str]], stop_on_fail: bool = False
    ) -> ExecFeedback:

        v = self._io(
            language, source, [IOCase(i.encode(), o.encode()) for i, o in cases], self.limits, stop_on_fail=stop_on_fail
        )
        passed = sum(c.passed for c in v.cases)
        failed = next((c for c in v.cases if not c.passed), None)
        result = failed.result if failed else (v.cases[-1].result if v.cases else v.result)
        status, code, _ = sandbox_outcome(result)
        if failed is None and v.result is not None and not v.cases:
            status, code, _ = sandbox_outcome(v.result)  # the compile step failed: no case ran
        msg = "all tests passed"
        if failed is not None or not v.passed:
            i = v.cases.index(failed) if failed is not None else 0
            stdin, want = cases[i] if cases else ("", "")
            got = _tail(failed.result.stdout, 120) if failed is not None and failed.result else ""
            err = _tail(failed.result.stderr) if failed is not None and failed.result else v.reason
            msg = f"{v.reason or 'failed'}; input {stdin!r}, expected {want!r}, got {got!r}" + (
                f"; stderr: {err}" if err else ""
            )
        return ExecFeedback(passed, len(cases), status, code, float(v.wall_s), msg)

    def judge_function(self, program: str, entry_point: str, test: str, prelude: str = "") -> ExecFeedback:

        task = FunctionTask(program=program, entry_point=entry_point, test=test, trusted_prelude=prelude)
        v = self._fn(task, self.limits)
        status, code, _ = sandbox_outcome(v.result)
        if v.passed:
            return ExecFeedback(1, 1, status, code, float(v.wall_s), "all tests passed")
        err = _tail(v.result.stderr) if v.result is not None else ""
        if status == "ok":
            status = "error"  # the program ran but the test failed: the store's "error"
        return ExecFeedback(0, 1, status, code, float(v.wall_s), v.reason + (f"; stderr: {err}" if err else ""))


_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)(?:```|\Z)", re.S)


def extract_code(action: str) -> str:
    """The program in an action: the first fenced block if there is one, else the text up to
    the end marker."""
    m = _FENCE.search(action)
    code = m.group(1) if m else action
    return code.split(END_MARK)[0].rstrip() + "\n"


class _CodeEnv(Environment):
    """Shared multi-turn loop: judge the code, stop on success or after `turns` attempts."""

    def __init__(self, task: Task, judge: CodeJudge, turns: int, reward: str):
        if judge is None:
            raise ValueError(f"{task.domain}: needs a sandbox; pass executor=SandboxJudge(...) (or a sandbox client)")
        self.task, self.judge, self.turns = task, judge, turns
        self.reward = REWARDS.get(reward)
        self.turn, self.done = 0, False

    def _judge(self, code: str) -> ExecFeedback:
        raise NotImplementedError

    def final(self, code: str) -> tuple[float, ExecFeedback]:
        """The reward and verdict of `code` as the episode's last turn scores it."""
        fb = self._judge(code)
        return self.reward(code, self.task, fb), fb

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() after the episode ended; call reset()")
        self.turn += 1
        fb = self._judge(extract_code(action))
        info = {"feedback": fb, "turn": self.turn}
        if fb.all_passed or self.turn >= self.turns:
            self.done = True
            return StepResult("", self.reward(action, self.task, fb), True, info)
        obs = f"\n# {fb.passed}/{fb.total} tests passed: {fb.message}\n# Try again. End with {END_MARK}\n"
        return StepResult(obs, 0.0, False, info)


class SynthEnv(_CodeEnv):
    def reset(self) -> str:
        self.turn, self.done = 0, False
        return self.task.prompt

    def _judge(self, code: str) -> ExecFeedback:
        """The hidden (reward) cases: their verdict names no case."""
        hidden = [tuple(c) for c in self.task.data["hidden"]]
        fb = self.judge.judge_io("python", code, hidden)
        msg = "all hidden tests passed" if fb.all_passed else f"{fb.passed}/{fb.total} hidden tests passed"
        return ExecFeedback(fb.passed, fb.total, fb.status, fb.exit_code, fb.duration_s, msg)

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() after the episode ended; call reset()")
        self.turn += 1
        code = extract_code(action)
        if self.turn >= self.turns:  # the last turn: every hidden case, for partial credit
            fb = self._judge(code)
            self.done = True
            return StepResult("", self.reward(action, self.task, fb), True, {"feedback": fb, "turn": self.turn})
        # Before it, to their first failure: the hidden cases decide whether the episode ends
        # here; if not, the feedback cases give the observation a failing case to show.
        hidden = self.judge.judge_io("python", code, [tuple(c) for c in self.task.data["hidden"]], stop_on_fail=True)
        if hidden.all_passed:
            self.done = True
            fb = ExecFeedback(hidden.passed, hidden.total, hidden.status, hidden.exit_code, hidden.duration_s,
                              "all hidden tests passed")  # fmt: skip
            return StepResult("", self.reward(action, self.task, fb), True, {"feedback": fb, "turn": self.turn})
        shown = self.judge.judge_io("python", code, [tuple(c) for c in self.task.data["cases"]], stop_on_fail=True)
        if not shown.all_passed:  # the observation may show this case: it is not a reward case
            obs = f"\n# A test failed: {shown.message}\n# Try again. End with {END_MARK}\n"
            return StepResult(obs, 0.0, False, {"feedback": shown, "turn": self.turn})
        fb = ExecFeedback(0, hidden.total, hidden.status, hidden.exit_code, hidden.duration_s, "a hidden test failed")
        obs = f"\n# The shown tests pass; a hidden test fails.\n# Try again. End with {END_MARK}\n"
        return StepResult(obs, 0.0, False, {"feedback": fb, "turn": self.turn})


class RepairEnv(_CodeEnv):
    def reset(self) -> str:
        self.turn, self.done = 0, False
        # The first observation shows the real failure of the buggy code, as a developer sees it.
        fb = self._judge(self.task.data["buggy"])
        return f"{self.task.prompt}# Test result: {fb.message}\n# Fixed code:\n"

    def _judge(self, code: str) -> ExecFeedback:
        d = self.task.data
        return self.judge.judge_function(code, d["entry_point"], d["test"])


class _ProblemDomain(Domain):
    needs_executor = True
    languages = ("python",)
    action = ActionSpec(max_tokens=256, stop=(END_MARK,))

    def __init__(
        self, family: str, problems: Sequence, heldout: Sequence, variant: str | None, turns: int, reward: str
    ):
        names = [p.name for p in (*problems, *heldout)]
        if variant:
            if variant not in names:
                raise ValueError(
                    f"{family}: unknown problem {variant!r}; problems: {', '.join(names)} (or no variant for all)"
                )
            problems, heldout = [p for p in (*problems, *heldout) if p.name == variant], ()
        self.name = f"{family}/{variant}" if variant else family
        self.problems = tuple(problems)  # task(0, 1, ...) cycles through these
        self.heldout = tuple(heldout)  # task(EVAL_BASE + j): evaluation only
        # `size` stays None (the sampler's order for these predates it); the held-out problems
        # are what evaluation sees (Domain.eval_indices), never the training ones.
        self.heldout_size = len(self.heldout) or None
        self.turns, self.reward = turns, reward
        self.multi_step = turns > 1  # a failed program gets its feedback and another turn

    @property
    def has_heldout(self) -> bool:
        return bool(self.heldout)

    def eval_indices(self, n: int | None = None) -> list[int]:
        if self.heldout:
            return super().eval_indices(n)
        return list(range(min(n, len(self.problems)) if n else len(self.problems)))  # a one-problem variant

    def _problem(self, index: int):
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        if index >= EVAL_BASE and self.heldout:
            return self.heldout[(index - EVAL_BASE) % len(self.heldout)]
        return self.problems[index % len(self.problems)]

    # -- tasks as tools see them: one file ---------------------------------------------------------
    #: the file the model writes, the whole workspace
    workspace_file = "main.py"

    def task_names(self) -> list[str]:
        return [p.name for p in (*self.problems, *self.heldout)]

    def _named_task(self, k: int) -> Task:
        n = len(self.problems)
        return self.task(k if k < n else EVAL_BASE + k - n)

    def _task_problem(self, task: Task):
        return next(p for p in (*self.problems, *self.heldout) if p.name == task.data["problem"])

    def submit(self, task: Task, files: dict[str, str], executor: Any) -> StepResult:
        if self.workspace_file not in files:
            raise ValueError(f"{self.name}: the submission has no {self.workspace_file} (the file the model writes)")
        env = self.make_env(task, executor)
        reward, fb = env.final(files[self.workspace_file])
        return StepResult("", float(reward), True, {"feedback": fb, "reason": fb.message})


class SynthDomain(_ProblemDomain):
    def __init__(self, variant: str | None = None, turns: int = 2, reward: str = "tests_passed"):
        super().__init__("synth", SYNTH_PROBLEMS, SYNTH_HELDOUT, variant, turns, reward)

    def task(self, index: int) -> Task:
        p: SynthProblem = self._problem(index)
        prompt = f"# {p.statement}\n# Write a Python 3 program. End with {END_MARK}\n"
        data = {"cases": [list(c) for c in p.cases], "hidden": [list(c) for c in p.hidden], "problem": p.name}
        return Task(self.name, f"{p.name}-{index}", prompt, data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return SynthEnv(task, executor, self.turns, self.reward)

    def workspace(self, task: Task) -> dict[str, str]:
        return {self.workspace_file: ""}

    def reference(self, task: Task) -> dict[str, str]:
        return {self.workspace_file: self._task_problem(task).reference}


class RepairDomain(_ProblemDomain):
    def __init__(self, variant: str | None = None, turns: int = 3, reward: str = "all_tests"):
        super().__init__("code-repair", REPAIR_PROBLEMS, REPAIR_HELDOUT, variant, turns, reward)

    def task(self, index: int) -> Task:
        p: RepairProblem = self._problem(index)
        prompt = f"# Fix the bug in {p.entry_point} so its tests pass. End with {END_MARK}\n{p.buggy}"
        data = {"entry_point": p.entry_point, "buggy": p.buggy, "test": p.test, "problem": p.name}
        return Task(self.name, f"{p.name}-{index}", prompt, data)

    workspace_file = "solution.py"

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return RepairEnv(task, executor, self.turns, self.reward)

    def workspace(self, task: Task) -> dict[str, str]:
        return {self.workspace_file: task.data["buggy"]}

    def reference(self, task: Task) -> dict[str, str]:
        return {self.workspace_file: self._task_problem(task).reference}


def make_synth(variant: str | None) -> SynthDomain:
    return SynthDomain(variant)


def make_repair(variant: str | None) -> RepairDomain:
    return RepairDomain(variant)
