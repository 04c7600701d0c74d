"""`c-repair`: fix a seeded bug in a small C project with a build step, on a sandbox session.

    domain = get_domain("c-repair")                 # or c-repair/strrev
    env = domain.make_env(domain.task(0), executor)
    env.step("<run>make test</run>")                # compile errors and test failures come back
    env.step('<write path="src/lib.c">...</write><run>make test</run>')
    env.step("<submit/>")                           # hidden tests, reward 1 iff they all pass

Each project is a library (`src/lib.c`, `src/lib.h`) with one seeded bug, a visible test driver
(`tests/visible.c`) and a Makefile whose `test` target builds and runs it; gcc's diagnostics
and the driver's failures are ordinary run output, so compile errors are part of the loop.
Submit judges the model's `src/lib.c` outside the workspace, as code-repair judges a function
(`judge_function`, docs/judging.md): the file is compiled in a fresh sandbox with the task's
original header and a driver for the library's signatures (`harness_wire.c_driver`; the
model's Makefile, headers and test drivers play no part), the hidden check runs in a checker
process outside the sandbox, and each call it makes goes to the driver over a pipe and comes
back as plain data. The expected values never enter the sandbox, so nothing the library does
in its process (constructors, exit calls, prints, reading stdin or memory) can pass the check;
only right answers can. Only the verdict reaches the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcrl.rl.domains.base import ActionSpec, Environment, StepResult, Task
from hpcrl.rl.domains.session_env import SessionDomain, SessionEnv
from hpcrl.rl.domains.toolcalls import SYNTAX
from hpcrl.sandbox.harness_wire import c_driver, parse_signature
from hpcrl.sandbox.judge import FunctionTask

__all__ = ["C_PROBLEMS", "CProblem", "CRepairDomain", "make_c_repair"]

MAKEFILE = """\
# plain ASCII quotes in gcc's diagnostics
export LC_ALL = C
CFLAGS = -std=c11 -O1 -Wall -Isrc

test: tests/visible.c src/lib.c src/lib.h
\tgcc $(CFLAGS) -o visible tests/visible.c src/lib.c -lm
\t./visible
"""


@dataclass(frozen=True)
class CProblem:
    name: str
    statement: str
    header: str  # src/lib.h
    source: str  # src/lib.c, with the bug
    visible: str  # tests/visible.c
    signatures: tuple[str, ...]  # the library's functions for the judge's driver (harness_wire.parse_signature)
    hidden: str  # def check(candidate): ..., the hidden tests, run by the judge (candidate: the first signature)
    reference: str  # src/lib.c fixed

    @property
    def entry_point(self) -> str:

        return parse_signature(self.signatures[0])[1]


def _visible(include: str, body: str) -> str:
    return (
        f'#include <stdio.h>\n#include <string.h>\n#include "lib.h"\n{include}\n'
        "static int fails = 0;\n"
        '#define EXPECT(c) do { if (!(c)) { printf("FAIL %s:%d: %s\\n", __FILE__, __LINE__, #c); fails++; } } '
        "while (0)\n"
        f"int main(void) {{\n{body}"
        '    if (!fails) printf("all visible tests passed\\n");\n    return fails != 0;\n}\n'
    )


C_PROBLEMS: tuple[CProblem, ...] = (
    CProblem(
        "sum-array",
        "sum_array(xs, n) should return the sum of the n ints in xs.",
        "int sum_array(const int *xs, int n);\n",
        '#include "lib.h"\n\nint sum_array(const int *xs, int n) {\n    int s = 0;\n'
        "    for (int i = 1; i < n; i++)\n        s += xs[i];\n    return s;\n}\n",
        _visible("", "    int a[] = {4, 5, 6};\n    EXPECT(sum_array(a, 3) == 15);\n"),
        ("int sum_array(int[] xs, int n)",),
        "def check(candidate):\n    a = [7, -2, 9, 1]\n    assert candidate(a, 4) == 15\n"
        "    assert candidate(a, 0) == 0\n    assert candidate(a, 1) == 7\n",
        '#include "lib.h"\n\nint sum_array(const int *xs, int n) {\n    int s = 0;\n'
        "    for (int i = 0; i < n; i++)\n        s += xs[i];\n    return s;\n}\n",
    ),
    CProblem(
        "strrev",
        "str_reverse(s) should reverse the string s in place.",
        "void str_reverse(char *s);\n",
        '#include <string.h>\n#include "lib.h"\n\nvoid str_reverse(char *s) {\n    size_t n = strlen(s);\n'
        "    for (size_t i = 0; i < n; i++) {\n        char t = s[i];\n        s[i] = s[n - 1 - i];\n"
        "        s[n - 1 - i] = t;\n    }\n}\n",
        _visible("", '    char s[] = "abc";\n    str_reverse(s);\n    EXPECT(strcmp(s, "cba") == 0);\n'),
        ("void str_reverse(str s)",),
        "def check(candidate):\n    assert candidate('hello') == ('olleh',)\n    assert candidate('') == ('',)\n"
        "    assert candidate('ab') == ('ba',)\n",
        '#include <string.h>\n#include "lib.h"\n\nvoid str_reverse(char *s) {\n    size_t n = strlen(s);\n'
        "    for (size_t i = 0; i < n / 2; i++) {\n        char t = s[i];\n        s[i] = s[n - 1 - i];\n"
        "        s[n - 1 - i] = t;\n    }\n}\n",
    ),
    CProblem(
        "max-index",
        "max_index(xs, n) should return the index of the largest element (the first one on ties).",
        "int max_index(const int *xs, int n);\n",
        '#include "lib.h"\n\nint max_index(const int *xs, int n) {\n    int best = 0;\n'
        "    for (int i = 1; i < n; i++)\n        if (xs[i] >= xs[best])\n            best = i;\n"
        "    return best;\n}\n",
        _visible(
            "",
            "    int a[] = {1, 9, 3};\n    EXPECT(max_index(a, 3) == 1);\n    int b[] = {5, 5};\n"
            "    EXPECT(max_index(b, 2) == 0);\n",
        ),
        ("int max_index(int[] xs, int n)",),
        "def check(candidate):\n    assert candidate([-3, -1, -2], 3) == 1\n"
        "    assert candidate([2, 7, 7, 1], 4) == 1\n    assert candidate([-3, -1, -2], 1) == 0\n",
        '#include "lib.h"\n\nint max_index(const int *xs, int n) {\n    int best = 0;\n'
        "    for (int i = 1; i < n; i++)\n        if (xs[i] > xs[best])\n            best = i;\n"
        "    return best;\n}\n",
    ),
    CProblem(
        "count-words",
        "count_words(s) should count the runs of non-space characters in s.",
        "int count_words(const char *s);\n",
        '#include <ctype.h>\n#include "lib.h"\n\nint count_words(const char *s) {\n    int n = 0, in = 0;\n'
        "    for (; *s; s++) {\n        if (isspace((unsigned char)*s))\n            in = 0;\n"
        "        else if (!in)\n            in = 1;\n    }\n    return n\n}\n",
        _visible("", '    EXPECT(count_words("two words") == 2);\n'),
        ("int count_words(str s)",),
        "def check(candidate):\n    assert candidate('') == 0\n    assert candidate('  a  bc d ') == 3\n"
        "    assert candidate('one') == 1\n",
        '#include <ctype.h>\n#include "lib.h"\n\nint count_words(const char *s) {\n    int n = 0, in = 0;\n'
        "    for (; *s; s++) {\n        if (isspace((unsigned char)*s))\n            in = 0;\n"
        "        else if (!in) {\n            in = 1;\n            n++;\n        }\n    }\n    return n;\n"
        "}\n",
    ),
    CProblem(
        "gcd",
        "gcd(a, b) should return the greatest common divisor of two non-negative ints (gcd(0, 0) == 0).",
        "int gcd(int a, int b);\n",
        '#include "lib.h"\n\nint gcd(int a, int b) {\n    while (b != 0) {\n        int t = a / b;\n'
        "        a = b;\n        b = t;\n    }\n    return a;\n}\n",
        _visible("", "    EXPECT(gcd(12, 18) == 6);\n"),
        ("int gcd(int a, int b)",),
        "def check(candidate):\n    assert candidate(17, 5) == 1\n    assert candidate(0, 9) == 9\n"
        "    assert candidate(0, 0) == 0\n    assert candidate(100, 75) == 25\n",
        '#include "lib.h"\n\nint gcd(int a, int b) {\n    while (b != 0) {\n        int t = a % b;\n'
        "        a = b;\n        b = t;\n    }\n    return a;\n}\n",
    ),
    CProblem(
        "binsearch",
        "bsearch_int(xs, n, key) should return an index of key in the sorted array xs, or -1.",
        "int bsearch_int(const int *xs, int n, int key);\n",
        '#include "lib.h"\n\nint bsearch_int(const int *xs, int n, int key) {\n    int lo = 0, hi = n - 1;\n'
        "    while (lo < hi) {\n        int mid = lo + (hi - lo) / 2;\n        if (xs[mid] == key)\n"
        "            return mid;\n        if (xs[mid] < key)\n            lo = mid + 1;\n        else\n"
        "            hi = mid - 1;\n    }\n    return -1;\n}\n",
        _visible(
            "",
            "    int a[] = {1, 3, 5, 7};\n    EXPECT(bsearch_int(a, 4, 5) == 2);\n"
            "    EXPECT(bsearch_int(a, 4, 4) == -1);\n",
        ),
        ("int bsearch_int(int[] xs, int n, int key)",),
        "def check(candidate):\n    a = [2, 4, 6, 8, 10]\n    assert candidate(a, 5, 10) == 4\n"
        "    assert candidate(a, 5, 2) == 0\n    assert candidate(a, 1, 2) == 0\n"
        "    assert candidate(a, 0, 2) == -1\n    assert candidate(a, 5, 7) == -1\n",
        '#include "lib.h"\n\nint bsearch_int(const int *xs, int n, int key) {\n'
        "    int lo = 0, hi = n - 1;\n    while (lo <= hi) {\n        int mid = lo + (hi - lo) / 2;\n"
        "        if (xs[mid] == key)\n            return mid;\n        if (xs[mid] < key)\n"
        "            lo = mid + 1;\n        else\n            hi = mid - 1;\n    }\n    return -1;\n}\n",
    ),
)


class CRepairEnv(SessionEnv):
    """A session episode whose submit has the judge compile src/lib.c with its driver and call it."""

    language = "c"

    def _submit(self) -> StepResult:

        self._step_calls.append("submit")
        d = self.task.data
        got = self._read(["src/lib.c"])
        if isinstance(got, str):
            return self._verdict(False, "error", -1, 0.0, "hidden tests failed", got)
        files = (("lib.c", got["src/lib.c"]), ("lib.h", d["header"]))  # the task's header, not the model's
        name = f"{self.task.domain}/{self.task.id}"
        task = FunctionTask(
            c_driver(d["signatures"]), d["entry_point"], d["hidden"], name=name, files=files, language="c"
        )
        return self._judged(task)


class CRepairDomain(SessionDomain):
    """`c-repair[/problem]`: fix a seeded bug in a small C library, build with make, hidden tests."""

    needs_executor = True
    multi_step = True
    languages = ("c",)
    action = ActionSpec(max_tokens=512, stop=("<submit/>",))

    def __init__(
        self,
        variant: str | None = None,
        max_ops: int = 64,
        run_timeout_s: float = 20.0,
        client_timeout_s: float | None = None,
    ):
        problems = C_PROBLEMS
        if variant:
            problems = tuple(p for p in C_PROBLEMS if p.name == variant)
            if not problems:
                names = ", ".join(p.name for p in C_PROBLEMS)
                raise ValueError(f"c-repair: unknown problem {variant!r}; problems: {names} (or no variant)")
        self.name = f"c-repair/{variant}" if variant else "c-repair"
        self.problems, self.max_ops, self.run_timeout_s = problems, max_ops, run_timeout_s
        self.client_timeout_s = client_timeout_s
        self.size = len(problems)

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        p = self.problems[index % len(self.problems)]
        files = (
            ("Makefile", MAKEFILE),
            ("src/lib.h", p.header),
            ("src/lib.c", p.source),
            ("tests/visible.c", p.visible),
        )
        prompt = (
            f"Fix the bug in this C project, then submit. {p.statement}\n"
            f"Files: {', '.join(path for path, _ in files)}\n"
            "Build and run the visible tests with <run>make test</run>; hidden tests compile src/lib.c and judge "
            "the submission.\n"
            f"Act with tool calls (up to 8 per message, {self.max_ops} in all): {SYNTAX}\n"
        )
        data = {
            "files": [list(f) for f in files],
            "header": p.header,
            "signatures": list(p.signatures),
            "entry_point": p.entry_point,
            "hidden": p.hidden,
            "problem": p.name,
        }
        return Task(self.name, f"{p.name}-{index}", prompt, data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return CRepairEnv(task, executor, self.max_ops, self.run_timeout_s, self.client_timeout_s)

    def task_names(self) -> list[str]:
        return [p.name for p in self.problems]

    def _named_task(self, k: int) -> Task:
        return self.task(k)

    def reference(self, task: Task) -> dict[str, str]:
        p = next(p for p in self.problems if p.name == task.data["problem"])
        return self.workspace(task) | {"src/lib.c": p.reference}


def make_c_repair(variant: str | None) -> CRepairDomain:
    return CRepairDomain(variant)
