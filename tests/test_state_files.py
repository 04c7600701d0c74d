"""State that survives a crash: a corrupt state file falls back to its previous copy
with a warning naming it, both corrupt is a one-line error, and a learner resumes from the newest
whole checkpoint. The DeepSpeed side of the last is in tests/test_learner.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from hpcrl.core.config import CoordinatorConfig
from hpcrl.core.files import StateFileError, atomic_write_json, previous_copy, read_state_json
from hpcrl.jobs.launch import read_jobs, write_jobs
from hpcrl.rl.coordinator.coordinator import Coordinator
from hpcrl.rl.learner.checkpoints import COMPLETE_NAME, CheckpointError, mark_complete, prune_checkpoints, resume_tag


def test_a_corrupt_state_file_falls_back_to_its_previous_copy(tmp_path, caplog):
    path = tmp_path / "state.json"
    atomic_write_json(path, {"n": 1}, keep_previous=True)
    assert not previous_copy(path).exists()
    atomic_write_json(path, {"n": 2}, keep_previous=True)
    assert read_state_json(path) == {"n": 2} and json.loads(previous_copy(path).read_text()) == {"n": 1}
    for damage in (path.read_bytes()[:5], b"\xff\xfe{", b'{"m": 3}'):
        path.write_bytes(damage)
        with caplog.at_level(logging.WARNING, logger="hpcrl.files"):
            caplog.clear()
            assert read_state_json(path, check=lambda d: d["n"]) == {"n": 1}
        assert str(path) in caplog.text and str(previous_copy(path)) in caplog.text
    # Between the two renames of a write only the previous copy exists: it is taken.
    path.unlink()
    assert read_state_json(path) == {"n": 1}
    previous_copy(path).write_text("{")
    path.write_text("[")
    with pytest.raises(StateFileError) as err:
        read_state_json(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and str(previous_copy(path)) in msg and "restore it" in msg
    assert read_state_json(tmp_path / "absent.json") is None


def _coordinator(run_dir) -> Coordinator:
    cfg = CoordinatorConfig(lease_s=60.0, max_attempts=3)
    weights = {"arith/copy": 1.0}
    return Coordinator(run_dir, weights, group_size=4, batch_groups=2, max_staleness=2, max_steps=5, seed=0, cfg=cfg)


def test_a_coordinator_resumes_from_the_previous_state_when_state_json_is_truncated(tmp_path, caplog):
    c = _coordinator(tmp_path)
    c.handle("sync", {"generator": "g0", "want": 8, "done": [], "failed": [], "released": [], "stats": {}})
    c._save()
    before = c.groups_issued
    c.handle("learner", {"step": 1, "version": 1, "trained_groups": 2, "dropped_groups": 0})
    c.handle("sync", {"generator": "g0", "want": 8, "done": [], "failed": [], "released": [], "stats": {}})
    c._save()
    assert c.groups_issued > before
    state = c._state_path
    state.write_bytes(state.read_bytes()[: len(state.read_bytes()) // 2])  # a crash the filesystem lost
    with caplog.at_level(logging.WARNING, logger="hpcrl.files"):
        again = _coordinator(tmp_path)
    assert again.groups_issued == before and str(state) in caplog.text
    assert len(again.queue) == 8  # what the previous state had out is issued again
    # Both copies unreadable: the coordinator refuses to start, naming them, rather than
    # starting over (which would issue episode numbers already in the store a second time).
    previous_copy(state).write_text("not json")
    with pytest.raises(StateFileError, match="state.json.*restore a good copy"):
        _coordinator(tmp_path)


def test_jobs_json_falls_back_and_status_names_both_files_when_neither_reads(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.resolved.yaml").write_text("{}\n")
    write_jobs(run, {"state": "running", "components": {"learner": {"job_id": "1"}}})
    write_jobs(run, {"state": "running", "components": {"learner": {"job_id": "2"}}})
    (run / "jobs.json").write_text('{"state": "runn')
    assert read_jobs(run)["components"]["learner"]["job_id"] == "1"
    previous_copy(run / "jobs.json").write_text("[1, 2]")  # JSON, but not a jobs record
    proc = subprocess.run([sys.executable, "-m", "hpcrl.jobs.cli", "status", str(run)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "jobs.json" in lines[0] and "jobs.json.prev" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def _tag(ckpt, step: int, files: dict[str, bytes], complete: bool = True):
    d = ckpt / f"step{step:08d}"
    (d / "zero").mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    if complete:
        mark_complete(d, step=step, version=step)
    return d


def test_resume_takes_the_newest_whole_checkpoint(tmp_path, caplog):
    ckpt = tmp_path / "checkpoints"
    files = {"mp_rank_00_model_states.pt": b"m" * 100, "zero/optim_rank0.pt": b"o" * 400}
    assert resume_tag(ckpt) is None
    _tag(ckpt, 50, files)
    newest = _tag(ckpt, 100, files)
    (ckpt / "latest").write_text("step00000100")
    assert resume_tag(ckpt) == "step00000100"
    assert json.loads((newest / COMPLETE_NAME).read_text())["files"]["zero/optim_rank0.pt"] == 400
    # A save that died halfway (no mark) is skipped, and so is a truncated or missing file.
    _tag(ckpt, 150, files, complete=False)
    (newest / "zero/optim_rank0.pt").write_bytes(b"o" * 10)
    (ckpt / "latest").write_bytes(b"\xff")
    with caplog.at_level(logging.WARNING, logger="hpcrl.learner"):
        assert resume_tag(ckpt) == "step00000050"
    assert "step00000150" in caplog.text and "10 bytes, 400 when saved" in caplog.text
    (ckpt / "step00000050" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError) as err:
        resume_tag(ckpt)
    assert "mp_rank_00_model_states.pt is missing" in str(err.value) and "move" in str(err.value)


def test_checkpoints_of_an_older_hpcrl_resume_from_deepspeeds_latest(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _tag(ckpt, 50, {"a.pt": b"x"}, complete=False)
    _tag(ckpt, 100, {"a.pt": b"x"}, complete=False)
    assert resume_tag(ckpt) is None  # no latest: no save ever finished
    (ckpt / "latest").write_text("step00000050\n")
    assert resume_tag(ckpt) == "step00000050"


def test_a_restarted_coordinator_never_reuses_an_episode_number_handed_out_after_its_last_save(tmp_path):
    """state.json is saved about once a second: what was issued after the last save is unknown to
    the successor. Downstream, trajectories are deduplicated by episode number, so a reused one
    would silently discard new work as a 'duplicate'."""
    c = _coordinator(tmp_path)
    c.handle("sync", {"generator": "g0", "want": 8, "done": [], "failed": [], "released": [], "stats": {}})
    c._save()
    c.handle("learner", {"step": 1, "version": 1, "trained_groups": 2, "dropped_groups": 0})
    late = c.handle("sync", {"generator": "g1", "want": 8, "done": [], "failed": [], "released": [], "stats": {}})
    handed_out = {row[2] for row in late["tickets"]} | {t.episode for t in c.queue}
    groups = {row[3] for row in late["tickets"]}
    assert handed_out  # issued after the save; the coordinator now dies without saving again
    again = _coordinator(tmp_path)
    again.handle("learner", {"step": 3, "version": 3, "trained_groups": 6, "dropped_groups": 0})
    fresh = again.handle("sync", {"generator": "g2", "want": 64, "done": [], "failed": [], "released": [], "stats": {}})
    new = [row for row in fresh["tickets"] if row[4] == 0]  # attempt 0: not a re-issue of the saved ones
    assert new and not {row[2] for row in new} & handed_out and not {row[3] for row in new} & groups


def test_rotation_keeps_whole_checkpoints_and_never_the_damaged_ones_instead(tmp_path):
    """Resumed from step 100 (step 150 damaged), a save at 120 with keep 1 must not delete 100
    and leave 150: only tags older than the kept whole ones go."""
    ckpt = tmp_path / "checkpoints"
    files = {"a.pt": b"x" * 10}
    _tag(ckpt, 50, files)
    _tag(ckpt, 100, files)
    damaged = _tag(ckpt, 150, files)
    (damaged / "a.pt").write_bytes(b"x")
    _tag(ckpt, 120, files)
    assert prune_checkpoints(ckpt, keep=2, saved="step00000120") == ["step00000050"]
    assert resume_tag(ckpt) == "step00000120"
    assert prune_checkpoints(ckpt, keep=1, saved="step00000120") == ["step00000100"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step00000120", "step00000150"]
    assert resume_tag(ckpt) == "step00000120"
