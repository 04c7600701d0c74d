"""The simulator's live run (slurm/sim/backfill.py, slurm.py, shared.py) and `hpcrl sim`'s newer options.

backfill is async under the coordinator's flow control when no rollout job runs; lending takes
more episodes while others wait on sandboxes; rollout jobs are planned by the live rounds and
hand back what they hold; the simulated Slurm's passes plan as the dev cluster did; old traces
with the retired packer's keys still load and say so; shared GPUs divide their time between the
turns they decode, keep each experiment's episodes in flight, and `--experiments` compares them
with split ones.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hpcrl.core.schema import ConfigError
from hpcrl.slurm.backfill.book import SlurmRollouts
from hpcrl.slurm.sim import backfill as sim_backfill
from hpcrl.slurm.sim.backfill import BackfillPolicy
from hpcrl.slurm.sim.engine import Episode, EventLoop
from hpcrl.slurm.sim.run import simulate
from hpcrl.slurm.sim.slurm import SimJob, SimSlurm
from hpcrl.slurm.sim.trace import EpisodeSpec, SlurmSpec, World, load_trace, parse_trace

from test_sim import GOOD, TRACES
from test_sim_cli import hpcrl


@pytest.fixture(scope="module")
def small():
    return load_trace(TRACES / "small.yaml")


def no_slurm(trace, **training):
    return dataclasses.replace(trace, slurm=None, training=dataclasses.replace(trace.training, **training))


def test_without_rollout_jobs_backfill_is_async_under_the_coordinators_flow_control(tmp_path):
    """No partition to backfill and no lending: the only difference left is flow control, which
    is the coordinator's max(1, max_staleness) x batch (async: AReaL's (max_staleness + 1) x batch)."""
    from hpcrl.core.config import CoordinatorConfig
    from hpcrl.rl.coordinator.coordinator import Coordinator

    heavy = no_slurm(load_trace(TRACES / "sandbox-heavy.yaml"))  # 128 rows never reach 2 batches: alike
    world = World(heavy)
    a, b = simulate(heavy, "async", world=world), simulate(heavy, "backfill", world=world)
    assert dataclasses.replace(b, policy="async", wall_s=0, rollout_jobs=None) == dataclasses.replace(a, wall_s=0)
    assert b.rollout_jobs["submitted"] == 0
    # max_staleness 1: one batch outstanding, so a batch waits for its last episode (sync-like)
    small = no_slurm(load_trace(TRACES / "small.yaml"))
    world = World(small)
    assert simulate(small, "backfill", world=world).makespan_s > 2 * simulate(small, "async", world=world).makespan_s
    t = small.training
    coordinator = Coordinator(
        tmp_path, {"arith/copy": 1.0}, 4, t.batch_size, t.max_staleness, 1, 0, CoordinatorConfig()
    )
    assert BackfillPolicy(small).admit_limit == coordinator.max_ahead == t.batch_size


def test_lending_takes_more_episodes_while_others_wait_on_sandboxes():
    trace = no_slurm(load_trace(TRACES / "sandbox-heavy.yaml"))
    world = World(trace)
    base = simulate(trace, "backfill", world=world)
    lend = simulate(no_slurm(trace, lend_episodes=4), "backfill", world=world)
    assert lend.generator.busy_fraction > base.generator.busy_fraction + 0.05
    assert lend.makespan_s < base.makespan_s
    calls = []
    real = sim_backfill.episodes_to_take
    sim_backfill.episodes_to_take = lambda *a: calls.append(a) or real(*a)
    try:
        BackfillPolicy(no_slurm(trace, lend_episodes=4, steps=1)).run()
    finally:
        sim_backfill.episodes_to_take = real
    assert any(open_ > cap for cap, open_, _, _ in calls)  # it did lend: more open than the batch's rows


def test_rollout_jobs_are_planned_by_the_live_rounds_and_hand_back_what_they_hold(small):
    sim = BackfillPolicy(small)
    assert isinstance(sim.rounds, SlurmRollouts) and sim.rounds.cluster is sim.slurm
    leases = []
    real = sim_backfill.may_lease
    sim_backfill.may_lease = lambda *a: leases.append(a) or real(*a)
    try:
        sim.run()
    finally:
        sim_backfill.may_lease = real
    r = sim.rollout_summary()
    assert r["submitted"] == len(sim.record) >= r["started"] > 0 and sim.rounds.snapshots > 10
    assert r["gave_way"] > 0 and r["episodes_leased"] > 0 and r["episodes_handed_back"] > 0
    assert leases and all(left > 0 for left, _, _ in leases)  # each lease was asked by the live rule
    for rec in sim.record.values():
        job = sim.slurm.jobs[rec["job_id"]]
        assert rec["time_min_min"] == rec["time_limit_min"] - 1 or rec["time_min_min"] > 1
        if not math.isnan(job.start):  # Slurm granted its --time-min (as 22.05 does)
            assert job.planned_end - job.start == rec["time_min_min"] * 60
            assert job.end <= job.planned_end
    lost = sum(sim.ledger.totals[g][3] for g, role in enumerate(sim.roles) if role == "rollout")
    assert lost == pytest.approx(sim.tally["rollout"][2]) and lost > 0  # handed-back work is lost, not busy
    # Other users' jobs start as they would without rollout jobs, but for the give-way's lag.
    others = r["others"]
    assert others["started"] > 10 and others["max_start_delay_s"] < 2 * sim_backfill.SUPERVISOR_POLL_S


def _slurm(**kw) -> SlurmSpec:
    return SlurmSpec(**{"nodes": 2, "gpus_per_node": 4, "cpus_per_node": 8, "mem_gb_per_node": 16.0, **kw})


def _job(name, gpus, limit_s, **kw):
    return SimJob(name, "other", gpus, 1, 256, limit_s, **kw)


def test_the_simulated_backfill_pass_plans_as_the_dev_cluster_did():
    """Measured on the dev cluster (2 nodes of 4 GPUs, bf_resolution 60 s): A (4 GPUs, 3 min) and B
    (2 GPUs, 5 min) start at :08; C (4 GPUs) is expected when A ends (:03:08) on A's node; D (4 GPUs)
    at :05:00 on the same node, C's booking being aligned down to the minute, not at :05:08 on B's."""
    loop = EventLoop()
    ctl = SimSlurm(loop, _slurm(bf_interval_s=1.0))
    for job in (_job("a", 4, 180, run_s=100), _job("b", 2, 300, run_s=100)):
        loop.at(8.0, lambda j, now: ctl.submit(j, now), job)
    c, d = _job("c", 4, 120), _job("d", 4, 120)
    loop.at(11.0, lambda j, now: ctl.submit(j, now), c)
    loop.at(11.0, lambda j, now: ctl.submit(j, now), d)
    loop.at(12.0, lambda _, now: ctl.backfill_pass(now))
    loop.run(lambda: loop.now >= 12.0)
    a = next(j for j in ctl.jobs.values() if j.name == "a")
    assert (a.state, a.start, a.node.name) == ("RUNNING", 8.0, "n0001")
    assert (c.expected_start, c.sched_node, c.reason) == (188.0, "n0001", "Resources")
    assert (d.expected_start, d.sched_node, d.reason) == (300.0, "n0001", "Priority")
    snap = ctl.snapshot()
    assert [p.name for p in snap.pending] == ["c", "d"] and snap.pending[0].sched_nodes == ("n0001",)
    assert {r.name: r.nodes for r in snap.running} == {"a": ("n0001",), "b": ("n0002",)}


def _short_job_beside_a_booking(submit_at: float):
    loop = EventLoop()
    ctl = SimSlurm(loop, _slurm())
    ctl.submit(_job("a", 2, 180, run_s=180), 8.0)
    ctl.submit(_job("b", 4, 600, run_s=600), 8.0)
    c, e = _job("c", 4, 120), _job("e", 1, 300, time_min_s=60.0, nice=True)
    loop.at(9.0, lambda _, now: ctl.submit(c, now))
    loop.at(submit_at, lambda _, now: ctl.submit(e, now))
    loop.at(submit_at + 1, lambda _, now: ctl.backfill_pass(now))
    loop.run(lambda: loop.now >= submit_at + 1)
    return c, e


def test_backfill_starts_a_short_job_only_if_it_ends_by_the_aligned_booking():
    """A holds 2 of n1's GPUs until 188 s, B all of n2's; C needs n1's four: booked from 180 (188
    aligned down). A 60-s job fits n1's 2 free GPUs at 115 s (ends 175), not at 125 s (185); the
    main scheduler stops at C (Resources), so a job behind it waits for a backfill pass (Priority).
    A job with --time-min is granted exactly that."""
    for submit_at, starts in ((115.0, True), (125.0, False)):
        c, e = _short_job_beside_a_booking(submit_at)
        assert c.reason == "Resources" and c.expected_start == 188.0
        assert (e.state == "RUNNING") == starts, submit_at
        if starts:
            assert (e.node.name, e.planned_end - e.start) == ("n0001", 60.0)
        else:
            assert e.reason == "Priority" and e.expected_start == 300.0  # after C's booking


# ------------------------------------------------------------------------------ retired keys, shared GPUs
def test_old_traces_with_the_retired_packer_keys_still_load_and_say_so(tmp_path):
    text = (
        GOOD.replace("reload_s: 0}", "reload_s: 0, resume_s: 1.0}") + "scheduler: {min_chunk_s: 8, fit_quantile: 0.8}\n"
    )
    trace = parse_trace(text)
    assert trace.ignored == ("scheduler.min_chunk_s", "training.resume_s") and trace.scheduler.fit_quantile == 0.8
    path = tmp_path / "old.yaml"
    path.write_text(text)
    proc = hpcrl(str(path), "--policy", "sync")
    assert proc.returncode == 0, proc.stderr
    assert "sets scheduler.min_chunk_s, training.resume_s: ignored" in proc.stderr
    with pytest.raises(ConfigError, match="the loader sets it"):
        parse_trace(GOOD + "ignored: [x]\n")


def test_a_shared_gpu_divides_its_time_between_the_turns_it_decodes():
    from types import SimpleNamespace

    from hpcrl.slurm.sim.shared import _Gpu

    loop = EventLoop()
    gpu = _Gpu(loop, efficiency=0.9)
    done = []

    class Gen:  # hashable, as the engine's generators are
        def __init__(self, exp):
            self.exp, self.turn = exp, None

    exps = [SimpleNamespace(gen_gpu_s=0.0, turn_done=lambda g, ep, now: done.append((ep, now))) for _ in range(2)]
    gens = [Gen(e) for e in exps]
    a, b = (Episode(EpisodeSpec(i, "d", (10.0,), (1.0,)), 0) for i in range(2))
    gpu.start(gens[0], a, 0.0)
    loop.at(5.0, lambda _, now: gpu.start(gens[1], b, now))
    loop.run(lambda: len(done) == 2)
    # a alone for 5 s (half done), then both at 0.45 of full speed: a ends 5 / 0.45 s later, b
    # has 10 - 5 = 5 s of work left then, alone again
    t_a = 5.0 + 5.0 / 0.45
    assert done[0] == (a, pytest.approx(t_a)) and done[1] == (b, pytest.approx(t_a + 5.0))
    assert gpu.busy_s == pytest.approx(t_a + 5.0)
    assert exps[0].gen_gpu_s + exps[1].gen_gpu_s == pytest.approx(gpu.busy_s)
    assert exps[1].gen_gpu_s == pytest.approx((t_a - 5.0) / 2 + 5.0)


def test_shared_generators_keep_the_experiments_episodes_in_flight(small):
    from hpcrl.slurm.sim.shared import _placement, _rows

    rows = _rows(small, 3)  # 12 generator GPUs x 4 episodes over 36 generators of a third of a GPU
    assert len(rows) == 36 and sum(rows) == 48 and set(rows) == {1, 2}
    assert _rows(small, 1) == [4] * 12
    # 32 + 12 generator GPUs, two experiments: each GPU holds two generators, of both where they last
    big = dataclasses.replace(small, name="big", cluster=dataclasses.replace(small.cluster, generator_gpus=32))
    gpus = _placement([big, small], shared=True)
    assert len(gpus) == 44 and all(len(g) == 2 for g in gpus)
    assert sum(g.count(0) for g in gpus) == 64 and sum(g.count(1) for g in gpus) == 24
    assert sum(1 for g in gpus if sorted(g) == [0, 1]) == 24
    assert _placement([big, small], shared=False) == [[0]] * 32 + [[1]] * 12


def test_cli_compares_experiments_on_shared_gpus_against_split_ones(tmp_path):
    paths = []
    for name, seed in (("a", 3), ("b", 4)):
        text = (
            (TRACES / "small.yaml")
            .read_text()
            .replace("name: small", f"name: {name}")
            .replace("seed: 3", f"seed: {seed}")
        )
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(text)
    proc = hpcrl("--experiments", *map(str, paths), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [e["trace"] for e in doc["experiments"]] == ["a", "b"]
    for row in [*doc["experiments"], doc["total"]]:
        for mode in ("shared", "split"):
            assert {"busy", "trajectories_per_gpu_h"} <= set(row[mode]) and row[mode]["trajectories_per_gpu_h"] > 0
    assert 0 < doc["total"]["shared"]["busy"] <= 1 and 0 < doc["generator_pool_busy"]["shared"] <= 1
    assert doc["model"]["generators_per_gpu"] == {"split": 1, "shared": 2}
    assert doc["model"]["episodes_in_flight"] == {"a": 48, "b": 48}  # 12 generators x 4, split or shared
    table = hpcrl("--experiments", *map(str, paths))
    assert table.returncode == 0 and "total" in table.stdout and "traj/GPU-h" in table.stdout
    bad = hpcrl("--experiments", str(paths[0]))
    assert bad.returncode == 2 and "at least two traces" in bad.stderr
