"""Plain, readable sbatch scripts for a run, for users who submit by hand (`hpcrl sbatch`).

    paths = write_scripts(cfg, run_dir, out_dir, search_path=[config_dir])   # one script per component
    paths = write_scripts(cfg, run_dir, out_dir, hetjob=True)                # one heterogeneous job

Each script asks for its role's resources (slurm.<role>), runs
`python -m hpcrl.jobs.component RUN_DIR NAME` under srun and writes its output where
submitit would (RUN_DIR/submitit/<job id>_0_log.out/.err), so `hpcrl status/logs/cancel` work the
same. `submit.sh` submits them in dependency-free order, records the job ids in jobs.json and
submits the supervisor last, which resubmits components that die (as under `hpcrl submit`).

The heterogeneous mode puts every component in one `#SBATCH hetjob` script: Slurm starts them
together in one allocation. There is no supervisor in that mode: the allocation is the unit, a
component that dies is not replaced, and the whole job is requeued (`--requeue`) or resubmitted.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from hpcrl.jobs.config import Config, SlurmRoleConfig
from hpcrl.slurm.sbatch import Resources, render_script, write_script

__all__ = ["write_scripts", "resources"]


def resources(cfg: Config, role: str) -> Resources:
    r: SlurmRoleConfig = cfg.slurm.role(role)
    return Resources(partition=r.partition, time_min=r.time_min, nodes=r.nodes, ntasks_per_node=r.tasks_per_node,
                     cpus_per_task=r.cpus_per_task, gpus_per_node=r.gpus_per_node,
                     mem_mb=max(1, round(r.mem_gb * 1024)), account=cfg.slurm.account, qos=cfg.slurm.qos,
                     extra={**cfg.slurm.extra_directives, **r.extra_directives})


def _command(run_dir: Path, name: str, search_path: Sequence[str], max_restarts: int) -> str:
    argv = [sys.executable, "-u", "-m", "hpcrl.jobs.component", str(run_dir), name]
    for p in search_path:
        argv += ["--search-path", str(p)]
    if name == "supervisor":
        argv += ["--max-restarts", str(max_restarts)]
    # The sandbox array's task index picks the server: leave $SLURM_ARRAY_TASK_ID to the shell.
    return shlex.join(argv).replace("'sandbox-$SLURM_ARRAY_TASK_ID'", '"sandbox-$SLURM_ARRAY_TASK_ID"')


def _preamble(cfg: Config, role: str) -> list[str]:
    lines = [*cfg.slurm.setup]
    r = cfg.slurm.role(role)
    if role == "learner" and r.nodes == 1:
        # All ranks on one node: loopback is the rendezvous (Slurm node names need not resolve).
        lines.append("export MASTER_ADDR=127.0.0.1")
    lines.append("export HF_HUB_OFFLINE=1  # components never download")
    return lines


def _components(cfg: Config, run_dir: Path, search_path: Sequence[str]) -> list[tuple[str, str]]:
    from hpcrl.jobs.slurmrun import _roles

    return [(r.name, r.slurm_role) for r in _roles(cfg, run_dir, search_path, 0).roles]


def write_scripts(cfg: Config, run_dir: str | os.PathLike, out_dir: str | os.PathLike, search_path: Sequence[str] = (),
                  max_restarts: int = 3, hetjob: bool = False) -> list[Path]:
    """Write the scripts and submit.sh into out_dir; return their paths (submit.sh last)."""
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir)
    logs = run_dir / "submitit"
    comps = _components(cfg, run_dir, search_path)
    if hetjob:
        return _write_hetjob(cfg, run_dir, out_dir, comps, search_path, logs)
    py = shlex.quote(sys.executable)
    paths, submit = [], [
        "#!/bin/bash",
        f"# Submits run {run_dir.name}: one job per component, then the supervisor that restarts dead ones.",
        "# Job ids go to the run's jobs.json, so `hpcrl status/logs/cancel RUN` work as after `hpcrl submit`.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f"mkdir -p {shlex.quote(str(logs))}",
        "sub() { local id; id=$(sbatch --parsable \"$1\"); echo \"${id%%;*}\"; }  # --parsable: ID or ID;cluster",
    ]
    record = []
    sandboxes = [n for n, role in comps if role == "sandbox"]
    for name, role in [*[c for c in comps if c[1] != "sandbox"], *([("sandbox", "sandbox")] if sandboxes else [])]:
        res = resources(cfg, role)
        extra = {}
        if name == "sandbox":
            extra["array"] = f"0-{len(sandboxes) - 1}"
        res = Resources(**{**res.__dict__, "extra": {**res.extra, **extra}})
        signal_s = cfg.slurm.role(role).signal_delay_s
        cmd_name = "sandbox-$SLURM_ARRAY_TASK_ID" if name == "sandbox" else name
        out = f"{logs}/%A_%a_0_log" if name == "sandbox" else f"{logs}/%j_0_log"
        text = render_script(
            [res], [*_preamble(cfg, role), f"srun --unbuffered {_command(run_dir, cmd_name, search_path, max_restarts)}"],
            job_name=f"hpcrl-{run_dir.name}-{name}", output=out + ".out", error=out + ".err",
            signal=f"USR2@{signal_s}", requeue=True,
            header_comment=(f"hpcrl run {run_dir.name}: the {name} component{' (one array task per server)' if name == 'sandbox' else ''}.\n"
                            f"USR2 {signal_s} s before the time limit: the component checkpoints and the job is requeued."))
        paths.append(write_script(text, out_dir / f"{name}.sbatch"))
        var = name.replace("-", "_")
        submit.append(f"{var}=$(sub {name}.sbatch)")
        if name == "sandbox":
            record += [f"sandbox-{i}=${{sandbox}}_{i}" for i in range(len(sandboxes))]
        else:
            record.append(f"{name}=${var}")
    sup = resources(cfg, "coordinator")
    text = render_script([sup], [*_preamble(cfg, "coordinator"),
                                 f"srun --unbuffered {_command(run_dir, 'supervisor', search_path, max_restarts)}"],
                         job_name=f"hpcrl-{run_dir.name}-supervisor", output=f"{logs}/%j_0_log.out",
                         error=f"{logs}/%j_0_log.err", signal=f"USR2@{cfg.slurm.coordinator.signal_delay_s}",
                         requeue=True, header_comment=f"hpcrl run {run_dir.name}: resubmits components that die.")
    paths.append(write_script(text, out_dir / "supervisor.sbatch"))
    component = f"{py} -m hpcrl.jobs.component {shlex.quote(str(run_dir))}"
    submit += [f"{component} --record {' '.join(record)}",
               "supervisor=$(sub supervisor.sbatch)",
               f"{component} --supervisor-job \"$supervisor\"",
               f"echo \"run {run_dir.name}: {' '.join(f'{r.split(chr(61))[0]} ' + r.split(chr(61))[1] for r in record)} "
               f"supervisor $supervisor\"", ""]
    paths.append(write_script("\n".join(submit), out_dir / "submit.sh"))
    return paths


def _write_hetjob(cfg, run_dir: Path, out_dir: Path, comps, search_path, logs: Path) -> list[Path]:
    """One het group per partition (a het job's groups cannot share a node, so fewer groups fit
    more clusters); inside a group each component is its own srun step with its own CPUs,
    memory and GPUs (`--exact`), so steps run side by side."""
    multi = sorted({role for _, role in comps if cfg.slurm.role(role).nodes > 1})
    if multi:
        raise ValueError(f"--hetjob puts each partition's components on one node; slurm.{multi[0]}.nodes > 1 "
                         "needs separate jobs (write the scripts without --hetjob)")
    parts: dict[str, list[tuple[str, str]]] = {}
    for name, role in comps:
        parts.setdefault(cfg.slurm.role(role).partition, []).append((name, role))
    groups, body, pids = [], [], {}
    for g, (partition, members) in enumerate(parts.items()):
        res = [resources(cfg, role) for _, role in members]
        groups.append(Resources(partition=partition, time_min=max(r.time_min for r in res), nodes=1,
                                ntasks_per_node=sum(r.ntasks_per_node for r in res),
                                cpus_per_task=max(r.cpus_per_task for r in res),
                                gpus_per_node=sum(r.gpus_per_node for r in res), mem_mb=sum(r.mem_mb for r in res),
                                account=cfg.slurm.account, qos=cfg.slurm.qos, extra=res[0].extra))
        for (name, _), r in zip(members, res):
            log = f"{logs}/${{SLURM_JOB_ID}}_{name}_log"
            gres = f" --gres=gpu:{r.gpus_per_node}" if r.gpus_per_node else ""
            body.append(f"srun --het-group={g} --exact -n{r.ntasks_per_node} -c{r.cpus_per_task} --mem={r.mem_mb}M{gres} "
                        f"--unbuffered --output={log}.out --error={log}.err {_command(run_dir, name, search_path, 0)} &")
            pids[name] = f"pid_{name.replace('-', '_')}"
            body.append(f"{pids[name]}=$!")
    gens = " ".join(f"${pids[n]}" for n, role in comps if role == "generator")
    rest = " ".join(f"${pids[n]}" for n, role in comps if role not in ("generator", "learner"))
    body += [
        f"wait ${pids['learner']} || true  # the run is over when the learner reached learner.max_steps",
        f"(sleep 60; kill -TERM {gens} 2>/dev/null) & timer=$!  # generators leave when the coordinator says so; bound it",
        f"wait {gens} || true",
        "kill $timer 2>/dev/null || true",
        "# SIGTERM to the steps still running (store, coordinator, sandboxes) and not to srun itself, which",
        "# would kill them after KillWait: they stop cleanly and the store finalizes its shard.",
        'scancel --signal=TERM "$SLURM_JOB_ID" || true',
        f"wait {rest} || true",
    ]
    text = render_script(groups, [*_preamble(cfg, "learner"), *body],
                         job_name=f"hpcrl-{run_dir.name}", output=f"{logs}/%j_hetjob.out",
                         signal=f"USR2@{cfg.slurm.learner.signal_delay_s}", requeue=True,
                         header_comment=(f"hpcrl run {run_dir.name}: every component in one heterogeneous job, one "
                                         f"group per partition ({', '.join(parts)}).\n"
                                         "No supervisor: a component that dies is not replaced; requeue the job."))
    script = write_script(text, out_dir / "run.hetjob.sbatch")
    py = shlex.quote(sys.executable)
    component = f"{py} -m hpcrl.jobs.component {shlex.quote(str(run_dir))}"
    # Slurm names a heterogeneous job's groups <id>+<offset>; squeue/sacct/scancel take them.
    offset = {name: g for g, members in enumerate(parts.values()) for name, _ in members}
    record = " ".join(f"{n}=$job+{offset[n]}" for n, _ in comps)
    submit = ["#!/bin/bash", f"# Submits run {run_dir.name} as one heterogeneous job and records its id.",
              "set -euo pipefail", 'cd "$(dirname "$0")"', f"mkdir -p {shlex.quote(str(logs))}",
              'job=$(sbatch --parsable run.hetjob.sbatch); job=${job%%;*}',
              f"{component} --record {record}", f'echo "run {run_dir.name}: hetjob $job"', ""]
    return [script, write_script("\n".join(submit), out_dir / "submit.sh")]
