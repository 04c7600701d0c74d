"""The floors of the house: which package may import which, and no import circles.

    core/      config, schema, transport, rpc, files, processes: imports nothing else of hpcrl
    sandbox/   slurm/                     import core only
    rl/                                   imports core, sandbox, slurm
    jobs/                                 imports anything (CLI, launching, supervision)
    bench/                                imports anything; nothing imports bench/

Inside rl/ the same holds between its wings (sub-packages): WINGS says which wing may import
which, so the dependencies between them run one way, and no module sits loose in rl/ outside a
wing. No source file is over MAX_LINES lines: split it along a seam when it grows.

Every import counts, including the ones inside functions (kept there for start-up speed): a
lazy import is still a dependency. The root package (`hpcrl`, its version) sits below core.
`python tests/test_architecture.py --dot` prints the floors as a Graphviz graph (`| dot -Tpng`).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "sandbox", "slurm", "rl", "jobs", "bench")
# What each top-level package may import (besides itself and the root package).
ALLOWED = {
    "core": set(),
    "sandbox": {"core"},
    "slurm": {"core"},
    "rl": {"core", "sandbox", "slurm"},
    "jobs": {"core", "sandbox", "slurm", "rl"},
    "bench": {"core", "sandbox", "slurm", "rl", "jobs"},
}
# The wings of rl/ and what each may import (besides itself, the root packages and rl/'s own
# `__init__`), in the order rl/__init__.py lists them: a wing imports only wings before it.
WINGS = {
    "common": set(),
    "record": set(),
    "store": {"record"},
    "model": {"common"},
    "domains": {"common"},
    "coordinator": {"common", "record", "domains"},
    "audit": {"common", "record", "store", "coordinator"},
    "weights": {"common", "model"},
    "rollout": {"common", "record", "store", "model", "domains", "coordinator", "weights"},
    "learner": {"common", "record", "store", "model", "domains", "coordinator", "audit", "weights", "rollout"},
}
MAX_LINES = 500
# Where the line limit applies: the source of every floor and the tests.
SIZED = (*PACKAGES, "tests")


def _modules() -> dict[str, Path]:
    out = {"hpcrl": ROOT / "__init__.py"}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(("hpcrl", *parts))] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import of `name` loads last: itself if it is a module, else its package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> modules of hpcrl it imports (anywhere in its body)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import mod` imports the module when there is one, else a name of pkg.
                targets = [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                if t.split(".")[0] != "hpcrl":
                    continue
                dep = _resolve(t, modules)
                if dep and dep != mod:
                    graph[mod].add(dep)
    return graph


def _floor(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "hpcrl"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        here = _floor(mod)
        for dep in sorted(deps):
            there = _floor(dep)
            if here == "hpcrl" and there != "hpcrl":
                bad.append(f"{mod} -> {dep} (the root package imports nothing)")
            elif there not in ("hpcrl", here) and there not in ALLOWED.get(here, set()):
                bad.append(f"{mod} -> {dep} ({here}/ may import {', '.join(sorted(ALLOWED[here])) or 'nothing'})")
    return bad


def _wing(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "rl" else None


def wing_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports between rl/'s wings that WINGS does not allow, and modules outside any wing."""
    bad = []
    for mod, deps in graph.items():
        here = _wing(mod)
        if _floor(mod) == "rl" and mod != "hpcrl.rl" and here not in WINGS:
            bad.append(f"{mod} is in no wing of rl/ (wings: {', '.join(WINGS)})")
            continue
        for dep in sorted(deps):
            there = _wing(dep)
            if here and there and there != here and there not in WINGS.get(here, set()):
                allowed = ", ".join(sorted(WINGS.get(here, set()))) or "no other wing"
                bad.append(f"{mod} -> {dep} (rl/{here}/ may import {allowed})")
    return bad


def long_files(limit: int = MAX_LINES) -> list[str]:
    out = []
    for pkg in SIZED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > limit:
                out.append(f"{path.relative_to(ROOT)}: {n} lines")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_floors_import_downwards_only():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "modules that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_rl_wings_import_one_way():
    bad = wing_imports(import_graph())
    assert not bad, "imports against the wings of rl/:\n" + "\n".join(bad)


def test_wings_form_no_circle_and_list_their_order():
    # WINGS itself must be one direction: each wing's allowed set only names wings listed before it.
    order = list(WINGS)
    for i, (wing, allowed) in enumerate(WINGS.items()):
        assert allowed <= set(order[:i]), f"rl/{wing}/ may import a wing listed after it: {allowed - set(order[:i])}"
        assert (ROOT / "rl" / wing / "__init__.py").exists(), f"rl/{wing}/ is listed in WINGS but missing"
    on_disk = {p.parent.name for p in (ROOT / "rl").glob("*/__init__.py")}
    assert on_disk == set(WINGS), f"wings on disk and in WINGS differ: {sorted(on_disk ^ set(WINGS))}"


def test_no_source_file_over_the_line_limit():
    found = long_files()
    assert not found, f"files over {MAX_LINES} lines (split them along a seam):\n" + "\n".join(found)


def test_the_checker_sees_an_upward_import_and_a_circle():
    # The rules themselves, on a made-up graph: a test that cannot fail proves nothing.
    graph = {"hpcrl.core.a": {"hpcrl.rl.b"}, "hpcrl.rl.b": {"hpcrl.core.a"}, "hpcrl.jobs.c": {"hpcrl.rl.b"}}
    assert upward_imports(graph) == ["hpcrl.core.a -> hpcrl.rl.b (core/ may import nothing)"]
    assert cycles(graph) == [["hpcrl.core.a", "hpcrl.rl.b"]]
    # Wings: a backward import between wings, a module loose in rl/, bench/ imported from below.
    graph = {
        "hpcrl.rl.record.t": {"hpcrl.rl.learner.l"},
        "hpcrl.rl.learner.l": {"hpcrl.rl.record.t"},
        "hpcrl.rl.loose": set(),
        "hpcrl.jobs.x": {"hpcrl.bench.b"},
    }
    assert wing_imports(graph) == [
        "hpcrl.rl.record.t -> hpcrl.rl.learner.l (rl/record/ may import no other wing)",
        f"hpcrl.rl.loose is in no wing of rl/ (wings: {', '.join(WINGS)})",
    ]
    assert upward_imports(graph) == [
        "hpcrl.jobs.x -> hpcrl.bench.b (jobs/ may import core, rl, sandbox, slurm)",
    ]


def test_the_line_limit_sees_a_long_file():
    assert long_files(limit=0), "every file is over 0 lines"
    assert not long_files(limit=10**9)


def floors_dot(graph: dict[str, set[str]]) -> str:
    """The floors and the imports between them (edge label: how many module-to-module imports),
    each floor listing its sub-packages (the wings of rl/), for `dot -Tpng`."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for mod, deps in graph.items():
        for dep in deps:
            a, b = _floor(mod), _floor(dep)
            if a != b and b != "hpcrl":
                counts[a, b] += 1
    lines = ["digraph floors {", "  rankdir=BT; node [shape=box, fontname=Helvetica]; edge [fontname=Helvetica];"]
    for floor in PACKAGES:
        subs = sorted(
            {
                ".".join(m.split(".")[2:3])
                for m in graph
                if _floor(m) == floor and len(m.split(".")) > 3 and (ROOT / floor / m.split(".")[2]).is_dir()
            }
        )
        label = f"{floor}/" + (f"\\n{', '.join(s + '/' for s in subs)}" if subs else "")
        lines.append(f'  "{floor}" [label="{label}"];')
    lines.append('  { rank=same; "sandbox"; "slurm"; }')
    lines += [f'  "{a}" -> "{b}" [label="{n}"];' for (a, b), n in sorted(counts.items())]
    return "\n".join(lines + ["}"])


if __name__ == "__main__":
    if "--dot" in sys.argv:
        print(floors_dot(import_graph()))
    else:
        g = import_graph()
        print("\n".join(upward_imports(g)) or "floors: ok")
        print("\n".join(wing_imports(g)) or "wings: ok")
        print("\n".join(" <-> ".join(c) for c in cycles(g)) or "circles: none")
        print("\n".join(long_files()) or f"no file over {MAX_LINES} lines")
