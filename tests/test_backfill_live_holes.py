"""bench/backfill_live.py's hole measure on hand-made accounting records: idle GPU-seconds per node,
and the part of them a rollout job of a given shape fits in beside the jobs there (CPU jobs hold
memory too), clipped to the measured span."""

from __future__ import annotations

import datetime as dt
import importlib.util
import sys
from pathlib import Path

import pytest

from hpcrl.slurm.queries import JobRecord, NodeState
from hpcrl.slurm.sbatch import Resources

BENCH = Path(__file__).resolve().parents[1] / "bench"
T0 = 1_800_000_000.0


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # it imports its neighbour backfill_cluster, as a bench script does
    try:
        spec = importlib.util.spec_from_file_location("backfill_live", BENCH / "backfill_live.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def job(jid, start, end, gpus, cpus, mem_mb, node="n1"):
    at = lambda s: None if s is None else dt.datetime.fromtimestamp(T0 + s)
    return JobRecord(
        jid, jid, "gpu", "COMPLETED", None, 0, 0, None, (node,), at(start), at(end), cpus=cpus, gpus=gpus, mem_mb=mem_mb
    )


NODE = NodeState("n1", "IDLE", ("gpu", "cpu"), 8, 0, 4, 0, 16384, 0)
RECORDS = [
    job("learner", -50, None, 1, 2, 4096),  # began before the span, still running: counts to its end
    job("gen", -50, 200, 1, 1, 4096),
    *(job(f"cpu-{i}", -50, 200, 0, 1, 2048) for i in range(3)),  # the run's CPU jobs: memory, no GPU
    job("other", 0, 40, 1, 1, 256),
    job("withdrawn", None, 30, 0, 0, 0),  # never started: holds nothing
    job("elsewhere", 0, 100, 4, 1, 256, node="n2"),
]


def hole(bench, mem_mb, cpus=1):
    need = Resources(partition="gpu", time_min=1, gpus_per_node=1, cpus_per_task=cpus, mem_mb=mem_mb)
    (got,) = bench.holes_by_node(RECORDS, [NODE], T0, T0 + 100, need).values()
    return round(got["idle_gpu_h"] * 3600, 6), round(got["fillable_gpu_h"] * 3600, 6)


def test_idle_gpus_a_job_of_the_generators_shape_cannot_use_are_not_fillable(bench):
    # 1 GPU idle for 40 s, then 2 for 60 s: 160 GPU-s. 14.25 GB held leaves 1.75 GB: no 4-GB job fits.
    assert hole(bench, 4096) == (160, 0)


def test_a_smaller_job_fills_every_idle_gpu_its_cpus_and_memory_allow(bench):
    assert hole(bench, 1024) == (160, 160)
    # Two CPUs each: 1 CPU free while `other` runs (none fits), 2 after it (one job, one GPU of two).
    assert hole(bench, 1024, cpus=2) == (160, 60)


def test_a_wait_counts_from_when_its_nodes_gpus_came_free_but_for_rollout_jobs(bench):
    spans = [
        ("learner", "n1", 1, -50.0, None, "own"),  # the run's fixed jobs hold 2 of n1's GPUs throughout
        ("gen", "n1", 1, -50.0, None, "own"),
        ("store", "n1", 0, -50.0, None, "own"),
        ("D", "n2", 4, 0.0, 100.0, "background"),  # n2 is full all along
        ("A", "n1", 2, 0.0, 30.0, "background"),
        ("R", "n1", 2, 30.0, 45.0, "rollout"),  # took A's GPUs as they came free ...
        ("B", "n1", 2, 45.2, 80.0, "background"),  # ... so B waited 15.2 s for what was free at 30
        ("C", "n1", 2, 80.5, 90.0, "background"),  # 0.5 s after B: B's own lateness is not carried
        ("E", "n2", 1, 100.7, 120.0, "background"),  # waited for D on n2 (not for n1's free GPUs)
        ("never", "n1", 1, None, None, "background"),
    ]
    got = bench.waits_after_free(spans, {"n1": 4, "n2": 4}, t0=0.0)
    assert {n: round(w, 6) for n, w in got.items()} == {"D": 0.0, "A": 0.0, "B": 15.2, "C": 0.5, "E": 0.7}
