"""Judging candidate code from outside the sandbox, on evidence the candidate cannot forge.

    verdict = judge_io(backend, "cpp", source, [IOCase(b"1 2\\n", b"3\\n")])
    verdict = judge_function(backend, FunctionTask.humaneval(problem, completion))

Two kinds of tests:

* stdin/stdout pairs (`judge_io`): each case runs in a fresh sandbox (compiled languages
  compile once); a case passes when the program exits 0 and its stdout equals the expected
  output up to trailing whitespace. Expected outputs never enter the sandbox.
* a Python test harness such as HumanEval's `check(candidate)` (`judge_function`): the test
  code is trusted and runs here, in the judge's process; only the candidate runs in the
  sandbox, behind a driver (`pyharness.py`) that answers call requests. `check` receives a
  proxy: each call sends the arguments in, and gets back a freshly decoded plain value.

Pass/fail is decided here: for functions, by `check` returning normally while every call got
an answer; nothing the candidate prints, no exit code and no "passed" marker counts. The
candidate never shares a process with the test, so overriding `__eq__` (values arrive as
plain data), patching builtins (they are the sandbox's own), walking the stack (the judge's
frames are not there) or exiting early (the proxy gets no answer, which fails) cannot pass.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.sandbox.backend import Backend, Session
from hpcrl.sandbox.harness_wire import CodecError, decode, load_request, loads, request
from hpcrl.sandbox.languages import get_language
from hpcrl.sandbox.result import ExecResult
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile

__all__ = [
    "IOCase",
    "CaseVerdict",
    "Verdict",
    "FunctionTask",
    "JudgeError",
    "judge_io",
    "judge_function",
    "start_harness",
    "HARNESS_LIMITS",
]

_HARNESS_SOURCE = (Path(__file__).resolve().parent / "pyharness.py").read_bytes()


class JudgeError(RuntimeError):
    """The test itself is broken (does not compile, has no check()): not the candidate's fault."""


@dataclass(frozen=True)
class IOCase:
    stdin: bytes
    expected: bytes


@dataclass(frozen=True)
class CaseVerdict:
    passed: bool
    reason: str
    result: ExecResult | None = None

    def to_wire(self) -> dict:
        return {"passed": self.passed, "reason": self.reason, "result": self.result.to_wire() if self.result else None}

    @classmethod
    def from_wire(cls, d: dict) -> CaseVerdict:
        return cls(bool(d["passed"]), str(d["reason"]), ExecResult.from_wire(d["result"]) if d.get("result") else None)


@dataclass(frozen=True)
class Verdict:
    """`passed` and, if not, why; `cases` per stdin/stdout case; `result` of the candidate's run.

    For `judge_function`, `result` is the run of the harness and candidate: ok (exit 0) when the
    judge ended it after check(), else what ended it first (crash, timeout, memory...).
    """

    passed: bool
    reason: str
    cases: tuple[CaseVerdict, ...] = ()
    result: ExecResult | None = None
    wall_s: float = 0.0

    def to_wire(self) -> dict:
        return {
            "passed": self.passed,
            "reason": self.reason,
            "cases": [c.to_wire() for c in self.cases],
            "result": self.result.to_wire() if self.result else None,
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_wire(cls, d: dict) -> Verdict:
        return cls(
            bool(d["passed"]),
            str(d["reason"]),
            tuple(CaseVerdict.from_wire(c) for c in d.get("cases") or ()),
            ExecResult.from_wire(d["result"]) if d.get("result") else None,
            float(d.get("wall_s", 0.0)),
        )


def _norm(out: bytes) -> list[bytes]:
    lines = [ln.rstrip() for ln in out.replace(b"\r\n", b"\n").split(b"\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def judge_io(
    backend: Backend,
    language: str,
    source: str | bytes | Sequence[SourceFile],
    cases: Sequence[IOCase],
    limits: Limits | None = None,
    *,
    stop_on_fail: bool = True,
) -> Verdict:
    """Run the program once per case with the case's stdin; pass when every case's stdout matches."""
    t0 = time.monotonic()
    lang = get_language(language)
    files = tuple(source) if isinstance(source, (list, tuple)) else (SourceFile(lang.main_file, source),)
    spec = ExecSpec(language=language, files=files, limits=limits or Limits())
    artifact = None
    if lang.compiled:
        built = backend.build(spec)
        if isinstance(built, ExecResult):
            return Verdict(False, built.status, result=built, wall_s=time.monotonic() - t0)
        artifact = built
    verdicts = []
    for i, case in enumerate(cases):
        res = backend.run(ExecSpec(language=language, files=files, stdin=case.stdin, limits=spec.limits), artifact)
        if res.status != "ok":
            cv = CaseVerdict(False, f"case {i}: {res.status}", res)
        elif _norm(res.stdout) != _norm(case.expected):
            cv = CaseVerdict(False, f"case {i}: wrong output", res)
        else:
            cv = CaseVerdict(True, "passed", res)
        verdicts.append(cv)
        if not cv.passed and stop_on_fail:
            break
    failed = next((v for v in verdicts if not v.passed), None)
    return Verdict(
        failed is None and len(verdicts) == len(cases),
        failed.reason if failed else "passed",
        tuple(verdicts),
        wall_s=time.monotonic() - t0,
    )


@dataclass(frozen=True)
class FunctionTask:
    """A Python function to test. `program` runs in the sandbox; `trusted_prelude` + `test` run here.

    `test` must define `check(candidate)`; `trusted_prelude` holds helpers the test uses (for
    HumanEval, the prompt, so `poly` or `encode_cyclic` are the task's, not the candidate's).
    """

    program: str
    entry_point: str
    test: str
    trusted_prelude: str = ""
    name: str = field(default="task")

    @classmethod
    def humaneval(cls, problem: dict, completion: str) -> FunctionTask:
        return cls(
            program=problem["prompt"] + completion,
            entry_point=problem["entry_point"],
            test=problem["test"],
            trusted_prelude=problem["prompt"],
            name=problem["task_id"],
        )


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one; carries its type name."""


class _Abort(BaseException):
    """No usable answer (timeout, dead sandbox, garbage).

    BaseException: `except Exception` in a test cannot swallow it.
    """


class _Proxy:
    def __init__(self, session, entry_point: str, deadline: float):
        self._s = session
        self._fn = entry_point
        self._deadline = deadline
        self._next_id = 0
        self.broken: str | None = None
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.broken:
            raise _Abort(self.broken)
        if kwargs:
            raise JudgeError("keyword arguments are not supported by the function harness")
        self.calls += 1
        rid = self._next_id
        self._next_id += 1
        try:
            line = request(rid, self._fn, list(args))
        except CodecError as exc:
            raise JudgeError(f"test passes a non-plain argument: {exc}") from None
        self._s.send(line)
        line = self._s.read_line(timeout_s=max(0.0, self._deadline - time.monotonic()))
        if line is None:
            self._fail("no answer from the candidate (timeout, exit or crash)")
        try:
            msg = loads(line)
            if not isinstance(msg, dict) or msg.get("id") != rid:
                raise CodecError("answer to another request")
            if "error" in msg:
                raise _builtin_exception(str(msg["error"]), str(msg.get("message", "")))
            return decode(msg["value"])
        except (CodecError, KeyError, TypeError) as exc:
            self._fail(f"unusable answer: {exc}")

    def _fail(self, why: str) -> None:
        self.broken = why
        raise _Abort(why)


def _builtin_exception(name: str, message: str) -> Exception:
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # exotic constructor signatures (UnicodeError...)
            pass
    return CandidateError(f"{name}: {message}")


# -S: no site module, ~4 ms less per judged program; the harness puts dist-packages on sys.path itself.
_HARNESS_COMMAND = ("python3", "-S", "-B")
_EXIT_GRACE_S = 0.5
HARNESS_LIMITS = Limits(wall_s=10.0, cpu_s=10.0, memory_mb=512, output_kb=4096)


def start_harness(backend: Backend, limits: Limits | None = None) -> Session:
    """A sandbox running the function harness, waiting for its candidate (see pyharness.py)."""
    spec = ExecSpec(
        language="python",
        argv=("main.py",),
        limits=limits or HARNESS_LIMITS,
        files=(SourceFile("main.py", _HARNESS_SOURCE),),
    )
    return backend.start(spec, command=_HARNESS_COMMAND)


def judge_function(backend: Backend, task: FunctionTask, limits: Limits | None = None, *, warm: Any = None) -> Verdict:
    """Run `check(candidate)` here against the candidate running in a sandbox; see the module docstring.

    `warm` (a `hpcrl.sandbox.warm.WarmHarness` of this backend and these limits) hands over a
    harness sandbox started ahead, so the candidate does not wait for one to start.
    """
    t0 = time.monotonic()
    limits = limits or HARNESS_LIMITS
    namespace: dict[str, Any] = {"__name__": "__judge__"}
    try:
        exec(compile(task.trusted_prelude, f"<{task.name} prelude>", "exec"), namespace)  # trusted test code
        exec(compile(task.test, f"<{task.name} test>", "exec"), namespace)  # trusted test code
    except Exception as exc:  # any exception out of check() is a failed test
        raise JudgeError(f"{task.name}: the test code does not load: {type(exc).__name__}: {exc}") from exc
    check = namespace.get("check")
    if not callable(check):
        raise JudgeError(f"{task.name}: the test code defines no check(candidate)")
    if warm is not None and warm.backend is backend and warm.limits == limits:
        s = warm.take()
    else:
        s = start_harness(backend, limits)
    try:
        s.restart_clock()
        deadline = time.monotonic() + limits.wall_s
        s.send(load_request(task.program))
        reason = _drive(s, task, check, namespace, deadline)
        # Done with the candidate: the driver exits at once (no interpreter shutdown); one that
        # does not (the candidate took over the channel) is killed within _EXIT_GRACE_S.
        s.send(b"exit\n")
        s.close_stdin()
        s.restart_clock(min(_EXIT_GRACE_S, max(0.0, deadline - time.monotonic())))
    except BaseException:
        s.kill()
        raise
    finally:
        result = s.finish()
    return Verdict(reason == "passed", reason, result=result, wall_s=time.monotonic() - t0)


def _drive(session, task: FunctionTask, check, namespace: dict, deadline: float) -> str:
    hello = session.read_line(timeout_s=max(0.0, deadline - time.monotonic()))
    try:
        msg = loads(hello) if hello is not None else None
    except CodecError:
        msg = None
    if not isinstance(msg, dict) or msg.get("ready") is not True:
        if isinstance(msg, dict) and "load_error" in msg:
            return f"candidate does not load: {str(msg['load_error'])[:200]}"
        return "candidate did not start the harness"
    proxy = _Proxy(session, task.entry_point, deadline)
    namespace[task.entry_point] = proxy
    try:
        check(proxy)
    except _Abort as exc:
        return f"failed: {exc}"
    except JudgeError:
        raise
    except AssertionError as exc:
        return f"failed: assertion {str(exc)[:200]}".rstrip()
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    if proxy.broken:  # a test that swallowed the abort still fails
        return f"failed: {proxy.broken}"
    return "passed"
