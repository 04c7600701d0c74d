"""Crash consistency of the shard writer under SIGKILL (issue 3, deliverable 3).

A writer (`hpcrl traj synth`, the real CLI code path) is killed with SIGKILL at random
moments, again and again, in the same store directory with the same writer name, so each
new writer first recovers the shard its predecessor left open. At the end:

* every trajectory the killed writers printed as acknowledged (`acked <total>`) is stored;
* no trajectory is stored twice;
* every shard is finalized and matches its manifest, and every segment verifies;
* quarantine holds only never-acknowledged `.tmp` segments (no visible segment was damaged).

The loop forks writers from a pre-warmed forkserver so a kill lands within ~0.01-0.25 s of
the start: during recovery, appends, segment writes, fsyncs, renames and shard rotation.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from hpcrl.rl.store.layout import QUARANTINE_DIR, list_shards, read_segment

WRITER = "drill"
EPISODES_PER_RUN = 1_000_000  # run k writes episodes k*1e6 .. : ids never collide across runs


def _synth(store: str, log_path: str, first: int, flush_every: int, count: int) -> None:
    """Child body: the CLI's synth verb, stdout to a file (written before each print returns)."""
    sys.stdout = open(log_path, "w", buffering=1)
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
            "40",
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


def _check_store(store: Path, acked: dict[int, int]) -> dict:
    """Assert the four properties; return some counts for the report."""
    ids: Counter[str] = Counter()
    for state in list_shards(store):
        assert state.finalized, f"shard {state.name} left unfinalized"
        listed = [s.name for s in state.manifest.segments]
        assert listed == state.segment_names, f"{state.name}: files {state.segment_names} != manifest {listed}"
        seqs = [int(n.split("-")[1]) for n in listed]
        assert seqs == list(range(1, len(seqs) + 1)), f"{state.name}: segments not visible in order: {seqs}"
        for info in state.manifest.segments:
            cols = read_segment(state.path / info.name, info)  # checksum + manifest + offsets
            ids.update(cols.ids())
    dupes = [i for i, c in ids.items() if c > 1]
    assert not dupes, f"{len(dupes)} trajectories stored twice, e.g. {dupes[:3]}"
    lost = [
        f"synth/{WRITER}/{first + j}"
        for first, n in acked.items()
        for j in range(n)
        if f"synth/{WRITER}/{first + j}" not in ids
    ]
    assert not lost, f"{len(lost)} acknowledged trajectories lost, e.g. {lost[:3]}"
    qdir = store / QUARANTINE_DIR
    quarantined = (
        [p for p in qdir.rglob("*") if p.is_file() and not p.name.endswith(".reason.txt")] if qdir.exists() else []
    )
    bad = [p for p in quarantined if not p.name.endswith(".h5.tmp")]
    assert not bad, f"complete segments were quarantined (damage): {bad[:3]}"
    return {"stored": len(ids), "acked": sum(acked.values()), "tmp_quarantined": len(quarantined)}


@pytest.mark.slow
def test_sigkill_loop_loses_nothing_acknowledged(tmp_path):
    store = tmp_path / "store"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hpcrl.jobs.cli.traj", "hpcrl.rl.store.writer", "hpcrl.rl.synth", "h5py", "numpy"])
    rng = random.Random(1234)
    acked: dict[int, int] = {}
    kills = 0
    tmp_seen: set[tuple[str, str]] = set()  # distinct half-written segments found after a kill
    iterations = 210
    for k in range(iterations):
        log_path = tmp_path / f"run-{k}.log"
        first = k * EPISODES_PER_RUN
        p = ctx.Process(target=_synth, args=(str(store), str(log_path), first, rng.randint(1, 8), 10**6))
        p.start()
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert p.exitcode == -signal.SIGKILL, f"run {k} ended by itself (exit {p.exitcode}) before the kill"
        kills += 1
        acked[first] = _acked(log_path) if log_path.exists() else 0
        tmp_seen.update((s.name, n) for s in list_shards(store) for n in s.tmp_files if n.startswith("seg-"))
    # A last writer that runs to completion recovers the final crashed shard.
    final = iterations * EPISODES_PER_RUN
    p = ctx.Process(target=_synth, args=(str(store), str(tmp_path / "final.log"), final, 4, 50))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    acked[final] = _acked(tmp_path / "final.log")
    assert acked[final] == 50
    mid_flush = len(tmp_seen)
    report = _check_store(store, acked)
    print(
        f"\n{kills} SIGKILLs: {report['acked']} acknowledged, {report['stored']} stored "
        f"({report['stored'] - report['acked']} durable but killed before the ack), {mid_flush} kills landed "
        f"inside a segment write, {report['tmp_quarantined']} .tmp quarantined"
    )
    assert kills >= 200
    assert report["acked"] > 1000, "the writers barely ran: kills land too early to test anything"
    # Kills must land inside flushes too, not only between them.
    assert mid_flush >= 5, f"only {mid_flush} kills landed inside a segment write"


def test_sigkill_real_cli_then_resume(tmp_path):
    """The `hpcrl traj synth` entry point itself, killed and resumed in the same directory."""
    store = tmp_path / "store"
    exe = [sys.executable, "-m", "hpcrl.jobs.cli"]
    env = {**os.environ, "HDF5_USE_FILE_LOCKING": "FALSE"}
    acked: dict[int, int] = {}
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
    assert statuses["recovered"] >= 4, statuses  # each killed run's open shard was recovered
    verify = subprocess.run(exe + ["traj", "verify", str(store)], capture_output=True, text=True, env=env)
    assert verify.returncode == 0, verify.stdout
