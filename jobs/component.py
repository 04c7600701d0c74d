"""Run one component of a run in the foreground: what the plain sbatch scripts of `hpcrl sbatch` call.

    python -m hpcrl.jobs.component RUN_DIR learner [--search-path DIR]     # inside a Slurm job
    python -m hpcrl.jobs.component RUN_DIR supervisor --max-restarts 3
    python -m hpcrl.jobs.component RUN_DIR --record store=101 learner=103 --supervisor-job 105

The component is rebuilt from RUN_DIR/config.resolved.yaml exactly as `hpcrl submit` builds
it, and runs as under submitit: its return value (or error) lands in
RUN_DIR/submitit/<job id>_0_result.pkl, its log is the job's output file, so the supervisor,
`hpcrl status` and `hpcrl logs` treat hand-submitted and submitit-submitted jobs alike.
SIGUSR2 (`#SBATCH --signal=USR2@N`, ahead of the time limit) makes the component drain and
checkpoint, then requeue its job (jobs/components.py), which runs again later under the same id.
`--record` writes the job ids submit.sh got from sbatch into RUN_DIR/jobs.json.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import traceback
from pathlib import Path


def build(run_dir: Path, name: str, search_path=(), max_restarts: int = 3):
    """The picklable component called `name` ('store', 'learner', 'gen-0', 'supervisor', ...)."""
    from hpcrl.jobs.config import RESOLVED_NAME, load_config
    from hpcrl.jobs.slurmrun import SUPERVISOR, SupervisorComponent, _roles

    cfg = load_config(run_dir / RESOLVED_NAME)
    if name == SUPERVISOR:
        return SupervisorComponent(run_dir, cfg, tuple(search_path), max_restarts)
    roles = {r.name: r for r in _roles(cfg, run_dir, search_path, max_restarts).roles}
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


def run(run_dir: Path, name: str, search_path, max_restarts: int) -> int:
    component = build(run_dir, name, search_path, max_restarts)
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
            tmp = out.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                pickle.dump(outcome, f)
            os.replace(tmp, out)
    print(f"{name} returned {value!r}", flush=True)
    return 0


def record(run_dir: Path, pairs: list[str], supervisor: str | None, search_path, max_restarts: int) -> int:
    import time

    from hpcrl.jobs.slurmrun import read_jobs, write_jobs

    rec = read_jobs(run_dir) or {"executor": "slurm", "run_dir": str(run_dir), "submitted": time.time(),
                                 "state": "submitted", "message": "", "max_restarts": max_restarts,
                                 "search_path": list(search_path), "components": {}}
    roles = {"store": "coordinator", "coordinator": "coordinator", "learner": "learner"}
    for pair in pairs:
        name, _, job = pair.partition("=")
        if not job:
            raise SystemExit(f"--record takes NAME=JOBID pairs (got {pair!r})")
        role = roles.get(name) or ("generator" if name.startswith("gen-") else "sandbox")
        old = rec["components"].get(name, {"history": [], "restarts": 0})
        rec["components"][name] = {"role": role, "job_id": job, "history": [*old["history"], job],
                                   "restarts": old["restarts"]}
    if supervisor:
        rec["supervisor"] = {"job_id": supervisor, "history": [supervisor]}
        rec["state"] = "running"
    write_jobs(run_dir, rec)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcrl.jobs.component", description=__doc__.split("\n\n")[1])
    p.add_argument("run_dir", type=Path)
    p.add_argument("name", nargs="?", help="component to run: store, coordinator, learner, gen-N, sandbox-N, supervisor")
    p.add_argument("--search-path", action="append", default=[], help="folder searched for site domain modules")
    p.add_argument("--max-restarts", type=int, default=3, help="supervisor: resubmissions allowed per component")
    p.add_argument("--record", nargs="*", metavar="NAME=JOBID", help="write these job ids into jobs.json instead")
    p.add_argument("--supervisor-job", help="with --record: the supervisor's job id")
    args = p.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if args.record is not None or args.supervisor_job:
        return record(run_dir, args.record or [], args.supervisor_job, args.search_path, args.max_restarts)
    if not args.name:
        p.error("name the component to run (or use --record)")
    return run(run_dir, args.name, args.search_path, args.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
