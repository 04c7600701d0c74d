"""`hpcrl sandbox exec|session|info|build-image|serve`: run code in the configured sandbox, build its image, serve it.

    hpcrl sandbox exec --lang python prog.py --stdin in.txt --timeout-s 5 --json
    hpcrl sandbox session --json < ops.jsonl   # a session's operations, one JSON line each, in and out
    hpcrl sandbox info                          # backend, languages, which limits are enforced
    hpcrl sandbox build-image --out sandbox.sif # Apptainer image from containers/sandbox.def
    hpcrl sandbox serve --slots 4 --run-dir runs/x

`exec` exits 0 whenever the sandbox ran, whatever the program did (its status is in the
output); 1 when the sandbox itself failed (status sandbox_error, or no sandbox available);
2 for bad input. `session` exits 0 when every operation's result is ok, 1 when one is not.
As root, each of them (and each server's slot) runs as a uid of the host's pool that no other
sandbox uses meanwhile, so any number of them, of any runs and users, can run on one host.
"""

from __future__ import annotations

import argparse
import sys

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sandbox",
        help="run a program in the code-execution sandbox; build its image; serve it",
        description="Isolated execution of untrusted code (bubblewrap locally, Apptainer on clusters).",
    )
    verbs = p.add_subparsers(dest="sandbox_verb", metavar="VERB")
    p.set_defaults(func=lambda args: _usage(p))

    e = verbs.add_parser(
        "exec",
        help="run one program and print its result",
        description=(
            "Run FILE in a fresh sandbox of the configured backend and print the result: the program's "
            "stdout/stderr and a status line, or one JSON object with --json. Statuses: ok, nonzero_exit, "
            "timeout, cpu_limit, memory_limit, output_limit, killed_by_signal, compile_error, sandbox_error. "
            "Exit code 0 whenever the sandbox ran, 1 if the sandbox failed, 2 for bad input."
        ),
    )
    e.add_argument("file", help="source file, e.g. prog.py; it becomes the language's main file in /work")
    e.add_argument("--lang", required=True, help="language: python, c, cpp, bash, node")
    e.add_argument("--stdin", metavar="FILE", help="file fed to the program's stdin (default: empty)")
    e.add_argument("--timeout-s", type=float, metavar="S", help="wall-clock and CPU limit, seconds (default 10)")
    e.add_argument("--memory-mb", type=int, metavar="M", help="memory limit, MiB (default 512)")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of the program's output")
    _common(e)
    e.set_defaults(func=run_exec)

    se = verbs.add_parser(
        "session",
        help="run a JSON-lines script of session operations from stdin",
        description=(
            "Read one operation per line from stdin and print one JSON result per operation: "
            '{"op": "open"}, {"op": "write", "path": P, "content": S}, {"op": "read", "path": P}, '
            '{"op": "list"}, {"op": "run", "cmd": [ARGV], "timeout_s": T}, {"op": "snapshot"}, '
            '{"op": "restore", "snapshot": ID}, {"op": "close"}. Paths are relative to the workspace, '
            "which is the working directory of run. Operations apply to the session the script opened last "
            'unless they name one ("session": ID). Every result has "ok" and, when false, "error". '
            "Locally (default) the sessions end with the script; with --run-dir they live on that run's "
            "sandbox server until closed or idle for sandbox.session_idle_s."
        ),
    )
    se.add_argument("--json", action="store_true", help="JSON lines out (the one output format; required)")
    se.add_argument("--run-dir", metavar="DIR", help="drive a sandbox server of this run instead of a local sandbox")
    se.add_argument("--name", default="sandbox-0", help="the server's name within the run (with --run-dir)")
    _common(se)
    se.set_defaults(func=run_session)

    i = verbs.add_parser("info", help="show the backend, its languages and which limits it enforces here")
    _common(i)
    i.set_defaults(func=run_info)

    b = verbs.add_parser(
        "build-image",
        help="build the Apptainer image from containers/sandbox.def",
        description=(
            "Run `apptainer build OUT DEF` (streamed). Needs apptainer on PATH; "
            "--fakeroot where unprivileged builds need it."
        ),
    )
    b.add_argument(
        "--def", dest="def_file", metavar="FILE", help="definition file (default: hpcrl's containers/sandbox.def)"
    )
    b.add_argument("--out", metavar="FILE", help="image to write (default: sandbox.image from the config)")
    b.add_argument("--fakeroot", action="store_true", help="pass --fakeroot to apptainer build")
    b.add_argument("--force", action="store_true", help="overwrite an existing image")
    _common(b)
    b.set_defaults(func=run_build_image)

    s = verbs.add_parser(
        "serve",
        help="run a sandbox server (slot pool behind ZeroMQ) until interrupted",
        description="Serve sandboxed execution to clients over ZeroMQ: SLOTS concurrent sandboxes, a bounded queue.",
    )
    s.add_argument("--slots", type=int, help="concurrent executions (default: sandbox.slots from the config)")
    s.add_argument(
        "--run-dir", required=True, metavar="DIR", help="run directory: keys and the server's address go here"
    )
    s.add_argument("--name", default="sandbox-0", help="server name within the run (default sandbox-0)")
    _common(s)
    s.set_defaults(func=run_serve)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="experiment YAML (default: built-in defaults)")


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2


def _sandbox_cfg(args: argparse.Namespace):
    from hpcrl.core.config import load_config

    return load_config(args.config).sandbox


def _backend(args: argparse.Namespace, as_configured: bool = False):
    """The configured backend; bwrap as root on a free uid of the host's pool, given back at exit.
    One command's: it starts no sandbox ahead of a next run that never comes, unless
    `as_configured` (`info`, which describes what a server would run)."""
    import dataclasses

    from hpcrl.sandbox.auto import make_backend

    cfg = _sandbox_cfg(args)
    return make_backend(cfg if as_configured else dataclasses.replace(cfg, start_ahead=False))


def run_exec(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpcrl.jobs.cli import UsageError
    from hpcrl.sandbox.languages import get_language
    from hpcrl.sandbox.result import SandboxError
    from hpcrl.sandbox.spec import ExecSpec, Limits

    try:
        lang = get_language(args.lang)
    except ValueError as exc:
        raise UsageError(f"--lang: {exc}") from None
    source = _read(args.file, "FILE")
    stdin = _read(args.stdin, "--stdin") if args.stdin else b""
    changes = {}
    if args.timeout_s is not None:
        changes.update(wall_s=args.timeout_s, cpu_s=args.timeout_s)
    if args.memory_mb is not None:
        changes.update(memory_mb=args.memory_mb)
    try:
        limits = Limits(**changes)
        spec = ExecSpec.single(lang.name, source, stdin=stdin, limits=limits)
    except ValueError as exc:
        raise UsageError(
            str(exc).replace("Limits.wall_s", "--timeout-s").replace("Limits.memory_mb", "--memory-mb")
        ) from None
    try:
        backend = _backend(args)
        result = backend.run(spec)
    except SandboxError as exc:
        print(f"hpcrl sandbox exec: sandbox failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(result.to_json())
    else:
        sys.stdout.buffer.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(result.stderr)
        cut = " (output truncated)" if result.stdout_truncated or result.stderr_truncated else ""
        print(f"[{Path(args.file).name}: {result.summary()}{cut}]", file=sys.stderr)
    return 1 if result.status == "sandbox_error" else 0


def run_session(args: argparse.Namespace) -> int:
    import json

    from hpcrl.jobs.cli import UsageError
    from hpcrl.sandbox.result import SandboxError
    from hpcrl.sandbox.session import json_result

    if not args.json:
        raise UsageError("sandbox session: give --json (one JSON object per operation is the output format)")
    try:
        execute, finish = _session_driver(args)
    except SandboxError as exc:
        print(f"hpcrl sandbox session: sandbox failed: {exc}", file=sys.stderr)
        return 1
    current, failed = None, False
    try:
        for n, line in enumerate(sys.stdin, 1):
            if not line.strip():
                continue
            try:
                op = json.loads(line)
            except ValueError as exc:
                op, res = None, {"ok": False, "error": f"line {n}: not JSON ({exc}); one object per line"}
            else:
                if isinstance(op, dict) and op.get("op") != "open" and "session" not in op and current:
                    op = {**op, "session": current}  # the session the script opened last
                res = execute(op)
            if isinstance(op, dict) and op.get("op") == "open" and res.get("ok"):
                current = res["session"]
            failed |= not res.get("ok")
            kind = op.get("op") if isinstance(op, dict) else None
            print(json.dumps({"op": kind, **json_result(res)}), flush=True)
    finally:
        finish()
    return 1 if failed else 0


def _session_driver(args: argparse.Namespace):
    """(execute(op) -> result, finish()) against a local sandbox, or the run's server with --run-dir."""
    import os

    from hpcrl.core.transport import Node, TransportError
    from hpcrl.sandbox.session import SessionManager, SessionOp

    if args.run_dir:
        from hpcrl.sandbox.client import SandboxClient

        node = Node(args.run_dir, f"session-cli-{os.getpid()}")
        client = SandboxClient(node, args.name)

        def remote(op):
            try:
                return client.session(op)
            except (TransportError, ValueError) as exc:
                return {"ok": False, "error": f"{args.name}: {exc}"}

        def close_remote():
            client.close()
            node.close()

        return remote, close_remote
    cfg = _sandbox_cfg(args)
    backend = _backend(args)
    mgr = SessionManager.from_config(cfg)

    def local(op):
        try:
            return mgr.execute(SessionOp.from_wire(op), backend)
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}

    def close_local():
        mgr.close_all()  # a local session cannot outlive this process: its workspace goes too
        backend.close()

    return local, close_local


def _read(path: str, what: str) -> bytes:
    from hpcrl.jobs.cli import UsageError

    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise UsageError(f"{what}: no such file: {path}") from None
    except OSError as exc:
        raise UsageError(f"{what}: cannot read {path}: {exc.strerror}") from None


def run_info(args: argparse.Namespace) -> int:
    from hpcrl.sandbox.result import SandboxError

    try:
        backend = _backend(args, as_configured=True)
        backend.check()
    except SandboxError as exc:
        print(f"hpcrl sandbox info: {exc}", file=sys.stderr)
        return 1
    print(backend.describe())
    print(f"languages: {', '.join(backend.languages())}")
    backend.close()
    return 0


def run_build_image(args: argparse.Namespace) -> int:
    from hpcrl.jobs.cli import UsageError
    from hpcrl.sandbox.apptainer import build_image, default_def_file
    from hpcrl.sandbox.result import SandboxError

    cfg = _sandbox_cfg(args)
    def_file = args.def_file or str(default_def_file())
    try:
        open(def_file, "rb").close()
    except OSError:
        raise UsageError(f"--def: no such definition file: {def_file}") from None
    out = args.out or cfg.image
    try:
        code = build_image(def_file, out, apptainer=cfg.apptainer, fakeroot=args.fakeroot, force=args.force)
    except SandboxError as exc:
        print(f"hpcrl sandbox build-image: {exc}", file=sys.stderr)
        return 1
    if code:
        print(f"hpcrl sandbox build-image: apptainer build failed (exit {code})", file=sys.stderr)
        return 1
    print(f"built {out} from {def_file}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from hpcrl.jobs.cli import UsageError
    from hpcrl.sandbox.result import SandboxError
    from hpcrl.sandbox.server import serve

    cfg = _sandbox_cfg(args)
    slots = args.slots if args.slots is not None else cfg.slots
    if slots < 1:
        raise UsageError(f"--slots must be >= 1 (got {slots})")
    try:
        return serve(cfg, run_dir=args.run_dir, slots=slots, name=args.name)
    except SandboxError as exc:  # e.g. its slot uids are taken: say so, no traceback
        print(f"hpcrl sandbox serve: {exc}", file=sys.stderr)
        return 1
