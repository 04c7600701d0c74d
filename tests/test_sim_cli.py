"""Traces and `hpcrl sim`: the shipped traces load, a trace draws from families or replays a run
directory's measured episodes, bad traces, run directories and arguments fail with one line and
exit code 2, and `--policy all --json` keeps its fields and adds the rollout jobs'."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hpcrl.core.schema import ConfigError
from hpcrl.slurm.sim.run import POLICIES, simulate
from hpcrl.slurm.sim.trace import World, load_trace, parse_trace

from test_sim import GOOD, ROOT, TRACES


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with stored trajectories, written by the real shard writer (no training run)."""
    import numpy as np

    from hpcrl.rl.record.synth import TINY_SHAPE, synth_trajectory
    from hpcrl.rl.store.writer import ShardWriter

    run = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(4)
    with ShardWriter(run / "trajectories", "gen-0", dedup=False) as w:
        for i in range(120):
            w.append(synth_trajectory(rng, "r", "gen-0", i, TINY_SHAPE))
    return run


def test_cli_replays_a_run_directory(run_dir):
    from hpcrl.jobs.cli.sim import read_store
    from hpcrl.slurm.sim.replay import read_measured

    measured, bad = read_measured(run_dir, read_store)
    assert len(measured) == 120 and not bad
    longest = max(sum(m.gen_s) + sum(m.sandbox_s) for m in measured)
    proc = hpcrl(str(run_dir), "--setup", str(TRACES / "small.yaml"), "--policy", "all", "--json", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    assert [d["policy"] for d in docs] == ["sync", "sync-split", "async", "backfill"]
    for d in docs:
        assert d["replay"]["episodes"] == 120 and d["steps"] == 2
        assert 0 < d["started_len_s"]["max"] <= longest * (1 + 1e-9)
        assert d["useful"] <= d["busy"]
    table = hpcrl(str(run_dir), "--setup", str(TRACES / "small.yaml"), "--policy", "all", "--steps", "2")
    assert table.returncode == 0 and "120 measured episodes" in table.stdout and "sync-split" in table.stdout


def test_a_trace_file_may_name_a_run_to_replay(run_dir, tmp_path):
    trace = tmp_path / "replay.yaml"
    text = textwrap.dedent(GOOD)
    text = text[: text.index("families:")] + f"replay: {run_dir.name}\n"
    (tmp_path / run_dir.name).symlink_to(run_dir)
    trace.write_text(text)
    assert load_trace(trace).replay == str(tmp_path / run_dir.name)
    proc = hpcrl(str(trace), "--policy", "sync", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["replay"]["episodes"] == 120


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_traces_load(path):
    trace = load_trace(path)
    world = World(trace)
    assert len(world.domains) == sum(f.count for f in trace.families)
    assert world.episode(0).turns >= 1


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


def test_a_trace_draws_from_families_or_replays_a_run():
    no_families = GOOD[: GOOD.index("families:")]
    with pytest.raises(ConfigError) as info:
        parse_trace(no_families)
    assert info.value.path == "families" and "replay" in info.value.message
    with pytest.raises(ConfigError) as info:
        parse_trace(GOOD + "replay: runs/x\n")
    assert info.value.path == "replay" and "not both" in info.value.message


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
    assert 0 < doc["useful"] <= doc["busy"] <= 1 and doc["learner"]["busy_fraction"] > 0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    proc = hpcrl(str(TRACES / "small.yaml"), "--policy", "sync", "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr


def test_cli_json_of_all_policies_keeps_its_contract():
    """`--policy all --json`: a list, one object per policy, with the documented keys."""
    proc = hpcrl(str(TRACES / "small.yaml"), "--policy", "all", "--json")
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    assert isinstance(docs, list) and [d["policy"] for d in docs] == ["sync", "sync-split", "async", "backfill"]
    for d in docs:
        for key in ("busy", "useful", "dropped"):
            assert isinstance(d[key], float) and 0 <= d[key] <= 1, (d["policy"], key)
        assert d["useful"] <= d["busy"] and d["useful"] + d["dropped"] + d["open"] == pytest.approx(d["busy"])
        for key in ("trained_len_s", "started_len_s"):
            assert {"mean", "p99", "max"} <= set(d[key])
            assert 0 < d[key]["mean"] <= d[key]["p99"] <= d[key]["max"]
        assert d["episodes"]["started"] == d["episodes"]["trained"] + d["episodes"]["dropped"] + d["episodes"]["open"]
    before = {  # every key the output had before the simulator ran the live planner
        *("policy", "trace", "drop_stale", "busy", "useful", "dropped", "open", "lost", "trained_len_s"),
        *("started_len_s", "dropped_len_s", "traj_per_gpu_hour", "trajectories", "steps", "makespan_s", "gpu_h"),
        *("episodes", "staleness", "learner_gpus", "generator_gpus", "learner", "generator", "packer"),
        *("sandbox_busy", "events", "wall_s"),
    }
    for d in docs:
        assert before <= set(d), before - set(d)
    by = {d["policy"]: d for d in docs}
    assert by["sync"]["dropped"] == 0 and by["async"]["dropped"] > 0
    jobs = by["backfill"]["rollout_jobs"]  # counted as bench/backfill_live.py counts a live run's
    assert {"submitted", "started", "withdrawn", "gave_way", "ended_in_window"} <= set(jobs)
    assert jobs["submitted"] >= jobs["started"] > 0 and all(isinstance(jobs[k], int) for k in ("started", "gave_way"))
    assert "rollout_jobs" not in by["async"]
    assert by["sync"]["traj_per_gpu_hour"] > by["sync-split"]["traj_per_gpu_hour"]


def test_cli_no_drop():
    proc = hpcrl(str(TRACES / "small.yaml"), "--policy", "all", "--no-drop", "--json")
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    assert {d["episodes"]["trained"] for d in docs} == {d["episodes"]["started"] for d in docs} == {384}
    assert all(d["dropped"] == 0 and not d["staleness"]["enforced"] for d in docs)
    table = hpcrl(str(TRACES / "small.yaml"), "--policy", "all", "--no-drop")
    assert table.returncode == 0 and "no drops" in table.stdout and "(no drop)" in table.stdout


def test_cli_table_of_policies():
    proc = hpcrl(str(TRACES / "small.yaml"), "--policy", "all")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert {"sync", "sync-split", "async", "backfill"} <= set(rows)
    head = proc.stdout.splitlines()[1]
    for column in ("busy", "useful", "dropped", "trained len s", "started len s", "vs sync"):
        assert column in head


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["nope.yaml"], "nope.yaml: no such trace file"),
        (["{small}", "--plot", "x.txt"], "--plot x.txt: the file name must end in .png, .pdf, .svg"),
        (["{small}", "--plot", "/no/such/dir/u.png"], "folder /no/such/dir does not exist"),
        (["{small}", "--policy", "all", "--plot", "{tmp}/u.png"], "pick --policy sync, sync-split, async, backfill"),
        (["{small}", "--bins", "3"], "--bins must be at least 10"),
        (["{tmp}"], "no trajectories to replay"),
        (["{tmp}", "--setup", "{small}"], "no trajectories to replay"),
        (["{run}"], "a run directory takes its cluster and training from --setup"),
        (["{run}", "--setup", "{tmp}/nope.yaml"], "nope.yaml: no such trace file"),
        (["{small}", "--setup", "{small}"], "--setup is for replaying a run directory"),
        (["{bad}"], "invalid YAML"),
        (["{small}", "--learner-gpus", "0"], "cluster.learner_gpus: must be >= 1"),
        (["{small}", "--experiments", "{small}", "{small}"], "--experiments takes trace files only"),
        ([], "give a TRACE file or run directory"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, run_dir, args, fragment):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncluster: {learner_gpus: 1\n")
    args = [a.format(small=TRACES / "small.yaml", tmp=tmp_path, run=run_dir, bad=bad) for a in args]
    proc = hpcrl(*args)
    assert proc.returncode == 2
    assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_cli_bad_trace_content_exit_2(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text(textwrap.dedent(GOOD).replace("count: 2", "count: -2"))
    proc = hpcrl(str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"config error: families.0.count: must be >= 1 (got -2) [{bad}]"
