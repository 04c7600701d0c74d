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

The knobs only the simulator has live here, not in the run's config: the optional `slurm:`
section (`SlurmSpec`: the GPU partition the run shares with other users, Slurm's backfill
interval and resolution, the other users' workload, a rollout job's start-up). `scheduler:`
takes config.yaml's scheduler section as it is.

Instead of families, a trace may *replay* what a real run measured (`replay:` names the run
directory; `hpcrl sim RUN_DIR` builds such a trace): replay.py turns every stored trajectory's
per-turn generate_s and env_s into `MeasuredEpisode`s (the store's reader handed in by the
CLI, since slurm/ may not import rl/) for `World(trace, measured=...)`. Episode i is then
measured episode perm_k[i mod n] for pass k = i // n over the n measured ones, perm_k a
permutation drawn from (seed, k): each pass replays every measured episode once.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpcrl.core.config import SchedulerConfig
from hpcrl.core.schema import ConfigError, from_dict, load_yaml_text, spec

__all__ = ["Trace", "load_trace", "replay_trace", "parse_trace", "World", "Domain", "EpisodeSpec", "MeasuredEpisode"]

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
    episodes_in_flight: int = spec(8, help="episodes each generator keeps open (async and backfill)", ge=1)
    lend_episodes: int = spec(
        0,
        help="backfill: a generator takes up to this many more episodes while some wait on sandboxes "
        "(generators.lend_episodes of the run)",
        ge=0,
    )
    drop_stale: bool = spec(
        True,
        help="drop episodes older than max_staleness (false: train every one, off-policy correction only, "
        "and start exactly steps x batch_size episodes, so every policy trains the same episodes)",
    )

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
class RunTimeSpec:
    """One distribution of job run times: lognormal or Pareto with this median, capped."""

    dist: Literal["lognormal", "pareto"] = spec("lognormal", help="lognormal or pareto")
    median_s: float = spec(help="median run time, seconds", gt=0)
    shape: float = spec(help="lognormal sigma, or Pareto tail index alpha", gt=0)
    cap_s: float = spec(help="no job runs longer (a partition's MaxTime), seconds", gt=0)

    def validate(self):
        if self.cap_s < self.median_s:
            yield "cap_s", f"must be >= median_s ({self.median_s}) (got {self.cap_s})"


@dataclass(frozen=True, kw_only=True)
class OthersSpec:
    """Other users' jobs on the partition: Poisson arrivals, first come first served."""

    jobs_per_h: float = spec(help="jobs submitted per hour", gt=0)
    gpus: tuple[int, ...] = spec((1, 2, 4, 8), help="GPUs of one job (on one node), drawn uniformly from this list")
    run_s: RunTimeSpec = spec(help="how long a job runs")
    limit_factor: tuple[float, ...] = spec(
        (2.0, 4.0),
        help="[low, high]: a job's time limit is its run time times a factor drawn from this range, in whole "
        "minutes (users ask for more than they use; Slurm plans by the limit)",
    )
    cpus_per_gpu: int = spec(4, help="CPUs a job asks per GPU", ge=0)
    mem_gb_per_gpu: float = spec(16.0, help="memory a job asks per GPU, GB", ge=0)

    def validate(self):
        if not self.gpus or any(g < 1 for g in self.gpus):
            yield "gpus", f"a list of GPU counts >= 1 (got {list(self.gpus)})"
        yield from _range_errors("limit_factor", self.limit_factor)
        if len(self.limit_factor) == 2 and self.limit_factor[0] < 1:
            yield (
                "limit_factor",
                f"a limit below the run time kills the job; low must be >= 1 (got {self.limit_factor[0]})",
            )


@dataclass(frozen=True, kw_only=True)
class JobShapeSpec:
    cpus: int = spec(help="CPUs per GPU", ge=0)
    mem_gb: float = spec(help="memory per GPU, GB", ge=0)


@dataclass(frozen=True, kw_only=True)
class SlurmSpec:
    """The GPU partition the run shares with other users (simulator only: policy backfill's
    rollout jobs are sized to its backfill windows by the live planner)."""

    nodes: int = spec(help="nodes of the partition", ge=1)
    gpus_per_node: int = spec(help="GPUs per node", ge=1)
    cpus_per_node: int = spec(64, help="CPUs per node", ge=1)
    mem_gb_per_node: float = spec(512.0, help="memory per node, GB", gt=0)
    bf_interval_s: float = spec(30.0, help="Slurm's backfill pass runs this often (SchedulerParameters)", gt=0)
    bf_resolution_s: int = spec(60, help="... and plans in steps of this (SchedulerParameters)", ge=1)
    warmup_s: float = spec(
        7200.0, help="other users' jobs arrive from this long before the run starts (a busy queue at its start)", ge=0
    )
    startup_s: float | None = spec(
        None,
        help="a rollout job's start to its first episode (loading the model), seconds; null: scheduler.job_overhead_s",
        ge=0,
    )
    rollout_time_min: int = spec(
        60, help="a rollout job's --time when no pending job ends the window, minutes (slurm.generator.time_min)", ge=1
    )
    learner: JobShapeSpec = spec(factory=lambda: JobShapeSpec(cpus=8, mem_gb=64.0), help="the learner's request")
    generator: JobShapeSpec = spec(
        factory=lambda: JobShapeSpec(cpus=8, mem_gb=64.0),
        help="a generator's request (each fixed generator and each rollout job has one GPU)",
    )
    others: OthersSpec | None = spec(None, help="other users' jobs; null: the partition holds the run alone")

    def validate(self):
        if self.others is not None:
            big = [g for g in self.others.gpus if g > self.gpus_per_node]
            if big:
                yield "others.gpus", f"jobs are single-node: at most gpus_per_node ({self.gpus_per_node}) (got {big})"


# Keys of the retired gap packer: a trace may still set them; they are ignored, and `ignored`
# names them so that `hpcrl sim` can say so.
_RETIRED = {"scheduler": ("reclaim_quantile", "window_margin_s", "min_chunk_s"), "training": ("resume_s",)}


@dataclass(frozen=True, kw_only=True)
class Trace:
    name: str = spec(help="trace name", pattern=_NAME)
    description: str = spec("", help="free text")
    seed: int = spec(0, help="seed for domains and episodes", ge=0)
    cluster: ClusterSpec = spec(help="GPUs and sandbox slots")
    training: TrainingSpec = spec(help="the RL loop")
    families: tuple[FamilySpec, ...] = spec((), help="domain families (or replay)")
    replay: str = spec(
        "",
        help="a run directory (or trajectory store) whose measured episodes are replayed instead of families; "
        "relative to the trace file",
    )
    scheduler: SchedulerConfig = spec(
        factory=SchedulerConfig, help="the run's planner settings, as in config.yaml's scheduler section"
    )
    slurm: SlurmSpec | None = spec(
        None, help="the GPU partition shared with other users (backfill's rollout jobs); null: none"
    )
    ignored: tuple[str, ...] = spec((), help="(set by the loader) retired keys the trace sets, which do nothing")

    def validate(self):
        if not self.families and not self.replay:
            yield "families", "required key is missing: a trace needs families of domains, or replay: RUN_DIR"
        if self.families and self.replay:
            yield "replay", "a trace replays a run or draws from families, not both; remove one of the two"
        if self.slurm is not None:
            run = self.cluster.learner_gpus + self.cluster.generator_gpus
            if self.slurm.nodes * self.slurm.gpus_per_node < run:
                yield (
                    "slurm.nodes",
                    (
                        f"{self.slurm.nodes} x {self.slurm.gpus_per_node} GPUs cannot hold the run's {run} "
                        "(cluster.learner_gpus + generator_gpus)"
                    ),
                )
        if self.scheduler.rollout_partition:
            yield (
                "scheduler.rollout_partition",
                ('the simulator models one partition (rollout jobs give way through the planner); set it to ""'),
            )
        seen = set()
        for i, fam in enumerate(self.families):
            if fam.name in seen:
                yield f"families.{i}.name", f"duplicate family {fam.name!r}; each family may be listed once"
            seen.add(fam.name)


def parse_trace(text: str, source: str = "<trace>") -> Trace:
    raw = load_yaml_text(text, source=source)
    if not isinstance(raw, dict):
        raise ConfigError("", f"{source}: a trace is a mapping with keys name, cluster, training, families")
    return trace_from_mapping(raw, source)


def read_trace_mapping(path: str | Path) -> dict:
    """A trace file's YAML mapping, unvalidated (`hpcrl sim RUN_DIR --setup FILE` takes its
    cluster and training from it); ConfigError when it cannot be read or is no mapping."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError("", f"{p}: no such trace file (examples: {Path(__file__).parent / 'traces'})") from None
    except IsADirectoryError:
        raise ConfigError("", f"{p}: is a directory, not a trace file") from None
    except OSError as exc:
        raise ConfigError("", f"{p}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError("", f"{p}: not a text file (a trace is YAML)") from None
    raw = load_yaml_text(text, source=str(p))
    if not isinstance(raw, dict):
        raise ConfigError("", f"{p}: a trace is a mapping with keys name, cluster, training, families")
    return raw


def load_trace(path: str | Path, overrides: dict | None = None) -> Trace:
    """Read and validate a trace file; every problem is a one-line ConfigError. `overrides`
    ({"cluster": {"learner_gpus": 8}, ...}) replace keys before validation. A relative
    `replay:` path is taken relative to the trace file's folder."""
    p = Path(path)
    raw = _merge(read_trace_mapping(p), overrides)
    trace = trace_from_mapping(raw, str(p))
    if trace.replay and not Path(trace.replay).is_absolute():
        trace = dataclasses.replace(trace, replay=str(p.parent / trace.replay))
    return trace


def replay_trace(run_dir: str | Path, setup: str | Path | None = None, overrides: dict | None = None) -> Trace:
    """A trace that replays `run_dir`'s measured episodes, with the cluster, training and
    scheduler of the `setup` trace file (its families, if any, are not used) and `overrides`.
    Keys neither gives are missing: a one-line ConfigError names the first."""
    run = Path(run_dir)
    raw = read_trace_mapping(setup) if setup is not None else {}
    raw.pop("families", None)
    raw["replay"] = str(run.resolve())
    if "name" not in raw:
        raw["name"] = ("replay-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", run.resolve().name))[:64].rstrip("-.")
    source = f"{setup} + {run}" if setup is not None else str(run)
    return trace_from_mapping(_merge(raw, overrides), source)


def _merge(raw: dict, overrides: dict | None) -> dict:
    """raw with overrides' keys replaced, one level of sections deep (a section that is not a
    mapping is left for validation to report)."""
    out = dict(raw)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict):
            section = out.get(key)
            if section is None:
                out[key] = dict(value)
            elif isinstance(section, dict):
                out[key] = {**section, **value}
        else:
            out[key] = value
    return out


def trace_from_mapping(raw: dict, source: str) -> Trace:
    if "ignored" in raw:
        raise ConfigError("ignored", "unknown key (the loader sets it); remove it", origin=source)
    ignored, raw = [], dict(raw)
    for section, keys in _RETIRED.items():
        if isinstance(raw.get(section), dict) and set(keys) & set(raw[section]):
            ignored += [f"{section}.{k}" for k in keys if k in raw[section]]
            raw[section] = {k: v for k, v in raw[section].items() if k not in keys}
    try:
        trace = from_dict(Trace, raw)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message}", origin=source) from None
    return dataclasses.replace(trace, ignored=tuple(ignored)) if ignored else trace


def ignored_note(trace: Trace) -> str:
    """One line about retired keys a trace sets ("" when none)."""
    if not trace.ignored:
        return ""
    return (
        f"note: trace {trace.name} sets {', '.join(trace.ignored)}: ignored (they tuned the retired gap packer; "
        "the simulator now runs the live planner's decisions)"
    )


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

    @property
    def length_s(self) -> float:
        """The episode's own work: every turn's generation plus its sandbox run, seconds (no
        queueing: the same number under every policy)."""
        return math.fsum(self.gen_s) + math.fsum(self.sandbox_s)


@dataclass(frozen=True)
class MeasuredEpisode:
    """What a real run recorded for one episode: its domain and, per turn, the generation and
    environment (sandbox) seconds."""

    domain: str
    gen_s: tuple[float, ...]
    sandbox_s: tuple[float, ...]

    def __post_init__(self):
        if not self.gen_s or len(self.gen_s) != len(self.sandbox_s):
            raise ValueError(f"MeasuredEpisode: {len(self.gen_s)} generation and {len(self.sandbox_s)} sandbox times")
        if not all(x >= 0 and math.isfinite(x) for x in self.gen_s + self.sandbox_s):
            raise ValueError("MeasuredEpisode: durations must be finite and >= 0")


def _draw(rng: random.Random, dist: str, median: float, shape: float, cap: float) -> float:
    if dist == "lognormal":
        x = median * math.exp(shape * rng.gauss(0.0, 1.0))
    else:  # Pareto with tail index `shape` and this median: x_m = median / 2^(1/alpha)
        x = median / 2.0 ** (1.0 / shape) / (1.0 - rng.random()) ** (1.0 / shape)
    return min(x, cap)


class World:
    """The trace's domains (drawn once from the families) and its deterministic episodes, or,
    for a replay trace, the measured episodes of a run (`measured`, read by the jobs layer)."""

    def __init__(self, trace: Trace, measured: list[MeasuredEpisode] | tuple[MeasuredEpisode, ...] | None = None):
        self.trace = trace
        self.measured: tuple[MeasuredEpisode, ...] = ()
        self._perms: dict[int, list[int]] = {}
        if trace.replay or measured is not None:
            if not measured:
                raise ValueError(
                    f"trace {trace.name} replays {trace.replay or 'a run'}: pass its measured episodes, "
                    "World(trace, measured=hpcrl.slurm.sim.replay.read_measured(run_dir, read_store)[0])"
                )
            self.measured = tuple(measured)
            self.domains: tuple[Domain, ...] = ()
            self.domain_names = tuple(sorted({m.domain for m in self.measured}))
            return
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
        self.domain_names = tuple(d.name for d in domains)
        acc, cum = 0.0, []
        for w in weights:
            acc += w
            cum.append(acc)
        self._cum = [c / acc for c in cum]

    def episode(self, index: int) -> EpisodeSpec:
        if self.measured:
            n = len(self.measured)
            k, i = divmod(index, n)
            perm = self._perms.get(k)
            if perm is None:
                perm = self._perms[k] = list(range(n))
                random.Random(self.trace.seed * 1_000_003 - k - 1).shuffle(perm)
            m = self.measured[perm[i]]
            return EpisodeSpec(index, m.domain, m.gen_s, m.sandbox_s)
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
