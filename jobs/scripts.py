"""Plain, readable sbatch scripts for a run, for users who submit by hand (`hpcrl sbatch`), and
the command those scripts run.

    paths = write_scripts(cfg, run_dir, out_dir, roles, search_path=[config_dir])   # one script per component
    paths = write_scripts(cfg, run_dir, out_dir, roles, hetjob=True)                # one heterogeneous job

    python -m hpcrl.jobs.scripts RUN_DIR learner [--search-path DIR]      # inside a Slurm job
    python -m hpcrl.jobs.scripts RUN_DIR supervisor               # budgets from supervise.* in the config
    python -m hpcrl.jobs.scripts RUN_DIR --record store=101 learner=103 --supervisor-job 105

Each script asks for its role's resources (`launch.role_resources`, the same options `hpcrl
submit` asks for), runs `python -m hpcrl.jobs.scripts RUN_DIR NAME` under srun and writes its
output where submitit would (RUN_DIR/submitit/<job id>_0_log.out/.err), so `hpcrl
status/logs/cancel` work the same. That command rebuilds the component from
RUN_DIR/config.resolved.yaml exactly as `hpcrl submit` builds it and runs it as under submitit:
its return value (or error) lands in RUN_DIR/submitit/<job id>_0_result.pkl, so the supervisor
treats hand-submitted and submitit-submitted jobs alike. `--record` writes the job ids
submit.sh got from sbatch into RUN_DIR/jobs.json. `submit.sh` submits them in dependency-free
order, records the job ids in jobs.json and submits the supervisor last, which resubmits
components that die (as under `hpcrl submit`).

The heterogeneous mode puts every component in one `#SBATCH hetjob` script: Slurm starts them
together in one allocation. There is no supervisor in that mode: the allocation is the unit, a
component that dies is not replaced, and the whole job is requeued (`--requeue`) or resubmitted.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hpcrl.core.config import RESOLVED_NAME, Config, load_config
from hpcrl.core.files import atomic_write_bytes
from hpcrl.jobs.launch import SUPERVISOR, Role, plan, read_jobs, role_resources, write_jobs
from hpcrl.jobs.supervise import SupervisorComponent
from hpcrl.slurm.sbatch import Resources, render_script, write_script

__all__ = ["write_scripts", "build", "main"]


def _command(run_dir: Path, name: str, search_path: Sequence[str]) -> str:
    argv = [sys.executable, "-u", "-m", "hpcrl.jobs.boot", "-m", "hpcrl.jobs.scripts", str(run_dir), name]
    for p in search_path:
        argv += ["--search-path", str(p)]
    # The sandbox array's task index picks the server: leave $SLURM_ARRAY_TASK_ID to the shell.
    return shlex.join(argv).replace("'sandbox-$SLURM_ARRAY_TASK_ID'", '"sandbox-$SLURM_ARRAY_TASK_ID"')


def _umask(cfg: Config) -> str:
    """Slurm creates a job's log files with the umask sbatch was called under: the run's own."""
    return f"umask {'027' if cfg.experiment.share_with_group else '077'}  # the jobs' logs are as private as the run"


def _preamble(cfg: Config, role: str) -> list[str]:
    lines = [*cfg.slurm.setup]
    r = cfg.slurm.role(role)
    if role == "learner" and r.nodes == 1:
        # All ranks on one node: loopback is the rendezvous (Slurm node names need not resolve).
        lines.append("export MASTER_ADDR=127.0.0.1")
    lines.append("export HF_HUB_OFFLINE=1  # components never download")
    return lines


def write_scripts(
    cfg: Config,
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    roles: Sequence[Role],
    search_path: Sequence[str] = (),
    hetjob: bool = False,
) -> list[Path]:
    """Write the scripts and submit.sh into out_dir; return their paths (submit.sh last)."""
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir)
    logs = run_dir / "submitit"
    comps = [(r.name, r.slurm_role) for r in roles]
    if hetjob:
        return _write_hetjob(cfg, run_dir, out_dir, comps, search_path, logs)
    py = shlex.quote(sys.executable)
    paths, submit = (
        [],
        [
            "#!/bin/bash",
            f"# Submits run {run_dir.name}: one job per component, then the supervisor that restarts dead ones.",
            "# Job ids go to the run's jobs.json, so `hpcrl status/logs/cancel RUN` work as after `hpcrl submit`.",
            "set -euo pipefail",
            _umask(cfg),
            'cd "$(dirname "$0")"',
            f"mkdir -p {shlex.quote(str(logs))}",
            'sub() { local id; id=$(sbatch --parsable "$1"); echo "${id%%;*}"; }  # --parsable: ID or ID;cluster',
        ],
    )
    record = []
    sandboxes = [n for n, role in comps if role == "sandbox"]
    for name, role in [*[c for c in comps if c[1] != "sandbox"], *([("sandbox", "sandbox")] if sandboxes else [])]:
        res = role_resources(cfg.slurm, role)
        extra = {}
        if name == "sandbox":
            extra["array"] = f"0-{len(sandboxes) - 1}"
        res = replace(res, extra={**res.extra, **extra})
        signal_s = cfg.slurm.role(role).signal_delay_s
        cmd_name = "sandbox-$SLURM_ARRAY_TASK_ID" if name == "sandbox" else name
        out = f"{logs}/%A_%a_0_log" if name == "sandbox" else f"{logs}/%j_0_log"
        text = render_script(
            [res],
            [*_preamble(cfg, role), f"srun --unbuffered {_command(run_dir, cmd_name, search_path)}"],
            job_name=f"hpcrl-{run_dir.name}-{name}",
            output=out + ".out",
            error=out + ".err",
            signal=f"USR2@{signal_s}",
            requeue=True,
            header_comment=(
                f"hpcrl run {run_dir.name}: the {name} component"
                f"{' (one array task per server)' if name == 'sandbox' else ''}.\n"
                f"USR2 {signal_s} s before the time limit: the component checkpoints and the job is requeued."
            ),
        )
        paths.append(write_script(text, out_dir / f"{name}.sbatch"))
        var = name.replace("-", "_")
        submit.append(f"{var}=$(sub {name}.sbatch)")
        if name == "sandbox":
            record += [f"sandbox-{i}=${{sandbox}}_{i}" for i in range(len(sandboxes))]
        else:
            record.append(f"{name}=${var}")
    sup = role_resources(cfg.slurm, "coordinator")
    text = render_script(
        [sup],
        [
            *_preamble(cfg, "coordinator"),
            f"srun --unbuffered {_command(run_dir, SUPERVISOR, search_path)}",
        ],
        job_name=f"hpcrl-{run_dir.name}-supervisor",
        output=f"{logs}/%j_0_log.out",
        error=f"{logs}/%j_0_log.err",
        signal=f"USR2@{cfg.slurm.coordinator.signal_delay_s}",
        requeue=True,
        header_comment=f"hpcrl run {run_dir.name}: resubmits components that die.",
    )
    paths.append(write_script(text, out_dir / "supervisor.sbatch"))
    component = f"{py} -m hpcrl.jobs.scripts {shlex.quote(str(run_dir))}"
    submit += [
        f"{component} --record {' '.join(record)}",
        "supervisor=$(sub supervisor.sbatch)",
        f'{component} --supervisor-job "$supervisor"',
        f'echo "run {run_dir.name}: {" ".join(f"{r.split(chr(61))[0]} " + r.split(chr(61))[1] for r in record)} '
        f'supervisor $supervisor"',
        "",
    ]
    paths.append(write_script("\n".join(submit), out_dir / "submit.sh"))
    return paths


def _write_hetjob(cfg, run_dir: Path, out_dir: Path, comps, search_path, logs: Path) -> list[Path]:
    """One het group per partition (a het job's groups cannot share a node, so fewer groups fit
    more clusters); inside a group each component is its own srun step with its own CPUs,
    memory and GPUs (`--exact`), so steps run side by side."""
    multi = sorted({role for _, role in comps if cfg.slurm.role(role).nodes > 1})
    if multi:
        raise ValueError(
            f"--hetjob puts each partition's components on one node; slurm.{multi[0]}.nodes > 1 "
            "needs separate jobs (write the scripts without --hetjob)"
        )
    parts: dict[str, list[tuple[str, str]]] = {}
    for name, role in comps:
        parts.setdefault(cfg.slurm.role(role).partition, []).append((name, role))
    groups, body, pids = [], [], {}
    for g, (partition, members) in enumerate(parts.items()):
        res = [role_resources(cfg.slurm, role) for _, role in members]
        groups.append(
            Resources(
                partition=partition,
                time_min=max(r.time_min for r in res),
                nodes=1,
                ntasks_per_node=sum(r.ntasks_per_node for r in res),
                cpus_per_task=max(r.cpus_per_task for r in res),
                gpus_per_node=sum(r.gpus_per_node for r in res),
                gpu_shards=sum(r.gpu_shards for r in res),
                mem_mb=sum(r.mem_mb for r in res),
                account=cfg.slurm.account,
                qos=cfg.slurm.qos,
                extra=res[0].extra,
            )
        )
        for (name, _), r in zip(members, res):
            log = f"{logs}/${{SLURM_JOB_ID}}_{name}_log"
            want = [f"gpu:{r.gpus_per_node}"] * bool(r.gpus_per_node) + [f"shard:{r.gpu_shards}"] * bool(r.gpu_shards)
            gres = f" --gres={','.join(want)}" if want else ""
            body.append(
                f"srun --het-group={g} --exact -n{r.ntasks_per_node} -c{r.cpus_per_task} --mem={r.mem_mb}M{gres} "
                f"--unbuffered --output={log}.out --error={log}.err {_command(run_dir, name, search_path)} &"
            )
            pids[name] = f"pid_{name.replace('-', '_')}"
            body.append(f"{pids[name]}=$!")
    gens = " ".join(f"${pids[n]}" for n, role in comps if role == "generator")
    rest = " ".join(f"${pids[n]}" for n, role in comps if role not in ("generator", "learner"))
    body += [
        f"wait ${pids['learner']} || true  # the run is over when the learner reached learner.max_steps",
        f"(sleep 60; kill -TERM {gens} 2>/dev/null) & timer=$!"
        "  # generators leave when the coordinator says so; bound it",
        f"wait {gens} || true",
        "kill $timer 2>/dev/null || true",
        "# SIGTERM to the steps still running (store, coordinator, sandboxes) and not to srun itself, which",
        "# would kill them after KillWait: they stop cleanly and the store finalizes its shard.",
        'scancel --signal=TERM "$SLURM_JOB_ID" || true',
        f"wait {rest} || true",
    ]
    text = render_script(
        groups,
        [*_preamble(cfg, "learner"), *body],
        job_name=f"hpcrl-{run_dir.name}",
        output=f"{logs}/%j_hetjob.out",
        signal=f"USR2@{cfg.slurm.learner.signal_delay_s}",
        requeue=True,
        header_comment=(
            f"hpcrl run {run_dir.name}: every component in one heterogeneous job, one "
            f"group per partition ({', '.join(parts)}).\n"
            "No supervisor: a component that dies is not replaced; requeue the job."
        ),
    )
    script = write_script(text, out_dir / "run.hetjob.sbatch")
    py = shlex.quote(sys.executable)
    component = f"{py} -m hpcrl.jobs.scripts {shlex.quote(str(run_dir))}"
    # Slurm names a heterogeneous job's groups <id>+<offset>; squeue/sacct/scancel take them.
    offset = {name: g for g, members in enumerate(parts.values()) for name, _ in members}
    record = " ".join(f"{n}=$job+{offset[n]}" for n, _ in comps)
    submit = [
        "#!/bin/bash",
        f"# Submits run {run_dir.name} as one heterogeneous job and records its id.",
        "set -euo pipefail",
        _umask(cfg),
        'cd "$(dirname "$0")"',
        f"mkdir -p {shlex.quote(str(logs))}",
        "job=$(sbatch --parsable run.hetjob.sbatch); job=${job%%;*}",
        f"{component} --record {record}",
        f'echo "run {run_dir.name}: hetjob $job"',
        "",
    ]
    return [script, write_script("\n".join(submit), out_dir / "submit.sh")]


# -- the command the scripts run ------------------------------------------------------------------


def build(run_dir: Path, name: str, search_path: Sequence[str] = ()):
    """The picklable component called `name` ('store', 'learner', 'gen-0', 'supervisor', ...)."""
    cfg = load_config(run_dir / RESOLVED_NAME)
    if name == SUPERVISOR:
        return SupervisorComponent(run_dir, cfg, tuple(search_path))
    roles = {r.name: r for r in plan(cfg, run_dir, search_path=search_path)}
    if name not in roles:
        raise SystemExit(f"{name!r} is not a component of {run_dir}; components: {', '.join(roles)}, {SUPERVISOR}")
    return roles[name].component


def _result_path(run_dir: Path) -> Path | None:
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_PROCID", "0") != "0":
        return None
    if os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return run_dir / "submitit" / f"{job}_0_result.pkl"


def run_component(run_dir: Path, name: str, search_path: Sequence[str]) -> int:
    component = build(run_dir, name, search_path)
    out = _result_path(run_dir)
    try:
        value = component()
        outcome = ("success", value)
    except BaseException:  # recorded for the supervisor, then re-raised
        outcome = ("error", traceback.format_exc())
        raise
    finally:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            # submitit's own result format: the supervisor reads hand-submitted jobs the same way.
            atomic_write_bytes(out, pickle.dumps(outcome))
    print(f"{name} returned {value!r}", flush=True)
    return 0


def record_jobs(run_dir: Path, pairs: list[str], supervisor: str | None, search_path: Sequence[str]) -> int:
    rec = read_jobs(run_dir) or {
        "executor": "slurm",
        "run_dir": str(run_dir),
        "submitted": time.time(),
        "state": "submitted",
        "message": "",
        "search_path": list(search_path),
        "components": {},
    }
    roles = {"store": "coordinator", "coordinator": "coordinator", "learner": "learner"}
    for pair in pairs:
        name, _, job = pair.partition("=")
        if not job:
            raise SystemExit(f"--record takes NAME=JOBID pairs (got {pair!r})")
        role = roles.get(name) or ("generator" if name.startswith("gen-") else "sandbox")
        old = rec["components"].get(name, {"history": [], "restarts": 0})
        rec["components"][name] = {
            "role": role,
            "job_id": job,
            "history": [*old["history"], job],
            "restarts": old["restarts"],
            "restart_times": old.get("restart_times", []),
        }
    if supervisor:
        rec["supervisor"] = {"job_id": supervisor, "history": [supervisor]}
        rec["state"] = "running"
    write_jobs(run_dir, rec)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hpcrl.jobs.scripts",
        description="Run one component of a run in the foreground (what the scripts of "
        "`hpcrl sbatch` call), or record the job ids submit.sh got.",
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument(
        "name", nargs="?", help="component to run: store, coordinator, learner, gen-N, sandbox-N, supervisor"
    )
    p.add_argument("--search-path", action="append", default=[], help="folder searched for site domain modules")
    p.add_argument("--record", nargs="*", metavar="NAME=JOBID", help="write these job ids into jobs.json instead")
    p.add_argument("--supervisor-job", help="with --record: the supervisor's job id")
    args = p.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if args.record is not None or args.supervisor_job:
        return record_jobs(run_dir, args.record or [], args.supervisor_job, args.search_path)
    if not args.name:
        p.error("name the component to run (or use --record)")
    return run_component(run_dir, args.name, args.search_path)


if __name__ == "__main__":
    sys.exit(main())
