"""The `hpcrl` command line.

    hpcrl --help
    hpcrl validate config.yaml learner.lr=3e-4

Each verb lives in its own module here with a `register(subparsers)` function; the module
imports nothing heavy at import time so `hpcrl --help` stays fast. Exit codes: 0 success,
1 the operation failed, 2 bad input (config, arguments). KEY=VALUE overrides may come anywhere
after CONFIG, between flags too (`hpcrl run config.yaml --run-id x learner.lr=1e-4`); any other
argument a verb does not know is one line naming the verb's flags.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from hpcrl import __version__
from hpcrl.core.files import StateFileError
from hpcrl.core.schema import ConfigError
from hpcrl.jobs.checks import RunCheckError
from hpcrl.jobs.rundir import RunDirError, private_umask
from hpcrl.slurm.command import SlurmCommandError

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).

# Verb modules in the order `--help` lists them.
VERBS = (
    "validate",
    "run",
    "resume",
    "submit",
    "supervise",
    "sbatch",
    "status",
    "cancel",
    "logs",
    "plot",
    "report",
    "eval",
    "traj",
    "chaos",
    "sandbox",
    "domains",
    "sim",
    "model",
)


def add_config_args(p: argparse.ArgumentParser, *, run_id: bool = False) -> None:
    """The arguments every config-driven verb shares: CONFIG, KEY=VALUE overrides, --run-id."""
    p.add_argument("config", help="experiment YAML file, e.g. config.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides through the same schema, values parsed as YAML (e.g. learner.lr=3e-4); "
        "anywhere after CONFIG, flags included",
    )
    if run_id:
        p.add_argument("--run-id", help="name of the run directory (default: <name>-<time>-<random>)")


def add_run_args(p: argparse.ArgumentParser, dest: str = "run", optional: bool = False, note: str = "") -> None:
    """RUN (a run directory, or a run id under --config's run_root) and --config, as every verb
    that reads a run takes them; `jobs.cli.status.resolve_run_dir` turns them into a directory."""
    help_ = "run directory, or a run id under the config's run_root" + note
    if optional:
        p.add_argument(dest, nargs="?", help=help_)
    else:
        p.add_argument(dest, metavar="RUN", help=help_)
    p.add_argument("--config", default="config.yaml", help="config whose run_root holds run ids (default config.yaml)")


class UsageError(Exception):
    """Bad command-line input that argparse cannot catch; exits 2 with the message."""


def load_experiment(args: argparse.Namespace, verb: str, slurm: bool = False, cluster: bool = False):
    """Config + overrides of a config-driven verb, its domains loaded (once: the launch plan
    takes them), and everything a component would otherwise find only when it starts checked
    (jobs/checks.py; the Slurm cluster too with `cluster`), before anything is created. Returns
    (config, [config folder] as the domain search path, {name: Domain})."""
    from pathlib import Path

    from hpcrl.core.config import load_config
    from hpcrl.jobs.checks import check_run
    from hpcrl.rl.domains import DomainError, load_domains
    from hpcrl.rl.model.alphabet import resolve_charset

    cfg = load_config(args.config, args.overrides)
    check_experiment(cfg)
    if slurm and cfg.executor != "slurm":
        raise UsageError(
            f"executor is {cfg.executor!r}: `hpcrl {verb}` is for Slurm; set `executor: slurm` "
            "(or add the override executor=slurm), or use `hpcrl run` to train on this machine"
        )
    search = [str(Path(args.config).resolve().parent)]
    try:
        domains = load_domains(cfg.domains, search)
    except DomainError as exc:
        raise UsageError(str(exc)) from None
    cfg = resolve_charset(cfg, domains)
    check_run(cfg, domains, cluster=cluster)
    return cfg, search, domains


def check_experiment(cfg) -> None:
    """Checks a config needs beyond its schema, at load time: `learner.deepspeed` against
    DeepSpeed's own schemas (ConfigError naming the dotted key)."""
    if cfg.learner.deepspeed:
        from hpcrl.rl.learner.dsconfig import check_deepspeed_section

        check_deepspeed_section(cfg.learner.deepspeed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl",
        description="RL post-training of LLMs on Slurm: learners, generators, sandboxes, one config.yaml.",
    )
    parser.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERBS:
        importlib.import_module(f"hpcrl.jobs.cli.{name}").register(sub)
    return parser


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, argparse.ArgumentParser]:
    """("run", its parser), or ("traj show", ...) for a verb with verbs of its own, as `args` chose."""
    words, cur = [], parser
    while True:
        subs = [a for a in cur._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen not in (subs[0].choices if subs else {}):
            return " ".join(words), cur
        words.append(chosen)
        cur = subs[0].choices[chosen]


def take_extras(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Overrides placed after a flag (argparse leaves them over) join the others in the order
    given; CONFIG must come before any override. UsageError for anything else left over."""
    config = getattr(args, "config", None)
    if hasattr(args, "overrides"):
        if config is not None and "=" in config and not config.startswith(("/", ".")):
            from pathlib import Path

            if not Path(config).exists():
                raise UsageError(
                    f"{config!r} stands where CONFIG goes: give the config file first, then KEY=VALUE "
                    f"overrides anywhere after it, e.g. `hpcrl {args.verb} config.yaml {config}`"
                )
        keep = [a for a in extras if "=" in a and not a.startswith("-")]
        args.overrides = [*args.overrides, *keep]
        extras = [a for a in extras if a not in keep]
    if not extras:
        return
    bad = extras[0]
    command, sub = _command(parser, args)
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    close = difflib.get_close_matches(bad.split("=")[0], flags, n=1) if bad.startswith("-") else []
    hint = f"did you mean {close[0]}? " if close else ""
    where = " (KEY=VALUE overrides go after CONFIG)" if hasattr(args, "overrides") else ""
    raise UsageError(
        f"unrecognized argument {bad!r}; {hint}`hpcrl {command}` takes {', '.join(flags) or 'no flags'}{where}"
    )


def main(argv: list[str] | None = None) -> int:
    private_umask()  # whatever a verb creates (run directories, scripts, jobs' logs) is the user's alone
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        if extras:
            print(f"hpcrl: error: unrecognized argument {extras[0]!r}; see `hpcrl --help`", file=sys.stderr)
        else:
            parser.print_help()
        return 2
    try:
        take_extras(parser, args, extras)
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (UsageError, RunDirError, RunCheckError) as exc:
        print(f"hpcrl {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except StateFileError as exc:  # a run's state file and its previous copy are both unreadable
        print(f"hpcrl {args.verb}: error: {exc}", file=sys.stderr)
        return 1
    except SlurmCommandError as exc:  # the cluster did not answer as asked: no traceback, the reason
        print(f"hpcrl {args.verb}: error: {exc.summary()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
