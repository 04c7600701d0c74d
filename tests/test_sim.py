"""The simulator (slurm/sim/): its live run and shared GPUs are tests/test_sim_live.py, traces and
`hpcrl sim` tests/test_sim_cli.py. GPU-time is conserved in every policy (and the check is not
vacuous), rollout jobs' GPUs included, and so is the split of busy time into useful, dropped and
open work; fair sync lets every GPU generate and train and beats sync-split on every shipped
trace; async holds no rollout GPU; trained trajectories respect the staleness bound, and with
drop_stale off every started episode is trained (the same episodes under every policy); trained
vs started lengths show a policy that drops long episodes; runs are deterministic; a run
directory's measured episodes replay once per pass.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpcrl.core.schema import ConfigError
from hpcrl.slurm.sim.engine import (
    DROPPED,
    OWNER,
    TRAINED,
    Episode,
    GpuLedger,
    Lengths,
    SimInvariantError,
    check_conservation,
    check_work,
)
from hpcrl.slurm.sim.run import POLICIES, format_table, simulate
from hpcrl.slurm.sim.trace import EpisodeSpec, MeasuredEpisode, World, load_trace, parse_trace, replay_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "slurm" / "sim" / "traces"


@pytest.fixture(scope="module")
def small():
    return load_trace(TRACES / "small.yaml")


@pytest.fixture(scope="module")
def small_results(small):
    world = World(small)
    return {p: simulate(small, p, world=world, timeline_bins=50) for p in POLICIES}


def no_drop(trace):
    return dataclasses.replace(trace, training=dataclasses.replace(trace.training, drop_stale=False))


@pytest.fixture(scope="module")
def small_no_drop(small):
    trace = no_drop(small)
    world = World(trace)
    return {p: simulate(trace, p, world=world) for p in POLICIES}


@pytest.fixture(scope="module")
def heavy():
    trace = load_trace(TRACES / "heavy-tail-300.yaml")
    world = World(trace)
    return trace, {p: simulate(trace, p, world=world) for p in ("sync", "sync-split", "backfill")}


# ------------------------------------------------------------------------------ accounting
@pytest.mark.parametrize("policy", list(POLICIES))
def test_gpu_time_is_conserved(small_results, policy):
    r = small_results[policy]
    for u in (r.learner, r.generator):
        assert u.capacity_s == pytest.approx(u.gpus * r.makespan_s)
    for u in (r.learner, r.generator, r.rollout):
        assert u.owner_s + u.packed_s + u.lost_s + u.idle_s == pytest.approx(u.capacity_s, rel=1e-9)
        assert min(u.owner_s, u.lost_s, u.idle_s) >= 0 and u.packed_s == 0
    assert r.capacity_s == pytest.approx(r.learner.capacity_s + r.generator.capacity_s + r.rollout.capacity_s)
    assert (r.rollout.capacity_s > 0) == (policy == "backfill")  # the small trace's rollout jobs ran
    assert 0 < r.useful_fraction <= r.busy_fraction <= 1
    # Busy time is exactly training + trained + dropped + open work, each episode counted once.
    w = r.work
    assert w.useful_s + w.dropped_s + w.open_s == pytest.approx(r.busy_fraction * r.capacity_s, rel=1e-9)
    assert r.useful_fraction + r.dropped_fraction + r.open_fraction == pytest.approx(r.busy_fraction, rel=1e-9)
    assert w.trained + w.dropped + w.open == r.episodes_started
    assert w.trained == r.trajectories and w.dropped == r.dropped_episodes
    # The binned timeline tells the same story as the totals.
    tl = r.timeline
    for role, u in (("learner", r.learner), ("generator", r.generator)):
        share = sum(sum(tl[f"{role}.{k}"]) for k in ("idle", "owner", "packed", "lost")) / len(tl["t_s"])
        assert share == pytest.approx(1.0, abs=1e-6)
        assert sum(tl[f"{role}.owner"]) / len(tl["t_s"]) == pytest.approx(u.owner_s / u.capacity_s, abs=1e-6)
    bin_s = r.makespan_s / len(tl["t_s"])  # rollout GPUs in GPUs, not a share: their number changes
    assert sum(sum(tl[f"rollout.{k}"]) for k in ("idle", "owner", "lost")) * bin_s == pytest.approx(
        r.rollout.capacity_s, rel=1e-6
    )


def test_the_conservation_check_catches_bad_books():
    ledger = GpuLedger(["learner", "generator"])
    ledger.begin(1, OWNER, 0.0)
    with pytest.raises(SimInvariantError, match="double-booked"):
        ledger.begin(1, OWNER, 1.0)
    ledger.end(1, 5.0)
    with pytest.raises(SimInvariantError, match="released while idle"):
        ledger.end(1, 6.0)
    g = ledger.add("rollout", 2.0)  # a rollout job's GPU, held from 2 s to 8 s; 3 s of work, 1 s lost
    ledger.begin(g, OWNER, 3.0)
    ledger.end(g, 7.0)
    with pytest.raises(SimInvariantError, match="released while busy"):
        ledger.begin(g, OWNER, 7.0) or ledger.release(g, 7.5)
    ledger.end(g, 7.5)
    ledger.move(g, 1.5, [])
    ledger.release(g, 8.0)
    ledger.finish(10.0)
    good = {"learner": [0.0, 0.0, 0.0], "generator": [5.0, 0.0, 0.0], "rollout": [3.0, 0.0, 1.5]}
    usage = check_conservation(ledger, good, 10.0)
    assert usage["generator"].idle_s == pytest.approx(5.0)
    assert (usage["rollout"].capacity_s, usage["rollout"].idle_s, usage["rollout"].lost_s) == (6.0, 1.5, 1.5)
    with pytest.raises(SimInvariantError, match="owner time"):
        check_conservation(ledger, {**good, "generator": [6.0, 0.0, 0.0]}, 10.0)
    with pytest.raises(SimInvariantError, match="lost time"):
        check_conservation(ledger, {**good, "rollout": [3.0, 0.0, 0.0]}, 10.0)  # lost work not accounted for
    with pytest.raises(SimInvariantError, match="not conserved"):
        check_conservation(ledger, good, 12.0)  # capacity that the GPUs never accounted for


def test_the_work_check_catches_bad_books():
    spec = EpisodeSpec(0, "d", (3.0,), (1.0,))
    trained, dropped, open_ = Episode(spec, 0), Episode(dataclasses.replace(spec, index=1), 0), Episode(spec, 0)
    for ep, gpu_s in ((trained, 3.0), (dropped, 3.0), (open_, 1.0)):
        ep.gpu_s = gpu_s
    trained.advance()
    trained.fate, dropped.fate = TRAINED, DROPPED
    eps = [trained, dropped, open_]
    w = check_work(eps, busy_s=17.0, training_s=10.0, open_expected=1)
    assert (w.useful_s, w.dropped_s, w.open_s, w.trained, w.dropped, w.open) == (13.0, 3.0, 1.0, 1, 1, 1)
    with pytest.raises(SimInvariantError, match="busy GPU time"):
        check_work(eps, busy_s=18.0, training_s=10.0, open_expected=1)  # a GPU-second nobody did
    with pytest.raises(SimInvariantError, match="neither trained nor dropped"):
        check_work(eps, busy_s=17.0, training_s=10.0, open_expected=0)  # an episode lost from the books
    open_.fate = TRAINED
    with pytest.raises(SimInvariantError, match="before its last turn"):
        check_work(eps, busy_s=17.0, training_s=10.0, open_expected=0)


def test_lengths_summary():
    xs = [float(i) for i in range(1, 201)]
    assert Lengths.of(xs) == Lengths(200, 100.5, 198.0, 200.0)
    assert Lengths.of([]).to_json() == {"n": 0, "mean": 0.0, "p99": 0.0, "max": 0.0}
    assert EpisodeSpec(0, "d", (1.0, 2.0), (0.5, 0.25)).length_s == 3.75


# ------------------------------------------------------------------------------ policies
def test_every_policy_trains_every_step_within_the_staleness_bound(small, small_results):
    t = small.training
    for policy, r in small_results.items():
        assert r.steps == t.steps and r.trajectories == t.steps * t.batch_size
        assert sum(r.staleness) == r.trajectories
        bound = 0 if policy.startswith("sync") else t.max_staleness
        assert r.max_staleness == bound and len(r.staleness) == bound + 1
    for policy in ("sync", "sync-split"):
        r = small_results[policy]
        assert r.staleness == (t.steps * t.batch_size,)
        assert (
            r.episodes_started == r.trajectories
            and r.dropped_episodes == 0
            and r.useful_fraction == pytest.approx(r.busy_fraction)
        )


def _phases(sim):
    iv = sim.ledger.intervals
    gen = [(g, s, e) for g, k, s, e in iv if k == 1 and not _is_training(sim, s, e)]
    train = [(g, s, e) for g, k, s, e in iv if k == 1 and _is_training(sim, s, e)]
    return gen, train


def _is_training(sim, s, e):
    return any(abs(s - ts) < 1e-9 and abs(e - te) < 1e-9 for ts, te in sim.train_spans)


class _Spans:
    """Records the training steps' spans."""

    def begin_train(self, now, gpus=None, duration=None):
        self.train_spans.append((now, now + (self.trace.training.train_s if duration is None else duration)))
        super().begin_train(now, gpus, duration)


def _run_recording(policy: str, trace):
    cls = type(f"Spans{policy}", (_Spans, POLICIES[policy]), {})
    sim = cls.__new__(cls)
    sim.train_spans = []
    cls.__init__(sim, trace, keep_intervals=True)
    return sim.run()


def test_sync_split_keeps_learner_and_generators_apart(small):
    sim = _run_recording("sync-split", small)
    gen, train = _phases(sim)
    assert train and gen
    assert not any(k in (2, 3) for _, k, _, _ in sim.ledger.intervals), "nothing is lost in sync"
    assert all(g >= sim.L for g, _, _ in gen), "learner GPUs never generate in sync-split"
    assert all(g < sim.L for g, _, _ in train), "generators never train in sync-split"
    # Generation never overlaps training: the learner's GPUs idle while the batch is made.
    for _, ts, te in train:
        assert not any(gs < te and ge > ts for _, gs, ge in gen)
    learner = sim.ledger.totals[0]
    assert learner[1] == pytest.approx(small.training.steps * small.training.train_s)


def test_fair_sync_generates_on_every_gpu_then_trains_on_every_gpu(small):
    sim = _run_recording("sync", small)
    gen, train = _phases(sim)
    n = sim.L + sim.G
    assert {g for g, _, _ in gen} == set(range(n)), "every GPU generates"
    assert not any(k in (2, 3) for _, k, _, _ in sim.ledger.intervals)
    t = small.training
    step_s = t.train_base_s + t.train_per_traj_s * t.batch_size * sim.L / n
    assert len(train) == t.steps * n and all(e - s == pytest.approx(step_s) for _, s, e in train)
    for _, ts, te in train:  # a barrier: no GPU generates while the batch trains
        assert not any(gs < te and ge > ts for _, gs, ge in gen)
    assert sim.train_gpu_s == pytest.approx(t.steps * n * step_s)


def test_fair_sync_is_work_conserving(small):
    """No GPU idles while a turn of the batch is ready to run, and long domains start first."""
    from hpcrl.slurm.sim.policies import SyncPolicy

    class Watched(SyncPolicy):
        checks = 0

        def _dispatch(self, now):
            super()._dispatch(now)
            assert not (self.idle and (self.back or self.pool)), "a free GPU left a ready turn waiting"
            Watched.checks += 1

        def start_order(self, batch):
            out = super().start_order(batch)
            q = self.trace.scheduler.fit_quantile
            keys = [self.length_est.quantile(ep.spec.domain, q) for ep in out]
            assert keys == sorted(keys, reverse=True)
            Watched.distinct = max(Watched.distinct, len(set(keys)))
            return out

    Watched.distinct = 0
    sim = Watched(small).run()
    assert Watched.checks > 1000 and sim.steps_done == small.training.steps
    assert Watched.distinct > 10  # the estimates learned from earlier steps do reorder the batch


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.yaml")), ids=lambda p: p.name)
def test_fair_sync_beats_sync_split_on_the_shipped_traces(path):
    trace = load_trace(path)
    world = World(trace)
    fair, split = simulate(trace, "sync", world=world), simulate(trace, "sync-split", world=world)
    assert fair.trajectories == split.trajectories == trace.training.steps * trace.training.batch_size
    assert fair.trained_len == split.trained_len  # the same episodes, on-policy
    assert fair.makespan_s < split.makespan_s
    assert fair.throughput_per_gpu_hour > split.throughput_per_gpu_hour


def test_async_holds_no_rollout_gpu_and_loses_nothing(small_results):
    r = small_results["async"]
    assert r.rollout.capacity_s == r.learner.lost_s == r.generator.lost_s == 0
    assert r.preemptions == 0 and r.packed_tasks == 0 and r.rollout_jobs is None
    assert r.makespan_s < small_results["sync"].makespan_s < small_results["sync-split"].makespan_s


def test_runs_are_deterministic_and_policies_see_the_same_episodes(small):
    one, two = simulate(small, "backfill"), simulate(small, "backfill")
    assert dataclasses.replace(one, wall_s=0) == dataclasses.replace(two, wall_s=0)
    assert World(small).episode(123) == World(small).episode(123)
    ep = World(small).episode(7)
    assert ep.turns == len(ep.sandbox_s) >= 1 and all(x > 0 for x in ep.gen_s + ep.sandbox_s)


def test_heavy_tail_trace_against_the_fair_sync(heavy):
    """The live run on the shipped heavy-tail trace (deterministic, simulated time), against the
    fair sync baseline: several times its throughput, within the staleness bound."""
    trace, r = heavy
    assert len(World(trace).domains) == 300
    sync, backfill = r["sync"], r["backfill"]
    assert backfill.throughput_per_gpu_hour >= 2.5 * sync.throughput_per_gpu_hour
    assert backfill.rollout_jobs["started"] > 10 and backfill.rollout.capacity_s > 0
    assert max(i for i, c in enumerate(backfill.staleness) if c) <= trace.training.max_staleness
    table = format_table([r["sync"], r["sync-split"], backfill])
    assert "backfill" in table and "x" in table.splitlines()[-1]
    assert "trained len s" in table and "useful" in table


def test_dropping_long_episodes_shows_in_the_lengths(heavy):
    """Backfill wins partly by dropping stale episodes, and the stale ones are the long ones:
    the trained length distribution says so; sync trains what it starts."""
    _, r = heavy
    b, s = r["backfill"], r["sync"]
    assert b.dropped_episodes > 0 and b.dropped_fraction > 0
    assert b.trained_len.max < b.started_len.max and b.trained_len.mean < b.started_len.mean
    assert b.dropped_len.mean > b.started_len.mean
    assert s.trained_len == s.started_len and s.dropped_fraction == 0


# ------------------------------------------------------------------------------ no drops
def test_no_drop_trains_every_started_episode_the_same_under_every_policy(small, small_no_drop):
    t = small.training
    n = t.steps * t.batch_size
    base = small_no_drop["sync"]
    for policy, r in small_no_drop.items():
        assert not r.drop_stale
        assert r.episodes_started == r.trajectories == n, policy
        assert r.dropped_episodes == 0 and r.dropped_fraction == 0 and r.work.open == 0
        assert r.trained_len == r.started_len == base.started_len, policy  # episodes 0..n-1, every one
        assert sum(r.staleness) == n
    # Trained at whatever staleness it took: the bound is not enforced, and here it is exceeded.
    assert max(r.max_trained_staleness for r in small_no_drop.values()) > t.max_staleness
    assert small_no_drop["async"].throughput_per_gpu_hour > small_no_drop["sync"].throughput_per_gpu_hour


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


def test_no_drop_is_a_trace_key_too():
    trace = parse_trace(GOOD.replace("reload_s: 0}", "reload_s: 0, drop_stale: false}"))
    assert trace.training.drop_stale is False
    for p in POLICIES:
        r = simulate(trace, p)
        assert r.episodes_started == r.trajectories == 4


# ------------------------------------------------------------------------------ replay
def _measured(n=40):
    return [
        MeasuredEpisode(f"d{i % 3}", tuple(1.0 + (i * k) % 7 for k in range(1, 2 + i % 3)), (0.5,) * (1 + i % 3))
        for i in range(n)
    ]


def test_replay_world_replays_every_measured_episode_once_per_pass(small):
    trace = replay_trace("/some/run", TRACES / "small.yaml")
    assert trace.replay and not trace.families and trace.cluster == small.cluster
    measured = _measured()
    world = World(trace, measured)
    assert world.domain_names == ("d0", "d1", "d2") and world.domains == ()
    first = [world.episode(i) for i in range(40)]
    second = [world.episode(i) for i in range(40, 80)]
    key = lambda e: (e.domain, e.gen_s, e.sandbox_s)
    want = sorted((m.domain, m.gen_s, m.sandbox_s) for m in measured)
    assert sorted(map(key, first)) == want == sorted(map(key, second))
    assert list(map(key, first)) != list(map(key, second))  # a fresh order each pass
    assert World(trace, measured).episode(57) == world.episode(57)  # deterministic
    with pytest.raises(ValueError, match="pass its measured episodes"):
        World(trace)
    r = simulate(trace, "backfill", world=world)
    assert r.trajectories == small.training.steps * small.training.batch_size


def test_replay_trace_names_what_is_missing():
    with pytest.raises(ConfigError) as info:
        replay_trace("/some/run")
    assert info.value.path == "cluster" and "required key is missing" in info.value.message
    trace = replay_trace("/some/run", TRACES / "small.yaml", {"cluster": {"learner_gpus": 2}, "training": {"steps": 3}})
    assert trace.cluster.learner_gpus == 2 and trace.training.steps == 3 and trace.name == "small"


# ------------------------------------------------------------------------------ traces


# ------------------------------------------------------------------------------ CLI
