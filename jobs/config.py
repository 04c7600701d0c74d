"""The experiment config: one typed tree of frozen dataclasses, loaded strictly from YAML.

    cfg = load_config("config.yaml", ["learner.lr=3e-4", "executor=slurm"])

Every field carries a one-line help text (`spec(help=...)`); `config.yaml` documents each
one, and a test keeps the two in step. Each component receives only its own section
(`cfg.learner`, `cfg.sandbox`, ...), never the whole tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from hpcrl.jobs.schema import ConfigError, apply_overrides, from_dict, load_yaml_text, spec, to_dict

RESOLVED_NAME = "config.resolved.yaml"

_NAME_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = spec("quickstart", help="run name prefix; letters, digits, '_', '.', '-'", pattern=_NAME_RE)
    run_root: str = spec("runs", help="folder that holds one sub-folder per run (relative to the config file's folder)", min_len=1)
    seed: int = spec(0, help="seed for task sampling, model init and everything random", ge=0)


@dataclass(frozen=True)
class SlurmRoleConfig:
    """Resources of one component's Slurm job(s)."""

    partition: str = spec("cpu", help="partition the role's jobs go to", min_len=1)
    time_min: int = spec(60, help="wall-clock limit of each job, minutes", gt=0)
    nodes: int = spec(1, help="nodes per job", ge=1)
    tasks_per_node: int = spec(1, help="tasks (ranks) per node", ge=1)
    cpus_per_task: int = spec(1, help="CPUs per task", ge=1)
    gpus_per_node: int = spec(0, help="GPUs (GRES gpu) per node; 0 for CPU roles", ge=0)
    mem_gb: float = spec(2.0, help="memory per node, GB", gt=0)
    signal_delay_s: int = spec(120, help="seconds before the time limit that the job is signalled to checkpoint", ge=0)
    extra_directives: dict[str, str] = spec(
        factory=dict, help="additional #SBATCH options for this role only, e.g. {constraint: a100}"
    )

    def validate(self):
        if self.signal_delay_s >= self.time_min * 60:
            yield "signal_delay_s", f"must be shorter than the time limit ({self.time_min * 60} s) (got {self.signal_delay_s})"


@dataclass(frozen=True)
class SlurmConfig:
    account: str | None = spec(None, help="--account charged for every job; null uses the user's default")
    qos: str | None = spec(None, help="--qos of every job; null uses the partition's default")
    extra_directives: dict[str, str] = spec(
        factory=dict, help="additional #SBATCH options for every job, e.g. {reservation: rl-week}"
    )
    setup: tuple[str, ...] = spec(
        factory=tuple, help="shell lines run before each job step, e.g. module load or venv activation"
    )
    coordinator: SlurmRoleConfig = spec(
        factory=lambda: SlurmRoleConfig(partition="cpu", cpus_per_task=1, mem_gb=2.0),
        help="the run's coordinator (one small CPU job)",
    )
    learner: SlurmRoleConfig = spec(
        factory=lambda: SlurmRoleConfig(partition="gpu", gpus_per_node=1, cpus_per_task=2, mem_gb=4.0),
        help="DeepSpeed learner ranks",
    )
    generator: SlurmRoleConfig = spec(
        factory=lambda: SlurmRoleConfig(partition="gpu", gpus_per_node=1, cpus_per_task=1, mem_gb=4.0),
        help="rollout generators (one job per generator)",
    )
    sandbox: SlurmRoleConfig = spec(
        factory=lambda: SlurmRoleConfig(partition="cpu", cpus_per_task=2, mem_gb=4.0),
        help="sandbox servers (a job array, one server per task)",
    )

    def role(self, name: str) -> SlurmRoleConfig:
        roles = ("coordinator", "learner", "generator", "sandbox")
        if name not in roles:
            raise KeyError(f"unknown role {name!r}; roles: {', '.join(roles)}")
        return getattr(self, name)


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = spec(1e-3, help="AdamW learning rate", gt=0)
    max_staleness: int = spec(2, help="drop trajectories more than this many policy versions behind the learner", ge=0)


@dataclass(frozen=True)
class GeneratorConfig:
    count: int = spec(1, help="number of rollout generator processes", ge=1)
    episodes_in_flight: int = spec(8, help="episodes each generator keeps open at once", ge=1)


@dataclass(frozen=True)
class SandboxConfig:
    backend: Literal["bwrap", "apptainer"] = spec("bwrap", help="isolation backend for executing model code")
    slots: int = spec(2, help="concurrent executions per sandbox server", ge=1)


@dataclass(frozen=True)
class DomainConfig:
    name: str = spec(help="registered domain name, or a label for a `module` domain", min_len=1)
    weight: float = spec(1.0, help="relative sampling weight", gt=0)
    module: str | None = spec(None, help="site domain as 'python.module:attribute'; null for a built-in", pattern=r"[\w.]+:[\w.]+")


@dataclass(frozen=True)
class StoreConfig:
    flush_every: int = spec(64, help="flush a shard after this many trajectories", ge=1)
    flush_interval_s: float = spec(5.0, help="... or after this many seconds, whichever comes first", gt=0)
    compression: Literal["none", "gzip", "lzf"] = spec("none", help="HDF5 filter for token datasets")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: Literal["sync", "async", "backfill"] = spec("backfill", help="how rollout work is placed on GPUs")


@dataclass(frozen=True)
class Config:
    experiment: ExperimentConfig = spec(factory=ExperimentConfig, help="what the run is called, where it lives, its seed")
    executor: Literal["local", "slurm"] = spec("local", help="local: submitit's local executor on this machine; slurm: jobs on a cluster")
    slurm: SlurmConfig = spec(factory=SlurmConfig, help="Slurm account, QoS and per-role resources (executor: slurm)")
    learner: LearnerConfig = spec(factory=LearnerConfig, help="the DeepSpeed ZeRO-3 learner")
    generators: GeneratorConfig = spec(factory=GeneratorConfig, help="rollout generators")
    sandbox: SandboxConfig = spec(factory=SandboxConfig, help="code-execution sandboxes")
    domains: tuple[DomainConfig, ...] = spec(
        factory=lambda: (DomainConfig(name="arith"),), help="task domains and their sampling weights", min_len=1
    )
    store: StoreConfig = spec(factory=StoreConfig, help="HDF5 trajectory shards")
    scheduler: SchedulerConfig = spec(factory=SchedulerConfig, help="rollout placement policy")

    def validate(self):
        seen = set()
        for i, d in enumerate(self.domains):
            if d.name in seen:
                yield f"domains.{i}.name", f"duplicate domain {d.name!r}; each domain may be listed once"
            seen.add(d.name)


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load `path` (None: built-in defaults) with `key=value` overrides; raise ConfigError."""
    if path is None:
        raw, source_dir = {}, Path.cwd()
    else:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError("", f"{p}: no such config file") from None
        except OSError as exc:
            raise ConfigError("", f"{p}: cannot read: {exc.strerror}") from None
        raw = load_yaml_text(text, source=str(p))
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError("", f"{p}: the top level must be a mapping of sections (got {type(raw).__name__})")
        source_dir = p.resolve().parent
    raw, origins = apply_overrides(raw, overrides)
    try:
        cfg = from_dict(Config, raw)
    except ConfigError as exc:
        origin = next((o for key, o in origins.items() if exc.path == key or exc.path.startswith(key + ".")), None)
        if origin is not None:
            raise ConfigError(exc.path, exc.message, origin=f"from override {origin}") from None
        raise
    return _anchor_run_root(cfg, source_dir)


def _anchor_run_root(cfg: Config, source_dir: Path) -> Config:
    """A relative run_root is relative to the config file, so a job on another node finds it."""
    from dataclasses import replace

    root = Path(os.path.expanduser(cfg.experiment.run_root))
    if not root.is_absolute():
        root = source_dir / root
    return replace(cfg, experiment=replace(cfg.experiment, run_root=str(root)))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def write_resolved(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the fully resolved config into a run directory (atomically)."""
    out = Path(run_dir) / RESOLVED_NAME
    tmp = out.with_suffix(".tmp")
    tmp.write_text("# Resolved by hpcrl: every field, defaults and overrides applied.\n" + dump_config(cfg))
    os.replace(tmp, out)
    return out
