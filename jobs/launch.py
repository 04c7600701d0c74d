"""Turn a role's config into a submitit executor: the one place resources become Slurm options.

    ex = make_executor(cfg.executor, cfg.slurm, "learner", folder=run_dir / "submitit")
    job = ex.submit(component)

`executor: local` gives submitit's LocalExecutor (same component classes, processes on this
machine); `executor: slurm` gives its SlurmExecutor with partition, time, nodes, tasks,
CPUs, GPUs (GRES), memory, account, QoS, signal delay and extra directives from the config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import submitit

from hpcrl.jobs.config import SlurmConfig, SlurmRoleConfig


def slurm_parameters(slurm: SlurmConfig, role: str, job_name: str) -> dict:
    """submitit.SlurmExecutor keywords for one role (pure; tested without a cluster)."""
    r: SlurmRoleConfig = slurm.role(role)
    params: dict = {
        "partition": r.partition,
        "time": r.time_min,
        "nodes": r.nodes,
        "ntasks_per_node": r.tasks_per_node,
        "cpus_per_task": r.cpus_per_task,
        "mem": f"{max(1, round(r.mem_gb * 1024))}M",
        "signal_delay_s": r.signal_delay_s,
        "job_name": job_name,
    }
    if r.gpus_per_node:
        params["gpus_per_node"] = r.gpus_per_node
    if slurm.account:
        params["account"] = slurm.account
    if slurm.qos:
        params["qos"] = slurm.qos
    extra = {**slurm.extra_directives, **r.extra_directives}
    if extra:
        # submitit writes `key_name` as `--key-name`; either spelling in the config works.
        params["additional_parameters"] = {k.replace("-", "_"): v for k, v in extra.items()}
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
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=3)
        ex.update_parameters(**slurm_parameters(slurm, role, name))
        return ex
    if kind == "local":
        r = slurm.role(role)
        ex = submitit.LocalExecutor(folder=folder, max_num_timeout=3)
        # Locally there are no partitions or GRES: keep the time limit and the task count,
        # and hide GPUs unless the role asks for them.
        ex.update_parameters(timeout_min=r.time_min, tasks_per_node=r.tasks_per_node, gpus_per_node=r.gpus_per_node)
        return ex
    raise ValueError(f"unknown executor {kind!r}; choose local or slurm")
