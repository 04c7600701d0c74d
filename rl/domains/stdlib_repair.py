"""`stdlib-repair`: fix a seeded bug in a real standard-library module, judged by its own tests.

    hpcrl domains build stdlib-repair              # once per interpreter and seed (minutes)
    domain = get_domain("stdlib-repair")            # every kept mutant; or stdlib-repair/shlex
    env = domain.make_env(domain.task(0), executor) # a session episode, as session-repair's
    env.step("<run>python3 -m unittest -q test_shlex</run>")

A task is one kept mutant (stdlib_build.py): the workspace holds the mutated module (`shlex.py`)
and its unittest file from CPython's `Lib/test` (`test_shlex.py`). The model runs the tests,
reads the failures, edits and submits.

Submit judges the module alone, outside the workspace. The module's own suite has to import it
into its process, so the check confines what the module may be before and while it runs (see
docs/judging.md):

1. Statically (`confine.py`), before anything runs: only `<module>.py` is taken from the
   workspace; no import, name or attribute the original does not have, and every statement
   that reaches into the interpreter or the process (reflection, frames, sys, os, exits...) is
   one of the original's, unchanged. A module outside these gets reward 0 without a run.
2. In a fresh sandbox, the module, an untouched copy of the original test file and the runner
   (`RUNNER`, under `python3 -I`): the runner reads a fresh nonce from stdin into a local of its
   own function and replaces stdin with /dev/null before the module loads; an audit hook it
   installs first (it cannot be removed) ends the process, failing, when code of the module is
   on the stack while frames, code objects or the garbage collector's objects are reached,
   hooks or tracers set, processes started or signalled, or /proc and the standard streams
   opened, or code other than the standard library's (the module's, or code evaluated for it)
   runs exec or eval, calls sys._getframe or sets a function's code; and the runner refuses a
   result when unittest's classes changed while it ran.
3. Pass: the runner's process exits 0 and the nonce is the last thing it printed; the runner
   prints it only after every test of the suite ran and passed. An exit from inside the module
   (os._exit, a killed process) comes before the nonce; printing "OK" does nothing.

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

from hpcrl.rl.domains.base import EVAL_BASE, ActionSpec, Environment, StepResult, Task
from hpcrl.rl.domains.code import sandbox_outcome
from hpcrl.rl.domains.confine import confine
from hpcrl.rl.domains.mutate import Mutation, apply
from hpcrl.rl.domains.session_env import SessionDomain, SessionEnv
from hpcrl.rl.domains.toolcalls import SYNTAX
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile

__all__ = ["MODULES", "RUNNER", "StdlibMutant", "StdlibRepairDomain", "cache_dir", "check_spec", "load_manifest"]

# Pure-Python modules whose own unittest file tests the module sitting in the workspace: no C
# accelerator swapped in (bisect, heapq), no import_fresh_module, not imported at interpreter
# or unittest start-up (textwrap, copy, fnmatch, difflib...), no network and no data files
# from Lib/test beyond test.support (which Debian's python3 ships), and none whose own code runs
# code or starts processes (timeit, pipes, rlcompleter: the submit check's confinement refuses
# them). The build checks each original passes in the sandbox and records the ones that do not.
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
    "plistlib",
    "quopri",
    "sched",
    "secrets",
    "shlex",
    "statistics",
    "string",
    "stringprep",
    "symtable",
    "telnetlib",
    "xdrlib",
    "zipapp",
)
# Part of the cache key: a changed mutator or submit check builds a new task list (the build
# keeps the mutants the check fails and the modules whose original passes it).
MUTATOR_VERSION = 2

# The submit check (and the build's): `python3 -I -B check.py` in a fresh sandbox, the nonce on
# stdin. -I keeps the work dir off sys.path: the module under test is loaded by path under its
# stdlib name, unittest and test.support from the stdlib, before it.
RUNNER = """\
import os, sys

_DENY = frozenset((
    "sys._getframe", "sys._current_frames", "object.__getattr__", "object.__setattr__", "object.__delattr__",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile",
    "sys.addaudithook", "exec", "code.__new__", "function.__new__", "builtins.input", "os.system", "os.exec",
    "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "subprocess.Popen",
    "signal.pthread_kill", "pty.spawn", "cpython.run_command", "cpython.run_file", "cpython.run_module",
))
_SELF = frozenset(("exec", "sys._getframe", "object.__setattr__", "object.__delattr__"))
# Standard-library code that hands the frames it fetches to its caller: never exempt.
_LEAKY = ("inspect.py", "traceback.py", "logging/__init__.py", "bdb.py", "pdb.py", "cgitb.py", "trace.py")


def _main(_exit=os._exit, _write=os.write, _getframe=sys._getframe):
    nonce = os.read(0, 256).split(b"\\n")[0].strip()  # before anything of the module's exists
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out = os.dup(1)
    os.dup2(2, 1)  # the suite's and the module's prints go to stderr; the verdict alone to `out`
    import importlib.util, io, unittest
    from test import support  # noqa: F401
    where = os.getcwd()
    candidate = os.path.join(where, {module!r} + ".py")
    stdlib = os.path.dirname(os.__file__) + os.sep
    watched = (unittest.TestCase, unittest.TestResult, unittest.TextTestResult, unittest.TextTestRunner,
               unittest.TestSuite, unittest.TestLoader, unittest.case._Outcome)
    def state():  # what the suite's verdict rests on: unittest's classes and their functions' code
        return [(c, k, v, getattr(v, "__code__", None)) for c in watched for k, v in vars(c).items()]

    before = state()
    was_successful = unittest.TestResult.wasSuccessful
    busy = []

    def hook(event, args):
        if busy:
            return
        if event == "open":
            path = args[0]
            if isinstance(path, bytes):
                path = path.decode("latin-1")
            if not (isinstance(path, int) and path < 3 or isinstance(path, str) and (
                    path.startswith(("/proc", "/dev/fd", "/dev/std")) or "/proc/" in path)):
                return
        elif event not in _DENY and not event.startswith("ctypes."):
            return
        busy.append(1)
        try:
            f = _getframe(1)
            # exec/eval, sys._getframe and setting a function's code or defaults are the standard
            # library's own business when its code does them (namedtuple's eval, its _getframe
            # for __module__ and its __defaults__, an import running a module's code), unless it
            # hands frames on (inspect, traceback...); done by any other code (the module's, code
            # it had evaluated), and everything else, they are refused while the module's code
            # is anywhere on the stack.
            caller = f.f_code.co_filename if f is not None else ""
            if event in _SELF and caller.startswith((stdlib, "<frozen ")) and not caller.endswith(_LEAKY):
                return
            while f is not None:
                if f.f_code.co_filename == candidate:
                    _write(2, ("\\nrefused: the module under test did %s\\n" % event).encode())
                    _exit(4)
                f = f.f_back
        finally:
            busy.pop()

    sys.addaudithook(hook)

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    ok = False
    try:
        load({module!r}, candidate)
        suite = unittest.defaultTestLoader.loadTestsFromModule(load({test!r}, os.path.join(where, {path!r})))
        stream = io.StringIO()
        result = unittest.TextTestRunner(stream=stream, verbosity=0).run(suite)
        sys.stderr.write(stream.getvalue()[-4000:])
        after = state()
        intact = len(after) == len(before) and all(x is y for a, b in zip(after, before) for x, y in zip(a, b))
        if not intact:
            _write(2, b"\\nrefused: unittest's classes changed while the suite ran\\n")
        ok = intact and was_successful(result) and result.testsRun > 0
    except BaseException as exc:
        _write(2, ("\\nthe check did not complete: %s: %s\\n" % (type(exc).__name__, exc)).encode()[:2000])
    if ok and len(nonce) == 32:
        _write(out, b"tests run: %d\\n%s\\n" % (result.testsRun, nonce))
    _exit(0 if ok else 1)


_main()
"""


def check_spec(module: str, test: str, source: str, test_text: str, nonce: str, timeout_s: float):
    """The submit check of `source` as one sandbox execution: the runner, the module, a copy of
    its test file; `nonce` on stdin (hpcrl.sandbox.spec.ExecSpec)."""

    files = (
        SourceFile("main.sh", "exec python3 -I -B check.py\n"),
        SourceFile("check.py", RUNNER.format(module=module, test=test, path=f"{test}.py")),
        SourceFile(f"{module}.py", source),
        SourceFile(f"{test}.py", test_text),
    )
    return ExecSpec(language="bash", files=files, stdin=nonce + "\n", limits=Limits(wall_s=timeout_s, cpu_s=timeout_s))


def check_verdict(result, nonce: str) -> tuple[str, str]:
    """('pass' | 'fail' | 'timeout' | 'error', detail) of a check_spec run's ExecResult."""
    if result.status == "sandbox_error":
        return "error", result.stderr.decode(errors="replace")[-300:]
    if result.status == "timeout":
        return "timeout", "the tests did not finish within the time limit"
    ok = result.status == "ok" and result.exit_code == 0 and result.stdout.split()[-1:] == [nonce.encode()]
    lines = result.stderr.decode(errors="replace").strip().splitlines()
    return ("pass" if ok else "fail"), (lines[-1][:300] if lines else result.status)


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
    """A session episode whose submit runs the module's original test suite (see the module docstring)."""

    def _submit(self) -> StepResult:
        self._step_calls.append("submit")
        d = self.task.data
        got = self._read([f"{d['module']}.py"])
        if isinstance(got, str):
            return self._verdict(False, "error", -1, 0.0, "tests failed", got)
        source = got[f"{d['module']}.py"]
        refused = confine(Path(d["source_path"]).read_text(), source)
        if refused is not None:
            return self._verdict(False, "error", -1, 0.0, "tests failed", f"refused: {refused}")
        nonce = secrets.token_hex(16)
        spec = check_spec(d["module"], d["test"], source, d["test_text"], nonce, d["timeout_s"])
        res = self._judge_call(lambda client: client.run(spec))
        status, code, wall = sandbox_outcome(res)  # a sandbox_error raises: the infrastructure's
        verdict, detail = check_verdict(res, nonce)
        passed = verdict == "pass"
        return self._verdict(passed, status, code, wall, "tests passed" if passed else "tests failed", detail)


def _held_out(module: str) -> bool:
    return int(hashlib.sha256(module.encode()).hexdigest(), 16) % 5 == 0


class StdlibRepairDomain(SessionDomain):
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
            "source_path": m.source_path,
            "kind": m.mutation.kind,
            "timeout_s": float(self.manifest["modules"][m.module].get("timeout_s", self.run_timeout_s)),
        }
        return Task(self.name, f"{m.id}-{index}", prompt, data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return StdlibRepairEnv(task, executor, self.max_ops, self.run_timeout_s, self.client_timeout_s)

    def task_names(self) -> list[str]:
        return [m.id for m in (*self.mutants, *self.heldout)]

    def _named_task(self, k: int) -> Task:
        n = len(self.mutants)
        return self.task(k if k < n else EVAL_BASE + k - n)

    def reference(self, task: Task) -> dict[str, str]:
        d = task.data
        return self.workspace(task) | {f"{d['module']}.py": Path(d["source_path"]).read_text()}
