"""Judging candidate code from outside the sandbox, on evidence the candidate cannot forge.

    verdict = judge_io(backend, "cpp", source, [IOCase(b"1 2\\n", b"3\\n")])
    verdict = judge_function(backend, FunctionTask.humaneval(problem, completion))
    verdict = judge_function(backend, FunctionTask("", "stats.median", test, files=(("stats/__init__.py", src),)))
    verdict = judge_function(backend, FunctionTask(c_driver(sigs), "gcd", test, files=(("lib.c", src),), language="c"))

Two kinds of tests:

* stdin/stdout pairs (`judge_io`): each case runs in a fresh sandbox (compiled languages
  compile once); a case passes when the program exits 0 and its stdout equals the expected
  output up to trailing whitespace. Expected outputs never enter the sandbox.
* a Python test harness such as HumanEval's `check(candidate)` (`judge_function`): the test
  code is trusted and runs in a checker process of its own (`pycheck.py`: this interpreter,
  under rlimits of the judge's limits, address space and CPU seconds, and the same wall limit
  as the candidate), never in the judge's process, so a test working on a value the candidate
  returned (a catastrophic regex, `range(10**15)`, `bytearray(2**40)`) fails at the limit
  instead of stalling or swelling the server. Only the candidate runs in the sandbox, behind a
  driver (`pyharness.py`) that answers call requests. The judge relays: each call of the
  checker's `candidate` proxy comes here, goes to the sandbox, and its answer is checked here
  (`harness_wire`: plain data only) and rebuilt as a fresh plain value for the checker.
  The candidate is one Python source, a Python package of several files (the test calls its
  functions by dotted name), or C sources compiled in the sandbox with a driver for the
  functions' signatures (`harness_wire.c_driver`); the test code and its expected values
  never enter the sandbox.

Pass/fail is decided here: for functions, by the checker reporting that `check` returned
normally, while every call got an answer; nothing the candidate prints, no exit code and no "passed" marker counts. The
candidate never shares a process with the test, so overriding `__eq__` (values arrive as
plain data), patching builtins (they are the sandbox's own), walking the stack (the judge's
frames are not there) or exiting early (the proxy gets no answer, which fails) cannot pass.
An exception the candidate raises reaches the test as a `CandidateError` (in the test's
namespace; `.type_name` is the candidate's type), which is also an instance of the builtin type
it names except StopIteration and StopAsyncIteration: `all(map(candidate, xs))` cannot end early
as a pass, and `except StopIteration` in a test does not catch the candidate's.
"""

from __future__ import annotations

import marshal
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.sandbox.backend import Backend, ProcessSession, Session
from hpcrl.sandbox.harness_wire import CodecError, decode, load_request, loads, request, valid_name
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
    "start_checker",
    "HARNESS_LIMITS",
    "task_data_exposed",
]

_HARNESS_SOURCE = (Path(__file__).resolve().parent / "pyharness.py").read_bytes()
_CHECKER_SOURCE = (Path(__file__).resolve().parent / "pycheck.py").read_text()


class JudgeError(RuntimeError):
    """The test itself is broken (does not compile, has no check()): not the candidate's fault."""


# What the bwrap backend shows every candidate of the host (launcher.host_layout): read-only, but readable.
_HOST_BOUND = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives")
_exposure: list[str | None] = []


def task_data_exposed(backend: Backend) -> str | None:
    """Why candidates of `backend` could read hpcrl's own files (its built-in tasks' hidden tests
    and expected outputs), or None. The bwrap backend binds the host's /usr and /lib: an hpcrl
    installed there (a system-wide pip install) is readable from inside every sandbox."""
    if getattr(backend, "name", "") != "bwrap":
        return None  # apptainer runs candidates in the sandbox image, never this installation
    if not _exposure:
        here = str(Path(__file__).resolve().parents[1])
        bound = next((d for d in _HOST_BOUND if here == d or here.startswith(d + "/")), None)
        _exposure.append(
            None
            if bound is None
            else f"hpcrl is installed at {here}, under {bound}, which the bwrap sandbox shows every candidate: "
            "its tasks' hidden tests are readable; install hpcrl outside the host's /usr and /lib (a virtual "
            "environment in a home or project directory)"
        )
    return _exposure[0]


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
    _refuse_exposed(backend)
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
    """Functions to test. The candidate runs in the sandbox; `trusted_prelude` + `test` in the checker.

    `test` must define `check(candidate)`, called with the function `entry_point`; it may call
    `function("name")` for others. `trusted_prelude` holds helpers the test uses (for HumanEval,
    the prompt, so `poly` or `encode_cyclic` are the task's, not the candidate's).

    language "python": the candidate is `program` (one source; may be empty) and `files` (a
    package written under the sandbox's work dir: `entry_point` and the names the test asks for
    are dotted, `pkg.mod.func`). language "c": `program` is the driver (`harness_wire.c_driver`,
    trusted text that only marshals) and `files` the candidate's C sources and headers; they
    are compiled together in the sandbox (`C_BUILD`), so a candidate that does not compile fails.
    """

    program: str
    entry_point: str
    test: str
    trusted_prelude: str = ""
    name: str = field(default="task")
    files: tuple[tuple[str, str], ...] = ()
    language: str = "python"

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple((str(p), str(t)) for p, t in self.files))
        if self.language not in ("python", "c"):
            raise ValueError(f"FunctionTask.language: python or c (got {self.language!r})")
        for path, _ in self.files:
            parts = path.split("/")
            if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or path == C_DRIVER_FILE:
                raise ValueError(f"FunctionTask.files: bad path {path!r} (relative, no '..', not {C_DRIVER_FILE})")

    @classmethod
    def humaneval(cls, problem: dict, completion: str) -> FunctionTask:
        return cls(
            program=problem["prompt"] + completion,
            entry_point=problem["entry_point"],
            test=problem["test"],
            trusted_prelude=problem["prompt"],
            name=problem["task_id"],
        )

    def load_payload(self) -> str | dict:
        """What the harness's `load` line carries (pyharness.py)."""
        if self.language == "c":
            sources = " ".join(shlex.quote(p) for p, _ in self.files if p.endswith(".c"))
            build = C_BUILD.format(driver=C_DRIVER_FILE, sources=sources)
            return {"files": [[C_DRIVER_FILE, self.program], *map(list, self.files)], "exec": ["sh", "-c", build]}
        if not self.files:
            return self.program
        module = self.entry_point.rpartition(".")[0]
        return {
            "files": [list(f) for f in self.files],
            "main": self.program or None,
            "imports": [module] if module else [],
        }


#: where a C task's driver is written, and how it is built with the candidate's sources and run
#: (diagnostics to stderr; the program to /tmp, which the candidate's files cannot shadow)
C_DRIVER_FILE = "judge_driver.c"
C_BUILD = "gcc -std=gnu11 -O1 -w -o /tmp/judge_prog {driver} {sources} -lm 1>&2 && exec /tmp/judge_prog"

# -S: no site module, ~4 ms less per judged program; the harness puts dist-packages on sys.path itself.
_HARNESS_COMMAND = ("python3", "-S", "-B")
_EXIT_GRACE_S = 0.5
HARNESS_LIMITS = Limits(wall_s=10.0, cpu_s=10.0, memory_mb=512, output_kb=4096)
# Address space the checker's interpreter takes before the test allocates anything.
_CHECKER_RESERVE_MB = 128


def start_harness(backend: Backend, limits: Limits | None = None) -> Session:
    """A sandbox running the function harness, waiting for its candidate (see pyharness.py)."""
    spec = ExecSpec(
        language="python",
        argv=("main.py",),
        limits=limits or HARNESS_LIMITS,
        files=(SourceFile("main.py", _HARNESS_SOURCE),),
    )
    return backend.start(spec, command=_HARNESS_COMMAND)


def start_checker(limits: Limits | None = None) -> Session:
    """A process for the trusted test code (pycheck.py), waiting for its test: this interpreter,
    isolated from the environment (-I -S), under rlimits of `limits` (address space `memory_mb`
    plus the interpreter's reserve, CPU seconds, file size) and, from outside, its wall limit."""
    limits = limits or HARNESS_LIMITS
    cpu = max(1, math.ceil(limits.cpu_s))
    argv = [
        "prlimit",
        f"--as={(limits.memory_mb + _CHECKER_RESERVE_MB) * 1024 * 1024}",
        f"--data={limits.memory_mb * 1024 * 1024}",
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={limits.file_size_mb * 1024 * 1024}",
        "--core=0",
        "--",
        sys.executable,
        "-I",
        "-S",
        "-B",
        "-c",
        _CHECKER_SOURCE,
    ]
    return ProcessSession(argv, limits, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"})


def _refuse_exposed(backend: Backend) -> None:
    why = task_data_exposed(backend)
    if why is not None:
        raise JudgeError(why)


def _send(session: Session, verb: str, value: Any) -> None:
    session.send(verb.encode() + b" " + marshal.dumps(value).hex().encode() + b"\n")


def _receive(session: Session, deadline: float) -> tuple[str, Any] | None:
    """The checker's next message, None when it ended or the deadline passed. It is our own trusted
    process writing marshal (pycheck.py); what is not a message of its verbs is an error."""
    line = session.read_line(timeout_s=max(0.0, deadline - time.monotonic()))
    if line is None:
        return None
    try:
        verb, _, payload = line.rstrip(b"\n").partition(b" ")
        value = marshal.loads(bytes.fromhex(payload.decode()))
    except (ValueError, EOFError, TypeError, UnicodeDecodeError):
        raise JudgeError(f"the checker sent a malformed message: {line[:100]!r}") from None
    if verb not in (b"ready", b"judge_error", b"call", b"done"):
        raise JudgeError(f"the checker sent an unknown message: {line[:100]!r}")
    return verb.decode(), value


def judge_function(backend: Backend, task: FunctionTask, limits: Limits | None = None, *, warm: Any = None) -> Verdict:
    """Run `check(candidate)` in a checker process against the candidate running in a sandbox; see
    the module docstring. Both count against one wall limit, `limits.wall_s`.

    `warm` (a `hpcrl.sandbox.warm.WarmHarness` of this backend and these limits) hands over a
    harness sandbox and a checker started ahead, so the judgement does not wait for them to start.
    """
    t0 = time.monotonic()
    _refuse_exposed(backend)
    limits = limits or HARNESS_LIMITS
    use_warm = warm is not None and warm.backend is backend and warm.limits == limits
    checker = warm.take_checker() if use_warm else start_checker(limits)
    try:
        checker.restart_clock()
        deadline = time.monotonic() + limits.wall_s
        load = {
            "path": [p for p in sys.path if p],
            "prelude": task.trusted_prelude,
            "test": task.test,
            "entry_point": task.entry_point,
            "name": task.name,
        }
        _send(checker, "load", load)
        first = _receive(checker, deadline)
        if first is None or first[0] != "ready":
            if first is not None and first[0] == "judge_error":
                raise JudgeError(str(first[1]))
            raise JudgeError(f"{task.name}: the checker did not start: {_checker_end(checker)}")
        s = warm.take() if use_warm else start_harness(backend, limits)
        try:
            s.restart_clock(max(0.0, deadline - time.monotonic()))
            s.send(load_request(task.load_payload()))
            reason = _drive(s, checker, task, deadline, limits)
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
    finally:
        checker.kill()
        checker.finish()
    if reason == _NO_START and task.language == "c":
        tail = result.stderr.decode("utf-8", "replace").strip()[-300:]
        reason = f"candidate does not build or start ({result.status})" + (f": {tail}" if tail else "")
    return Verdict(reason == "passed", reason, result=result, wall_s=time.monotonic() - t0)


def _checker_end(checker: Session) -> str:
    """Why the checker stopped talking: its wall limit, or how its process ended."""
    checker.kill()
    res = checker.finish()
    if res.status == "timeout":
        return "the test did not finish within the time limit"
    if res.status == "cpu_limit":
        return "the test ran out of CPU time (its CPU limit)"
    tail = res.stderr.decode("utf-8", "replace").strip()[-200:]
    return f"the test's process ended ({res.status})" + (f": {tail}" if tail else "")


_NO_START = "candidate did not start the harness"


def _drive(session: Session, checker: Session, task: FunctionTask, deadline: float, limits: Limits) -> str:
    """Relay the checker's calls to the candidate and the candidate's checked answers back."""
    hello = session.read_line(timeout_s=max(0.0, deadline - time.monotonic()))
    try:
        msg = loads(hello) if hello is not None else None
    except CodecError:
        msg = None
    if not isinstance(msg, dict) or msg.get("ready") is not True:
        if isinstance(msg, dict) and "load_error" in msg:
            return f"candidate does not load: {str(msg['load_error'])[:200]}"
        return _NO_START
    broken: str | None = None
    rid = 0
    while True:
        got = _receive(checker, deadline)
        if got is None:
            if time.monotonic() >= deadline:
                return f"failed: the test did not finish within the time limit ({limits.wall_s:g} s)"
            return f"failed: {_checker_end(checker)}"
        verb, value = got
        if verb == "done":
            return f"failed: {broken}" if broken and value == "passed" else str(value)
        if verb == "judge_error":
            raise JudgeError(str(value))
        if verb != "call" or not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], list)):
            raise JudgeError(f"the checker sent {verb} where a call or its verdict belongs")
        fn, args = value
        if not valid_name(fn, task.language):
            raise JudgeError(f"{task.name}: the test calls {fn!r}, which is no function name")
        if broken is None:
            try:
                line = request(rid, fn, args, task.language)
            except CodecError as exc:
                raise JudgeError(f"{task.name}: test passes a non-plain argument: {exc}") from None
            session.send(line)
            verb, value = _answer(session, rid, deadline)
            rid += 1
            if verb == "abort":
                broken = value
        else:
            verb, value = "abort", broken
        _send(checker, verb, value)


def _answer(session: Session, rid: int, deadline: float) -> tuple[str, Any]:
    """The candidate's answer to request `rid`, checked and rebuilt: ("value", v), ("raise", (type
    name, message)) or ("abort", why) when there is no usable one."""
    line = session.read_line(timeout_s=max(0.0, deadline - time.monotonic()))
    if line is None:
        return "abort", "no answer from the candidate (timeout, exit or crash)"
    try:
        msg = loads(line)
        if not isinstance(msg, dict) or msg.get("id") != rid:
            raise CodecError("answer to another request")
        if "error" in msg:
            return "raise", (str(msg["error"])[:200], str(msg.get("message", ""))[:2000])
        return "value", decode(msg["value"])
    except (CodecError, KeyError, TypeError) as exc:
        return "abort", f"unusable answer: {exc}"
