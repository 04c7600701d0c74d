"""The built-in code problems: stdin/stdout synthesis tasks and buggy functions to repair.

Each problem carries a reference solution so tests can prove, through the real sandbox, that
the judge accepts a correct answer (and, for repairs, rejects the buggy one).

A synthesis problem has two sets of cases: `cases`, the feedback cases, of which a failed turn's
observation may show one (its input and expected output); and `hidden`, the reward cases, never
shown: the reward is the share of them the program passes. `SYNTH_HELDOUT` and `REPAIR_HELDOUT`
are problems training never samples (`hpcrl eval` evaluates on them: base.EVAL_BASE).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SynthProblem", "RepairProblem", "SYNTH_PROBLEMS", "SYNTH_HELDOUT", "REPAIR_PROBLEMS", "REPAIR_HELDOUT"]


@dataclass(frozen=True)
class SynthProblem:
    name: str
    statement: str
    cases: tuple[tuple[str, str], ...]  # feedback cases (stdin, expected stdout): a failed turn may show one
    reference: str
    hidden: tuple[tuple[str, str], ...] = ()  # reward cases, never shown


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
        (("7 8\n", "15\n"), ("-3 -4\n", "-7\n"), ("0 0\n", "0\n"), ("123456789 987654321\n", "1111111110\n")),
    ),
    SynthProblem(
        "reverse",
        "Read one line and print it reversed.",
        (("abc\n", "cba\n"), ("racecar\n", "racecar\n"), ("ab cd\n", "dc ba\n")),
        "print(input()[::-1])\n",
        (("hello\n", "olleh\n"), ("a\n", "a\n"), ("12 34\n", "43 21\n"), ("xyz!\n", "!zyx\n")),
    ),
    SynthProblem(
        "count-vowels",
        "Read one line and print how many of its characters are vowels (aeiou, lowercase).",
        (("hello\n", "2\n"), ("xyz\n", "0\n"), ("aeiou aeiou\n", "10\n")),
        "print(sum(c in 'aeiou' for c in input()))\n",
        (("banana\n", "3\n"), ("AEIOU\n", "0\n"), ("queue\n", "4\n"), ("rhythm\n", "0\n")),
    ),
    SynthProblem(
        "max-of-list",
        "Read integers separated by spaces on one line and print the largest.",
        (("3 9 2\n", "9\n"), ("-1 -7\n", "-1\n"), ("5\n", "5\n")),
        "print(max(map(int, input().split())))\n",
        (("1 2 3 4\n", "4\n"), ("-5 -2 -9\n", "-2\n"), ("7 7 7\n", "7\n"), ("100 -100 50\n", "100\n")),
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
        (("1\n", "1\n"), ("3\n", "1\n2\nFizz\n"), ("6\n", "1\n2\nFizz\n4\nBuzz\nFizz\n"), ("0\n", "")),
    ),
    SynthProblem(
        "factorial",
        "Read n (0 <= n <= 20) and print n factorial.",
        (("0\n", "1\n"), ("5\n", "120\n"), ("20\n", "2432902008176640000\n")),
        "import math\nprint(math.factorial(int(input())))\n",
        (("1\n", "1\n"), ("3\n", "6\n"), ("10\n", "3628800\n"), ("12\n", "479001600\n")),
    ),
    SynthProblem(
        "word-count",
        "Read one line and print the number of words (separated by whitespace).",
        (("a b c\n", "3\n"), ("  one   two \n", "2\n"), ("\n", "0\n")),
        "print(len(input().split()))\n",
        (("hello\n", "1\n"), ("a b  c   d\n", "4\n"), ("x y\n", "2\n"), ("   \n", "0\n")),
    ),
    SynthProblem(
        "palindrome",
        "Read one word and print yes if it reads the same backwards, else no.",
        (("level\n", "yes\n"), ("hello\n", "no\n"), ("a\n", "yes\n")),
        "w = input().strip()\nprint('yes' if w == w[::-1] else 'no')\n",
        (("abba\n", "yes\n"), ("abc\n", "no\n"), ("noon\n", "yes\n"), ("ab\n", "no\n")),
    ),
)


# Evaluation only: `task(EVAL_BASE + j)` of synth; training never samples them.
SYNTH_HELDOUT: tuple[SynthProblem, ...] = (
    SynthProblem(
        "sum-list",
        "Read integers separated by spaces on one line and print their sum.",
        (("1 2 3\n", "6\n"), ("-4 4\n", "0\n")),
        "print(sum(map(int, input().split())))\n",
        (("10\n", "10\n"), ("5 5 5 5\n", "20\n"), ("-1 -2 -3\n", "-6\n"), ("100 200\n", "300\n")),
    ),
    SynthProblem(
        "upper",
        "Read one line and print it in upper case.",
        (("abc\n", "ABC\n"), ("Hi there\n", "HI THERE\n")),
        "print(input().upper())\n",
        (("x\n", "X\n"), ("MiXeD 42\n", "MIXED 42\n"), ("already\n", "ALREADY\n"), ("a-b_c\n", "A-B_C\n")),
    ),
    SynthProblem(
        "count-even",
        "Read integers separated by spaces on one line and print how many of them are even.",
        (("1 2 3 4\n", "2\n"), ("5\n", "0\n")),
        "print(sum(int(x) % 2 == 0 for x in input().split()))\n",
        (("2 4 6\n", "3\n"), ("0\n", "1\n"), ("-2 -3\n", "1\n"), ("7 9 11 13\n", "0\n")),
    ),
    SynthProblem(
        "digit-sum",
        "Read a non-negative integer and print the sum of its digits.",
        (("123\n", "6\n"), ("0\n", "0\n")),
        "print(sum(map(int, input().strip())))\n",
        (("9\n", "9\n"), ("1001\n", "2\n"), ("99999\n", "45\n"), ("405\n", "9\n")),
    ),
    SynthProblem(
        "leap-year",
        "Read a year and print yes if it is a leap year in the Gregorian calendar, else no.",
        (("2024\n", "yes\n"), ("2023\n", "no\n")),
        "y = int(input())\nprint('yes' if y % 4 == 0 and (y % 100 != 0 or y % 400 == 0) else 'no')\n",
        (("1900\n", "no\n"), ("2000\n", "yes\n"), ("1996\n", "yes\n"), ("2100\n", "no\n")),
    ),
    SynthProblem(
        "min-max",
        "Read integers separated by spaces on one line and print the smallest and the largest, separated by a space.",
        (("3 1 2\n", "1 3\n"), ("5\n", "5 5\n")),
        "xs = list(map(int, input().split()))\nprint(min(xs), max(xs))\n",
        (("-1 -5 -3\n", "-5 -1\n"), ("0 0\n", "0 0\n"), ("9 2 7 4\n", "2 9\n"), ("100 -100\n", "-100 100\n")),
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


# Evaluation only: `task(EVAL_BASE + j)` of code-repair; training never samples them.
REPAIR_HELDOUT: tuple[RepairProblem, ...] = (
    RepairProblem(
        "wrong-operator",
        "area",
        'def area(w, h):\n    """The area of a w by h rectangle."""\n    return w + h\n',
        "def check(candidate):\n"
        "    assert candidate(2, 3) == 6, 'f(2, 3) should be 6'\n"
        "    assert candidate(1, 1) == 1, 'f(1, 1) should be 1'\n"
        "    assert candidate(0, 5) == 0, 'f(0, 5) should be 0'\n",
        'def area(w, h):\n    """The area of a w by h rectangle."""\n    return w * h\n',
    ),
    RepairProblem(
        "off-by-one-slice",
        "first_n",
        'def first_n(xs, n):\n    """The first n elements of xs."""\n    return xs[:n - 1]\n',
        "def check(candidate):\n"
        "    assert candidate([1, 2, 3], 2) == [1, 2], 'f([1, 2, 3], 2) should be [1, 2]'\n"
        "    assert candidate([1], 1) == [1], 'f([1], 1) should be [1]'\n"
        "    assert candidate([4, 5], 0) == [], 'f([4, 5], 0) should be []'\n",
        'def first_n(xs, n):\n    """The first n elements of xs."""\n    return xs[:n]\n',
    ),
    RepairProblem(
        "inverted-flag",
        "is_empty",
        'def is_empty(s):\n    """True when the string s has no characters."""\n    return len(s) > 0\n',
        "def check(candidate):\n"
        "    assert candidate('') is True, \"f('') should be True\"\n"
        "    assert candidate('a') is False, \"f('a') should be False\"\n",
        'def is_empty(s):\n    """True when the string s has no characters."""\n    return len(s) == 0\n',
    ),
    RepairProblem(
        "wrong-accumulator",
        "product",
        'def product(xs):\n    """The product of the numbers in xs (1 for none)."""\n    p = 0\n    for x in xs:\n'
        "        p *= x\n    return p\n",
        "def check(candidate):\n"
        "    assert candidate([2, 3, 4]) == 24, 'f([2, 3, 4]) should be 24'\n"
        "    assert candidate([]) == 1, 'f([]) should be 1'\n"
        "    assert candidate([-1, 5]) == -5, 'f([-1, 5]) should be -5'\n",
        'def product(xs):\n    """The product of the numbers in xs (1 for none)."""\n    p = 1\n    for x in xs:\n'
        "        p *= x\n    return p\n",
    ),
)
