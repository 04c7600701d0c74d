"""bench/backfill_measure.py, what bench/backfill_live.py measures, on hand-made records: idle
GPU-seconds per node and the part a rollout job of a given shape fits in beside the jobs there
(CPU jobs hold memory too); each background job's wait after its GPUs came free; and why it
pended, by a reckoning of Slurm's backfill plan: blocked by rollout jobs, or Slurm's own latency."""

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
    spec = importlib.util.spec_from_file_location("backfill_measure", BENCH / "backfill_measure.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["backfill_measure"] = mod  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(mod)
        return mod
    finally:
        del sys.modules["backfill_measure"]


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
    S = bench.Stretch
    spans = [
        S("learner", "n1", 1, -50.0, None, "own"),  # the run's fixed jobs hold 2 of n1's GPUs throughout
        S("gen", "n1", 1, -50.0, None, "own"),
        S("store", "n1", 0, -50.0, None, "own"),
        S("D", "n2", 4, 0.0, 100.0, "background"),  # n2 is full all along
        S("A", "n1", 2, 0.0, 30.0, "background"),
        S("R", "n1", 2, 30.0, 45.0, "rollout"),  # took A's GPUs as they came free ...
        S("B", "n1", 2, 45.2, 80.0, "background"),  # ... so B waited 15.2 s for what was free at 30
        S("C", "n1", 2, 80.5, 90.0, "background"),  # 0.5 s after B: B's own lateness is not carried
        S("E", "n2", 1, 100.7, 120.0, "background"),  # waited for D on n2 (not for n1's free GPUs)
        S("never", "n1", 1, None, None, "background"),
    ]
    got = bench.waits_after_free(spans, {"n1": 4, "n2": 4}, t0=0.0)
    assert {n: round(w, 6) for n, w in got.items()} == {"D": 0.0, "A": 0.0, "B": 15.2, "C": 0.5, "E": 0.7}


def test_a_lower_job_starts_first_only_if_it_ends_before_the_higher_ones_booking(bench):
    running = [("n1", 3, 100.0)]  # 1 of n1's 4 GPUs free until its limit at 100
    big = ("big", 4, 60.0)  # first in priority: booked on n1 at 100
    assert bench.startable_now(0.0, running, [big, ("short", 1, 90.0)], {"n1": 4}) == {"short"}
    assert bench.startable_now(0.0, running, [big, ("long", 1, 120.0)], {"n1": 4}) == set()
    assert bench.startable_now(0.0, running, [("long", 1, 120.0)], {"n1": 4}) == {"long"}  # none booked ahead
    # Where both nodes fit now, the fuller takes it; the next job finds the emptier one whole.
    two = bench.startable_now(0.0, running, [("one", 1, 500.0), ("four", 4, 500.0)], {"n1": 4, "n2": 4})
    assert two == {"one", "four"}


def scene(bench, rollout_end: float, b_start: float):
    """C fills n1 beside the run's jobs. On n2, A (1 GPU, 2-min limit) ends early at 43; B (4 GPUs,
    next in priority) waits for n2 and starts at `b_start`; R, a rollout job of 2 GPUs sized to
    end before B's booking at A's limit, gives way (or not) at `rollout_end`. D (2 GPUs, last)
    could fit on n2 beside A without R, but not before B's booking: it waits for B's end."""
    S = bench.Stretch
    spans = [
        S("learner", "n1", 1, -50.0, None, "own"),
        S("gen", "n1", 1, -50.0, None, "own"),
        S("C", "n1", 2, 0.3, 300.0, "background", 420.0, 1),
        S("A", "n2", 1, 0.3, 43.0, "background", 120.0, 2),
        S("B", "n2", 4, b_start, b_start + 35, "background", 120.0, 3),
        S("D", "n2", 2, b_start + 35.4, b_start + 60, "background", 180.0, 4),
    ]
    if rollout_end:
        spans.append(S("R", "n2", 2, 0.5, rollout_end, "rollout", 118.5))
    got = bench.pending_time(spans, {"n1": 4, "n2": 4}, t0=0.0)
    return (
        {n: round(v, 2) for n, v in got.blocked_by_rollout_s.items()},
        {n: round(v, 2) for n, v in got.startable_s.items()},
    )


def test_pending_time_counts_only_the_time_a_rollout_job_held_what_slurm_would_have_started(bench):
    blocked, startable = scene(bench, rollout_end=44.0, b_start=45.0)  # it gave way 1 s after A's end
    assert blocked == {"C": 0.0, "A": 0.0, "B": 1.0, "D": 0.0}  # D: n2's free GPUs were B's from its booking
    assert startable == {"C": 0.3, "A": 0.3, "B": 1.0, "D": 0.4}  # Slurm's own latency, here as written


def test_pending_time_shows_a_rollout_job_that_does_not_give_way(bench):
    blocked, startable = scene(bench, rollout_end=119.0, b_start=119.5)  # it held n2 to its window's end
    assert blocked == {"C": 0.0, "A": 0.0, "B": 76.0, "D": 0.0}
    assert startable["B"] == 0.5


def test_without_rollout_jobs_nothing_is_blocked(bench):
    blocked, startable = scene(bench, rollout_end=0.0, b_start=43.7)
    assert set(blocked.values()) == {0.0}
    assert startable == {"C": 0.3, "A": 0.3, "B": 0.7, "D": 0.4}
