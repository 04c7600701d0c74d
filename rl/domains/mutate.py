"""Seeded bugs for Python source: every place an AST mutation applies, as a text edit.

    sites = mutation_sites(source)                # every candidate, in source order
    picked = sample_sites(sites, seed=0, n=20)    # deterministic: the same seed, the same mutants
    buggy = apply(source, picked[0])              # the source with exactly that one change

Kinds (`KINDS`): `operator` (+ <-> -, * <-> //, and <-> or, ...), `comparison` (< <-> <=,
== <-> !=, in <-> not in, ...), `off-by-one` (an int literal n -> n + 1 or n - 1),
`constant` (True <-> False, a string loses its last character) and `deleted-line`
(a one-line statement in a block of several is removed). A mutation is an edit of the text at
the node's position, not an `ast.unparse`, so the mutant keeps the module's comments and layout
and restoring the original is a one-place fix. Docstrings, annotations and `__all__` are never
mutated (those changes do nothing a test could see).
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

__all__ = ["KINDS", "Mutation", "mutation_sites", "sample_sites", "apply"]

KINDS = ("operator", "comparison", "off-by-one", "constant", "deleted-line")

_BINOPS = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "//"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"),
    ast.Mod: ("%", "//"),
    ast.BitAnd: ("&", "|"),
    ast.BitOr: ("|", "&"),
    ast.LShift: ("<<", ">>"),
    ast.RShift: (">>", "<<"),
}
_CMPOPS = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}
_DELETABLE = (ast.Assign, ast.AugAssign, ast.Expr, ast.Return, ast.Raise, ast.Delete, ast.AnnAssign)


@dataclass(frozen=True)
class Mutation:
    """Replace the text from (line, col) to (end_line, end_col) (1-based lines, 0-based columns
    of characters) with `new`; `old` is the text there, checked when applied."""

    kind: str
    line: int
    col: int
    end_line: int
    end_col: int
    old: str
    new: str
    description: str

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, d: dict) -> Mutation:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def _offsets(lines: list[str]) -> list[int]:
    out, pos = [0], 0
    for ln in lines:
        pos += len(ln)
        out.append(pos)
    return out


def apply(source: str, m: Mutation) -> str:
    """The source with `m` applied; ValueError if the text at its place is not `m.old`."""
    starts = _offsets(source.splitlines(keepends=True))
    a, b = starts[m.line - 1] + m.col, starts[m.end_line - 1] + m.end_col
    if source[a:b] != m.old:
        raise ValueError(f"mutation at line {m.line}: expected {m.old!r} there, found {source[a:b]!r}")
    return source[:a] + m.new + source[b:]


def sample_sites(sites: list[Mutation], seed: int, n: int) -> list[Mutation]:
    """Up to `n` of `sites`, the same for the same seed, spread over the kinds (round-robin over
    the kinds' own shuffled lists) so that no single kind crowds out the rest."""
    rng = random.Random(seed)
    by_kind = {k: [s for s in sites if s.kind == k] for k in KINDS}
    for k in KINDS:
        rng.shuffle(by_kind[k])
    out: list[Mutation] = []
    while len(out) < n and any(by_kind.values()):
        for k in KINDS:
            if by_kind[k] and len(out) < n:
                out.append(by_kind[k].pop())
    return sorted(out, key=lambda s: (s.line, s.col, s.kind, s.new))


def mutation_sites(source: str) -> list[Mutation]:
    """Every mutation of every kind that applies to `source`, in source order."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    skip = _unmutated(tree)
    sites: list[Mutation] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            sym, new = _BINOPS[type(node.op)]
            sites += _between(lines, node.left, node.right, sym, new, "operator")
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOPS:
            sym, new = _BINOPS[type(node.op)]
            sites += _between(lines, node.target, node.value, sym + "=", new + "=", "operator")
        elif isinstance(node, ast.BoolOp):
            sym, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            for left, right in zip(node.values, node.values[1:]):
                sites += _between(lines, left, right, sym, new, "operator")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                sym, new = _CMPOPS[type(op)]
                sites += _between(lines, left, right, sym, new, "comparison")
        elif isinstance(node, ast.Constant):
            sites += _constant(lines, node)
        if isinstance(getattr(node, "body", None), list):
            for field in ("body", "orelse", "finalbody"):
                sites += _deletions(lines, getattr(node, field, None) or [], skip)
    return sorted(sites, key=lambda s: (s.line, s.col, s.kind, s.new))


def _unmutated(tree: ast.AST) -> set[int]:
    """ids of nodes (and their subtrees) no test can tell apart when changed."""
    out: set[int] = set()

    def drop(n: ast.AST | None) -> None:
        if n is not None:
            out.update(id(x) for x in ast.walk(n))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                drop(body[0])  # a docstring
        if isinstance(node, (ast.arg, ast.AnnAssign)):
            drop(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
        if isinstance(node, ast.JoinedStr):
            drop(node)  # f-string parts carry the f-string's position, not their own
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            drop(node)
        if isinstance(node, ast.If) and "__main__" in ast.dump(node.test):
            drop(node)
    return out


def _pos(lines: list[str], line: int, col_bytes: int) -> int:
    """The character column of a byte offset (the AST counts UTF-8 bytes)."""
    return len(lines[line - 1].encode()[:col_bytes].decode("utf-8", "replace"))


def _segment(lines: list[str], l1: int, c1: int, l2: int, c2: int) -> str:
    if l1 == l2:
        return lines[l1 - 1][c1:c2]
    return lines[l1 - 1][c1:] + "".join(lines[l1 : l2 - 1]) + lines[l2 - 1][:c2]


def _between(lines, left: ast.AST, right: ast.AST, sym: str, new: str, kind: str) -> list[Mutation]:
    """The operator token between two operands, when the gap holds it and only brackets besides."""
    l1, c1 = left.end_lineno, _pos(lines, left.end_lineno, left.end_col_offset)
    l2, c2 = right.lineno, _pos(lines, right.lineno, right.col_offset)
    gap = _segment(lines, l1, c1, l2, c2)
    if "#" in gap or " ".join(re.sub(r"[()\\]", " ", gap).split()) != sym:
        return []
    m = re.search(r"\s+".join(re.escape(w) for w in sym.split()), gap)
    assert m is not None
    before = gap[: m.start()]
    line = l1 + before.count("\n")
    col = (c1 if line == l1 else 0) + len(before.rpartition("\n")[2])
    return [Mutation(kind, line, col, line, col + len(m.group(0)), m.group(0), new, f"{m.group(0)!r} -> {new!r}")]


def _constant(lines, node: ast.Constant) -> list[Mutation]:
    if node.end_lineno is None:
        return []
    v = node.value
    l1, c1 = node.lineno, _pos(lines, node.lineno, node.col_offset)
    l2, c2 = node.end_lineno, _pos(lines, node.end_lineno, node.end_col_offset)
    old = _segment(lines, l1, c1, l2, c2)

    def m(kind: str, new: str, what: str) -> Mutation:
        return Mutation(kind, l1, c1, l2, c2, old, new, what)

    if isinstance(v, bool):
        return [m("constant", str(not v), f"{v} -> {not v}")]
    if isinstance(v, int):
        out = [m("off-by-one", str(v + 1), f"{v} -> {v + 1}")]
        if v > 0:
            out.append(m("off-by-one", str(v - 1), f"{v} -> {v - 1}"))
        return out
    if isinstance(v, str) and l1 == l2 and len(v) <= 40:
        new = repr(v[:-1]) if v else repr(" ")
        return [m("constant", new, f"{old} -> {new}")]
    return []


def _deletions(lines, body: list[ast.stmt], skip: set[int]) -> list[Mutation]:
    if len(body) < 2:
        return []
    out = []
    for st in body:
        if id(st) in skip or not isinstance(st, _DELETABLE) or st.lineno != st.end_lineno:
            continue
        text = lines[st.lineno - 1]
        code = text.strip()
        c1, c2 = _pos(lines, st.lineno, st.col_offset), _pos(lines, st.lineno, st.end_col_offset)
        if text[:c1].strip() or text[c2:].strip():
            continue  # shares its line with other code (a `;`, a trailing comment)
        out.append(Mutation("deleted-line", st.lineno, 0, st.lineno + 1, 0, text, "", f"deleted {code!r}"))
    return out
