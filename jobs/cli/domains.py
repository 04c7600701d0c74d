"""`hpcrl domains list [--json]` and `hpcrl domains build stdlib-repair`: the registered task families.

    hpcrl domains list                       # a table: name, tasks, multi-step, languages
    hpcrl domains list --json                # [{"name", "family", "tasks", "multi_step", "languages"}]
    hpcrl domains build stdlib-repair        # mutate stdlib modules, keep what their tests catch

`tasks` is how many distinct tasks the family has (training plus held-out), null when every
task index is a task of its own (arith) or when the family's task list is not built yet
(stdlib-repair before `hpcrl domains build stdlib-repair`; the table says so).
The build runs the mutants in the bwrap sandbox of this machine (`sandbox.*` of the config).
"""

from __future__ import annotations

import argparse
import json
import re
import sys


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
    return len(problems) if problems is not None else None


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
