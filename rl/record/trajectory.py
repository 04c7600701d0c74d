"""Trajectory records: everything one episode of a rollout generator produced, typed and versioned.

    from hpcrl.rl.record.trajectory import Step, Trajectory, SandboxOutcome
    step = Step(policy_version=7, prompt_tokens=[1, 2, 3], action_tokens=[4, 5],
                action_logprobs=[-0.1, -0.7], loss_mask=[1, 1], observation_tokens=[9],
                reward=0.0, sandbox=SandboxOutcome("error", exit_code=1, duration_s=0.4))
    traj = Trajectory(run="r1", domain="code", task="fizzbuzz-3", episode=12,
                      generator="gen-0", steps=(step,), final_reward=1.0)
    traj.id  # "r1/gen-0/12"

A trajectory is a sequence of steps; each step is one model turn: the prompt the model saw
(for the first step the task prompt, later the new context fed to it), the action tokens it
sampled with their per-token log-probabilities and a loss mask over them, and the observation
tokens the environment or sandbox returned. Each step records the policy version that sampled
it, because with asynchronous generation one episode can straddle a weight update, and the
sampling parameters it was drawn with (temperature, top_p, top_k): its log-probabilities are
those of that distribution (rl/rollout/engine.py), and the learner scores the current policy under the
same parameters. Temperature 0 is greedy: a point mass, recorded with log-probability 0 and
never trained (the learner masks such steps whatever their loss mask says).

Every value is checked on construction (by the rules of `checks`, which a batch in columns is
held to as well); a bad one raises `TrajectoryError` naming the trajectory, the field and what
is expected. Token arrays become read-only int32 views, so a
record cannot change after it was validated. `SCHEMA_VERSION` is stored with every record;
readers refuse records from a newer schema with a message that says to upgrade.

The id `run/generator/episode` is the unit of deduplication across the whole pipeline: a
generator must never reuse an episode number within a run (keep the counter in its checkpoint,
or use a fresh generator name after a restart).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hpcrl.rl.record.checks import (
    MAX_COMMAND_BYTES,
    MAX_FAULT_BYTES,
    SANDBOX_RULES,
    SCHEMA_VERSION,
    STEP_RULES,
    TRAJ_RULES,
    TrajectoryError,
    check_int,
    check_name,
    check_tokens,
    clip_text,
    fail,
    frozen,
    logprobs_ok,
    mask_ok,
    tests_ok,
)

__all__ = [
    "SCHEMA_VERSION",
    "TRUNCATION_REASONS",
    "SANDBOX_STATUSES",
    "TrajectoryError",
    "SandboxOutcome",
    "clip_text",
    "Step",
    "Trajectory",
]

# Codes are positions in these tuples (stored as uint8). Append new names at the end only:
# stored files keep their own copy of the tuple, so old files decode even if this one grows.
TRUNCATION_REASONS = ("none", "max_steps", "max_tokens", "timeout", "sandbox_error", "aborted")
SANDBOX_STATUSES = ("none", "ok", "error", "timeout", "oom", "crash")

TruncationReason = Literal["none", "max_steps", "max_tokens", "timeout", "sandbox_error", "aborted"]
SandboxStatus = Literal["none", "ok", "error", "timeout", "oom", "crash"]


@dataclass(frozen=True)
class SandboxOutcome:
    """What executing the step's action in a sandbox gave; status 'none' when nothing ran.

    `command` names what ran (e.g. `python3 -m unittest -q`, cut to MAX_COMMAND_BYTES), `tests_passed`
    of `tests_total` is what the run's own checks reported (0 of 0: none), `resumes` counts the
    sandbox sessions reopened for this step after infrastructure faults (the step was retried)."""

    status: SandboxStatus = "none"
    exit_code: int = 0
    duration_s: float = 0.0
    command: str = ""
    tests_passed: int = 0
    tests_total: int = 0
    resumes: int = 0

    def __post_init__(self) -> None:
        if self.status not in SANDBOX_STATUSES:
            raise TrajectoryError(f"sandbox.status: must be one of {', '.join(SANDBOX_STATUSES)} (got {self.status!r})")
        if (
            isinstance(self.exit_code, bool)
            or not isinstance(self.exit_code, (int, np.integer))
            or not (-(2**31) <= int(self.exit_code) < 2**31)
        ):
            raise TrajectoryError(f"sandbox.exit_code: expected an int32 (got {self.exit_code!r})")
        object.__setattr__(self, "exit_code", int(self.exit_code))
        object.__setattr__(self, "duration_s", SANDBOX_RULES["duration_s"].check(self.duration_s, "sandbox.duration_s"))
        if not isinstance(self.command, str):
            raise TrajectoryError(f"sandbox.command: expected a string (got {type(self.command).__name__})")
        object.__setattr__(self, "command", clip_text(self.command, MAX_COMMAND_BYTES))
        for k in ("tests_passed", "tests_total", "resumes"):
            object.__setattr__(self, k, SANDBOX_RULES[k].check(getattr(self, k), f"sandbox.{k}"))
        if not tests_ok(self.tests_passed, self.tests_total):
            raise TrajectoryError(
                f"sandbox.tests_passed: {self.tests_passed} is more than tests_total {self.tests_total}"
            )


NO_SANDBOX = SandboxOutcome()


def sandbox_unchecked(
    status: str,
    exit_code: int,
    duration_s: float,
    command: str = "",
    tests_passed: int = 0,
    tests_total: int = 0,
    resumes: int = 0,
) -> SandboxOutcome:
    out = object.__new__(SandboxOutcome)
    out.__dict__.update(
        status=status,
        exit_code=exit_code,
        duration_s=duration_s,
        command=command,
        tests_passed=tests_passed,
        tests_total=tests_total,
        resumes=resumes,
    )
    return out


@dataclass(frozen=True, eq=False)
class Step:
    """One model turn: prompt in, action (with logprobs and loss mask) out, observation back."""

    policy_version: int
    prompt_tokens: np.ndarray
    action_tokens: np.ndarray
    action_logprobs: np.ndarray
    loss_mask: np.ndarray
    observation_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    reward: float = 0.0
    sandbox: SandboxOutcome = NO_SANDBOX
    generate_s: float = 0.0
    env_s: float = 0.0
    temperature: float = 1.0  # sampling parameters the action was drawn with (0: greedy)
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k

    def __post_init__(self) -> None:
        self._check("step")

    def _check(self, where: str) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # frozen dataclass
        put("policy_version", STEP_RULES["policy_version"].check(self.policy_version, f"{where}.policy_version"))
        for k in ("prompt_tokens", "action_tokens", "observation_tokens"):
            put(k, check_tokens(getattr(self, k), f"{where}.{k}"))
        n = len(self.action_tokens)
        lp = np.asarray(self.action_logprobs)
        if lp.ndim != 1 or len(lp) != n:
            raise fail(f"{where}.action_logprobs", f"need one value per action token ({n}) (got shape {lp.shape})")
        if n and lp.dtype.kind != "f":
            raise fail(f"{where}.action_logprobs", f"expected floats (got dtype {lp.dtype})")
        lp = lp.astype(np.float32, copy=False)
        if not logprobs_ok(lp):
            raise fail(f"{where}.action_logprobs", "log-probabilities must be finite and <= 0")
        put("action_logprobs", frozen(np.ascontiguousarray(lp)))
        mask = np.asarray(self.loss_mask)
        if mask.ndim != 1 or len(mask) != n:
            raise fail(f"{where}.loss_mask", f"need one 0/1 value per action token ({n}) (got shape {mask.shape})")
        if n and (mask.dtype.kind not in "biu" or not mask_ok(mask)):
            raise fail(f"{where}.loss_mask", "values must be 0 or 1 (or bool)")
        put("loss_mask", frozen(np.ascontiguousarray(mask.astype(np.uint8, copy=False))))
        put("reward", STEP_RULES["reward"].check(self.reward, f"{where}.reward"))
        if not isinstance(self.sandbox, SandboxOutcome):
            raise fail(f"{where}.sandbox", f"expected a SandboxOutcome (got {type(self.sandbox).__name__})")
        for k in ("generate_s", "env_s", "temperature", "top_p", "top_k"):
            put(k, STEP_RULES[k].check(getattr(self, k), f"{where}.{k}"))

    @classmethod
    def unchecked(
        cls,
        policy_version: int,
        prompt_tokens: np.ndarray,
        action_tokens: np.ndarray,
        action_logprobs: np.ndarray,
        loss_mask: np.ndarray,
        observation_tokens: np.ndarray,
        reward: float,
        sandbox: SandboxOutcome,
        generate_s: float,
        env_s: float,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> Step:
        """Build without re-checking: only for values already checked (stored and checksummed
        after validation, or checked in bulk by `Columns.row_errors`). Skips ~10 checks per step."""
        self = object.__new__(cls)
        self.__dict__.update(
            policy_version=policy_version,
            reward=reward,
            sandbox=sandbox,
            generate_s=generate_s,
            env_s=env_s,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            prompt_tokens=prompt_tokens if not prompt_tokens.flags.writeable else frozen(prompt_tokens),
            action_tokens=action_tokens if not action_tokens.flags.writeable else frozen(action_tokens),
            action_logprobs=action_logprobs if not action_logprobs.flags.writeable else frozen(action_logprobs),
            loss_mask=loss_mask if not loss_mask.flags.writeable else frozen(loss_mask),
            observation_tokens=(
                observation_tokens if not observation_tokens.flags.writeable else frozen(observation_tokens)
            ),
        )
        return self

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.action_tokens) + len(self.observation_tokens)

    @property
    def greedy(self) -> bool:
        """Sampled at temperature 0: a point mass, never trained."""
        return self.temperature <= 0.0

    @property
    def plain(self) -> bool:
        """Drawn from the model's own distribution (temperature 1, no truncation)."""
        return self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k <= 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Step):
            return NotImplemented
        return (
            self.policy_version == other.policy_version
            and (self.temperature, self.top_p, self.top_k) == (other.temperature, other.top_p, other.top_k)
            and self.reward == other.reward
            and self.sandbox == other.sandbox
            and self.generate_s == other.generate_s
            and self.env_s == other.env_s
            and all(np.array_equal(getattr(self, k), getattr(other, k)) for k in _ARRAY_FIELDS)
        )

    __hash__ = None  # type: ignore[assignment]  # arrays: equality only


_ARRAY_FIELDS = ("prompt_tokens", "action_tokens", "action_logprobs", "loss_mask", "observation_tokens")


@dataclass(frozen=True, eq=False)
class Trajectory:
    """One episode: ids, the steps in order, the final reward and why it ended.

    `fault` is a short message of the sandbox infrastructure fault the episode met (a lost
    server, a session gone): the one that truncated it, or the last one it was resumed after;
    "" when none. Cut to MAX_FAULT_BYTES."""

    run: str
    domain: str
    task: str
    episode: int
    generator: str
    steps: tuple[Step, ...]
    final_reward: float
    truncation: TruncationReason = "none"
    started_at: float = 0.0  # unix seconds
    finished_at: float = 0.0
    schema_version: int = SCHEMA_VERSION
    fault: str = ""

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # frozen dataclass
        where = "trajectory"
        put("run", check_name(self.run, f"{where}.run", allow_slash=False))
        put("generator", check_name(self.generator, f"{where}.generator", allow_slash=False))
        put("episode", TRAJ_RULES["episode"].check(self.episode, f"{where}.episode"))
        where = f"trajectory {self.id}"
        put("domain", check_name(self.domain, f"{where}: domain"))
        put("task", check_name(self.task, f"{where}: task"))
        if isinstance(self.steps, Step) or not isinstance(self.steps, Iterable):
            raise fail(where, "steps: expected a sequence of Step")
        steps = tuple(self.steps)
        if not steps:
            raise fail(where, "steps: a trajectory needs at least one step")
        for i, s in enumerate(steps):
            if not isinstance(s, Step):
                raise fail(where, f"steps[{i}]: expected a Step (got {type(s).__name__})")
        put("steps", steps)
        put("final_reward", TRAJ_RULES["final_reward"].check(self.final_reward, f"{where}: final_reward"))
        if self.truncation not in TRUNCATION_REASONS:
            raise fail(where, f"truncation: must be one of {', '.join(TRUNCATION_REASONS)} (got {self.truncation!r})")
        put("started_at", TRAJ_RULES["started_at"].check(self.started_at, f"{where}: started_at"))
        put("finished_at", TRAJ_RULES["finished_at"].check(self.finished_at, f"{where}: finished_at"))
        version = check_int(self.schema_version, f"{where}: schema_version", lo=1)
        if version > SCHEMA_VERSION:  # TRAJ_RULES' bound, saying what to do
            raise fail(
                where, f"schema_version {version} is newer than this hpcrl reads ({SCHEMA_VERSION}); upgrade hpcrl"
            )
        if not isinstance(self.fault, str):
            raise fail(where, f"fault: expected a string (got {type(self.fault).__name__})")
        put("fault", clip_text(self.fault, MAX_FAULT_BYTES))
        put("schema_version", SCHEMA_VERSION)  # older records lack only newer defaulted fields

    @classmethod
    def unchecked(cls, steps: tuple[Step, ...], **fields: Any) -> Trajectory:
        """Build without re-checking: only for values already checked (see Step.unchecked)."""
        self = object.__new__(cls)
        self.__dict__.update(fields, steps=steps)
        return self

    @property
    def id(self) -> str:
        return f"{self.run}/{self.generator}/{self.episode}"

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(s.policy_version for s in self.steps)

    @property
    def min_policy_version(self) -> int:
        """The oldest policy that contributed a step: what staleness is measured by."""
        return min(s.policy_version for s in self.steps)

    @property
    def max_policy_version(self) -> int:
        return max(s.policy_version for s in self.steps)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.steps)

    @property
    def step_rewards(self) -> tuple[float, ...]:
        return tuple(s.reward for s in self.steps)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in _SCALAR_FIELDS) and self.steps == other.steps

    __hash__ = None  # type: ignore[assignment]

    # -- plain data (JSONL export, tests) ---------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: arrays become lists. `from_dict` inverts it."""
        out: dict[str, Any] = {"id": self.id}
        out.update({k: getattr(self, k) for k in _SCALAR_FIELDS})
        out["steps"] = [
            {
                "policy_version": s.policy_version,
                **{k: getattr(s, k).tolist() for k in _ARRAY_FIELDS},
                "reward": s.reward,
                "sandbox": {
                    "status": s.sandbox.status,
                    "exit_code": s.sandbox.exit_code,
                    "duration_s": s.sandbox.duration_s,
                    "command": s.sandbox.command,
                    "tests_passed": s.sandbox.tests_passed,
                    "tests_total": s.sandbox.tests_total,
                    "resumes": s.sandbox.resumes,
                },
                "generate_s": s.generate_s,
                "env_s": s.env_s,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
            }
            for s in self.steps
        ]
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Trajectory:
        if not isinstance(data, dict):
            raise TrajectoryError(f"trajectory: expected a mapping (got {type(data).__name__})")
        known = set(_SCALAR_FIELDS) | {"steps", "id"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrajectoryError(f"trajectory: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = sorted({"run", "domain", "task", "episode", "generator", "steps", "final_reward"} - set(data))
        if missing:
            raise TrajectoryError(f"trajectory: missing field(s) {missing}")
        raw_steps = data["steps"]
        if not isinstance(raw_steps, list):
            raise TrajectoryError("trajectory: steps: expected a list")
        steps = []
        for i, s in enumerate(raw_steps):
            if not isinstance(s, dict):
                raise TrajectoryError(f"trajectory: steps[{i}]: expected a mapping")
            s = dict(s)
            sb = s.pop("sandbox", None) or {}
            try:
                steps.append(Step(sandbox=SandboxOutcome(**sb), **s))
            except TypeError as exc:
                raise TrajectoryError(f"trajectory: steps[{i}]: {exc}") from None
            except TrajectoryError as exc:
                raise TrajectoryError(str(exc).replace("step.", f"steps[{i}].", 1)) from None
        kwargs = {k: data[k] for k in _SCALAR_FIELDS if k in data}
        traj = cls(steps=tuple(steps), **kwargs)
        if "id" in data and data["id"] != traj.id:
            raise TrajectoryError(f"trajectory: id {data['id']!r} does not match run/generator/episode ({traj.id!r})")
        return traj


_SCALAR_FIELDS = (
    "run",
    "domain",
    "task",
    "episode",
    "generator",
    "final_reward",
    "truncation",
    "started_at",
    "finished_at",
    "schema_version",
    "fault",
)
