"""Trajectory schema v2: per-step sandbox command, tests passed/total and session resumes, and the
trajectory's fault message; v3: per-step sampling parameters (temperature, top_p, top_k). Through
the record, the wire's columns and real HDF5 segments; segments written under schemas v1 and v2
(narrower tables) still read, the new fields at their defaults (temperature 1, top_p 1, top_k 0:
what their generators' recorded log-probabilities were of).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcrl.rl.record.columns import Columns
from hpcrl.rl.record.synth import SynthShape, synth_trajectory
from hpcrl.rl.record.trajectory import (
    MAX_COMMAND_BYTES,
    MAX_FAULT_BYTES,
    SCHEMA_VERSION,
    SandboxOutcome,
    Step,
    Trajectory,
    TrajectoryError,
)
from hpcrl.rl.store.segment import publish_segment, write_segment
from hpcrl.rl.store.segment_read import read_segment

SMALL = SynthShape(first_prompt=(5, 20), later_prompt=(2, 8), action=(3, 20), observation=(0, 10))

# Schema v1's tables, as hpcrl wrote them before v2 (string widths as Columns.encode picks them).
V1_STEP = np.dtype(
    [
        ("policy_version", "<i8"),
        ("reward", "<f8"),
        ("token_start", "<i8"),
        ("prompt_len", "<i4"),
        ("action_len", "<i4"),
        ("obs_len", "<i4"),
        ("action_start", "<i8"),
        ("sandbox_status", "u1"),
        ("sandbox_exit_code", "<i4"),
        ("sandbox_s", "<f8"),
        ("generate_s", "<f8"),
        ("env_s", "<f8"),
    ]
)
V1_TRAJ_NUMERIC = [
    ("episode", "<i8"),
    ("final_reward", "<f8"),
    ("truncation", "u1"),
    ("started_at", "<f8"),
    ("finished_at", "<f8"),
    ("step_start", "<i8"),
    ("n_steps", "<i4"),
    ("n_tokens", "<i8"),
    ("min_policy_version", "<i8"),
    ("max_policy_version", "<i8"),
    ("schema_version", "<u2"),
]


def _with_results(t: Trajectory, i: int) -> Trajectory:
    """`t` with v2's and v3's fields set: every step ran a command, some resumed, the record has a
    fault; steps drawn at various temperatures and truncations."""
    sampling = [(1.0, 1.0, 0), (0.7, 0.95, 0), (2.0, 1.0, 40), (0.0, 1.0, 0)]
    steps = tuple(
        dataclasses.replace(
            s,
            sandbox=SandboxOutcome(
                "error" if j % 2 else "ok", j % 3, 0.25 * j, f"python3 -m unittest -q  # {i}.{j} é", j, j + 2, j % 2
            ),
            **dict(zip(("temperature", "top_p", "top_k"), sampling[(i + j) % 4])),
        )
        for j, s in enumerate(t.steps)
    )
    return dataclasses.replace(t, steps=steps, fault=f"sandbox session run on sandbox-0: RequestTimeout {i}")


def _trajs(n: int = 6) -> list[Trajectory]:
    rng = np.random.default_rng(3)
    return [_with_results(synth_trajectory(rng, "r", "g", i, SMALL), i) for i in range(n)]


def _segment(tmp_path, cols: Columns, seq: int):
    path = tmp_path / f"seg-{seq:06d}-0000000000000000.h5"
    tmp = path.with_name(path.name + ".tmp")
    info = write_segment(tmp, cols, {"seq": seq})
    publish_segment(tmp, path)
    return path, info


def test_per_step_results_and_the_fault_round_trip_through_dict_wire_and_hdf5(tmp_path):
    trajs = _trajs()
    assert trajs[0].schema_version == SCHEMA_VERSION == 3
    assert [Trajectory.from_dict(t.to_dict()) for t in trajs] == trajs
    cols = Columns.encode(trajs)
    body, arrays = cols.to_wire()
    back = Columns.from_wire(body, arrays)
    assert back.row_errors() == [None] * len(trajs)
    assert [back.trajectory(i) for i in range(back.rows)] == trajs
    path, info = _segment(tmp_path, cols, 1)
    stored = read_segment(path, info)
    for trusted in (False, True):
        got = [stored.trajectory(i, trusted=trusted) for i in range(stored.rows)]
        assert got == trajs
    s = got[2].steps[1].sandbox
    assert (s.command, s.tests_passed, s.tests_total, s.resumes) == ("python3 -m unittest -q  # 2.1 é", 1, 3, 1)
    assert got[2].fault.endswith("RequestTimeout 2")
    assert [(s.temperature, s.top_p, s.top_k) for s in got[1].steps[:2]] == [(0.7, 0.95, 0), (2.0, 1.0, 40)]


def test_a_schema_v1_segment_reads_with_the_new_fields_at_their_defaults(tmp_path):
    rng = np.random.default_rng(5)
    plain = [synth_trajectory(rng, "r", "g", i, SMALL) for i in range(5)]
    new = Columns.encode(plain)
    steps = np.zeros(len(new.steps), V1_STEP)
    for name in V1_STEP.names:
        steps[name] = new.steps[name]
    strings = [(n, new.traj.dtype[n]) for n in ("id", "run", "domain", "task", "generator")]
    traj = np.zeros(new.rows, np.dtype(strings + V1_TRAJ_NUMERIC))
    for name in traj.dtype.names:
        traj[name] = new.traj[name]
    traj["schema_version"] = 1
    old = Columns(traj, steps, new.tokens, new.logprobs, new.loss_mask)
    path, info = _segment(tmp_path, old, 1)
    back = read_segment(path, info)
    got = [back.trajectory(i) for i in range(back.rows)]
    assert got == plain  # the same records; v1 lacked only what now defaults
    assert all(t.fault == "" and t.schema_version == SCHEMA_VERSION for t in got)
    assert all(s.sandbox.command == "" and s.sandbox.tests_total == 0 for t in got for s in t.steps)
    # An old segment and a new one go on together (compaction concatenates stored columns).
    both = Columns.concat([back, Columns.encode(_trajs(2))])
    assert both.row_errors() == [None] * 7


def test_a_schema_v2_segment_reads_as_sampled_from_the_models_own_distribution(tmp_path):
    """v2 generators recorded the model's own log-probabilities (temperature 1, untruncated),
    whatever they sampled with: their steps read with exactly those parameters, and the learner
    scores them the same way."""
    trajs = _trajs(4)
    new = Columns.encode(trajs)
    v3_only = ("temperature", "top_p", "top_k")
    v2 = np.dtype([(n, new.steps.dtype[n]) for n in new.steps.dtype.names if n not in v3_only])
    steps = np.zeros(len(new.steps), v2)
    for name in v2.names:
        steps[name] = new.steps[name]
    traj = new.traj.copy()
    traj["schema_version"] = 2
    path, info = _segment(tmp_path, Columns(traj, steps, new.tokens, new.logprobs, new.loss_mask), 1)
    back = read_segment(path, info)
    got = [back.trajectory(i, trusted=trusted) for i in range(back.rows) for trusted in (False, True)]
    assert all((s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0) and s.plain for t in got for s in t.steps)
    assert [t.steps[0].action_logprobs.tolist() for t in got[::2]] == [
        t.steps[0].action_logprobs.tolist() for t in trajs
    ]


def test_bad_sampling_parameters_are_refused_by_the_record_and_the_columns():
    step = _trajs(1)[0].steps[0]
    for field, value, msg in (("top_p", 0.0, "top_p: must be in"), ("temperature", -1.0, "temperature: must be >= 0"),
                              ("top_k", -2, "top_k: must be >= 0")):  # fmt: skip
        with pytest.raises(TrajectoryError, match=msg):
            dataclasses.replace(step, **{field: value})
    cols = Columns.encode(_trajs(2))
    steps = cols.steps.copy()
    steps["top_p"][0] = 1.5
    errors = Columns(cols.traj, steps, cols.tokens, cols.logprobs, cols.loss_mask).row_errors()
    assert errors[1] is None and "top_p: must be in (0, 1]" in errors[0]


def test_long_texts_are_cut_and_bad_counts_are_refused():
    s = SandboxOutcome("ok", command="x" * 500 + "\nrm -rf /")
    assert len(s.command.encode()) <= MAX_COMMAND_BYTES and s.command.endswith("...") and "\n" not in s.command
    t = dataclasses.replace(_trajs(1)[0], fault="é" * 300)
    assert len(t.fault.encode()) <= MAX_FAULT_BYTES and t.fault.endswith("...")
    with pytest.raises(TrajectoryError, match="tests_passed: 3 is more than tests_total 2"):
        SandboxOutcome("ok", tests_passed=3, tests_total=2)
    with pytest.raises(TrajectoryError, match="sandbox.resumes: at most 255"):
        SandboxOutcome("ok", resumes=256)
    # A sender's columns claiming more passed than run are refused, row by row.
    cols = Columns.encode(_trajs(2))
    steps = cols.steps.copy()
    steps["tests_passed"][0] = steps["tests_total"][0] + 1
    bad = Columns(cols.traj, steps, cols.tokens, cols.logprobs, cols.loss_mask)
    errors = bad.row_errors()
    assert errors[1] is None and "more than tests_total" in errors[0]


def _stored_run(tmp_path):
    from hpcrl.core.config import StoreConfig
    from hpcrl.rl.store.writer import ShardWriter

    run_dir = tmp_path / "run"
    (run_dir / "trajectories").mkdir(parents=True)
    w = ShardWriter(run_dir / "trajectories", "g", StoreConfig(flush_every=2, compression="none"))
    trajs = _trajs(3)
    for t in trajs:
        w.append(t)
    w.close()
    return run_dir, trajs


def test_traj_show_prints_each_steps_sandbox_results_and_the_fault(tmp_path, capsys):
    import json

    from hpcrl.jobs.cli import main

    run_dir, trajs = _stored_run(tmp_path)
    assert main(["traj", "show", str(run_dir), "r/g/1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("r/g/1  code task ")
    assert "fault: sandbox session run on sandbox-0: RequestTimeout 1" in out
    # No run config beside the store: token counts, no text; every step's command and results.
    assert "sandbox: python3 -m unittest -q  # 1.1 é -> error, exit 1, tests 1/3, 0.25 s, resumed 1x" in out
    assert out.count("  step ") == len(trajs[1].steps)
    assert "sampled at temperature 0.7, top_p 0.95, top_k 0" in out  # steps not drawn from the model's own
    assert main(["traj", "show", str(run_dir / "trajectories"), "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["id"] == "r/g/2" and got["truncation"] == trajs[2].truncation and "RequestTimeout 2" in got["fault"]
    assert [s["sandbox"]["tests_total"] for s in got["steps"]] == [s.sandbox.tests_total for s in trajs[2].steps]
    assert "text" not in got["steps"][0]
    want = [{"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k} for s in trajs[2].steps]
    assert [s["sampling"] for s in got["steps"]] == want
    # Bad input: one line naming what and what to do, exit 2.
    assert main(["traj", "show", str(run_dir), "r/g/99"]) == 2
    err = capsys.readouterr().err
    assert "r/g/99: no such trajectory" in err and len(err.strip().splitlines()) == 1
    assert main(["traj", "show", str(run_dir), "x/y"]) == 2
    assert "is not a trajectory id" in capsys.readouterr().err


def test_traj_show_decodes_text_with_the_runs_tokenizer(tmp_path, capsys):
    """Beside a run's resolved config, `traj show` prints each step's prompt, action and
    observation as text, decoded with the tokenizer the run trained with."""
    import json

    from hpcrl.core.config import StoreConfig, load_config, write_resolved
    from hpcrl.jobs.cli import main
    from hpcrl.rl.model.policy import load_tokenizer
    from hpcrl.rl.store.writer import ShardWriter

    run_dir = tmp_path / "run"
    (run_dir / "trajectories").mkdir(parents=True)
    charset = "0123456789+=? abcdefghijklmnopqrstuvwxyz\n"
    cfg = load_config(None, [f"policy.tiny.charset={json.dumps(charset)}"])
    write_resolved(cfg, run_dir)
    tok = load_tokenizer(cfg.policy)
    texts = [("what is 7+8?\n", "15", "wrong try again\n"), ("", "15", "")]
    steps = []
    for k, (prompt, action, obs) in enumerate(texts):
        ids = [tok.encode(t, add_special_tokens=False) for t in (prompt, action, obs)]
        steps.append(
            Step(
                policy_version=3,
                prompt_tokens=np.array(ids[0], np.int32),
                action_tokens=np.array(ids[1], np.int32),
                action_logprobs=np.full(len(ids[1]), -0.5, np.float32),
                loss_mask=np.ones(len(ids[1]), np.uint8),
                observation_tokens=np.array(ids[2], np.int32),
                reward=float(k),
            )
        )
    traj = Trajectory(
        run="r", domain="sum", task="7+8", episode=4, generator="g", steps=tuple(steps), final_reward=1.0,
        truncation="none", started_at=1.0, finished_at=2.0,
    )  # fmt: skip
    w = ShardWriter(run_dir / "trajectories", "g", StoreConfig(flush_every=1, compression="none"))
    w.append(traj)
    w.close()
    assert main(["traj", "show", str(run_dir), "r/g/4"]) == 0
    out = capsys.readouterr().out
    assert "    prompt: what is 7+8?\n" in out and "    action: 15\n" in out
    assert "    observation: wrong try again\n" in out
    assert main(["traj", "show", str(run_dir), "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [s["text"] for s in got["steps"]] == [dict(zip(("prompt", "action", "observation"), t)) for t in texts]
