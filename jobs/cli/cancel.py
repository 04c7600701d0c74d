"""`hpcrl cancel RUN`: cancel every Slurm job of a run started with `hpcrl submit` (or submit.sh).

    hpcrl cancel runs/quickstart-20261202-120000-ab12
    hpcrl cancel quickstart-20261202-120000-ab12 --grace-s 30

Order: a marker file tells the supervisor to restart nothing, then the supervisor, generators,
sandboxes and learner are cancelled (scancel: SIGTERM, the learner checkpoints), then the store
writer is sent SIGTERM and given --grace-s seconds to flush and finalize its shards; then the
coordinator and anything left are cancelled, and it waits until no job of the run is left. It
says whether every shard was finalized, or names the open ones (they are recovered when a writer
or reader next opens the store).
"""

from __future__ import annotations

import argparse

from hpcrl.jobs.cli import add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cancel", help="cancel every Slurm job of a run", description=__doc__.split("\n\n")[2].replace("\n", " ")
    )
    add_run_args(p)
    p.add_argument("--grace-s", type=float, default=20.0, help="seconds the store writer gets to finalize (default 20)")
    p.set_defaults(func=run)


def slurm_jobs(run_dir):
    """jobs.json of a Slurm run, or UsageError (exit 2) naming why there is none."""
    from hpcrl.jobs.cli import UsageError
    from hpcrl.jobs.launch import read_jobs

    jobs = read_jobs(run_dir)
    if jobs is None:
        raise UsageError(f"{run_dir} has no jobs.json: not a Slurm run (a local `hpcrl run` stops with Ctrl-C)")
    return jobs


def rollout_job_ids(run_dir) -> list[str]:
    """The run's backfill rollout jobs (rollout.json); those that left the queue are skipped below."""
    import json

    try:
        jobs = json.loads((run_dir / "rollout.json").read_text()).get("jobs", {})
    except (OSError, ValueError):
        return []
    return [j["job_id"] for j in jobs.values() if j.get("job_id")]


def run(args: argparse.Namespace) -> int:
    import time

    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.jobs.launch import write_jobs
    from hpcrl.jobs.supervise import CANCEL_NAME, queue_states
    from hpcrl.rl.store.layout import list_shards
    from hpcrl.slurm import queries

    run_dir = resolve_run_dir(args.run, args.config)
    jobs = slurm_jobs(run_dir)
    (run_dir / CANCEL_NAME).write_text(f"{time.time()}\n")  # before any scancel: the supervisor must not restart
    comps = jobs["components"]
    all_ids = [c["job_id"] for c in comps.values()] + ([jobs["supervisor"]["job_id"]] if jobs.get("supervisor") else [])
    all_ids += rollout_job_ids(run_dir)  # backfill rollout jobs (jobs/rollout_plan.py): ours, by id
    alive = queue_states(all_ids)
    if not alive:
        print(f"run {run_dir.name}: no job left in the queue")
    store = comps.get("store", {}).get("job_id")
    services = {store, comps.get("coordinator", {}).get("job_id")}
    # A heterogeneous job shares ids between components: cancel its groups once, at the end.
    first = [j for j in dict.fromkeys(all_ids) if j in alive and j not in services]
    queries.cancel(first)
    exited = None
    if store in alive:
        queries.cancel([store], signal="TERM")  # the store flushes, finalizes its shard and returns
        deadline = time.monotonic() + args.grace_s
        while store in queue_states([store]) and time.monotonic() < deadline:
            time.sleep(0.5)
        exited = store not in queue_states([store])
    queries.cancel([j for j in dict.fromkeys(all_ids) if j in queue_states(all_ids)])
    deadline = time.monotonic() + 30  # KillWait: scancel's SIGTERM, then SIGKILL
    while queue_states(all_ids) and time.monotonic() < deadline:
        time.sleep(0.5)
    jobs.update(state="cancelled", ended=time.time())
    write_jobs(run_dir, jobs)
    print(f"run {run_dir.name}: cancelled {len(alive)} job(s): {' '.join(sorted(alive))}")
    if exited is not None:
        # The outcome itself, not how the job ended: does every shard carry its manifest?
        open_shards = [s.name for s in list_shards(run_dir / "trajectories") if not s.finalized]
        if not open_shards:
            print(
                "store writer flushed and finalized its shards"
                + ("" if exited else f" (after the {args.grace_s:g} s grace, when cancelled)")
            )
        else:
            print(
                f"store writer was stopped before finalizing {', '.join(open_shards)}: "
                "open shards are recovered when the store is next opened"
            )
    return 0
