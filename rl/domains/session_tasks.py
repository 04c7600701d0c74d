"""The tasks of `session-repair`: small multi-file Python projects, each with one seeded bug.

Every task has the project's files (a package with the bug, and a visible unittest file the
model may run as often as it likes) and a hidden check: more cases, run only at submit, whose
expected values never reach the model (the episode ends with the verdict). A check is a
`check(candidate)` run by the judge outside the sandbox (hpcrl.sandbox.judge): the package's
files are copied from the workspace into a fresh sandbox, and each call the check makes
(`candidate(...)` for `entry_point`, `function("pkg.mod.func")(...)` for others) goes there
over a pipe and comes back as plain data. `reference` is a known-good fix (`hpcrl domains
tasks session-repair --reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SessionProblem", "SESSION_PROBLEMS", "VISIBLE_CMD"]

# The visible tests: stdlib unittest's discovery (test*.py in the workspace), no pytest needed.
VISIBLE_CMD = ("python3", "-m", "unittest", "-q")


@dataclass(frozen=True)
class SessionProblem:
    name: str
    statement: str
    files: tuple[tuple[str, str], ...]  # (path, content) written at reset
    entry_point: str  # the function `check(candidate)` gets, dotted: "stats.median"
    hidden: str  # def check(candidate): ..., run by the judge at submit
    reference: tuple[tuple[str, str], ...]  # a fix: the files it changes, (path, content)

    @property
    def packages(self) -> tuple[str, ...]:
        """The project's package directories: what the judge copies from the workspace."""
        return tuple(sorted({path.split("/")[0] for path, _ in self.files if "/" in path}))


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
        "stats.median",
        "def check(candidate):\n    assert candidate([5, 3, 1, 4]) == 3.5\n    assert candidate([9]) == 9\n"
        "    assert candidate([2, 1, 3, 7, 0]) == 2\n    assert function('stats.mean')([1, 2]) == 1.5\n",
        (
            (
                "stats/core.py",
                "def mean(xs):\n    return sum(xs) / len(xs)\n\n\n"
                "def median(xs):\n    xs = sorted(xs)\n    n = len(xs)\n"
                "    mid = n // 2\n    if n % 2:\n        return xs[mid]\n    return (xs[mid - 1] + xs[mid]) / 2\n",
            ),
        ),
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
        "textkit.slugify",
        "def check(candidate):\n    assert candidate('  A  b C ') == 'a-b-c'\n    assert candidate('x') == 'x'\n",
        (("textkit/slug.py", 'def slugify(s):\n    return "-".join(s.lower().split())\n'),),
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
        "shop.cart.total",
        "def check(candidate):\n    assert candidate([('apple', 1), ('pear', 3)]) == 18\n"
        "    assert candidate([]) == 0\n",
        (
            (
                "shop/cart.py",
                "from shop.prices import PRICES\n\n\ndef total(items):\n"
                '    """items: a list of (name, quantity)."""\n'
                "    return sum(PRICES[name] * qty for name, qty in items)\n",
            ),
        ),
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
        "geom.intervals.merge",
        "def check(candidate):\n    assert candidate([(5, 6), (1, 2), (2, 4)]) == [(1, 4), (5, 6)]\n"
        "    assert candidate([]) == []\n    assert candidate([(1, 10), (2, 3)]) == [(1, 10)]\n",
        (
            (
                "geom/intervals.py",
                "def merge(intervals):\n    out = []\n    for lo, hi in sorted(intervals):\n"
                "        if out and lo <= out[-1][1]:\n            out[-1] = (out[-1][0], max(out[-1][1], hi))\n"
                "        else:\n            out.append((lo, hi))\n    return out\n",
            ),
        ),
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
        "codec.rle.decode",
        "def check(candidate):\n    encode = function('codec.rle.encode')\n"
        "    for s in ['', 'x', 'ab' * 3, 'z' * 31 + 'yy']:\n        assert candidate(encode(s)) == s, s\n",
        (
            (
                "codec/rle.py",
                "import re\n\n\ndef encode(s):\n"
                "    return ''.join(f'{len(m.group(0))}{m.group(1)}' for m in re.finditer(r'(.)\\1*', s))\n"
                "\n\ndef decode(s):\n    return ''.join(c * int(n) for n, c in re.findall(r'(\\d+)(\\D)', s))\n",
            ),
        ),
    ),
)
