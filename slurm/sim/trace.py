"""Simulator traces: the cluster, the training loop and hundreds of task domains, from YAML.

    trace = load_trace("slurm/sim/traces/heavy-tail-300.yaml")     # ConfigError on bad input
    world = World(trace)                                      # domains drawn from the families
    ep = world.episode(17)                                    # the 18th episode ever started

A trace names *families* of domains (e.g. 150 code-repair domains, 100 math domains); each
family draws its domains' parameters from ranges, so a few lines describe hundreds of
domains with different heavy tails. The format is documented in slurm/sim/traces/README.md and
loaded strictly with hpcrl.core.schema (unknown keys, wrong types, bad ranges fail with the
dotted path).

Episode i is a pure function of (seed, i): every policy sees the same domains, turn counts,
generation and sandbox times in the same order, so policies differ only in scheduling.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpcrl.core.config import SchedulerConfig
from hpcrl.core.schema import ConfigError, from_dict, load_yaml_text, spec

__all__ = ["Trace", "load_trace", "parse_trace", "World", "Domain", "EpisodeSpec"]

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"


def _range_errors(name: str, values: tuple[float, ...], positive: bool = True):
    if len(values) != 2:
        yield name, f"expected [low, high] (2 numbers) (got {list(values)})"
    elif positive and not values[0] > 0:
        yield name, f"must be > 0 (got {values[0]})"
    elif values[0] > values[1]:
        yield name, f"low must be <= high (got {list(values)})"


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    learner_gpus: int = spec(help="GPUs of the learner (data-parallel ranks)", ge=1)
    generator_gpus: int = spec(help="GPUs of the rollout generators, one generator per GPU", ge=1)
    sandbox_slots: int = spec(help="concurrent sandbox executions on the CPU partitions", ge=1)


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    steps: int = spec(help="training steps to simulate; the run ends when the last one has synced", ge=1)
    batch_size: int = spec(help="trajectories per training step", ge=1)
    max_staleness: int = spec(2, help="trajectories may be at most this many policy versions old when trained on", ge=0)
    train_base_s: float = spec(help="learner time per step independent of batch size, seconds", ge=0)
    train_per_traj_s: float = spec(help="learner time per trajectory in the batch, seconds", ge=0)
    weight_sync_s: float = spec(help="learner broadcasts new weights after each step, seconds", ge=0)
    reload_s: float = spec(help="a generator pauses this long to load new weights, seconds", ge=0)
    resume_s: float = spec(
        1.0, help="GPU time to re-prefill a generation turn that resumes on another GPU, seconds", ge=0
    )
    episodes_in_flight: int = spec(8, help="episodes each generator keeps open (async and backfill)", ge=1)

    def validate(self):
        if self.train_base_s + self.train_per_traj_s <= 0:
            yield "train_base_s", "train_base_s and train_per_traj_s cannot both be 0"

    @property
    def train_s(self) -> float:
        return self.train_base_s + self.train_per_traj_s * self.batch_size


@dataclass(frozen=True, kw_only=True)
class DistSpec:
    """Each domain's duration distribution: its median drawn log-uniformly from `median_s`,
    its shape (lognormal sigma, Pareto alpha) uniformly from `shape`; samples capped at cap_s."""

    dist: Literal["lognormal", "pareto"] = spec(help="lognormal or pareto (heavier tail for small alpha)")
    median_s: tuple[float, ...] = spec(help="[low, high] range of the domains' medians, seconds")
    shape: tuple[float, ...] = spec(help="[low, high]: lognormal sigma, or Pareto tail index alpha")
    cap_s: float = spec(help="no sample exceeds this (a timeout or max-token limit), seconds", gt=0)

    def validate(self):
        yield from _range_errors("median_s", self.median_s)
        yield from _range_errors("shape", self.shape)
        if len(self.median_s) == 2 and self.cap_s < self.median_s[1]:
            yield "cap_s", f"must be >= the highest median ({self.median_s[1]}) (got {self.cap_s})"


@dataclass(frozen=True, kw_only=True)
class TurnsSpec:
    """Turns (generate, then execute) per episode: geometric with a per-domain mean."""

    mean: tuple[float, ...] = spec(help="[low, high] range of the domains' mean turns per episode (>= 1)")
    cap: int = spec(help="at most this many turns per episode", ge=1)

    def validate(self):
        yield from _range_errors("mean", self.mean)
        if len(self.mean) == 2 and self.mean[0] < 1:
            yield "mean", f"a mean below 1 turn is impossible (got {list(self.mean)})"


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    name: str = spec(help="family label; domains are named <name>-<i>", pattern=_NAME)
    count: int = spec(help="number of domains in the family", ge=1)
    weight: float = spec(1.0, help="share of episodes drawn from this family (relative)", gt=0)
    gen: DistSpec = spec(help="seconds of GPU time for one generation turn")
    sandbox: DistSpec = spec(help="seconds of one sandbox execution (compile, run tests, verify)")
    turns: TurnsSpec = spec(help="turns per episode")


@dataclass(frozen=True, kw_only=True)
class Trace:
    name: str = spec(help="trace name", pattern=_NAME)
    description: str = spec("", help="free text")
    seed: int = spec(0, help="seed for domains and episodes", ge=0)
    cluster: ClusterSpec = spec(help="GPUs and sandbox slots")
    training: TrainingSpec = spec(help="the RL loop")
    families: tuple[FamilySpec, ...] = spec(help="domain families", min_len=1)
    scheduler: SchedulerConfig = spec(
        factory=SchedulerConfig, help="packer settings, as in config.yaml's scheduler section"
    )

    def validate(self):
        seen = set()
        for i, fam in enumerate(self.families):
            if fam.name in seen:
                yield f"families.{i}.name", f"duplicate family {fam.name!r}; each family may be listed once"
            seen.add(fam.name)


def parse_trace(text: str, source: str = "<trace>") -> Trace:
    raw = load_yaml_text(text, source=source)
    if not isinstance(raw, dict):
        raise ConfigError("", f"{source}: a trace is a mapping with keys name, cluster, training, families")
    try:
        return from_dict(Trace, raw)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message}", origin=source) from None


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file; every problem is a one-line ConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError("", f"{p}: no such trace file (examples: {Path(__file__).parent / 'traces'})") from None
    except OSError as exc:
        raise ConfigError("", f"{p}: cannot read: {exc.strerror}") from None
    return parse_trace(text, source=str(p))


@dataclass(frozen=True)
class Domain:
    name: str
    family: str
    gen_dist: str
    gen_median_s: float
    gen_shape: float
    gen_cap_s: float
    sbx_dist: str
    sbx_median_s: float
    sbx_shape: float
    sbx_cap_s: float
    mean_turns: float
    turn_cap: int


@dataclass(frozen=True)
class EpisodeSpec:
    index: int
    domain: str
    gen_s: tuple[float, ...]  # one per turn
    sandbox_s: tuple[float, ...]  # one per turn: each turn's output is executed

    @property
    def turns(self) -> int:
        return len(self.gen_s)


def _draw(rng: random.Random, dist: str, median: float, shape: float, cap: float) -> float:
    if dist == "lognormal":
        x = median * math.exp(shape * rng.gauss(0.0, 1.0))
    else:  # Pareto with tail index `shape` and this median: x_m = median / 2^(1/alpha)
        x = median / 2.0 ** (1.0 / shape) / (1.0 - rng.random()) ** (1.0 / shape)
    return min(x, cap)


class World:
    """The trace's domains (drawn once from the families) and its deterministic episodes."""

    def __init__(self, trace: Trace):
        self.trace = trace
        rng = random.Random(trace.seed)
        domains: list[Domain] = []
        weights: list[float] = []
        for fam in trace.families:
            # Popularity within a family is uneven (a few domains dominate), like real task mixes.
            fam_w = [rng.lognormvariate(0.0, 1.0) for _ in range(fam.count)]
            total = sum(fam_w)
            for i in range(fam.count):
                domains.append(
                    Domain(
                        name=f"{fam.name}-{i}",
                        family=fam.name,
                        gen_dist=fam.gen.dist,
                        gen_median_s=_loguniform(rng, fam.gen.median_s),
                        gen_shape=rng.uniform(*fam.gen.shape),
                        gen_cap_s=fam.gen.cap_s,
                        sbx_dist=fam.sandbox.dist,
                        sbx_median_s=_loguniform(rng, fam.sandbox.median_s),
                        sbx_shape=rng.uniform(*fam.sandbox.shape),
                        sbx_cap_s=fam.sandbox.cap_s,
                        mean_turns=rng.uniform(*fam.turns.mean),
                        turn_cap=fam.turns.cap,
                    )
                )
                weights.append(fam.weight * fam_w[i] / total)
        self.domains = tuple(domains)
        acc, cum = 0.0, []
        for w in weights:
            acc += w
            cum.append(acc)
        self._cum = [c / acc for c in cum]

    def episode(self, index: int) -> EpisodeSpec:
        rng = random.Random(self.trace.seed * 1_000_003 + index + 1)
        d = self.domains[min(bisect.bisect_left(self._cum, rng.random()), len(self.domains) - 1)]
        # Geometric number of turns with the domain's mean, at least 1, capped.
        p = 1.0 / d.mean_turns
        turns = 1 if p >= 1 else 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
        turns = min(turns, d.turn_cap)
        gen = tuple(_draw(rng, d.gen_dist, d.gen_median_s, d.gen_shape, d.gen_cap_s) for _ in range(turns))
        sbx = tuple(_draw(rng, d.sbx_dist, d.sbx_median_s, d.sbx_shape, d.sbx_cap_s) for _ in range(turns))
        return EpisodeSpec(index, d.name, gen, sbx)


def _loguniform(rng: random.Random, bounds: tuple[float, float]) -> float:
    lo, hi = bounds
    return lo if lo == hi else math.exp(rng.uniform(math.log(lo), math.log(hi)))
