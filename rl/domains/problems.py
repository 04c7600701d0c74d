"""The built-in code problems: stdin/stdout synthesis tasks and buggy functions to repair.

Each problem carries a reference solution so tests can prove, through the real sandbox, that
the judge accepts a correct answer (and, for repairs, rejects the buggy one).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SynthProblem", "RepairProblem", "SYNTH_PROBLEMS", "REPAIR_PROBLEMS"]


@dataclass(frozen=True)
class SynthProblem:
    name: str
    statement: str
    cases: tuple[tuple[str, str], ...]  # (stdin, expected stdout)
    reference: str


@dataclass(frozen=True)
class RepairProblem:
    name: str
    entry_point: str
    buggy: str
    test: str  # defines check(candidate); runs in the judge, never in the sandbox
    reference: str


SYNTH_PROBLEMS: tuple[SynthProblem, ...] = (
    SynthProblem(
        "sum-two",
        "Read two integers on one line and print their sum.",
        (("1 2\n", "3\n"), ("-5 5\n", "0\n"), ("100 23\n", "123\n")),
        "a, b = map(int, input().split())\nprint(a + b)\n",
    ),
    SynthProblem(
        "reverse",
        "Read one line and print it reversed.",
        (("abc\n", "cba\n"), ("racecar\n", "racecar\n"), ("ab cd\n", "dc ba\n")),
        "print(input()[::-1])\n",
    ),
    SynthProblem(
        "count-vowels",
        "Read one line and print how many of its characters are vowels (aeiou, lowercase).",
        (("hello\n", "2\n"), ("xyz\n", "0\n"), ("aeiou aeiou\n", "10\n")),
        "print(sum(c in 'aeiou' for c in input()))\n",
    ),
    SynthProblem(
        "max-of-list",
        "Read integers separated by spaces on one line and print the largest.",
        (("3 9 2\n", "9\n"), ("-1 -7\n", "-1\n"), ("5\n", "5\n")),
        "print(max(map(int, input().split())))\n",
    ),
    SynthProblem(
        "fizzbuzz",
        "Read n and print 1..n, one per line, with Fizz for multiples of 3, Buzz of 5, FizzBuzz of both.",
        (
            ("5\n", "1\n2\nFizz\n4\nBuzz\n"),
            ("15\n", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n"),
        ),
        "n = int(input())\nfor i in range(1, n + 1):\n"
        "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)\n",
    ),
    SynthProblem(
        "factorial",
        "Read n (0 <= n <= 20) and print n factorial.",
        (("0\n", "1\n"), ("5\n", "120\n"), ("20\n", "2432902008176640000\n")),
        "import math\nprint(math.factorial(int(input())))\n",
    ),
    SynthProblem(
        "word-count",
        "Read one line and print the number of words (separated by whitespace).",
        (("a b c\n", "3\n"), ("  one   two \n", "2\n"), ("\n", "0\n")),
        "print(len(input().split()))\n",
    ),
    SynthProblem(
        "palindrome",
        "Read one word and print yes if it reads the same backwards, else no.",
        (("level\n", "yes\n"), ("hello\n", "no\n"), ("a\n", "yes\n")),
        "w = input().strip()\nprint('yes' if w == w[::-1] else 'no')\n",
    ),
)


REPAIR_PROBLEMS: tuple[RepairProblem, ...] = (
    RepairProblem(
        "off-by-one-sum",
        "sum_to",
        'def sum_to(n):\n    """Return 1 + 2 + ... + n."""\n    return sum(range(n))\n',
        "def check(candidate):\n"
        "    assert candidate(1) == 1, 'f(1) should be 1'\n"
        "    assert candidate(4) == 10, 'f(4) should be 10'\n"
        "    assert candidate(0) == 0, 'f(0) should be 0'\n",
        'def sum_to(n):\n    """Return 1 + 2 + ... + n."""\n    return sum(range(n + 1))\n',
    ),
    RepairProblem(
        "wrong-compare",
        "is_adult",
        'def is_adult(age):\n    """True when age is 18 or more."""\n    return age > 18\n',
        "def check(candidate):\n"
        "    assert candidate(18) is True, 'f(18) should be True'\n"
        "    assert candidate(17) is False, 'f(17) should be False'\n"
        "    assert candidate(40) is True, 'f(40) should be True'\n",
        'def is_adult(age):\n    """True when age is 18 or more."""\n    return age >= 18\n',
    ),
    RepairProblem(
        "mutable-default",
        "append_one",
        'def append_one(xs=[]):\n    """Return a new list: xs followed by 1."""\n    xs.append(1)\n    return xs\n',
        "def check(candidate):\n"
        "    assert candidate([2]) == [2, 1], 'f([2]) should be [2, 1]'\n"
        "    assert candidate() == [1], 'f() should be [1]'\n"
        "    assert candidate() == [1], 'f() should be [1]'\n",
        'def append_one(xs=None):\n    """Return a new list: xs followed by 1."""\n    return list(xs or []) + [1]\n',
    ),
    RepairProblem(
        "integer-division",
        "mean",
        'def mean(xs):\n    """The arithmetic mean of a non-empty list."""\n    return sum(xs) // len(xs)\n',
        "def check(candidate):\n"
        "    assert candidate([1, 2]) == 1.5, 'f([1, 2]) should be 1.5'\n"
        "    assert candidate([4]) == 4, 'f([4]) should be 4'\n",
        'def mean(xs):\n    """The arithmetic mean of a non-empty list."""\n    return sum(xs) / len(xs)\n',
    ),
    RepairProblem(
        "name-error",
        "greet",
        "def greet(name):\n    \"\"\"Return 'Hello, <name>!'.\"\"\"\n    return 'Hello, ' + nme + '!'\n",
        "def check(candidate):\n    assert candidate('Ada') == 'Hello, Ada!', \"f('Ada') should be 'Hello, Ada!'\"\n",
        "def greet(name):\n    \"\"\"Return 'Hello, <name>!'.\"\"\"\n    return 'Hello, ' + name + '!'\n",
    ),
    RepairProblem(
        "wrong-index",
        "last",
        'def last(xs):\n    """The last element of a non-empty list."""\n    return xs[len(xs)]\n',
        "def check(candidate):\n"
        "    assert candidate([1, 2, 3]) == 3, 'f([1, 2, 3]) should be 3'\n"
        "    assert candidate(['a']) == 'a', \"f(['a']) should be 'a'\"\n",
        'def last(xs):\n    """The last element of a non-empty list."""\n    return xs[-1]\n',
    ),
    RepairProblem(
        "reversed-condition",
        "evens",
        'def evens(xs):\n    """The even numbers of xs, in order."""\n    return [x for x in xs if x % 2]\n',
        "def check(candidate):\n"
        "    assert candidate([1, 2, 3, 4]) == [2, 4], 'f([1, 2, 3, 4]) should be [2, 4]'\n"
        "    assert candidate([]) == [], 'f([]) should be []'\n",
        'def evens(xs):\n    """The even numbers of xs, in order."""\n    return [x for x in xs if x % 2 == 0]\n',
    ),
    RepairProblem(
        "missing-return",
        "square",
        'def square(x):\n    """x squared."""\n    x * x\n',
        "def check(candidate):\n"
        "    assert candidate(3) == 9, 'f(3) should be 9'\n"
        "    assert candidate(-2) == 4, 'f(-2) should be 4'\n",
        'def square(x):\n    """x squared."""\n    return x * x\n',
    ),
)
