"""Sandbox sessions against today's fresh executions, side by side, through one real
sandbox server (CURVE ZeroMQ, bwrap slots) in this process.

    .venv/bin/python bench/session.py [--runs 100] [--files 200] [--slots 1] [--json out.json]

Needs bubblewrap and root (per-slot uids). Interleaved one by one, so a busy machine slows both
sides alike; medians of wall time as the client sees it (request to answer):

1. same command: `exec` of python3 `print('hello')` in a fresh sandbox, against a session `run`
   of the same program already in the workspace. Both launch one sandbox through the same path.
2. file operations: session `write` (1 KiB), `read` and `list`, which launch no sandbox.
3. an episode of 50 operations (run, read, write, repeated; open and close included), per
   operation, against a fresh execution: what an agent's step costs either way.
4. a repository: `--files` files of 4 KiB each that the program reads; a fresh execution ships
   them all every time, the session has them already.

Operations per second per slot: 1 / median of the session `run`, and 1 / the episode's mean.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from hpcrl.core.config import load_config
from hpcrl.core.transport import Node
from hpcrl.sandbox.client import SandboxClient
from hpcrl.sandbox.pool import SlotPool
from hpcrl.sandbox.server import SandboxServer
from hpcrl.sandbox.session import SessionManager
from hpcrl.sandbox.spec import ExecSpec, SourceFile

UID_BASE = 61240
HELLO = "print('hello')\n"
READER = "import os\nn = sum(len(open('repo/' + f).read()) for f in os.listdir('repo'))\nprint(n)\n"


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/session.py: run as root (per-slot uids, tmpfs workspaces)", file=sys.stderr)
        return 2
    cfg = load_config(None, [f"sandbox.uid_base={UID_BASE}"]).sandbox
    pool = SlotPool.from_config(cfg, slots=args.slots)
    sessions = SessionManager.from_config(cfg)
    run_dir = tempfile.mkdtemp(prefix="hpcrl-bench-session-")
    stop, ready = threading.Event(), threading.Event()
    holder: dict = {}

    def serve():
        with Node(run_dir, "sandbox-0", bind_host="127.0.0.1") as node:
            holder["srv"] = srv = SandboxServer(node, "sandbox-0", pool, ceiling=cfg.ceiling, sessions=sessions)
            ready.set()
            while not stop.is_set():
                srv.poll_once(0.01)
            pool.close()
            srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ready.wait(30)
    out: dict = {"runs": args.runs, "files": args.files, "slots": args.slots, "machine": machine()}
    try:
        with Node(run_dir, "bench") as node:
            c = SandboxClient(node)
            out.update(measure(c, args))
            c.close()
    finally:
        stop.set()
        t.join(30)
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def op(c: SandboxClient, **o) -> dict:
    res = c.session(o)
    if not res["ok"]:
        raise SystemExit(f"session op failed: {o['op']}: {res['error']}")
    return res


def measure(c: SandboxClient, args) -> dict:
    hello = ExecSpec.single("python", HELLO)
    for _ in range(3):  # warm both paths (imports, first sandboxes) before timing
        c.run(hello)
    sid = op(c, op="open")["session"]
    op(c, op="write", session=sid, path="main.py", content=HELLO)
    run = {"op": "run", "session": sid, "cmd": ["python3", "main.py"]}
    fresh, sess, writes, reads, lists = [], [], [], [], []
    for _ in range(args.runs):
        dt, r = timed(lambda: c.run(hello))
        assert r.status == "ok" and r.stdout == b"hello\n", r
        fresh.append(dt)
        dt, r = timed(lambda: op(c, **run))
        assert r["stdout"] == b"hello\n", r
        sess.append(dt)
        writes.append(timed(lambda: op(c, op="write", session=sid, path="w.txt", content="x" * 1024))[0])
        reads.append(timed(lambda: op(c, op="read", session=sid, path="main.py"))[0])
        lists.append(timed(lambda: op(c, op="list", session=sid))[0])
    op(c, op="close", session=sid)

    # 50-operation episodes: open, 16 x (run, read, write), list, close = 51 ops (the open included).
    episode_per_op = []
    for _ in range(max(3, args.runs // 20)):
        t0 = time.perf_counter()
        sid = op(c, op="open")["session"]
        op(c, op="write", session=sid, path="step.py", content="import os\nprint(len(os.listdir('.')))\n")
        for k in range(16):
            op(c, op="run", session=sid, cmd=["python3", "step.py"])
            op(c, op="read", session=sid, path="step.py")
            op(c, op="write", session=sid, path=f"notes/{k}.txt", content=f"step {k}")
        op(c, op="close", session=sid)
        episode_per_op.append((time.perf_counter() - t0) / 51)

    # A repository the program reads: shipped whole by every fresh execution, kept by the session.
    files = tuple(SourceFile(f"repo/f{i:04d}.txt", b"y" * 4096) for i in range(args.files))
    repo_spec = ExecSpec(language="python", files=(SourceFile("main.py", READER.encode()), *files))
    sid = op(c, op="open")["session"]
    op(c, op="write", session=sid, path="main.py", content=READER)
    for f in files:
        op(c, op="write", session=sid, path=f.path, content=f.data)
    expect = f"{4096 * args.files}\n".encode()
    repo_fresh, repo_sess = [], []
    for _ in range(max(10, args.runs // 3)):
        dt, r = timed(lambda: c.run(repo_spec))
        assert r.stdout == expect, r
        repo_fresh.append(dt)
        dt, r = timed(lambda: op(c, op="run", session=sid, cmd=["python3", "main.py"]))
        assert r["stdout"] == expect, r
        repo_sess.append(dt)
    op(c, op="close", session=sid)

    ep = statistics.mean(episode_per_op)
    return {
        "same_command_ms": {"fresh_exec": ms(fresh), "session_run": ms(sess), "ratio": round(ms(sess) / ms(fresh), 3)},
        "file_ops_ms": {"write_1k": ms(writes), "read": ms(reads), "list": ms(lists)},
        "episode_50_ops": {
            "per_op_ms": round(ep * 1000, 2),
            "fresh_exec_ms": ms(fresh),
            "ratio": round(ep * 1000 / ms(fresh), 3),
        },
        "repo": {
            "files": args.files,
            "fresh_exec_ms": ms(repo_fresh),
            "session_run_ms": ms(repo_sess),
            "ratio": round(ms(repo_sess) / ms(repo_fresh), 3),
        },
        "ops_per_s_per_slot": {
            "session_run": round(1000 / ms(sess) / args.slots, 1),
            "episode_mix": round(1 / ep / args.slots, 1),
            "fresh_exec": round(1000 / ms(fresh) / args.slots, 1),
        },
    }


def machine() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, {platform.platform()}"


if __name__ == "__main__":
    sys.exit(main())
