"""The family `libcall/...`: call a library function whose name only the sandbox's error tells.

    libcall/names8-retry2   the model writes the name in `print(lib.?(3))`; two attempts
    libcall/names8          one attempt: nothing to go on but a guess (the control)

Each task is a two-file Python program: `lib.py`, a library with one function (its name one of
the first K lowercase letters, drawn per task), and `main.py`:

    import lib
    print(lib.<action>(<x>))

The model sees `import lib\\nprint(lib.` and writes one token, the name (`ActionSpec(max_tokens=1)`);
the environment writes the rest of the program around it, verbatim, and runs it in the sandbox
through the code domains' judge (`CodeJudge.judge_io`): the program's stdout is compared, outside
the sandbox, with the function's value computed here (3x + 1); the expected output never enters
the sandbox. A wrong name fails as Python fails: the library's `__getattr__` raises
`AttributeError: lib has no c, only e`; any other character gives Python's own SyntaxError.
That last line of the program's stderr is the next observation, and the model's next attempt
(again the name) is the token right after it. A correct attempt `t` ends the episode with
reward 1/t.

Why this shape: the name is drawn per task and nothing in the prompt tells it, so a first attempt
succeeds with probability 1/K at best, whatever the policy; a later attempt can do better only by
reading the error line. An untrained character model (one token of 40 for names8) is right about
2% of the time on each attempt: small but not zero, which is what a group-relative policy
gradient needs to start. Trained, attempt 1 settles near 1/K (and no lower: 1 beats 1/2) and
attempt 2 rises toward 1 (docs/learning.md, "Learning from the sandbox's feedback").

What the model writes is one token: with the character tokenizer one character, the only part of
the program it chooses. It does not write the program. What it learns is to repeat the name that
ends the error line, the easiest copy there is (with tied embeddings an untrained model already
leans toward repeating the token before it): the error line is laid out so that the tiny model
learns it in minutes. With the name further back (the error line, then the prompt again) it did
not learn to copy in 6,000 episodes. That it learns through the real sandbox, in the
pipeline's multi-step loop, is what the family shows.

The alphabet is closed: every character of the prompt, the names, and of every error line a
character of the alphabet can produce (Python 3.11's wording; another Python's wording may add a
character, which the tokenizer then reads as unknown).
"""

from __future__ import annotations

import re
from typing import Any

from hpcrl.rl.domains.base import ActionSpec, Domain, Environment, StepResult, Task
from hpcrl.rl.domains.code import CodeJudge
from hpcrl.rl.domains.types import ExecFeedback
from hpcrl.sandbox.spec import SourceFile

__all__ = ["LibCallDomain", "LibCallEnv", "make_libcall", "LIBCALL_VARIANT_HELP", "program_files", "error_line"]

LIBCALL_VARIANT_HELP = (
    "names<K> (K 2..26: the function's name is one of the first K letters), optionally -retry<t> (t 2..9 attempts)"
)
_VARIANT_RE = re.compile(r"names(?P<k>[2-9]|1[0-9]|2[0-6])(?:-retry(?P<t>[2-9]))?")

PROGRAM = "import lib\nprint(lib.{action}({x}))\n"
PROMPT = "import lib\nprint(lib."  # what the model sees: the program up to the name
# After a failed attempt: the program's error line, which ends with the function's name.
OBSERVATION = "\n{line}"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
LIB = '''"""A library with one function."""

__all__ = [{name!r}]


def {name}(x):
    return 3 * x + 1


def __getattr__(name):
    raise AttributeError(f"lib has no {{name}}, only {{__all__[0]}}")
'''
# The characters of the prompt and of every error line a character of this set (or none: an
# action that is the eos token) gives as the name, on Python 3.11; closed under that, for every
# lowercase name. tests/test_libcall.py checks it through the sandbox.
_BASE = "\n '(),.2:?ADEPSabcdefghilmnoprstuvxy"
# What the judge's message holds before the program's stderr (SandboxJudge.judge_io).
_STDERR = "; stderr: "


def program_files(name: str, action: str, x: int) -> tuple:
    """The sandbox files of one attempt: the library (function `name`) and main.py around `action`."""

    main = PROGRAM.format(action=action, x=x)
    return (SourceFile("main.py", main), SourceFile("lib.py", LIB.format(name=name)))


def error_line(fb: ExecFeedback) -> str:
    """The last line of the program's stderr as the judge reported it (Python's error line), or
    the judge's reason when the program wrote nothing there (a timeout, a wrong output)."""
    msg = fb.message
    err = msg[msg.index(_STDERR) + len(_STDERR) :] if _STDERR in msg else ""
    lines = err.strip().splitlines()
    return lines[-1] if lines else msg.split(";")[0]


class LibCallDomain(Domain):
    needs_executor = True
    languages = ("python",)
    action = ActionSpec(max_tokens=1)

    def __init__(self, variant: str):
        m = _VARIANT_RE.fullmatch(variant or "")
        if not m:
            raise ValueError(f"libcall: unknown variant {variant!r}; variants: {LIBCALL_VARIANT_HELP}")
        self.name = f"libcall/{variant}"
        self.names = LETTERS[: int(m["k"])]
        self.turns = int(m["t"] or 1)
        self.multi_step = self.turns > 1
        self.size = len(self.names) * 10  # every name with every argument 0..9
        self.alphabet = "".join(sorted(set(_BASE) | set(self.names)))

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        k = index % self.size
        name, x = self.names[k % len(self.names)], k // len(self.names)
        return Task(self.name, f"{name}{x}-{index}", PROMPT, {"name": name, "x": x, "expected": str(3 * x + 1)})

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return LibCallEnv(task, executor, self.turns)

    # -- tasks as tools see them: the one thing the model writes, the name ----------------------------
    workspace_file = "name.txt"

    def task_names(self) -> list[str]:
        return [self.task(k).id.split("-")[0] for k in range(self.size)]

    def _named_task(self, k: int) -> Task:
        return self.task(k)

    def workspace(self, task: Task) -> dict[str, str]:
        return {self.workspace_file: ""}

    def reference(self, task: Task) -> dict[str, str]:
        return {self.workspace_file: task.data["name"] + "\n"}

    def submit(self, task: Task, files: dict[str, str], executor: Any) -> StepResult:
        """`name.txt` (its text without the final newline) as a first attempt's action: a Python
        name, or one character (what an episode of the character model can write). Not an
        expression: `__dict__[lib.__all__[0]]` would find the function without the feedback."""
        if self.workspace_file not in files:
            raise ValueError(f"{self.name}: the submission has no {self.workspace_file} (the name the program calls)")
        action = files[self.workspace_file].removesuffix("\n")
        if len(action) > 1 and not action.isidentifier():
            raise ValueError(f"{self.name}: {self.workspace_file} holds {action[:40]!r}, not a Python name")
        _, reward, _, info = LibCallEnv(task, executor, 1).step(action)
        return StepResult("", reward, True, {**info, "reason": info["feedback"].message})


class LibCallEnv(Environment):
    """Up to `turns` attempts; the first that prints the function's value ends the episode with
    reward 1/attempt. A failed attempt's observation is the program's error line, then the prompt."""

    def __init__(self, task: Task, judge: CodeJudge, turns: int):
        if judge is None:
            raise ValueError(f"{task.domain}: needs a sandbox; pass executor=SandboxJudge(...) (or a sandbox client)")
        self.task, self.judge, self.turns = task, judge, turns
        self.turn, self.done = 0, False

    def reset(self) -> str:
        self.turn, self.done = 0, False
        return self.task.prompt

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() after the episode ended; call reset()")
        self.turn += 1
        d = self.task.data
        fb = self.judge.judge_io("python", program_files(d["name"], action, d["x"]), [("", d["expected"])])
        info = {"feedback": fb, "turn": self.turn}
        if fb.all_passed:
            self.done = True
            return StepResult("", 1.0 / self.turn, True, info)
        if self.turn >= self.turns:
            self.done = True
            return StepResult("", 0.0, True, info)
        return StepResult(OBSERVATION.format(line=error_line(fb)), 0.0, False, info)


def make_libcall(variant: str | None) -> LibCallDomain:
    if not variant:
        raise ValueError(f"libcall needs a variant, e.g. libcall/names8-retry2; variants: {LIBCALL_VARIANT_HELP}")
    return LibCallDomain(variant)
