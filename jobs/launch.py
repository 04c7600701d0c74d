"""Launching a run's roles: which components a run has, the one translation from a role's config
to Slurm options, the submitit executor for it, and submitting a run to Slurm.

    roles = plan(cfg, run_dir, domains)                  # store, coordinator, sandbox-N?, learner, gen-N
    ex = make_executor(cfg.executor, cfg.slurm, "learner", folder=run_dir / "submitit")
    job = ex.submit(roles[3].component)
    scripts = dry_run_scripts(cfg, run_dir, roles)       # {component: sbatch text}; submits nothing

`executor: local` gives submitit's LocalExecutor (same component classes, processes on this
machine); `executor: slurm` gives its SlurmExecutor with the options `role_resources` derives
from `slurm.<role>`: partition, time, nodes, tasks, CPUs, GPUs (GRES), memory, account, QoS,
extra directives. `hpcrl sbatch` renders its scripts from the same `Resources`.

Each component goes to its role's partition: store writer and coordinator on
`slurm.coordinator`, the learner on `slurm.learner`, generators on `slurm.generator`, sandbox
servers on `slurm.sandbox` as one job array. `<run>/jobs.json` (written atomically) maps
component -> current job id, earlier job ids and restarts; `hpcrl status/cancel/logs` and the
supervisor (jobs/supervise.py) read it. A local run, which has no jobs.json, keeps the same
map of its job ids in `<run>/logs/index.json` (`component_jobs` reads either). Every (re)submitted
job's output is also named after its component: `<run>/logs/<component>.out` and `.err` link to
its current job's files in `<run>/submitit/` (`tail -F` follows them across restarts).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import submitit

from hpcrl.core.config import Config, SlurmConfig
from hpcrl.core.files import atomic_write_json, read_state_json
from hpcrl.jobs.components import (
    CoordinatorComponent,
    GeneratorComponent,
    LearnerComponent,
    SandboxComponent,
    StoreComponent,
)
from hpcrl.rl.domains import load_domains
from hpcrl.rl.model.alphabet import resolve_charset
from hpcrl.slurm.queries import show_config
from hpcrl.slurm.sbatch import Resources

__all__ = [
    "Role",
    "plan",
    "role_resources",
    "slurm_parameters",
    "make_executor",
    "slurm_executor",
    "dry_run_scripts",
    "preflight",
    "read_jobs",
    "write_jobs",
    "link_logs",
    "component_jobs",
    "check_slurm",
    "JOBS_NAME",
    "SUPERVISOR",
]

JOBS_NAME = "jobs.json"
LOGS_DIR = "logs"  # <component>.out/.err links, and a local run's index.json
# Every job's python runs hpcrl.jobs.boot first, which holds an early SIGUSR2 until the component
# can drain on it (see jobs/boot.py); submitit appends "-u -m submitit.core._submit FOLDER".
BOOT_PYTHON = f"{shlex.quote(sys.executable)} -u -m hpcrl.jobs.boot"
SUPERVISOR = "supervisor"


@dataclass
class Role:
    """One component of a run and the job that runs it now."""

    name: str  # store, coordinator, sandbox-0, learner, gen-0, ...
    slurm_role: str  # the slurm.<section> it runs with: coordinator, learner, generator, sandbox
    component: Any
    job: Any = None
    restarts: int = 0
    history: list = field(default_factory=list)
    started: float = 0.0  # when its current job was submitted (time.time())
    restart_times: list = field(default_factory=list)  # when each restart was submitted, for the budget
    start_failure: str | None = None  # the error its last job ended with before its main loop, if it did


def plan(
    cfg: Config, run_dir: str | os.PathLike, domains: Mapping[str, Any] | None = None, search_path: Sequence[str] = ()
) -> list[Role]:
    """The run's components in start order. `domains` ({name: Domain}, as `load_domains` gives
    them) decides whether sandbox servers are needed; they are loaded here when not given."""
    run_dir = Path(run_dir)
    if domains is None:
        domains = load_domains(cfg.domains, search_path)
    cfg = resolve_charset(cfg, domains)  # every component builds the same tokenizer
    needs_sandbox = any(d.needs_executor for d in domains.values())
    sizes = {name: d.size for name, d in domains.items() if d.size}
    seed = cfg.experiment.seed
    sandboxes = [f"sandbox-{i}" for i in range(cfg.sandbox.servers)] if needs_sandbox else []
    roles = [
        Role("store", "coordinator", StoreComponent(run_dir, cfg.store)),
        Role(
            "coordinator",
            "coordinator",
            CoordinatorComponent(run_dir, cfg.coordinator, cfg.domains, cfg.learner, seed, sizes),
        ),
        *[
            Role(s, "sandbox", SandboxComponent(run_dir, cfg.sandbox, s))  # slot uids: free ones of its node's pool
            for s in sandboxes
        ],
        Role("learner", "learner", LearnerComponent(run_dir, cfg.learner, cfg.policy, seed)),
        *[
            Role(
                f"gen-{i}",
                "generator",
                GeneratorComponent(
                    run_dir,
                    f"gen-{i}",
                    cfg.generators,
                    cfg.policy,
                    cfg.domains,
                    sandboxes,
                    seed + 1000 * (i + 1),
                    search_path,
                    cfg.sandbox.slots * len(sandboxes),
                ),
            )
            for i in range(cfg.generators.count)
        ],
    ]
    for r in roles:
        r.component.metrics = cfg.metrics  # each job serves its Prometheus endpoint (core/metrics.py)
    return roles


# -- roles as Slurm options ---------------------------------------------------------------------


def role_resources(slurm: SlurmConfig, role: str) -> Resources:
    """What `slurm.<role>` asks of Slurm: the one place a role's config becomes job options."""
    r = slurm.role(role)
    return Resources(
        partition=r.partition,
        time_min=r.time_min,
        nodes=r.nodes,
        ntasks_per_node=r.tasks_per_node,
        cpus_per_task=r.cpus_per_task,
        gpus_per_node=0 if r.gpu_shards else r.gpus_per_node,  # shards of one GPU instead of whole ones
        gpu_shards=r.gpu_shards,
        mem_mb=max(1, round(r.mem_gb * 1024)),
        account=slurm.account,
        qos=slurm.qos,
        extra={**slurm.extra_directives, **r.extra_directives},
    )


def slurm_parameters(
    slurm: SlurmConfig,
    role: str,
    job_name: str,
    time_limit_min: int | None = None,
    shrink_to_min: int | None = None,
    partition: str | None = None,
) -> dict:
    """submitit.SlurmExecutor keywords for one role (pure; tested without a cluster).

    A backfill rollout job (jobs/rollout_plan.py) runs as `generator` with the --time its window
    allows (`time_limit_min`) and --time-min `shrink_to_min`, down to which Slurm may cut it, in
    `partition` when given (scheduler.rollout_partition: a preemptible one) instead of the role's."""
    res = role_resources(slurm, role)
    params: dict = {
        "partition": partition or res.partition,
        "time": time_limit_min or res.time_min,
        "nodes": res.nodes,
        "ntasks_per_node": res.ntasks_per_node,
        "cpus_per_task": res.cpus_per_task,
        "mem": f"{res.mem_mb}M",
        "signal_delay_s": slurm.role(role).signal_delay_s,
        "job_name": job_name,
    }
    if res.gpus_per_node:
        params["gpus_per_node"] = res.gpus_per_node
    if res.gpu_shards:  # shards of one GPU, beside other jobs' shards (Slurm gives a GPU whole or as shards)
        params["gres"] = f"shard:{res.gpu_shards}"
    if res.account:
        params["account"] = res.account
    if res.qos:
        params["qos"] = res.qos
    if res.extra:
        # submitit writes `key_name` as `--key-name`; either spelling in the config works.
        params["additional_parameters"] = {k.replace("-", "_"): v for k, v in res.extra.items()}
    if shrink_to_min:
        params.setdefault("additional_parameters", {})["time_min"] = str(shrink_to_min)
    if slurm.setup:
        params["setup"] = list(slurm.setup)
    return params


def make_executor(
    kind: Literal["local", "slurm"],
    slurm: SlurmConfig,
    role: str,
    folder: str | os.PathLike,
    job_name: str | None = None,
) -> submitit.Executor:
    """A submitit executor for `role` ('coordinator', 'learner', 'generator', 'sandbox')."""
    folder = Path(folder)
    name = job_name or f"hpcrl-{role}"
    if kind == "slurm":
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=3, python=BOOT_PYTHON)
        ex.update_parameters(**slurm_parameters(slurm, role, name))
        return ex
    if kind == "local":
        r = slurm.role(role)
        ex = submitit.LocalExecutor(folder=folder, max_num_timeout=3, python=BOOT_PYTHON)
        # Locally there are no partitions or GRES: keep the time limit and the task count,
        # and hide GPUs unless the role asks for them.
        ex.update_parameters(timeout_min=r.time_min, tasks_per_node=r.tasks_per_node, gpus_per_node=r.gpus_per_node)
        return ex
    raise ValueError(f"unknown executor {kind!r}; choose local or slurm")


# -- a run on Slurm ------------------------------------------------------------------------------


def read_jobs(run_dir: str | os.PathLike) -> dict | None:
    """The run's jobs.json; a corrupt one falls back to the copy before it, with a warning
    (StateFileError, naming both files, when neither is readable)."""
    advice = "restore it, or cancel the run's jobs with scancel (names hpcrl-<run>-*) and submit the run again"
    return read_state_json(Path(run_dir) / JOBS_NAME, check=_check_jobs, advice=advice)


def _check_jobs(record) -> None:
    if not isinstance(record, dict) or not isinstance(record.get("components", {}), dict):
        raise ValueError("not a jobs record (an object with a 'components' object)")


def write_jobs(run_dir: str | os.PathLike, record: dict) -> None:
    """Atomically and durably: readers (status, cancel) never see half a file; the record it
    replaces stays as jobs.json.prev for read_jobs."""
    atomic_write_json(Path(run_dir) / JOBS_NAME, record, keep_previous=True)


def link_logs(run_dir: str | os.PathLike, name: str, job: Any, history: Sequence[str] | None = None) -> None:
    """Point logs/<name>.out and .err at `job`'s files (relative links: the run directory may be
    moved or mounted elsewhere); with `history` (a local run's job ids of `name`, oldest first),
    also record them in logs/index.json. Best effort: a log link is never worth a component."""
    folder = Path(run_dir) / LOGS_DIR
    try:
        folder.mkdir(exist_ok=True)
        for ext, target in (("out", job.paths.stdout), ("err", job.paths.stderr)):
            tmp = folder / f".{name}.{ext}.tmp"
            tmp.unlink(missing_ok=True)
            os.symlink(os.path.relpath(target, folder), tmp)
            os.replace(tmp, folder / f"{name}.{ext}")
        if history is not None:
            index = read_state_json(folder / "index.json", check=_check_index) or {}
            index[name] = [str(j) for j in history]
            atomic_write_json(folder / "index.json", index, keep_previous=True)
    except (OSError, ValueError) as exc:
        import logging

        logging.getLogger("hpcrl.launch").warning("%s: cannot link its logs into %s: %s", name, folder, exc)


def _check_index(index) -> None:
    if not isinstance(index, dict) or not all(isinstance(v, list) for v in index.values()):
        raise ValueError("not a log index (an object of job id lists)")


def component_jobs(run_dir: str | os.PathLike) -> dict[str, list[str]] | None:
    """{component: its job ids, oldest first} of a run, Slurm's (jobs.json, the supervisor
    included) or local (logs/index.json); None when the run recorded neither."""
    jobs = read_jobs(run_dir)
    if jobs is not None:
        out = {n: [str(j) for j in c.get("history") or [c["job_id"]]] for n, c in jobs["components"].items()}
        sup = jobs.get("supervisor")
        if sup:
            out["supervisor"] = [str(j) for j in sup.get("history") or [sup["job_id"]]]
        return out
    return read_state_json(Path(run_dir) / LOGS_DIR / "index.json", check=_check_index)


def slurm_executor(cfg: Config, run_dir: Path, slurm_role: str, name: str) -> submitit.Executor:
    return make_executor("slurm", cfg.slurm, slurm_role, run_dir / "submitit", job_name=f"hpcrl-{run_dir.name}-{name}")


def check_slurm(cfg: Config) -> None:
    if cfg.executor != "slurm":
        raise ValueError(f"a Slurm run needs executor: slurm (got {cfg.executor!r}); `hpcrl run` runs locally")


def dry_run_scripts(cfg: Config, run_dir: str | os.PathLike, roles: Sequence[Role]) -> dict[str, str]:
    """The sbatch script submitit would submit for each component (and the supervisor); nothing is queued."""
    check_slurm(cfg)
    run_dir = Path(run_dir)
    out = {}
    sandboxes = sum(r.slurm_role == "sandbox" for r in roles)
    for name, slurm_role in [(r.name, r.slurm_role) for r in roles] + [(SUPERVISOR, "coordinator")]:
        if slurm_role == "sandbox":
            if name != "sandbox-0":
                continue
            name = "sandbox"  # one job array, as submit_run submits it
        ex = slurm_executor(cfg, run_dir, slurm_role, name)
        if name == "sandbox":
            ex.parameters["map_count"] = sandboxes
        out[name] = ex._make_submission_file_text(ex._submitit_command_str, "dry-run")
    return out


def preflight(cfg: Config) -> list[str]:
    """Warnings about cluster settings (`scontrol show config`) that break requeue or signals."""

    conf = show_config()
    warn = []
    if conf.get("JobRequeue") == "0":
        warn.append(
            "JobRequeue=0: jobs are not requeueable, so a component at its time limit cannot requeue "
            "itself; the supervisor resubmits it instead (a new job id, one restart of its budget)"
        )
    kill_wait = int((conf.get("KillWait") or "30").split()[0])
    if kill_wait < 10:
        warn.append(
            f"KillWait={kill_wait} s: a cancelled or requeued component has only that long after SIGTERM to "
            "checkpoint and flush; the learner may resume from an older checkpoint and the store's open "
            "shard is then recovered at next open"
        )
    mode = conf.get("PreemptMode", "OFF").upper()
    if conf.get("PreemptType", "preempt/none") != "preempt/none" and ("CANCEL" in mode or "SUSPEND" in mode):
        warn.append(
            f"PreemptMode={mode}: preempted components are cancelled or suspended, not requeued; the "
            "supervisor resubmits cancelled ones (each costs a restart)"
        )
    for role in ("coordinator", "learner", "generator", "sandbox"):
        delay = cfg.slurm.role(role).signal_delay_s
        if delay < 60:
            warn.append(
                f"slurm.{role}.signal_delay_s={delay}: Slurm checks time limits about once a minute, so the "
                "USR2 that starts the drain may come too late; 120 or more is safer"
            )
    return warn
