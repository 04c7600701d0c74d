"""Plain sbatch scripts, rendered by hpcrl itself where submitit cannot (heterogeneous jobs,
scripts users submit by hand).

    groups = [Resources(partition="cpu"), Resources(partition="gpu", gpus_per_node=1)]
    text = render_script(groups, ["srun --het-group=0 hostname", "srun --het-group=1 nvidia-smi"],
                         job_name="hpcrl-run", output="logs/%j.out")
    job_id = submit_script(path_of(text))

One `Resources` is an ordinary job; several become components of one heterogeneous job
(`#SBATCH hetjob` between their directive blocks), which Slurm starts together in one
allocation. Rendering is pure and deterministic so tests compare text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.slurm.command import run_slurm
from hpcrl.slurm.parse import parse_sbatch_job_id


@dataclass(frozen=True)
class Resources:
    """One job's (or one heterogeneous component's) resource request."""

    partition: str
    time_min: int = 60
    nodes: int = 1
    ntasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    gpu_shards: int = 0  # shards of one GPU (GRES shard) instead of whole GPUs
    mem_mb: int | None = None
    account: str | None = None
    qos: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def directives(self) -> list[str]:
        opts = [
            f"--partition={self.partition}",
            f"--time={self.time_min}",
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={self.ntasks_per_node}",
            f"--cpus-per-task={self.cpus_per_task}",
        ]
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.gpu_shards:
            opts.append(f"--gres=shard:{self.gpu_shards}")
        if self.mem_mb is not None:
            opts.append(f"--mem={self.mem_mb}M")
        if self.account:
            opts.append(f"--account={self.account}")
        if self.qos:
            opts.append(f"--qos={self.qos}")
        for key, value in sorted(self.extra.items()):
            flag = "--" + key.replace("_", "-")
            opts.append(flag if value in ("", None) else f"{flag}={value}")
        return opts


def render_script(
    groups: list[Resources] | tuple[Resources, ...],
    body: list[str] | tuple[str, ...],
    *,
    job_name: str,
    output: str,
    error: str | None = None,
    signal: str | None = None,
    requeue: bool = False,
    header_comment: str = "",
) -> str:
    """An sbatch script; more than one group makes it a heterogeneous job."""
    if not groups:
        raise ValueError("render_script: at least one resource group is needed")
    lines = ["#!/bin/bash"]
    if header_comment:
        lines += [f"# {line}" if line else "#" for line in header_comment.splitlines()]
    lines += [f"#SBATCH --job-name={job_name}", f"#SBATCH --output={output}"]
    if error:
        lines.append(f"#SBATCH --error={error}")
    if signal:
        lines.append(f"#SBATCH --signal={signal}")
    if requeue:
        lines.append("#SBATCH --requeue")
    for i, group in enumerate(groups):
        if i:
            lines.append("#SBATCH hetjob")
        lines += [f"#SBATCH {d}" for d in group.directives()]
    lines += ["", "set -euo pipefail", *body, ""]
    return "\n".join(lines)


def write_script(text: str, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def submit_script(path: str | os.PathLike, extra_args: list[str] | tuple[str, ...] = ()) -> str:
    """`sbatch --parsable PATH`; returns the job id (the first component's for a hetjob)."""
    out = run_slurm(["sbatch", "--parsable", *extra_args, str(path)])
    return parse_sbatch_job_id(out.stdout)
