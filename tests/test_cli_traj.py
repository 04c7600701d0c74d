"""`hpcrl traj ls|stats|verify|export|synth`: the store's command line."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import pytest

from hpcrl.jobs.cli import main
from hpcrl.rl.record.trajectory import Trajectory
from hpcrl.rl.store.layout import MANIFEST_NAME, list_shards, read_segment


def run(capsys, *argv):
    code = main(["traj", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def store(tmp_path, capsys):
    """A run directory whose store holds 30 synthetic trajectories from two writers."""
    run_dir = tmp_path / "run"
    (run_dir / "trajectories").mkdir(parents=True)
    assert run(capsys, "synth", run_dir, "--count", 20, "--writer", "gen-a", "--flush-every", 8)[0] == 0
    assert run(capsys, "synth", run_dir, "--count", 10, "--writer", "gen-b", "--seed", 1, "--flush-every", 4)[0] == 0
    return run_dir


def test_synth_prints_acked_totals_after_each_flush(tmp_path, capsys):
    code, out, _ = run(capsys, "synth", tmp_path, "--count", 21, "--flush-every", 8, "--seed", 3)
    assert code == 0
    totals = [int(line.removeprefix("acked ")) for line in out.splitlines()]
    # Syncs finish in the background, so two flushes may be acknowledged in one line.
    assert totals == sorted(set(totals)) and totals[-1] == 21 and set(totals) <= {8, 16, 21}
    [state] = list_shards(tmp_path)
    cols = read_segment(state.path / state.segment_names[0])
    assert cols.ids()[:2] == ["synth/synth/0", "synth/synth/1"]
    assert 1000 < len(cols.tokens) / cols.rows < 10000  # "a few thousand tokens" per trajectory


def test_synth_is_deterministic_given_seed(tmp_path, capsys):
    for d in ("a", "b"):
        run(capsys, "synth", tmp_path / d, "--count", 5, "--seed", 9)
    docs = []
    for d in ("a", "b"):
        _code, out, _ = run(capsys, "export", tmp_path / d)
        docs.append(
            [
                {k: v for k, v in json.loads(line).items() if k not in ("started_at", "finished_at")}
                for line in out.splitlines()
            ]
        )
    assert docs[0] == docs[1]


def test_ls(store, capsys):
    code, out, _ = run(capsys, "ls", store)
    assert code == 0
    assert out.splitlines()[-1].startswith("2 shard(s), 30 trajectories, ")
    code, out, _ = run(capsys, "ls", store, "--json")
    shards = json.loads(out)["shards"]
    assert [(s["writer"], s["status"], s["segments"], s["rows"]) for s in shards] == [
        ("gen-a", "closed", 3, 20),
        ("gen-b", "closed", 3, 10),
    ]
    assert all(s["bytes"] > 0 for s in shards)


def test_stats(store, capsys):
    code, out, _ = run(capsys, "stats", store, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["trajectories"] == 30
    assert sum(d["count"] for d in data["reward_by_domain"].values()) == 30
    assert data["policy_versions"]["min"] == 0 and data["policy_versions"]["max"] >= 0
    assert sum(data["policy_versions"]["steps_by_version"].values()) == data["steps"]
    assert data["bytes"] == sum(p.stat().st_size for p in (store / "trajectories").rglob("seg-*.h5"))
    code, text, _ = run(capsys, "stats", store)
    assert text.startswith("trajectories 30 ") and "mean_reward=" in text and "policy versions 0.." in text


def test_verify_ok_then_damaged(store, capsys):
    code, out, _ = run(capsys, "verify", store)
    assert code == 0 and "all 2 shard(s) verified" in out
    state = list_shards(store / "trajectories")[0]
    seg = state.path / state.segment_names[1]
    with h5py.File(seg, "r") as f:
        offset = f["logprobs"].id.get_offset()
    with open(seg, "r+b") as fh:
        fh.seek(offset + 3)
        fh.write(b"\x7f")
    code, out, _ = run(capsys, "verify", store, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    bad = [s for s in report["shards"] if not s["ok"]]
    assert len(bad) == 1 and "checksum mismatch" in bad[0]["problems"][0]
    code, out, _ = run(capsys, "verify", store)
    assert code == 1 and out.startswith("BAD ") and "NOT all" in out


def test_verify_flags_manifest_tampering(store, capsys):
    state = list_shards(store / "trajectories")[1]
    data = json.loads((state.path / MANIFEST_NAME).read_text())
    data["segments"][0]["rows"] += 1
    data["rows"] += 1
    (state.path / MANIFEST_NAME).write_text(json.dumps(data))
    code, out, _ = run(capsys, "verify", store)
    assert code == 1 and "the manifest says" in out


def test_verify_repair_finalizes_an_orphaned_shard(store, capsys):
    state = list_shards(store / "trajectories")[1]
    (state.path / MANIFEST_NAME).unlink()
    writer, stamp, host, _, rand = state.name.split(".")
    p = subprocess.Popen(["true"])
    p.wait()
    state.path.rename(state.path.with_name(f"{writer}.{stamp}.{host}.{p.pid}.{rand}"))
    code, out, _ = run(capsys, "verify", store)
    assert code == 0 and "orphaned" in out and "--repair" in out
    code, out, _ = run(capsys, "verify", store, "--repair")
    assert code == 0 and "(recovered, 3 segments, 10 rows)" in out


def test_export_writes_jsonl_that_round_trips(store, tmp_path, capsys):
    target = tmp_path / "out.jsonl"
    code, _, err = run(capsys, "export", store, "-o", target)
    assert code == 0 and "exported 30 trajectories" in err
    trajs = [Trajectory.from_dict(json.loads(line)) for line in target.read_text().splitlines()]
    stored = []
    for state in list_shards(store / "trajectories"):
        for name in state.segment_names:
            cols = read_segment(state.path / name)
            stored += [cols.trajectory(i) for i in range(cols.rows)]
    assert trajs == stored
    code, out, err = run(capsys, "export", store, "--json")
    assert len(out.splitlines()) == 30 and json.loads(err)["exported"] == 30


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["ls", "/nonexistent/run"], "no such directory"),
        (["verify", "/nonexistent/run"], "no such directory"),
        (["synth", "{tmp}", "--count", "0"], "--count must be >= 1"),
        (["synth", "{tmp}", "--count", "3", "--flush-every", "0"], "store.flush_every: must be >= 1"),
        (["synth", "{tmp}", "--count", "3", "--writer", "bad.name"], "no dots"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, fragment):
    code, _out, err = run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_entry_point_lists_traj():
    res = subprocess.run([sys.executable, "-m", "hpcrl.jobs.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "traj" in res.stdout
    res = subprocess.run([sys.executable, "-m", "hpcrl.jobs.cli", "traj", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and all(v in res.stdout for v in ("ls", "stats", "verify", "export", "synth"))
