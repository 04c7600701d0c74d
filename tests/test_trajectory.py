"""The trajectory record, its checks and its columnar form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcrl.rl.record.columns import Columns, ColumnsError
from hpcrl.rl.record.synth import TINY_SHAPE, synth_trajectory
from hpcrl.rl.record.trajectory import SCHEMA_VERSION, SandboxOutcome, Step, Trajectory, TrajectoryError


def step(**kw) -> Step:
    args = dict(
        policy_version=3,
        prompt_tokens=[1, 2, 3],
        action_tokens=[4, 5],
        action_logprobs=[-0.5, -1.25],
        loss_mask=[1, 0],
        observation_tokens=[7, 8, 9, 10],
        reward=0.25,
        sandbox=SandboxOutcome("error", exit_code=1, duration_s=0.5),
        generate_s=1.5,
        env_s=0.75,
    )
    args.update(kw)
    return Step(**args)


def traj(steps=None, **kw) -> Trajectory:
    if steps is None:
        steps = (step(), step(policy_version=4, observation_tokens=[]))
    args = dict(
        run="run1",
        domain="code",
        task="fizzbuzz",
        episode=12,
        generator="gen-0",
        steps=steps,
        final_reward=1.0,
        truncation="none",
        started_at=100.0,
        finished_at=104.5,
    )
    args.update(kw)
    return Trajectory(**args)


def test_fields_ids_and_derived_values():
    t = traj()
    assert t.id == "run1/gen-0/12"
    assert t.policy_versions == (3, 4) and t.min_policy_version == 3 and t.max_policy_version == 4
    assert t.n_tokens == 9 + 5
    assert t.step_rewards == (0.25, 0.25)
    assert t.schema_version == SCHEMA_VERSION
    s = t.steps[0]
    assert s.prompt_tokens.dtype == np.int32 and s.action_logprobs.dtype == np.float32 and s.loss_mask.dtype == np.uint8


def test_arrays_are_frozen_but_callers_arrays_are_not_touched():
    mine = np.array([4, 5], dtype=np.int32)
    s = step(action_tokens=mine)
    assert mine.flags.writeable
    with pytest.raises(ValueError):
        s.action_tokens[0] = 9
    with pytest.raises(AttributeError):
        s.reward = 2.0  # frozen dataclass


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(action_logprobs=[-0.5]), "one value per action token (2)"),
        (dict(action_logprobs=[-0.5, 0.5]), "finite and <= 0"),
        (dict(action_logprobs=[-0.5, float("nan")]), "finite and <= 0"),
        (dict(loss_mask=[1, 2]), "0 or 1"),
        (dict(loss_mask=[1]), "one 0/1 value per action token"),
        (dict(prompt_tokens=[1, -2]), "token ids must be in 0..2147483647 (got -2..1)"),
        (dict(prompt_tokens=np.array([1, -2], np.int32)), "(got -2..1)"),
        (dict(prompt_tokens=np.array([1, 2**40])), "0..2147483647"),
        (dict(prompt_tokens=[1.5, 2.0]), "must be integers"),
        (dict(prompt_tokens=[[1, 2]]), "1-D"),
        (dict(policy_version=-1), "policy_version"),
        (dict(policy_version=True), "expected an int"),
        (dict(reward=float("inf")), "reward: must be finite"),
        (dict(generate_s=-1.0), "generate_s: must be >= 0"),
    ],
)
def test_bad_step_fields_name_the_field(kwargs, fragment):
    with pytest.raises(TrajectoryError) as err:
        step(**kwargs)
    assert fragment in str(err.value)


def test_bad_sandbox_outcome():
    with pytest.raises(TrajectoryError, match="sandbox.status: must be one of none, ok"):
        SandboxOutcome("exploded")
    with pytest.raises(TrajectoryError, match="exit_code"):
        SandboxOutcome("ok", exit_code=2**40)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(steps=()), "at least one step"),
        (dict(steps=("x",)), "steps[0]: expected a Step"),
        (dict(run="a/b"), "'/' is not allowed"),
        (dict(generator=""), "non-empty string"),
        (dict(task="t\x00"), "control characters"),
        (dict(truncation="bored"), "truncation: must be one of"),
        (dict(episode=-3), "episode"),
        (dict(final_reward=float("nan")), "final_reward: must be finite"),
        (dict(schema_version=SCHEMA_VERSION + 1), "upgrade hpcrl"),
    ],
)
def test_bad_trajectory_fields_name_the_record_and_field(kwargs, fragment):
    with pytest.raises(TrajectoryError) as err:
        traj(**kwargs)
    assert fragment in str(err.value)


def test_equality_compares_arrays():
    assert traj() == traj()
    assert traj() != traj(steps=(step(action_tokens=[4, 6]),))
    assert traj() != traj(final_reward=0.0)


def test_dict_round_trip_through_json():
    t = traj()
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t


def test_from_dict_rejects_unknown_missing_and_mismatched():
    d = traj().to_dict()
    with pytest.raises(TrajectoryError, match="unknown field"):
        Trajectory.from_dict({**d, "colour": "red"})
    with pytest.raises(TrajectoryError, match=r"missing field\(s\) \['task'\]"):
        Trajectory.from_dict({k: v for k, v in d.items() if k != "task"})
    with pytest.raises(TrajectoryError, match="does not match"):
        Trajectory.from_dict({**d, "id": "run1/gen-0/13"})
    d["steps"][1]["loss_mask"] = [1, 1, 1]
    with pytest.raises(TrajectoryError, match=r"steps\[1\]\.loss_mask"):
        Trajectory.from_dict(d)


def test_wire_form_is_the_columns_zero_copy_and_framing_is_checked():
    t = traj()
    body, arrays = Columns.encode([t]).to_wire()
    assert [a.dtype for a in arrays] == [np.uint8, np.uint8, np.int32, np.float32, np.uint8]
    assert len(arrays[2]) == t.n_tokens and len(arrays[3]) == len(arrays[4]) == 4 and body["ids"] == [t.id]
    back = Columns.from_wire(body, arrays)
    assert back.row_errors() == [None] and back.trajectory(0) == t
    assert np.shares_memory(back.trajectory(0).steps[1].action_tokens, arrays[2])  # views of the received arrays
    with pytest.raises(ColumnsError, match="expected 5 1-D arrays"):
        Columns.from_wire(body, arrays[:-1])
    with pytest.raises(ColumnsError, match="fall outside the tokens"):
        Columns.from_wire(body, [*arrays[:2], arrays[2][:-1], *arrays[3:]])
    with pytest.raises(ColumnsError, match="not back to back"):
        Columns.from_wire(body, [*arrays[:2], np.concatenate([arrays[2], arrays[2][:1]]), *arrays[3:]])
    with pytest.raises(ColumnsError, match="not whole"):
        Columns.from_wire(body, [arrays[0][:-1], *arrays[1:]])
    with pytest.raises(ColumnsError, match="ids do not name"):
        Columns.from_wire(dict(body, ids=["run1/gen-0/13"]), arrays)
    with pytest.raises(ColumnsError, match="code tables"):
        Columns.from_wire(dict(body, names=[["none", "bored"], body["names"][1]]), arrays)
    bad = [a.copy() for a in arrays]
    bad[3][3] = 0.5
    assert "steps[1].action_logprobs: log-probabilities" in Columns.from_wire(body, bad).row_errors()[0]


def _broken(table: str, field: str, value, row: int = 0):
    cols = Columns.encode([traj(), traj(episode=13)])
    getattr(cols, table)[field][row] = value
    return cols


@pytest.mark.parametrize(
    "cols, fragment",
    [
        (_broken("traj", "final_reward", float("nan")), "final_reward: must be finite"),
        (_broken("traj", "started_at", -1.0), "started_at: must be >= 0"),
        (_broken("traj", "schema_version", SCHEMA_VERSION + 1), "upgrade hpcrl"),
        (_broken("traj", "run", b"run\x01"), "control characters"),
        (_broken("traj", "episode", 14, row=1), "does not match its fields"),
        (_broken("traj", "n_tokens", 3), "n_tokens or policy version range"),
        (_broken("traj", "max_policy_version", 9), "n_tokens or policy version range"),
        (_broken("steps", "reward", float("inf"), row=2), "steps[0].reward: must be finite"),
        (_broken("steps", "generate_s", -0.5), "steps[0].generate_s"),
        (_broken("steps", "sandbox_s", float("nan")), "sandbox.duration_s"),
    ],
)
def test_row_errors_refuse_what_the_constructors_refuse_and_name_the_row(cols, fragment):
    errors = cols.row_errors()
    bad = [i for i, e in enumerate(errors) if e]
    assert len(bad) == 1 and fragment in errors[bad[0]], errors


def test_row_errors_see_bad_token_and_mask_values():
    cols = Columns.encode([traj(), traj(episode=13)])
    cols.tokens[-1] = -3
    cols.loss_mask[0] = 2
    errors = cols.row_errors()
    assert "loss_mask" in errors[0] and "token ids must be in" in errors[1]


def test_take_and_concat_keep_the_canonical_layout():
    rng = np.random.default_rng(2)
    trajs = [synth_trajectory(rng, "r", "g", i, TINY_SHAPE) for i in range(9)]
    cols = Columns.encode(trajs)
    part = cols.take([7, 2, 4])
    part.validate(canonical=True)
    assert [part.trajectory(i) for i in range(3)] == [trajs[7], trajs[2], trajs[4]]
    long_name = traj(run="a-much-longer-run-name-than-r", episode=1)
    both = Columns.concat([part, Columns.encode([long_name])])
    both.validate(canonical=True)
    assert both.row_errors() == [None] * 4
    assert [both.trajectory(i) for i in range(4)] == [trajs[7], trajs[2], trajs[4], long_name]


def test_columns_round_trip_many_shapes():
    rng = np.random.default_rng(5)
    trajs = [synth_trajectory(rng, "r", "g", i, TINY_SHAPE if i % 2 else synth_shape_small()) for i in range(40)]
    trajs.append(
        traj(
            steps=(step(prompt_tokens=[], observation_tokens=[], action_tokens=[], action_logprobs=[], loss_mask=[]),),
            episode=99,
        )
    )
    cols = Columns.encode(trajs)
    cols.validate()
    assert cols.rows == 41 and cols.ids()[0] == "r/g/0"
    assert len(cols.tokens) == sum(t.n_tokens for t in trajs)
    assert [cols.trajectory(i) for i in range(cols.rows)] == trajs
    assert list(cols.traj["min_policy_version"]) == [t.min_policy_version for t in trajs]


def synth_shape_small():
    from hpcrl.rl.record.synth import SynthShape

    return SynthShape(first_prompt=(10, 50), action=(5, 40), observation=(0, 30))


def test_columns_checksum_sees_every_byte():
    cols = Columns.encode([traj(), traj(episode=13)])
    crc = cols.crc32()
    for name in ("tokens", "logprobs", "loss_mask"):
        arr = getattr(cols, name)
        arr.view(np.uint8)[-1] ^= 1
        assert cols.crc32() != crc, name
        arr.view(np.uint8)[-1] ^= 1
    cols.steps["reward"][0] += 1
    assert cols.crc32() != crc


def test_columns_validate_refuses_out_of_range_offsets():
    cols = Columns.encode([traj()])
    cols.steps["token_start"][1] = len(cols.tokens)
    with pytest.raises(ColumnsError, match="token ranges"):
        cols.validate()
    cols = Columns.encode([traj()])
    cols.traj["n_steps"][0] = 5
    with pytest.raises(ColumnsError, match="step ranges"):
        cols.validate()
    cols = Columns.encode([traj()])
    cols.steps["sandbox_status"][0] = 200
    with pytest.raises(ColumnsError, match="sandbox status"):
        cols.validate()


def test_columns_decode_detects_id_mismatch():
    cols = Columns.encode([traj()])
    cols.traj["episode"][0] = 77
    with pytest.raises(ColumnsError, match="does not match its fields"):
        cols.trajectory(0)
