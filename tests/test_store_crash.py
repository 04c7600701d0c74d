"""Crash consistency of the shard writer under SIGKILL.

A writer (`hpcrl traj synth`, the real CLI code path) is killed with SIGKILL again and again,
in the same store directory with the same writer name, so each new writer first recovers the
shard its predecessor left open. At the end:

* every trajectory the killed writers printed as acknowledged (`acked <total>`) is stored;
* no trajectory is stored twice;
* every shard is finalized and matches its manifest, and every segment verifies;
* quarantine holds only never-acknowledged `.tmp` segments (no visible segment was damaged).

No kill depends on how fast the machine is: each one lands at a random point *after a
condition* the writer reports, never after a fixed delay from its start.

* acked:    the writer printed an acknowledged total >= a random target (1..40; shards rotate
            every 24 rows), then a random 0-10 ms more: anywhere in appends, HDF5 writes, syncs;
* startup:  the writer printed "started", then a random 0-20 ms: imports, recovery, first flush;
* recovery, rotation, flush: the writer stops itself (SIGSTOP) right before its n-th
            filesystem step (fsync, rename, replace, unlink, rmdir, mkdir, link) inside
            recovering its predecessor's shards, inside a shard rotation, or right before
            renaming its n-th segment into place, and is killed there. These steps are the only
            moments the on-disk state changes, so stopping before a random one of them is a
            kill at a random point of that phase, and the phase is hit whatever the speed.

Every wait has a generous deadline that fails with what the writer printed.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from hpcrl.rl.store.layout import QUARANTINE_DIR, list_shards, read_segment

WRITER = "drill"
EPISODES_PER_RUN = 1_000_000  # run k writes episodes k*1e6 .. : ids never collide across runs
SHARD_MAX_ROWS = 24
DEADLINE_S = 120.0  # per wait: generous, only a hung writer should ever reach it
FS_STEPS = ("fsync", "rename", "replace", "unlink", "rmdir", "mkdir", "link")
# Kinds of kill and how often each is drawn (see the module docstring).
KINDS = {"acked": 35, "startup": 10, "recovery": 20, "rotation": 15, "flush": 20}


def _arm(kind: str, n: int) -> None:
    """In the child: stop this process right before its n-th filesystem step of `kind`.

    "recovery" counts steps inside ShardWriter._recover_previous and "rotation" inside
    ShardWriter._rotate (if the phase ends with fewer steps, the stop is at its end);
    "flush" counts renames of `seg-*.h5.tmp` files.
    """
    from hpcrl.rl.store.writer import ShardWriter

    phase = ["run"]
    counts: Counter[str] = Counter()
    stopped = [False]

    def stop(where: str) -> None:
        stopped[0] = True
        print(f"stop {kind} {where}", flush=True)
        # Sent to this thread, not the process: another thread could take a process-directed
        # SIGSTOP and this one run its next system call (the step itself) before it stops.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)  # the parent kills us meanwhile

    def in_phase(name: str, fn):
        def wrapped(*args, **kwargs):
            prev, phase[0] = phase[0], name
            try:
                result = fn(*args, **kwargs)
            finally:
                phase[0] = prev
            if name == kind and not stopped[0]:
                stop(f"end of {name}")
            return result

        return wrapped

    ShardWriter._recover_previous = in_phase("recovery", ShardWriter._recover_previous)
    ShardWriter._rotate = in_phase("rotation", ShardWriter._rotate)

    def step(op: str, real):
        def wrapped(*args, **kwargs):
            key = "flush" if op == "rename" and str(args[0]).endswith(".h5.tmp") else phase[0]
            counts[key] += 1
            if key == kind and counts[key] == n and not stopped[0]:
                stop(f"before {op} {os.path.basename(str(args[0])) if args else ''}")
            return real(*args, **kwargs)

        return wrapped

    for op in FS_STEPS:
        setattr(os, op, step(op, getattr(os, op)))


def _synth(store: str, log_path: str, first: int, flush_every: int, count: int, arm=None) -> None:
    """Child body: the CLI's synth verb, stdout to a file (written before each print returns)."""
    sys.stdout = open(log_path, "w", buffering=1)
    print("started", flush=True)
    if arm:
        _arm(*arm)
    from hpcrl.jobs.cli import main

    code = main(
        [
            "traj",
            "synth",
            store,
            "--count",
            str(count),
            "--writer",
            WRITER,
            "--tiny",
            "--first-episode",
            str(first),
            "--flush-every",
            str(flush_every),
            "--flush-interval",
            "0.01",
            "--shard-max-rows",
            str(SHARD_MAX_ROWS),
        ]
    )
    sys.stdout.flush()
    os._exit(code)


def _acked(log_path: Path) -> int:
    total = 0
    for line in log_path.read_text().splitlines():
        if line.startswith("acked "):
            n = int(line.split()[1])
            assert n >= total, f"acked totals must grow: {n} after {total}"
            total = n
    return total


def _wait_for(p, log_path: Path, what: str, done) -> str:
    """Poll the child's log until `done(text)`; fail clearly if it dies or the deadline passes."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        text = log_path.read_text() if log_path.exists() else ""
        if done(text):
            return text
        if not p.is_alive():
            pytest.fail(f"writer exited ({p.exitcode}) before {what}; it printed:\n{text[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"writer did not reach {what} within {DEADLINE_S:.0f} s; it printed:\n{text[-2000:]}")
        time.sleep(0.002)


def _last_acked(text: str) -> int:
    lines = [ln for ln in text.splitlines() if ln.startswith("acked ")]
    return int(lines[-1].split()[1]) if lines else 0


def _survey(store: Path, acked: dict[int, int]) -> dict:
    """What the store holds against what was acknowledged: counts, and the problems found."""
    ids: Counter[str] = Counter()
    problems = []
    for state in list_shards(store):
        if not state.finalized:
            problems.append(f"shard {state.name} left unfinalized")
            continue
        listed = [s.name for s in state.manifest.segments]
        if listed != state.segment_names:
            problems.append(f"{state.name}: files {state.segment_names} != manifest {listed}")
        seqs = [int(n.split("-")[1]) for n in listed]
        if seqs != list(range(1, len(seqs) + 1)):
            problems.append(f"{state.name}: segments not visible in order: {seqs}")
        for info in state.manifest.segments:
            cols = read_segment(state.path / info.name, info)  # checksum + manifest + offsets
            ids.update(cols.ids())
    dupes = [i for i, c in ids.items() if c > 1]
    if dupes:
        problems.append(f"{len(dupes)} trajectories stored twice, e.g. {dupes[:3]}")
    lost = [
        f"synth/{WRITER}/{first + j}"
        for first, n in acked.items()
        for j in range(n)
        if f"synth/{WRITER}/{first + j}" not in ids
    ]
    if lost:
        problems.append(f"{len(lost)} acknowledged trajectories lost, e.g. {lost[:3]}")
    qdir = store / QUARANTINE_DIR
    quarantined = (
        [p for p in qdir.rglob("*") if p.is_file() and not p.name.endswith(".reason.txt")] if qdir.exists() else []
    )
    bad = [p for p in quarantined if not p.name.endswith(".h5.tmp")]
    if bad:
        problems.append(f"complete segments were quarantined (damage): {bad[:3]}")
    return {
        "stored": len(ids),
        "acked": sum(acked.values()),
        "lost": len(lost),
        "duplicated": len(dupes),
        "tmp_quarantined": len(quarantined),
        "problems": problems,
    }


def _check_store(store: Path, acked: dict[int, int]) -> dict:
    """Assert the four properties; return some counts for the report."""
    report = _survey(store, acked)
    assert not report["problems"], "\n".join(report["problems"])
    return report


@pytest.mark.slow
def test_sigkill_loop_loses_nothing_acknowledged(tmp_path):
    store = tmp_path / "store"
    ctx = multiprocessing.get_context("forkserver")
    # pytest too: the child unpickles its target from this module, which imports pytest.
    ctx.set_forkserver_preload(
        ["hpcrl.jobs.cli.traj", "hpcrl.rl.store.writer", "hpcrl.rl.record.synth", "h5py", "numpy", "pytest"]
    )
    rng = random.Random(1234)
    acked: dict[int, int] = {}
    kinds: Counter[str] = Counter()
    tmp_seen: set[tuple[str, str]] = set()  # distinct half-written segments found after a kill
    iterations = 200
    t0 = time.monotonic()
    for k in range(iterations):
        log_path = tmp_path / f"run-{k}.log"
        first = k * EPISODES_PER_RUN
        # The first writer has no predecessor to recover.
        kind = "acked" if k == 0 else rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        arm = None
        if kind == "recovery":
            arm = (kind, rng.randint(1, 6))
        elif kind == "rotation":
            arm = (kind, rng.randint(1, 10))
        elif kind == "flush":
            arm = (kind, rng.randint(1, 12))
        p = ctx.Process(target=_synth, args=(str(store), str(log_path), first, rng.randint(1, 8), 10**6, arm))
        p.start()
        if kind == "acked":
            target = rng.randint(1, 40)
            _wait_for(p, log_path, f"acked >= {target}", lambda text, t=target: _last_acked(text) >= t)
            time.sleep(rng.uniform(0.0, 0.01))
        elif kind == "startup":
            _wait_for(p, log_path, "start-up", lambda text: "started" in text)
            time.sleep(rng.uniform(0.0, 0.02))
        else:
            _wait_for(p, log_path, f"its {kind} stop", lambda text: "\nstop " in text)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert p.exitcode == -signal.SIGKILL, f"run {k} ended by itself (exit {p.exitcode}) before the kill"
        kinds[kind] += 1
        acked[first] = _acked(log_path)
        tmp_seen.update((s.name, n) for s in list_shards(store) for n in s.tmp_files if n.startswith("seg-"))
    # A last writer that runs to completion recovers the final crashed shard.
    final = iterations * EPISODES_PER_RUN
    p = ctx.Process(target=_synth, args=(str(store), str(tmp_path / "final.log"), final, 4, 50))
    p.start()
    p.join(DEADLINE_S)
    assert p.exitcode == 0
    acked[final] = _acked(tmp_path / "final.log")
    assert acked[final] == 50
    mid_flush = len(tmp_seen)
    report = _survey(store, acked)
    load = os.getloadavg()[0]
    print(
        f"\nstore drill: {iterations} kills ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
        f"{report['acked']} acknowledged, {report['stored']} stored, {report['lost']} lost, "
        f"{report['duplicated']} duplicated; {report['stored'] - report['acked']} durable but killed before "
        f"the ack, {mid_flush} kills inside a segment write, {report['tmp_quarantined']} .tmp quarantined; "
        f"{time.monotonic() - t0:.0f} s, load {load:.1f}"
    )
    assert not report["problems"], "\n".join(report["problems"])
    # Guaranteed by construction, whatever the speed: each "acked" kill waited for >= 1 ack,
    # each "flush" kill left a complete unrenamed segment, the phases were each stopped in.
    assert report["acked"] >= kinds["acked"]
    assert mid_flush >= kinds["flush"] >= 20, f"only {mid_flush} kills landed inside a segment write"
    assert kinds["recovery"] >= 20 and kinds["rotation"] >= 15, kinds


def test_sigkill_real_cli_then_resume(tmp_path):
    """The `hpcrl traj synth` entry point itself, killed and resumed in the same directory."""
    store = tmp_path / "store"
    exe = [sys.executable, "-m", "hpcrl.jobs.cli"]
    env = {**os.environ, "HDF5_USE_FILE_LOCKING": "FALSE"}
    acked: dict[int, int] = {}
    left_open = 0  # shards a killed writer left open, for the next writer to recover
    for k in range(4):
        first = k * EPISODES_PER_RUN
        proc = subprocess.Popen(
            exe
            + [
                "traj",
                "synth",
                str(store),
                "--count",
                "1000000",
                "--writer",
                WRITER,
                "--tiny",
                "--first-episode",
                str(first),
                "--flush-every",
                "3",
                "--shard-max-rows",
                "30",
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        total = 0
        for line in proc.stdout:  # kill right after an ack, at a varying depth
            total = int(line.split()[1])
            if total >= 30 * k + 15:  # mid-shard: the open shard must be recovered
                break
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate()
        for line in rest.splitlines():
            total = int(line.split()[1])
        acked[first] = total
        # The pipe lags the writer, so a kill may land right after a rotation, with no shard open.
        left_open += sum(st.manifest is None for st in list_shards(store))
    done = subprocess.run(
        exe
        + [
            "traj",
            "synth",
            str(store),
            "--count",
            "10",
            "--writer",
            WRITER,
            "--tiny",
            "--first-episode",
            str(99 * EPISODES_PER_RUN),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    acked[99 * EPISODES_PER_RUN] = 10
    _check_store(store, acked)
    statuses = Counter(s.manifest.status for s in list_shards(store))
    assert statuses["recovered"] == left_open >= 1, (statuses, left_open)  # each open shard was recovered
    verify = subprocess.run(exe + ["traj", "verify", str(store)], capture_output=True, text=True, env=env)
    assert verify.returncode == 0, verify.stdout
