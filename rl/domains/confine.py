"""Static confinement of a repaired Python module that must share its tests' process.

    reason = confine(original_source, candidate_source)    # None: allowed; else why not

`stdlib-repair` runs a module's own unittest suite in one interpreter with the module under
test, so the module could reach the suite (patch unittest, walk frames to the runner, exit with
status 0). Before anything runs, the candidate is compared with the untouched original and
refused unless it keeps to what the original already does:

* Imports: every import statement is one of the original's.
* Vocabulary: every attribute name it uses is one the original uses or a method of a builtin
  type (str, list, dict...); every new name it introduces is a plain one (no leading
  underscore, no builtin outside the pure ones such as len, sorted, isinstance).
* Reach: a statement (or the header of a def, class, if, for, with, except...) that mentions
  anything that reaches into the interpreter or the process must be one of the original's,
  unchanged, in the same function or class: reflection and dynamic code (getattr, setattr,
  vars, globals, eval, exec, compile, __import__, open, input, exit...), every module the
  original imports by name (sys, os...), dunder names (`__globals__`, `__class__`...), frame,
  traceback, generator and code attributes (`f_back`, `tb_frame`, `gi_frame`, `co_consts`...),
  the process's hooks and exits (`modules`, `stdin`, `_getframe`, `settrace`, `_exit`, `kill`,
  `system`...), and string constants that are such a name, hold a dunder or a `/proc` or
  `/dev/` path (docstrings aside).

So a repair that restores the original passes, and so does one written afresh in plain code
(its own local names, the original's names and attributes, methods of builtin types); one that
adds reflection, imports or exits does not, even where the original has the same construct
elsewhere. A statement of the original with the same text may still be fed other
values by changed statements around it; the runner's runtime checks (stdlib_repair.RUNNER)
are the second line. See docs/judging.md.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["confine"]

# Builtins a repair may use freely: no reflection, no dynamic code, no I/O, no exits.
_SAFE_BUILTINS = frozenset(
    "abs all any ascii bin bool bytearray bytes callable chr classmethod complex dict divmod enumerate filter "
    "float format frozenset hasattr hash hex id int isinstance issubclass iter len list map max min next object "
    "oct ord pow print property range repr reversed round set slice sorted staticmethod str sum super tuple type "
    "zip None True False NotImplemented Ellipsis".split()
) | frozenset(n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException))
_UNSAFE_BUILTINS = frozenset(n for n in dir(builtins) if n not in _SAFE_BUILTINS)
# Methods of the builtin types: attribute names any repair may call.
_SAFE_ATTRS = frozenset(
    n
    for t in (str, bytes, bytearray, list, dict, set, frozenset, tuple, int, float, complex)
    for n in dir(t)
    if not n.startswith("_")
)
# Attribute names that reach into the interpreter or the process, on whatever object.
_SENSITIVE_ATTRS = frozenset(
    """modules stdin stdout stderr __stdin__ _getframe _current_frames exc_info exception last_traceback last_value
    last_type settrace setprofile gettrace getprofile addaudithook audit _exit exit kill killpg abort system popen
    fork forkpty execv execve execl execle execlp execlpe execvp execvpe spawnv spawnve spawnvp spawnvpe spawnl
    spawnle spawnlp spawnlpe posix_spawn posix_spawnp meta_path path_hooks path_importer_cache excepthook
    displayhook breakpointhook unraisablehook setrecursionlimit setswitchinterval get_objects get_referrers
    get_referents register unregister signal alarm setitimer pthread_kill raise_signal dlopen CDLL""".split()
)
_FRAME_PREFIXES = ("f_", "tb_", "gi_", "cr_", "ag_", "co_")
_REFLECTION = frozenset("getattr setattr delattr vars globals locals eval exec compile __import__ breakpoint".split())
# A string constant that names one of these (as getattr's argument would) or a dunder, /proc, /dev/.
_SENSITIVE_TEXT = re.compile(r"__|/proc|/dev/")
_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _sensitive_attr(name: str) -> bool:
    return (
        (name.startswith("__") and name.endswith("__")) or name.startswith(_FRAME_PREFIXES) or name in _SENSITIVE_ATTRS
    )


def _units(tree: ast.Module) -> Iterator[tuple[tuple[str, ...], ast.AST]]:
    """(scope, header) of every statement: the statement with its nested statement lists
    emptied (a def's name, arguments and decorators; an if's test...), and each except handler
    and match case on its own. `scope` is the path of enclosing def and class names."""

    def visit(stmts, scope):
        for st in stmts:
            head = copy.copy(st)
            for f in _BODIES:
                if hasattr(head, f):
                    setattr(head, f, [])
            yield scope, head
            inner = (
                scope + (st.name,) if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
            )
            for f in ("body", "orelse", "finalbody"):
                yield from visit(getattr(st, f, None) or [], inner)
            for h in getattr(st, "handlers", None) or []:
                yield inner, ast.ExceptHandler(type=h.type, name=h.name, body=[])
                yield from visit(h.body, inner)
            for c in getattr(st, "cases", None) or []:
                yield inner, ast.match_case(pattern=c.pattern, guard=c.guard, body=[])
                yield from visit(c.body, inner)

    yield from visit(tree.body, ())


def _identifiers(node: ast.AST) -> Iterator[tuple[str, str]]:
    """(kind, identifier) in a node: name, attr, text (a string constant)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield "name", n.id
        elif isinstance(n, ast.Attribute):
            yield "attr", n.attr
        elif isinstance(n, ast.keyword) and n.arg:
            yield "name", n.arg
        elif isinstance(n, ast.arg):
            yield "name", n.arg
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield "name", n.name
        elif isinstance(n, ast.alias):
            yield "name", n.asname or n.name.split(".")[0]
            yield "attr", n.name
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            yield from (("name", x) for x in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            yield "name", n.name
        elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
            yield "name", n.name
        elif isinstance(n, ast.MatchMapping) and n.rest:
            yield "name", n.rest
        elif isinstance(n, ast.MatchClass):
            yield from (("attr", x) for x in n.kwd_attrs)
        elif isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)):
            text = n.value if isinstance(n.value, str) else n.value.decode("latin-1")
            yield "text", text


@dataclass(frozen=True)
class _Original:
    vocab: frozenset[str]  # every name and attribute it uses
    sensitive_names: frozenset[str]  # unsafe builtins and the modules it imports by name
    imports: frozenset[str]  # its import statements (ast.dump)
    allowed: Counter  # (scope, ast.dump) of its statements that reach into the interpreter -> count


def _hit(ids: list[tuple[str, str]], sensitive_names: frozenset[str]) -> str | None:
    """The first of a statement's identifiers that reaches into the interpreter or the process, if any."""
    for kind, x in ids:
        if kind == "text":
            if _sensitive_attr(x) or x in _REFLECTION or _SENSITIVE_TEXT.search(x):
                return x
        elif _sensitive_attr(x) or (kind == "name" and x in sensitive_names):
            return x
    return None


def _inert(head: ast.AST) -> bool:
    return isinstance(head, ast.Expr) and isinstance(head.value, ast.Constant)  # a docstring


@functools.lru_cache(maxsize=64)
def _original(source: str) -> _Original:
    """What confine needs of an original, once per source (a task's module is checked at every submit)."""
    tree = ast.parse(source)
    imported = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names = _UNSAFE_BUILTINS | frozenset(imported)
    allowed: Counter = Counter(
        (scope, ast.dump(head))
        for scope, head in _units(tree)
        if not _inert(head) and _hit(list(_identifiers(head)), names)
    )
    return _Original(
        frozenset(x for kind, x in _identifiers(tree) if kind != "text"),
        names,
        frozenset(ast.dump(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
        allowed,
    )


def confine(original: str, candidate: str) -> str | None:
    """None when `candidate` keeps within what `original` does (see the module docstring), else
    a one-line reason naming the first thing outside it. A candidate that does not parse is
    left to the tests (it fails them)."""
    orig = _original(original)
    try:
        tree = ast.parse(candidate)
    except (SyntaxError, ValueError):
        return None
    used: Counter = Counter()
    for scope, head in _units(tree):
        if _inert(head):
            continue
        if isinstance(head, (ast.Import, ast.ImportFrom)) and ast.dump(head) not in orig.imports:
            return f"line {head.lineno}: an import the original does not have ({ast.unparse(head)[:80]})"
        ids = list(_identifiers(head))
        for kind, x in ids:
            if kind == "text" or x in orig.vocab:
                continue
            plain = x in _SAFE_ATTRS if kind == "attr" else (x in _SAFE_BUILTINS or bool(_PLAIN.match(x)))
            if not plain or _sensitive_attr(x) or (kind == "name" and x in orig.sensitive_names):
                return f"line {getattr(head, 'lineno', '?')}: {kind} {x!r} is neither the original's nor plain"
        hit = _hit(ids, orig.sensitive_names)
        if hit is None:
            continue
        key = (scope, ast.dump(head))
        used[key] += 1
        if used[key] > orig.allowed[key]:
            where = ".".join(scope) or "module level"
            return (
                f"line {getattr(head, 'lineno', '?')} ({where}): a statement using {hit!r} that is not one of the "
                "original's; statements that reach into the interpreter must stay as they were"
            )
    return None
