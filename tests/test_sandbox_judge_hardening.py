"""Judge hardening: the trusted test code runs bounded, in a process of its own,
and the candidate's exceptions reach it as a distinct type that no test mistakes for control flow.

Needs bubblewrap and root; skips without, fails with HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import os
import textwrap
import threading

import pytest

from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.judge import FunctionTask, JudgeError, judge_function
from hpcrl.sandbox.spec import Limits

from conftest import require_bwrap
from residue import host_residue

UID = 62400
LIMITS = Limits(wall_s=3, cpu_s=3)
# A bound on how long a judgement may take before the test calls it hung: generous, for a loaded
# machine; the judgements here end at their own 3 s wall limit.
HUNG_S = 120


@pytest.fixture(scope="module")
def backend():
    require_bwrap(UID)
    b = BwrapBackend(uid=UID)
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _nothing_left(request):
    yield
    if "backend" in request.fixturenames:
        assert host_residue([UID], waiting=[request.getfixturevalue("backend")]) == []
        assert _checkers() == []


def _checkers() -> list[int]:
    """Checker processes (children of this one) still alive."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"The checker: trusted test code" in cmd and state != "Z":
            found.append(int(pid))
    return found


def judged(backend, program: str, test: str, entry_point: str = "f", limits: Limits = LIMITS):
    """judge_function in a thread: a judgement that never ends fails the test instead of hanging it."""
    out = {}

    def body():
        try:
            out["verdict"] = judge_function(backend, FunctionTask(program, entry_point, test), limits)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(HUNG_S)
    assert not t.is_alive(), "the judgement hung: the test code ran without a time limit"
    if "error" in out:
        raise out["error"]
    return out["verdict"]


# -- the candidate's exceptions ------------------------------------------------------------------


def test_a_candidate_raising_stopiteration_does_not_end_all_map_as_a_pass(backend):
    v = judged(backend, "def f(x):\n    raise StopIteration\n", "def check(c):\n    assert all(map(c, [1, 2, 3]))\n")
    assert not v.passed and "StopIteration" in v.reason, v.reason


def test_a_candidate_raising_stopiteration_is_not_caught_as_one(backend):
    test = "def check(c):\n    try:\n        c(1)\n    except StopIteration:\n        return\n    assert False\n"
    v = judged(backend, "def f(x):\n    raise StopIteration\n", test)
    assert not v.passed and v.reason.startswith("failed: the candidate raised StopIteration"), v.reason


def test_a_candidate_raising_stopiteration_does_not_end_a_zip_over_map_as_a_pass(backend):
    test = "def check(c):\n    for got, want in zip(map(c, [1, 2]), [2, 3]):\n        assert got == want\n"
    v = judged(backend, "def f(x):\n    raise StopIteration\n", test)
    assert not v.passed, v.reason


def test_candidate_exceptions_are_candidate_errors_and_still_their_builtin_type(backend):
    test = textwrap.dedent("""
        def check(c):
            try:
                c(0)
            except ZeroDivisionError as exc:
                assert isinstance(exc, CandidateError) and exc.type_name == 'ZeroDivisionError'
                assert type(exc) is not ZeroDivisionError and 'division' in str(exc)
            else:
                assert False, 'no exception'
            try:
                c('x')
            except CandidateError as exc:
                assert exc.type_name == 'Oops' and not isinstance(exc, (ValueError, StopIteration))
    """)
    program = "class Oops(Exception):\n    pass\ndef f(x):\n    if x == 'x':\n        raise Oops('mine')\n"
    program += "    return 1 / x\n"
    v = judged(backend, program, test)
    assert v.passed, v.reason


def test_a_candidate_raising_keyerror_or_unicode_errors_is_rebuilt_without_crashing_the_checker(backend):
    test = textwrap.dedent("""
        def check(c):
            for arg, kind in ((0, KeyError), (1, UnicodeError), (2, OSError)):
                try:
                    c(arg)
                except kind as exc:
                    assert isinstance(exc, CandidateError)
                else:
                    assert False
    """)
    program = textwrap.dedent("""
        def f(x):
            if x == 0:
                return {}['k']
            if x == 1:
                return b'\\xff'.decode('utf-8')
            raise FileNotFoundError(2, 'gone')
    """)
    v = judged(backend, program, test)
    assert v.passed, v.reason


# -- the test's own time and memory ----------------------------------------------------------------


def test_a_catastrophic_regex_on_the_candidates_value_is_cut_at_the_wall_limit(backend):
    test = "import re\ndef check(c):\n    assert re.match(r'(a+)+$', c(0)) is None\n"
    v = judged(backend, "def f(x):\n    return 'a' * 64 + '!'\n", test)
    assert not v.passed and "time limit" in v.reason, v.reason


def test_range_of_a_huge_value_from_the_candidate_is_cut_at_the_limit(backend):
    test = "def check(c):\n    assert sum(range(c(0))) >= 0\n"
    v = judged(backend, "def f(x):\n    return 10 ** 15\n", test)
    assert not v.passed and ("time limit" in v.reason or "CPU" in v.reason), v.reason


def test_the_test_code_has_a_memory_limit(backend):
    # 1 GiB is more than the judge's 512 MiB (plus the interpreter's reserve): the allocation
    # fails in the checker, not in the judge's process, and the test fails.
    test = "def check(c):\n    buf = bytearray(c(0))\n    assert len(buf) == 1 << 30\n"
    v = judged(backend, "def f(x):\n    return 1 << 30\n", test, limits=Limits(wall_s=10, cpu_s=10, memory_mb=512))
    assert not v.passed and "memory" in v.reason, v.reason


def test_a_test_that_swallows_the_abort_of_a_hanging_candidate_still_fails(backend):
    test = "def check(c):\n    try:\n        c(1)\n    except BaseException:\n        pass\n"
    v = judged(backend, "def f(x):\n    while True:\n        pass\n", test, limits=Limits(wall_s=2, cpu_s=2))
    assert not v.passed, v.reason


def test_the_tests_prints_do_not_disturb_the_channel(backend):
    test = "def check(c):\n    print('done passed')\n    print('ready')\n    assert c(1) == 2\n"
    assert judged(backend, "def f(x):\n    return x + 1\n", test).passed
    assert not judged(backend, "def f(x):\n    return x\n", test).passed


def test_a_test_that_exits_or_kills_its_process_fails(backend):
    for body in ("raise SystemExit(0)", "import os; os._exit(0)", "import os, signal; os.kill(os.getpid(), 9)"):
        v = judged(backend, "def f(x):\n    return x\n", f"def check(c):\n    c(1)\n    {body}\n")
        assert not v.passed, (body, v.reason)


def test_a_broken_test_is_still_the_judges_error(backend):
    with pytest.raises(JudgeError, match="defines no check"):
        judged(backend, "def f(x):\n    return x\n", "x = 1")
    with pytest.raises(JudgeError, match="does not load"):
        judged(backend, "def f(x):\n    return x\n", "def check(c) pass")
    with pytest.raises(JudgeError, match="keyword arguments"):
        judged(backend, "def f(x):\n    return x\n", "def check(c):\n    c(x=1)\n")
