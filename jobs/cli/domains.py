"""`hpcrl domains list|tasks|check|build`: the registered task families, their tasks, their checks.

    hpcrl domains list                       # a table: name, tasks, multi-step, languages
    hpcrl domains list --json                # [{"name", "family", "tasks", "multi_step", "languages"}]
    hpcrl domains tasks c-repair --json      # [{"name", "files": {path: text}}], each task's workspace
    hpcrl domains tasks c-repair --reference --json     # ... and "reference": a known-good fix's files
    hpcrl domains check c-repair --task gcd --files fix/ --json
        # {"domain", "task", "reward", "verdict"}: fix/'s files laid over the task's workspace and
        # submitted as an episode submits, judged by a sandbox server this command starts
    hpcrl domains build stdlib-repair        # mutate stdlib modules, keep what their tests catch

`tasks` and `check` cover the code domains (synth, code-repair, humaneval, session-repair,
c-repair, stdlib-repair), training and held-out tasks alike. Where the model writes a single
file, that file is the workspace: `main.py` for synth (empty at first), `solution.py` for
code-repair (the buggy function) and humaneval (the prompt, to be completed). A check runs the
sandbox of this machine (`sandbox.*` of --config, on the slot uids after a run's servers').

`tasks` is how many distinct tasks the family has (training plus held-out), null when every
task index is a task of its own (arith) or when the family's task list is not built yet
(stdlib-repair before `hpcrl domains build stdlib-repair`; the table says so).
The build runs the mutants in the bwrap sandbox of this machine (`sandbox.*` of the config).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).

_DOMAIN_HELP = "a code domain: synth, code-repair, humaneval, session-repair, c-repair, stdlib-repair"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("domains", help="task domains: list the registered families, build stdlib-repair's tasks")
    verbs = p.add_subparsers(dest="domains_verb", metavar="VERB", required=True)
    ls = verbs.add_parser("list", help="every registered family: tasks, multi-step, languages")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(func=run_list)
    b = verbs.add_parser("build", help="build a family's task list (stdlib-repair: seeded mutants of stdlib modules)")
    b.add_argument("family", choices=("stdlib-repair",), help="the family to build")
    b.add_argument("--seed", type=int, default=0, help="mutation seed (default 0)")
    b.add_argument("--per-module", type=int, default=24, help="mutants tried per module (default 24)")
    b.add_argument("--modules", help="comma-separated modules of the allow-list (default: all of it)")
    b.add_argument("--jobs", type=int, default=2, help="sandboxes run at once (default 2)")
    b.add_argument("--force", action="store_true", help="rebuild even when the task list exists")
    b.add_argument("--config", default=None, help="config whose sandbox section to use (default: built-in defaults)")
    b.set_defaults(func=run_build)
    t = verbs.add_parser(
        "tasks",
        help="a domain's tasks and their initial workspaces (synth: main.py; code-repair, humaneval: solution.py)",
    )
    t.add_argument("domain", help=_DOMAIN_HELP)
    t.add_argument("--reference", action="store_true", help="also each task's \"reference\": a known-good fix's files")
    t.add_argument("--json", action="store_true", help='print [{"name", "files": {path: text}}] (the default: a table)')
    t.set_defaults(func=run_tasks)
    c = verbs.add_parser(
        "check",
        help="judge files as a task's submission, as a run does (synth: main.py; code-repair, humaneval: solution.py)",
    )
    c.add_argument("domain", help=_DOMAIN_HELP)
    c.add_argument("--task", required=True, help="the task's name, as `hpcrl domains tasks DOMAIN` lists it")
    c.add_argument("--files", required=True, help="a directory whose files are laid over the task's workspace")
    c.add_argument("--json", action="store_true", help='print {"domain", "task", "reward", "verdict"}')
    c.add_argument("--config", default=None, help="config whose sandbox section to use (default: built-in defaults)")
    c.set_defaults(func=run_check)


def family_rows() -> list[dict]:
    """One row per registered family, as `--json` prints them."""
    from hpcrl.rl.domains import DOMAIN_FAMILIES, DomainError, get_domain

    rows = []
    for family in sorted(DOMAIN_FAMILIES.names()):
        row: dict = {"name": family, "family": family, "tasks": None, "multi_step": False, "languages": []}
        try:
            d = get_domain(family)
        except DomainError as exc:
            example = re.search(rf"e\.g\. ({re.escape(family)}/\S+?)[;,]", str(exc))
            try:  # a family that needs a variant (arith) is described by the example its error names
                d = get_domain(example.group(1)) if example else None
            except DomainError:
                d = None
            if d is None:  # e.g. stdlib-repair not built yet: listed, with the reason
                factory = DOMAIN_FAMILIES.get(family)  # a Domain class registered as its own factory
                row["multi_step"] = bool(getattr(factory, "multi_step", False))
                row["languages"] = list(getattr(factory, "languages", ()))
                row["note"] = str(exc).split(": ", 1)[-1].removeprefix(f"{family}: ")
                rows.append(row)
                continue
        row["tasks"] = _count(d)
        row["multi_step"] = bool(d.multi_step)
        row["languages"] = list(d.languages)
        rows.append(row)
    return rows


def _count(d) -> int | None:
    if d.size is not None:
        return d.size + (d.heldout_size or 0)
    problems = getattr(d, "problems", None)  # the code domains keep `size` None but list their problems
    return len(problems) + (d.heldout_size or 0) if problems is not None else None


def run_list(args: argparse.Namespace) -> int:
    rows = family_rows()
    for r in rows:  # on stderr, so that --json output stays one JSON document
        if "note" in r:
            print(f"{r['name']}: {r['note']}", file=sys.stderr)
    if args.json:
        print(json.dumps([{k: r[k] for k in ("name", "family", "tasks", "multi_step", "languages")} for r in rows]))
        return 0
    print(f"{'name':<16} {'tasks':>9}  {'multi-step':<10}  languages")
    for r in rows:
        tasks = r["tasks"] if r["tasks"] is not None else ("not built" if "note" in r else "unbounded")
        multi = "yes" if r["multi_step"] else "no"
        print(f"{r['name']:<16} {tasks!s:>9}  {multi:<10}  {','.join(r['languages']) or '-'}")
    return 0


def run_build(args: argparse.Namespace) -> int:
    from hpcrl.core.config import load_config
    from hpcrl.jobs.cli import UsageError
    from hpcrl.rl.domains.stdlib_build import build
    from hpcrl.rl.domains.stdlib_repair import MODULES, cache_dir

    modules = MODULES
    if args.modules:
        modules = tuple(m.strip() for m in args.modules.split(",") if m.strip())
        unknown = sorted(set(modules) - set(MODULES))
        if unknown:
            raise UsageError(f"--modules: {', '.join(unknown)} not in the allow-list; it has: {', '.join(MODULES)}")
    if args.per_module < 1 or args.jobs < 1:
        raise UsageError("--per-module and --jobs must be at least 1")
    out = cache_dir(args.seed)
    if (out / "manifest.json").is_file() and not args.force:
        m = json.loads((out / "manifest.json").read_text())
        print(f"stdlib-repair: {len(m['mutants'])} tasks already built at {out} (--force rebuilds)")
        return 0
    cfg = load_config(args.config, [])
    m = build(out, modules=modules, seed=args.seed, per_module=args.per_module, sandbox=cfg.sandbox, jobs=args.jobs)
    ok = sum(1 for i in m["modules"].values() if i.get("status") == "ok")
    print(f"stdlib-repair: {len(m['mutants'])} tasks from {ok} modules in {m['build_s']} s, at {out}/manifest.json")
    return 0


def _code_domain(name: str):
    from hpcrl.jobs.cli import UsageError
    from hpcrl.rl.domains import DomainError, get_domain

    try:
        domain = get_domain(name)
    except DomainError as exc:
        raise UsageError(str(exc)) from None
    if not domain.task_names():
        raise UsageError(f"domain {name!r} has no named tasks with a workspace; code domains do: {', '.join(CODE)}")
    return domain


CODE = ("synth", "code-repair", "humaneval", "session-repair", "c-repair", "stdlib-repair")


def run_tasks(args: argparse.Namespace) -> int:
    domain = _code_domain(args.domain)
    rows = []
    for name in domain.task_names():
        task = domain.named_task(name)
        row = {"name": name, "files": domain.workspace(task)}
        if args.reference:
            row["reference"] = domain.reference(task)
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        print(f"{r['name']:<24} {', '.join(r['files'])}")
    return 0


def _read_dir(path: str) -> dict[str, str]:
    from pathlib import Path

    from hpcrl.jobs.cli import UsageError

    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"--files {path}: no such directory; give the directory holding the submission's files")
    files = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if "__pycache__" in f.parts or f.is_dir():
            continue
        if f.is_symlink() or not f.is_file():
            raise UsageError(f"--files {path}: {rel} is not a regular file (a symlink or special file)")
        try:
            files[rel] = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"--files {path}: {rel} is not UTF-8 text") from None
    if not files:
        raise UsageError(f"--files {path}: the directory holds no files")
    return files


def run_check(args: argparse.Namespace) -> int:
    from hpcrl.jobs.cli import UsageError
    from hpcrl.sandbox.result import SandboxError

    domain = _code_domain(args.domain)
    try:
        task = domain.named_task(args.task)
    except ValueError as exc:
        raise UsageError(f"--task: {exc}") from None
    files = _read_dir(args.files)
    from hpcrl.rl.domains.session_env import SessionDomain

    if not isinstance(domain, SessionDomain):  # a single-file workspace: that file must be there
        (only,) = domain.workspace(task)
        if only not in files:
            raise UsageError(f"--files {args.files}: no {only} there; {domain.name}'s workspace is that one file")
    try:
        with _sandbox_client(args.config) as client:
            result = domain.submit(task, files, _executor(domain, client))
    except SandboxError as exc:
        print(f"hpcrl domains check: the sandbox failed: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise UsageError(f"--files {args.files}: {exc}") from None
    fb = result.info.get("feedback")
    verdict = str(result.info.get("reason") or (fb.message if fb else ""))
    out = {"domain": domain.name, "task": args.task, "reward": float(result.reward), "verdict": verdict}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['domain']} {out['task']}: reward {out['reward']:g} ({verdict})")
    return 0


def _executor(domain, client):
    """What a run's generator hands the domain: a sandbox client (session domains open their own
    sessions on its server), wrapped as a CodeJudge for the single-file domains."""
    from hpcrl.rl.domains import SandboxJudge
    from hpcrl.rl.domains.session_env import SessionDomain

    return client if isinstance(domain, SessionDomain) else SandboxJudge(client)


@contextlib.contextmanager
def _sandbox_client(config: str | None):
    """A client of a sandbox server (with sessions) this command runs in a thread, on a private
    run directory: the server a run's generators talk to, for one check."""
    import logging
    import tempfile
    import threading
    import time

    from hpcrl.core.config import load_config
    from hpcrl.core.transport import Node
    from hpcrl.sandbox.client import SandboxClient
    from hpcrl.sandbox.result import SandboxError
    from hpcrl.sandbox.server import serve

    cfg = load_config(config, [])
    sandbox = cfg.sandbox  # the server claims free slot uids of the host's pool, as a run's does
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="hpcrl-check-") as run_dir:
        stop, failed = threading.Event(), []

        def body():
            try:
                serve(sandbox, run_dir=run_dir, slots=sandbox.slots, name="sandbox-0", stop=stop)
            except BaseException as exc:  # handed to the command
                failed.append(exc)

        t = threading.Thread(target=body, name="hpcrl-check-sandbox", daemon=True)
        t.start()
        endpoint = os.path.join(run_dir, "endpoints", "sandbox-0.json")
        while not os.path.exists(endpoint) and t.is_alive():
            time.sleep(0.02)  # the server publishes its endpoint once it listens
        if failed or not t.is_alive():
            raise SandboxError(f"the sandbox server did not start: {failed[0] if failed else 'it ended'}")
        node = Node(run_dir, "domains-check")
        client = SandboxClient(node, "sandbox-0")
        try:
            yield client
        finally:
            client.close()
            node.close()
            stop.set()
            t.join(60)
