"""Code domains: `synth` (write a program, judged by stdin/stdout tests) and `code-repair` (fix a
buggy function until its unit tests pass). Both are multi-step: a failed attempt comes back as
an observation carrying the sandbox's verdict (wrong output, the error, the failed assertion),
and the model tries again, up to `turns` attempts.

    domain = get_domain("code-repair")            # every problem; or code-repair/wrong-compare
    env = domain.make_env(domain.task(3), executor=SandboxJudge(make_backend(cfg.sandbox)))

The environments talk to a `CodeJudge`: two calls, each returning an `ExecFeedback`.
`SandboxJudge` adapts a local sandbox backend (hpcrl.sandbox.judge); a remote sandbox client
fits the same protocol. The test code of a repair task runs in the judge, never next to the
candidate, so a candidate cannot pass by printing "ok" or patching the test.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from hpcrl.rl.domains.base import ActionSpec, Domain, Environment, ExecFeedback, StepResult, Task
from hpcrl.rl.domains.problems import REPAIR_PROBLEMS, SYNTH_PROBLEMS, RepairProblem, SynthProblem
from hpcrl.rl.domains.rewards import REWARDS

__all__ = ["CodeJudge", "SandboxJudge", "SynthDomain", "RepairDomain", "extract_code", "make_synth", "make_repair"]

# End marker the prompts ask for: the generator stops there instead of running to max_tokens.
END_MARK = "# end"
_MESSAGE_CHARS = 400


class CodeJudge(Protocol):
    """What the code domains need from a sandbox."""

    def judge_io(self, language: str, source: str, cases: Sequence[tuple[str, str]]) -> ExecFeedback:
        """Run `source` once per (stdin, expected stdout) case; count the cases that match."""

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


def _outcome(result) -> tuple[str, int, float]:
    if result is None:
        return "error", 0, 0.0
    if result.status == "sandbox_error":
        from hpcrl.sandbox.result import SandboxError

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
        from hpcrl.sandbox import judge

        self.sandbox = sandbox
        self.limits = limits
        if hasattr(sandbox, "judge_function"):  # a SandboxClient: the server runs the judge
            self._io, self._fn = sandbox.judge_io, sandbox.judge_function
        else:
            self._io = lambda *a, **kw: judge.judge_io(sandbox, *a, **kw)
            self._fn = lambda *a, **kw: judge.judge_function(sandbox, *a, **kw)

    def judge_io(self, language: str, source: str, cases: Sequence[tuple[str, str]]) -> ExecFeedback:
        from hpcrl.sandbox.judge import IOCase

        v = self._io(
            language, source, [IOCase(i.encode(), o.encode()) for i, o in cases], self.limits, stop_on_fail=False
        )
        passed = sum(c.passed for c in v.cases)
        failed = next((c for c in v.cases if not c.passed), None)
        result = failed.result if failed else (v.cases[-1].result if v.cases else v.result)
        status, code, _ = _outcome(result)
        if failed is None and v.result is not None and not v.cases:
            status, code, _ = _outcome(v.result)  # the compile step failed: no case ran
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
        from hpcrl.sandbox.judge import FunctionTask

        task = FunctionTask(program=program, entry_point=entry_point, test=test, trusted_prelude=prelude)
        v = self._fn(task, self.limits)
        status, code, _ = _outcome(v.result)
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
        cases = [tuple(c) for c in self.task.data["cases"]]
        return self.judge.judge_io("python", code, cases)


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

    def __init__(self, family: str, problems: Sequence, variant: str | None, turns: int, reward: str):
        names = [p.name for p in problems]
        if variant:
            if variant not in names:
                raise ValueError(
                    f"{family}: unknown problem {variant!r}; problems: {', '.join(names)} (or no variant for all)"
                )
            problems = [p for p in problems if p.name == variant]
        self.name = f"{family}/{variant}" if variant else family
        self.problems = tuple(problems)
        self.turns, self.reward = turns, reward
        self.multi_step = turns > 1  # a failed program gets its feedback and another turn

    # `size` stays None (the sampler's order for these predates it), but the list is short and
    # all of it is trained on: evaluation sees the training problems, and says so.
    @property
    def has_heldout(self) -> bool:
        return False

    def eval_indices(self, n: int | None = None) -> list[int]:
        return list(range(min(n, len(self.problems)) if n else len(self.problems)))

    def _problem(self, index: int):
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        return self.problems[index % len(self.problems)]


class SynthDomain(_ProblemDomain):
    def __init__(self, variant: str | None = None, turns: int = 2, reward: str = "tests_passed"):
        super().__init__("synth", SYNTH_PROBLEMS, variant, turns, reward)

    def task(self, index: int) -> Task:
        p: SynthProblem = self._problem(index)
        prompt = f"# {p.statement}\n# Write a Python 3 program. End with {END_MARK}\n"
        return Task(self.name, f"{p.name}-{index}", prompt, {"cases": [list(c) for c in p.cases], "problem": p.name})

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return SynthEnv(task, executor, self.turns, self.reward)


class RepairDomain(_ProblemDomain):
    def __init__(self, variant: str | None = None, turns: int = 3, reward: str = "all_tests"):
        super().__init__("code-repair", REPAIR_PROBLEMS, variant, turns, reward)

    def task(self, index: int) -> Task:
        p: RepairProblem = self._problem(index)
        prompt = f"# Fix the bug in {p.entry_point} so its tests pass. End with {END_MARK}\n{p.buggy}"
        data = {"entry_point": p.entry_point, "buggy": p.buggy, "test": p.test, "problem": p.name}
        return Task(self.name, f"{p.name}-{index}", prompt, data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return RepairEnv(task, executor, self.turns, self.reward)


def make_synth(variant: str | None) -> SynthDomain:
    return SynthDomain(variant)


def make_repair(variant: str | None) -> RepairDomain:
    return RepairDomain(variant)
