"""The tasks of `session-repair`: small multi-file Python projects, each with one seeded bug.

Every task has the project's files (a package with the bug, and a visible unittest file the
model may run as often as it likes) and a hidden check: more cases, run only at submit, whose
expected values never reach the model (the episode ends with the verdict). A check is its
body's asserts inside `HIDDEN_HARNESS`, which imports the model's code from the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SessionProblem", "SESSION_PROBLEMS", "HIDDEN_HARNESS", "VISIBLE_CMD"]

# The visible tests: stdlib unittest's discovery (test*.py in the workspace), no pytest needed.
VISIBLE_CMD = ("python3", "-m", "unittest", "-q")

# The hidden check runs with -I (no workspace on sys.path before the stdlib's, no
# PYTHON* variables), so a file the model wrote (unittest.py, sitecustomize.py) cannot stand in
# for a standard module. Passing needs exit 0 *and* the nonce, which comes on stdin and is read
# before the model's code is imported: a candidate calling os._exit(0) or printing "ok" at
# import fails. (A candidate that inspects the checker's frames could still find it; this
# domain exercises the episode loop, it is not a hardened judge like code-repair's.)
HIDDEN_HARNESS = """\
import os, sys
_nonce = sys.stdin.readline().strip()
sys.path.append(os.getcwd())
{body}
print(_nonce)
"""


@dataclass(frozen=True)
class SessionProblem:
    name: str
    statement: str
    files: tuple[tuple[str, str], ...]  # (path, content) written at reset
    hidden: str  # the check's body (asserts), run at submit inside HIDDEN_HARNESS


SESSION_PROBLEMS: tuple[SessionProblem, ...] = (
    SessionProblem(
        "median",
        "stats.median gives wrong answers for unsorted input.",
        (
            ("stats/__init__.py", "from stats.core import mean, median\n"),
            (
                "stats/core.py",
                "def mean(xs):\n    return sum(xs) / len(xs)\n\n\n"
                "def median(xs):\n    n = len(xs)\n    mid = n // 2\n    if n % 2:\n        return xs[mid]\n"
                "    return (xs[mid - 1] + xs[mid]) / 2\n",
            ),
            (
                "test_stats.py",
                "import unittest\n\nfrom stats import mean, median\n\n\nclass T(unittest.TestCase):\n"
                "    def test_mean(self):\n        self.assertEqual(mean([1, 2, 3]), 2)\n\n"
                "    def test_median(self):\n        self.assertEqual(median([3, 1, 2]), 2)\n",
            ),
        ),
        "from stats import median\nassert median([5, 3, 1, 4]) == 3.5\nassert median([9]) == 9\n"
        "assert median([2, 1, 3, 7, 0]) == 2\n",
    ),
    SessionProblem(
        "slugify",
        "textkit.slugify should give lowercase words joined by '-'.",
        (
            ("textkit/__init__.py", "from textkit.slug import slugify\n"),
            ("textkit/slug.py", 'def slugify(s):\n    return "-".join(s.split())\n'),
            (
                "test_slug.py",
                "import unittest\n\nfrom textkit import slugify\n\n\nclass T(unittest.TestCase):\n"
                "    def test_words(self):\n        self.assertEqual(slugify('Hello World'), 'hello-world')\n",
            ),
        ),
        "from textkit import slugify\nassert slugify('  A  b C ') == 'a-b-c'\nassert slugify('x') == 'x'\n",
    ),
    SessionProblem(
        "cart-total",
        "shop.cart.total should charge every item's price times its quantity.",
        (
            ("shop/__init__.py", ""),
            ("shop/prices.py", 'PRICES = {"apple": 3, "pear": 5}\n'),
            (
                "shop/cart.py",
                "from shop.prices import PRICES\n\n\ndef total(items):\n"
                '    """items: a list of (name, quantity)."""\n'
                "    return sum(PRICES[name] for name, qty in items)\n",
            ),
            (
                "test_cart.py",
                "import unittest\n\nfrom shop.cart import total\n\n\nclass T(unittest.TestCase):\n"
                "    def test_quantity(self):\n        self.assertEqual(total([('apple', 2)]), 6)\n",
            ),
        ),
        "from shop.cart import total\nassert total([('apple', 1), ('pear', 3)]) == 18\nassert total([]) == 0\n",
    ),
    SessionProblem(
        "merge-intervals",
        "geom.intervals.merge should merge overlapping and touching intervals.",
        (
            ("geom/__init__.py", ""),
            (
                "geom/intervals.py",
                "def merge(intervals):\n    out = []\n    for lo, hi in sorted(intervals):\n"
                "        if out and lo < out[-1][1]:\n            out[-1] = (out[-1][0], max(out[-1][1], hi))\n"
                "        else:\n            out.append((lo, hi))\n    return out\n",
            ),
            (
                "test_intervals.py",
                "import unittest\n\nfrom geom.intervals import merge\n\n\nclass T(unittest.TestCase):\n"
                "    def test_touching(self):\n        self.assertEqual(merge([(1, 3), (3, 5)]), [(1, 5)])\n",
            ),
        ),
        "from geom.intervals import merge\nassert merge([(5, 6), (1, 2), (2, 4)]) == [(1, 4), (5, 6)]\n"
        "assert merge([]) == []\nassert merge([(1, 10), (2, 3)]) == [(1, 10)]\n",
    ),
    SessionProblem(
        "rle",
        "codec.rle.decode should invert encode, also for runs of ten or more.",
        (
            ("codec/__init__.py", ""),
            (
                "codec/rle.py",
                "def encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
                "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
                '        out.append(f"{j - i}{s[i]}")\n        i = j\n    return "".join(out)\n\n\n'
                "def decode(s):\n    out = []\n    for k in range(0, len(s), 2):\n"
                '        out.append(s[k + 1] * int(s[k]))\n    return "".join(out)\n',
            ),
            (
                "test_rle.py",
                "import unittest\n\nfrom codec.rle import decode, encode\n\n\nclass T(unittest.TestCase):\n"
                "    def test_long_run(self):\n        s = 'a' * 12 + 'b'\n"
                "        self.assertEqual(decode(encode(s)), s)\n",
            ),
        ),
        "from codec.rle import decode, encode\nfor s in ['', 'x', 'ab' * 3, 'z' * 31 + 'yy']:\n"
        "    assert decode(encode(s)) == s, s\n",
    ),
)
