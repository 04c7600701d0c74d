"""The config sections of where and how a run's jobs run: Slurm resources per role, the rollout
scheduler, and supervision (restarts, hang detection). Part of the one config tree
(`hpcrl.core.config.Config`, which re-exports them); kept apart only for the file's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpcrl.core.schema import spec

__all__ = ["LocalWindowConfig", "SchedulerConfig", "SlurmConfig", "SlurmRoleConfig", "SuperviseConfig"]


@dataclass(frozen=True)
class SlurmRoleConfig:
    """Resources of one component's Slurm job(s)."""

    partition: str = spec("cpu", help="partition the role's jobs go to", min_len=1)
    time_min: int = spec(60, help="wall-clock limit of each job, minutes", gt=0)
    nodes: int = spec(1, help="nodes per job", ge=1)
    tasks_per_node: int = spec(1, help="tasks (ranks) per node", ge=1)
    cpus_per_task: int = spec(1, help="CPUs per task", ge=1)
    gpus_per_node: int = spec(0, help="GPUs (GRES gpu) per node; 0 for CPU roles", ge=0)
    gpu_shards: int = spec(
        0,
        help="generator only: ask for this many shards of one GPU (--gres=shard:N, shared with other runs' jobs) "
        "instead of whole GPUs; 0: whole GPUs",
        ge=0,
    )
    mem_gb: float = spec(2.0, help="memory per node, GB", gt=0)
    signal_delay_s: int = spec(120, help="seconds before the time limit that the job is signalled to checkpoint", ge=0)
    extra_directives: dict[str, str] = spec(
        factory=dict, help="additional #SBATCH options for this role only, e.g. {constraint: a100}"
    )

    def validate(self):
        if self.signal_delay_s >= self.time_min * 60:
            yield (
                "signal_delay_s",
                f"must be shorter than the time limit ({self.time_min * 60} s) (got {self.signal_delay_s})",
            )


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

    def validate(self):
        lr = self.learner
        if lr.gpus_per_node > 0 and lr.tasks_per_node != lr.gpus_per_node:
            yield (
                "learner.tasks_per_node",
                f"the learner runs one rank per GPU: set slurm.learner.tasks_per_node: {lr.gpus_per_node} to match "
                f"gpus_per_node: {lr.gpus_per_node} (got {lr.tasks_per_node}; "
                f"{abs(lr.gpus_per_node - lr.tasks_per_node)} GPU(s) per node would "
                + ("idle)" if lr.tasks_per_node < lr.gpus_per_node else "be shared)"),
            )
        for name in ("coordinator", "learner", "sandbox"):
            if self.role(name).gpu_shards:
                yield (
                    f"{name}.gpu_shards",
                    "only generators share a GPU by shards (a learner rank needs its GPU whole): set it to 0",
                )
        gen = self.generator
        if gen.gpu_shards and gen.gpus_per_node != 1:
            yield (
                "generator.gpus_per_node",
                f"with gpu_shards: {gen.gpu_shards} a generator takes shards of one GPU: set gpus_per_node: 1 "
                f"(got {gen.gpus_per_node})",
            )
        if gen.gpus_per_node > 1 or gen.tasks_per_node != 1:
            yield (
                "generator.gpus_per_node" if gen.gpus_per_node > 1 else "generator.tasks_per_node",
                "a generator is one process on one GPU: set slurm.generator.gpus_per_node: 1 and tasks_per_node: 1, "
                f"and generators.count for more (got gpus_per_node: {gen.gpus_per_node}, "
                f"tasks_per_node: {gen.tasks_per_node})",
            )

    def role(self, name: str) -> SlurmRoleConfig:
        roles = ("coordinator", "learner", "generator", "sandbox")
        if name not in roles:
            raise KeyError(f"unknown role {name!r}; roles: {', '.join(roles)}")
        return getattr(self, name)


@dataclass(frozen=True)
class LocalWindowConfig:
    start_s: float = spec(0.0, help="when the window opens, seconds after the run started", ge=0)
    length_s: float = spec(600.0, help="how long it stays open, seconds", gt=0)
    gpus: int = spec(1, help="idle GPUs in it (one rollout process per slurm.generator.gpus_per_node)", ge=1)


@dataclass(frozen=True)
class SchedulerConfig:
    policy: Literal["sync", "async", "backfill"] = spec("backfill", help="how rollout work is placed on GPUs")
    fit_quantile: float = spec(
        0.9,
        help="a rollout job takes another episode only while this quantile of its recent episode durations fits "
        "before its window ends",
        gt=0,
        le=1,
    )
    history: int = spec(256, help="recent task durations kept per domain for the estimates", ge=1)
    min_samples: int = spec(8, help="a domain with fewer samples uses the pooled history of all domains", ge=1)
    prior_s: float = spec(30.0, help="task duration assumed before any task has finished, seconds", gt=0)
    job_overhead_s: float = spec(
        20.0, help="start-up time of a Slurm rollout job, charged against its window, seconds", ge=0
    )
    slurm_margin_s: float = spec(
        0.0,
        help="rollout jobs are sized to end this long before the next queued job's expected start, seconds; "
        "0: Slurm's bf_interval + 4 (the wait for the backfill pass that can start them)",
        ge=0,
    )
    plan_interval_s: float = spec(
        10.0, help="policy backfill: how often the run looks for windows to submit rollout jobs into, seconds", gt=0
    )
    max_rollout_jobs: int = spec(
        0, help="policy backfill: rollout jobs (real generators in backfill windows) at once; 0: none", ge=0
    )
    max_rollout_gpus: int = spec(0, help="policy backfill: GPUs all rollout jobs together may hold; 0: none", ge=0)
    rollout_drain_s: float = spec(
        10.0, help="a rollout job hands back its unfinished episodes and exits this long before its window ends", ge=0
    )
    rollout_partition: str = spec(
        "",
        help="preemptible partition for rollout jobs (PriorityTier below slurm.generator's, its nodes); "
        '"": slurm.generator\'s, with give-way',
    )
    rollout_yield_after_s: float = spec(
        60.0,
        help="with rollout_partition: a rollout job Slurm leaves blocking another user's pending job this long "
        "is cancelled, seconds",
        ge=0,
    )
    rollout_withdraw_s: float = spec(
        0.0,
        help="a rollout job that Slurm has looked at and left pending this long after submission is withdrawn "
        "(scancel) and sized again to the window as it is then, seconds; 0: twice Slurm's bf_interval + 4",
        ge=0,
    )
    rollout_nice: int = spec(
        2147483645,
        help="Slurm --nice of rollout jobs, so they sort below every other pending job and one still pending "
        "never holds a backfill reservation ahead of another user's job; 2147483645: Slurm's largest; 0: none",
        ge=0,
        le=2147483645,
    )
    give_way_interval_s: float = spec(
        0.0,
        help="how often a Slurm run checks whether its rollout jobs keep another job from starting "
        "(one squeue of the partitions; the full check when a job there started or ended), seconds; "
        "0: a quarter of Slurm's bf_interval, at least 0.25",
        ge=0,
    )
    local_windows: tuple[LocalWindowConfig, ...] = spec(
        factory=lambda: (LocalWindowConfig(),),
        help="executor local: idle-GPU windows rollout processes may use (the Slurm run asks squeue)",
    )


@dataclass(frozen=True)
class SuperviseConfig:
    restarts: int = spec(
        5,
        help="restarts each component may use within restart_window_s; as old ones age out it may restart again",
        ge=0,
    )
    restart_window_s: float = spec(3600.0, help="the sliding window restarts are counted in, seconds", gt=0)
    backoff_s: float = spec(
        1.0, help="wait before restarting a component that ended; doubles with each restart in the window", ge=0
    )
    backoff_max_s: float = spec(300.0, help="the longest such wait, seconds", ge=0)
    hang_s: float = spec(
        600.0,
        help="a running component whose main loop has not turned for this long is hung: killed, restarted (0: never)",
        ge=0,
    )
    startup_s: float = spec(
        1800.0, help="the same for a component still starting: loading its model, joining its ranks (0: never)", ge=0
    )
