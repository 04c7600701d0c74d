"""The simulator (slurm/sim*.py) and `hpcrl sim`.

GPU-time is conserved in every policy (and the check is not vacuous); sync keeps its phases
apart; async packs nothing; backfill never lets a borrowed task stand in the way of an
owner; trained trajectories respect the staleness bound; runs are deterministic; the
shipped traces load; bad traces and arguments fail with one line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcrl.core.schema import ConfigError
from hpcrl.slurm.sim.backfill import BackfillPolicy
from hpcrl.slurm.sim.engine import BORROW, OWNER, GpuLedger, SimInvariantError, check_conservation
from hpcrl.slurm.sim.run import POLICIES, format_table, simulate
from hpcrl.slurm.sim.trace import World, load_trace, parse_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "slurm" / "sim" / "traces"


@pytest.fixture(scope="module")
def small():
    return load_trace(TRACES / "small.yaml")


@pytest.fixture(scope="module")
def small_results(small):
    world = World(small)
    return {p: simulate(small, p, world=world, timeline_bins=50) for p in POLICIES}


# ------------------------------------------------------------------------------ accounting
@pytest.mark.parametrize("policy", list(POLICIES))
def test_gpu_time_is_conserved(small_results, policy):
    r = small_results[policy]
    for u in (r.learner, r.generator):
        assert u.capacity_s == pytest.approx(u.gpus * r.makespan_s)
        assert u.owner_s + u.packed_s + u.lost_s + u.idle_s == pytest.approx(u.capacity_s, rel=1e-9)
        assert min(u.owner_s, u.packed_s, u.lost_s, u.idle_s) >= 0
    assert 0 < r.useful_fraction <= r.busy_fraction <= 1
    # The binned timeline tells the same story as the totals.
    tl = r.timeline
    for role, u in (("learner", r.learner), ("generator", r.generator)):
        share = sum(sum(tl[f"{role}.{k}"]) for k in ("idle", "owner", "packed", "lost")) / len(tl["t_s"])
        assert share == pytest.approx(1.0, abs=1e-6)
        assert sum(tl[f"{role}.owner"]) / len(tl["t_s"]) == pytest.approx(u.owner_s / u.capacity_s, abs=1e-6)


def test_the_conservation_check_catches_bad_books():
    ledger = GpuLedger(["learner", "generator"])
    ledger.begin(1, OWNER, 0.0)
    with pytest.raises(SimInvariantError, match="double-booked"):
        ledger.begin(1, BORROW, 1.0)
    ledger.end(1, 5.0)
    with pytest.raises(SimInvariantError, match="released while idle"):
        ledger.end(1, 6.0)
    ledger.finish(10.0)
    good = {"learner": [0.0, 0.0, 0.0], "generator": [5.0, 0.0, 0.0]}
    assert check_conservation(ledger, good, 10.0)["generator"].idle_s == pytest.approx(5.0)
    with pytest.raises(SimInvariantError, match="owner time"):
        check_conservation(ledger, {"learner": [0.0, 0.0, 0.0], "generator": [6.0, 0.0, 0.0]}, 10.0)
    with pytest.raises(SimInvariantError, match="not conserved"):
        check_conservation(ledger, good, 12.0)  # capacity that the GPUs never accounted for


# ------------------------------------------------------------------------------ policies
def test_every_policy_trains_every_step_within_the_staleness_bound(small, small_results):
    t = small.training
    for policy, r in small_results.items():
        assert r.steps == t.steps and r.trajectories == t.steps * t.batch_size
        assert sum(r.staleness) == r.trajectories
        bound = 0 if policy == "sync" else t.max_staleness
        assert r.max_staleness == bound and len(r.staleness) == bound + 1
    assert small_results["sync"].staleness == (t.steps * t.batch_size,)


def test_sync_runs_generate_execute_train_one_after_another(small):
    sim = POLICIES["sync"](small, keep_intervals=True).run()
    iv = sim.ledger.intervals
    train = [(s, e) for g, k, s, e in iv if g < sim.L and k == 1]
    gen = [(s, e) for g, k, s, e in iv if g >= sim.L and k == 1]
    assert train and gen
    assert not any(k in (2, 3) for _, k, _, _ in iv), "sync never lends a GPU"
    # Generation never overlaps training: the learner's GPUs idle while the batch is made.
    for ts, te in train:
        assert not any(gs < te and ge > ts for gs, ge in gen)
    learner = sim.ledger.totals[0]
    assert learner[1] == pytest.approx(small.training.steps * small.training.train_s)


def test_async_decouples_but_packs_nothing(small_results):
    r = small_results["async"]
    assert r.learner.packed_s == r.generator.packed_s == r.learner.lost_s == r.generator.lost_s == 0
    assert r.preemptions == 0 and r.packed_tasks == 0
    assert r.makespan_s < small_results["sync"].makespan_s


class _Watched(BackfillPolicy):
    """Backfill with an observer: a borrowed task must never stand between an owner and its GPU."""

    def start_gen(self, g, ep, kind, now, budget=math.inf):
        if kind == BORROW and g >= self.L:
            assert not self.ready[g], f"borrowed task started on generator {g} while its own turn waits"
        if kind == BORROW and g < self.L:
            assert self.state != "train", "borrowed task started on a training learner"
        super().start_gen(g, ep, kind, now, budget)

    def turn_ready(self, ep, now):
        super().turn_ready(ep, now)
        if ep.owner >= 0:
            run = self._run[ep.owner]
            assert run is None or run[2] == OWNER, "an own turn came back and a borrowed task kept the GPU"
            if run is not None and run[0] is ep:
                self.immediate += 1

    def begin_train(self, now):
        assert all(self._run[g] is None for g in self.learner_gpus), "training started on GPUs still lent out"
        super().begin_train(now)


def test_backfill_never_delays_the_owner(small):
    sim = _Watched.__new__(_Watched)
    sim.immediate = 0
    _Watched.__init__(sim, small)
    sim.run()
    assert sim.packer.preemptions > 0 and sim.packer.placements > 100  # both paths exercised
    assert sim.immediate > 100


def test_backfill_packs_and_beats_async_on_the_small_trace(small_results):
    b, a = small_results["backfill"], small_results["async"]
    assert b.learner.packed_s > 0 and b.packed_tasks > 0
    assert b.busy_fraction > a.busy_fraction
    assert b.throughput_per_gpu_hour > a.throughput_per_gpu_hour


def test_runs_are_deterministic_and_policies_see_the_same_episodes(small):
    one, two = simulate(small, "backfill"), simulate(small, "backfill")
    assert dataclasses.replace(one, wall_s=0) == dataclasses.replace(two, wall_s=0)
    assert World(small).episode(123) == World(small).episode(123)
    ep = World(small).episode(7)
    assert ep.turns == len(ep.sandbox_s) >= 1 and all(x > 0 for x in ep.gen_s + ep.sandbox_s)


def test_heavy_tail_trace_meets_the_targets():
    """The issue's targets on the shipped heavy-tail trace (deterministic, simulated time)."""
    trace = load_trace(TRACES / "heavy-tail-300.yaml")
    world = World(trace)
    assert len(world.domains) == 300
    sync, backfill = simulate(trace, "sync", world=world), simulate(trace, "backfill", world=world)
    assert backfill.busy_fraction >= 0.95
    assert backfill.throughput_per_gpu_hour >= 2.5 * sync.throughput_per_gpu_hour
    assert max(i for i, c in enumerate(backfill.staleness) if c) <= trace.training.max_staleness
    table = format_table([sync, backfill])
    assert "backfill" in table and "x" in table.splitlines()[-1]


# ------------------------------------------------------------------------------ traces
@pytest.mark.parametrize("path", sorted(TRACES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_traces_load(path):
    trace = load_trace(path)
    world = World(trace)
    assert len(world.domains) == sum(f.count for f in trace.families)
    assert world.episode(0).turns >= 1


GOOD = """
name: t
cluster: {learner_gpus: 1, generator_gpus: 2, sandbox_slots: 4}
training: {steps: 1, batch_size: 4, train_base_s: 1, train_per_traj_s: 0, weight_sync_s: 1, reload_s: 0}
families:
  - name: f
    count: 2
    gen: {dist: lognormal, median_s: [1, 2], shape: [0.5, 0.5], cap_s: 10}
    sandbox: {dist: pareto, median_s: [1, 2], shape: [2, 2], cap_s: 10}
    turns: {mean: [1, 2], cap: 3}
"""


@pytest.mark.parametrize(
    "edit, path, fragment",
    [
        (("sandbox_slots: 4", "sandbox_slot: 4"), "cluster.sandbox_slot", "did you mean 'sandbox_slots'"),
        (
            ("median_s: [1, 2], shape: [0.5", "median_s: [3, 2], shape: [0.5"),
            "families.0.gen.median_s",
            "low must be <= high",
        ),
        (
            ("median_s: [1, 2], shape: [0.5", "median_s: [1], shape: [0.5"),
            "families.0.gen.median_s",
            "expected [low, high]",
        ),
        (("dist: pareto", "dist: weibull"), "families.0.sandbox.dist", "must be one of lognormal, pareto"),
        (("steps: 1, ", ""), "training.steps", "required key is missing"),
        (
            ("cap_s: 10}\n    sandbox", "cap_s: 1}\n    sandbox"),
            "families.0.gen.cap_s",
            "must be >= the highest median",
        ),
        (("mean: [1, 2]", "mean: [0.5, 2]"), "families.0.turns.mean", "below 1 turn"),
        (("learner_gpus: 1", "learner_gpus: 0"), "cluster.learner_gpus", "must be >= 1"),
    ],
)
def test_bad_traces_name_the_key(edit, path, fragment):
    text = GOOD.replace(*edit)
    assert text != GOOD
    with pytest.raises(ConfigError) as info:
        parse_trace(text, "bad.yaml")
    assert info.value.path == path and fragment in info.value.message
    assert "bad.yaml" in str(info.value)


def test_good_minimal_trace_runs_every_policy():
    trace = parse_trace(GOOD)
    for p in POLICIES:
        assert simulate(trace, p).trajectories == 4


# ------------------------------------------------------------------------------ CLI
def hpcrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", "sim", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_cli_json_and_plot(tmp_path):
    plot = tmp_path / "util.png"
    proc = hpcrl(str(TRACES / "small.yaml"), "--policy", "backfill", "--json", "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["policy"] == "backfill" and doc["trace"] == "small"
    assert 0 < doc["busy_fraction"] <= 1 and doc["learner"]["busy_fraction"] > 0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_table_of_policies():
    proc = hpcrl(str(TRACES / "small.yaml"), "--policy", "all")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[0] for line in proc.stdout.splitlines()]
    assert {"sync", "async", "backfill"} <= set(rows)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["nope.yaml"], "nope.yaml: no such trace file"),
        (["{small}", "--plot", "x.txt"], "--plot x.txt: the file name must end in .png, .pdf, .svg"),
        (["{small}", "--plot", "/no/such/dir/u.png"], "folder /no/such/dir does not exist"),
        (["{small}", "--policy", "all", "--plot", "{tmp}/u.png"], "pick --policy sync, async or backfill"),
        (["{small}", "--bins", "3"], "--bins must be at least 10"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, args, fragment):
    args = [a.format(small=TRACES / "small.yaml", tmp=tmp_path) for a in args]
    proc = hpcrl(*args)
    assert proc.returncode == 2
    assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_cli_bad_trace_content_exit_2(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text(textwrap.dedent(GOOD).replace("count: 2", "count: -2"))
    proc = hpcrl(str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"config error: families.0.count: must be >= 1 (got -2) [{bad}]"
