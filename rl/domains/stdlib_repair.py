"""`stdlib-repair`: fix a seeded bug in a real standard-library module, judged by its own tests.

    hpcrl domains build stdlib-repair              # once per interpreter and seed (minutes)
    domain = get_domain("stdlib-repair")            # every kept mutant; or stdlib-repair/shlex
    env = domain.make_env(domain.task(0), executor) # a session episode, as session-repair's
    env.step("<run>python3 -m unittest -q test_shlex</run>")

A task is one kept mutant (stdlib_build.py): the workspace holds the mutated module (`shlex.py`)
and its unittest file from CPython's `Lib/test` (`test_shlex.py`). The model runs the tests,
reads the failures, edits and submits. Submit runs the module's full suite in the sandbox
from an untouched copy of the original test file (a model that edits or deletes the tests gains
nothing): reward 1 iff every test passes. The check (`RUNNER`) runs with `python3 -I`, loads the
workspace's module by path under its stdlib name and nothing else from the workspace, and
passes only with exit 0 *and* a nonce read from stdin before the module loads, printed after
the suite's result: a candidate that calls os._exit(0) or prints "OK" fails. (As with
session-repair, code that searches the checker's frames for the nonce could still forge it.)

Held-out split (base.Domain's protocol): the whole family keeps the mutants of whole modules out
of training (`eval_modules`: a fifth of the modules, by hash of the name); `task(0..size-1)`
are the other modules' mutants, `task(EVAL_BASE + j)` the held-out ones (`heldout_size`), so
an evaluation measures repairs of modules the policy never trained on. A one-module variant
(`stdlib-repair/shlex`) has no split.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.rl.domains.base import EVAL_BASE, ActionSpec, Domain, Environment, StepResult, Task
from hpcrl.rl.domains.mutate import Mutation, apply
from hpcrl.rl.domains.session_env import SessionEnv
from hpcrl.rl.domains.toolcalls import SYNTAX

__all__ = ["MODULES", "RUNNER", "StdlibMutant", "StdlibRepairDomain", "cache_dir", "load_manifest"]

# Pure-Python modules whose own unittest file tests the module sitting in the workspace: no C
# accelerator swapped in (bisect, heapq), no import_fresh_module, not imported at interpreter
# or unittest start-up (textwrap, copy, fnmatch, difflib...), no network and no data files
# from Lib/test beyond test.support (which Debian's python3 ships). The build checks each
# original passes in the sandbox and records the ones that do not.
MODULES = (
    "base64",
    "calendar",
    "cgi",
    "cmd",
    "codeop",
    "filecmp",
    "fractions",
    "getopt",
    "glob",
    "graphlib",
    "gzip",
    "mailbox",
    "netrc",
    "optparse",
    "pipes",
    "plistlib",
    "quopri",
    "rlcompleter",
    "sched",
    "secrets",
    "shlex",
    "statistics",
    "string",
    "stringprep",
    "symtable",
    "telnetlib",
    "timeit",
    "xdrlib",
    "zipapp",
)
MUTATOR_VERSION = 1  # part of the cache key: a changed mutator builds a new task list

# The submit check (and the build's): `python3 -I -B CHECK`, the nonce on stdin. -I keeps the
# workspace off sys.path, so only the module under test comes from there; unittest and
# test.support load before it, from the stdlib.
RUNNER = """\
import importlib.util, io, os, sys, unittest
_nonce = sys.stdin.readline().strip()
from test import support  # noqa: F401

def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

_load({module!r}, os.path.join(os.getcwd(), {module!r} + ".py"))
_suite = unittest.defaultTestLoader.loadTestsFromModule(_load({test!r}, os.path.join(os.getcwd(), {path!r})))
_out = io.StringIO()
_result = unittest.TextTestRunner(stream=_out, verbosity=0).run(_suite)
sys.stdout.write(_out.getvalue()[-4000:])
sys.stdout.write("\\ntests run: %d\\n" % _result.testsRun)
if _result.wasSuccessful() and _result.testsRun > 0:
    sys.stdout.write(_nonce + "\\n")
sys.stdout.flush()
os._exit(0 if _result.wasSuccessful() else 1)
"""


def cache_dir(seed: int = 0) -> Path:
    """Where the build keeps its manifest: $HPCRL_CACHE_DIR (default ~/.cache/hpcrl), keyed by the
    interpreter's minor version, the seed and the mutator's version."""
    root = Path(os.environ.get("HPCRL_CACHE_DIR") or Path.home() / ".cache" / "hpcrl")
    v = sys.version_info
    return root / "stdlib-repair" / f"py{v.major}{v.minor}-seed{seed}-m{MUTATOR_VERSION}"


@dataclass(frozen=True)
class StdlibMutant:
    id: str  # "<module>-<n>"
    module: str
    source_path: str  # the original module on this host
    test_path: str  # its unittest file
    mutation: Mutation

    def files(self) -> tuple[tuple[str, str], ...]:
        src = Path(self.source_path).read_text()
        return ((f"{self.module}.py", apply(src, self.mutation)), (self.test_name + ".py", self.test_text()))

    @property
    def test_name(self) -> str:
        return Path(self.test_path).stem

    def test_text(self) -> str:
        return Path(self.test_path).read_text()


def load_manifest(path: Path) -> dict:
    """The build's manifest; ValueError saying how to build it when it is missing or stale."""
    if not path.is_file():
        raise ValueError(
            f"stdlib-repair: no task list at {path}; build it once with `hpcrl domains build stdlib-repair` "
            "(a few minutes; set HPCRL_CACHE_DIR to keep it elsewhere)"
        )
    m = json.loads(path.read_text())
    for name, info in m["modules"].items():
        for key in ("source", "test"):
            digest = hashlib.sha256(Path(info[key]).read_bytes()).hexdigest() if Path(info[key]).is_file() else None
            if info.get("status") == "ok" and digest != info[f"{key}_sha256"]:
                raise ValueError(
                    f"stdlib-repair: {info[key]} ({name}) changed since the task list at {path} was built; "
                    "rebuild it with `hpcrl domains build stdlib-repair --force`"
                )
    return m


def mutants_of(manifest: dict) -> list[StdlibMutant]:
    mods = manifest["modules"]
    return [
        StdlibMutant(
            e["id"], e["module"], mods[e["module"]]["source"], mods[e["module"]]["test"], Mutation.from_json(e)
        )
        for e in manifest["mutants"]
    ]


class StdlibRepairEnv(SessionEnv):
    """A session episode whose submit runs the module's original test suite (RUNNER)."""

    def _submit(self) -> StepResult:
        d, tag = self.task.data, secrets.token_hex(8)
        check, tests = f".check_{tag}.py", f".check_{tag}_{d['test']}.py"  # names the model cannot have taken
        files = [(tests, d["test_text"]), (check, RUNNER.format(module=d["module"], test=d["test"], path=tests))]
        return self._hidden_check(files, ["python3", "-I", "-B", check], d["timeout_s"], what="tests")


def _held_out(module: str) -> bool:
    return int(hashlib.sha256(module.encode()).hexdigest(), 16) % 5 == 0


class StdlibRepairDomain(Domain):
    """`stdlib-repair[/module or mutant id]`: one task per kept mutant of the built task list."""

    needs_executor = True
    multi_step = True
    languages = ("python",)
    action = ActionSpec(max_tokens=1024, stop=("<submit/>",))

    def __init__(
        self,
        variant: str | None = None,
        manifest: Path | None = None,
        max_ops: int = 64,
        run_timeout_s: float = 30.0,
        client_timeout_s: float | None = None,
    ):
        self.manifest_path = manifest or cache_dir() / "manifest.json"
        self.manifest = load_manifest(self.manifest_path)
        mutants = mutants_of(self.manifest)
        if variant:
            mutants = [m for m in mutants if variant in (m.module, m.id)]
            if not mutants:
                mods = sorted({m.module for m in mutants_of(self.manifest)})
                raise ValueError(
                    f"stdlib-repair: no module or mutant {variant!r} in {self.manifest_path}; "
                    f"modules: {', '.join(mods)}"
                )
        self.name = f"stdlib-repair/{variant}" if variant else "stdlib-repair"
        self.max_ops, self.run_timeout_s, self.client_timeout_s = max_ops, run_timeout_s, client_timeout_s
        # The whole family holds out whole modules; one module (a variant) trains on all of it.
        held = {m.module for m in mutants if _held_out(m.module)} if not variant else set()
        self.eval_modules = tuple(sorted(held))
        self.mutants = [m for m in mutants if m.module not in held]  # task(0..size-1)
        self.heldout = [m for m in mutants if m.module in held]  # task(EVAL_BASE + j)
        self.size = len(self.mutants)
        self.heldout_size = len(self.heldout) or None

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        if index >= EVAL_BASE and self.heldout:
            m = self.heldout[(index - EVAL_BASE) % len(self.heldout)]
        else:
            m = self.mutants[index % len(self.mutants)]
        files = m.files()
        run = shlex.join(["python3", "-m", "unittest", "-q", m.test_name])
        prompt = (
            f"{m.module}.py, the Python standard library's {m.module} module, has one bug. Find it with its tests, "
            f"fix {m.module}.py, then submit. Run the tests with <run>{run}</run>; at submit an untouched copy of "
            f"{m.test_name}.py judges the module (every test must pass).\n"
            f"Files: {m.module}.py, {m.test_name}.py\n"
            f"Act with tool calls (up to 8 per message, {self.max_ops} in all): {SYNTAX}\n"
        )
        data = {
            "files": [list(f) for f in files],
            "module": m.module,
            "test": m.test_name,
            "test_text": files[1][1],
            "mutant": m.id,
            "kind": m.mutation.kind,
            "timeout_s": float(self.manifest["modules"][m.module].get("timeout_s", self.run_timeout_s)),
        }
        return Task(self.name, f"{m.id}-{index}", prompt, data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return StdlibRepairEnv(task, executor, self.max_ops, self.run_timeout_s, self.client_timeout_s)
