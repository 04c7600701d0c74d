"""What a run cost: wall-, CPU- and GPU-hours and queue wait per role, split across its domains.

    acct = account_run(run_dir)       # jobs.json + one sacct + the store + learner/trained.jsonl
    print(accounting_text(acct))      # what `hpcrl report RUN` prints; json.dumps(acct) for --json

A Slurm run (it has jobs.json) is asked of accounting once: `sacct -X -D` for every job id it
ever had (each component's `history`, restarts included, and the supervisor's; hetjob groups
`<id>+<offset>`, array tasks `<id>_<n>`). `-D` lists each life of a requeued job (same id) as
its own row. Per life:
    wall       Elapsed once it ended; now - Start while it runs
    CPU-hours  wall x AllocCPUS;  GPU-hours  wall x gres/gpu of AllocTRES
    wait       Start - Submit (a requeued life's Submit is its requeue); still pending:
               now - Submit, counted as pending, no hours; cancelled before it started: End - Submit
A job that holds several components (a hetjob group: store, coordinator and sandboxes in one,
learner and generators in another) counts once in the total; its CPU- and GPU-hours go to its
components in proportion to what each one's srun step asks (slurm.<role>: tasks_per_node x
cpus_per_task CPUs, gpus_per_node GPUs), and its wall time and wait count for each of its roles.

Per domain, each role's hours are split by a cost the trajectories record themselves
(`DOMAIN_RULES`, worded in `RULE_TEXT`):
    generator           share of the stored steps' generate_s (decoding time)
    sandbox             share of the stored steps' sandbox duration_s (execution in a sandbox)
    learner             share of the tokens of the trajectories the learner trained (the final
                        model's lineage in learner/trained.jsonl; a step redone after a restart once)
    store, coordinator  share of stored trajectories
    supervisor          not split: run overhead
A role with no basis (no sandbox time, no trained step yet) is not split either: its hours are
`unattributed`, so the domains plus `unattributed` add up to the total.

A local run (`executor: local`) has no Slurm accounting: no CPU- or GPU-hours and no queue wait
are reported, only each component process's wall time from its heartbeat (the last life of
each: its start to its last beat, or to now while it runs), split across domains by the same rules.

sacct prints the cluster's local time and `now` is this host's: run it where the two agree (a
login node of the cluster). The pure functions (`run_members`, `life_usage`, `summarize`,
`local_roles`, `apportion`) take parsed sacct records and store sums; the tests feed them rows.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcrl.core.liveness import read_heartbeats
from hpcrl.rl.audit.audit import AUDIT_NAME, lineage
from hpcrl.rl.coordinator.report import read_status
from hpcrl.slurm import queries
from hpcrl.slurm.queries import JobRecord

# hpcrl imports inside functions here would load h5py, msgpack, numpy, psutil, submitit, yaml, zmq for
# every importer of this module (start-up speed).

__all__ = [
    "ROLES",
    "DOMAIN_RULES",
    "RULE_TEXT",
    "DomainCosts",
    "Life",
    "role_of",
    "run_members",
    "life_usage",
    "summarize",
    "local_roles",
    "apportion",
    "store_costs",
    "account_run",
    "accounting_text",
]

ROLES = ("store", "coordinator", "sandbox", "learner", "generator", "supervisor")
# A component's name up to its first "-" -> its role (gen-3 -> generator, learner-1 -> learner).
_PREFIX_ROLE = {r: r for r in ROLES} | {"gen": "generator"}
# role -> the DomainCosts field its hours are split by; a role not here is not split.
DOMAIN_RULES = {
    "generator": "generate_s",
    "sandbox": "sandbox_s",
    "learner": "trained_tokens",
    "store": "trajectories",
    "coordinator": "trajectories",
}
RULE_TEXT = {
    "store": "by share of stored trajectories",
    "coordinator": "by share of stored trajectories",
    "sandbox": "by share of the stored steps' sandbox duration_s",
    "learner": "by share of the tokens of trained trajectories (learner/trained.jsonl lineage)",
    "generator": "by share of the stored steps' generate_s (decoding time)",
    "supervisor": "not split (run overhead): unattributed",
}


@dataclass
class DomainCosts:
    """One domain's sums over the store (and the learner's audit log)."""

    trajectories: int = 0
    steps: int = 0
    generate_s: float = 0.0
    env_s: float = 0.0
    sandbox_s: float = 0.0
    trained: int = 0
    trained_tokens: int = 0


@dataclass(frozen=True)
class Life:
    """One life of one job (a row of `sacct -X -D`) as hours and wait."""

    job_id: str
    state: str
    wall_s: float
    cpus: int
    gpus: int
    wait_s: float | None  # None: sacct has no Submit for it
    pending: bool
    running: bool


def role_of(name: str, slurm_role: str | None = None) -> str:
    """The report's role of a component: store-0 -> store, gen-3 -> generator, learner-1 -> learner.
    The store runs with slurm.coordinator but is its own role here."""
    return _PREFIX_ROLE.get(name.split("-", 1)[0], slurm_role or name)


def run_members(jobs: Mapping) -> dict[str, list[tuple[str, str]]]:
    """{job id: [(component, slurm role), ...]} for every job a jobs.json record names: each
    component's history (its restarts) and current job, and the supervisor's (slurm.coordinator).
    A hetjob group's id is shared by the components it holds."""
    entries = list((jobs.get("components") or {}).items())
    if jobs.get("supervisor"):
        entries.append(("supervisor", {**jobs["supervisor"], "role": "coordinator"}))
    out: dict[str, list[tuple[str, str]]] = {}
    for name, c in entries:
        ids = [str(j) for j in c.get("history") or []]
        if c.get("job_id") and str(c["job_id"]) not in ids:
            ids.append(str(c["job_id"]))
        for jid in ids:
            member = (name, c.get("role") or "coordinator")
            if member not in out.setdefault(jid, []):
                out[jid].append(member)
    return out


def _seconds(a: dt.datetime | None, b: dt.datetime | None) -> float | None:
    return None if a is None or b is None else max(0.0, (b - a).total_seconds())


def life_usage(rec: JobRecord, now: dt.datetime) -> Life:
    """Wall seconds, allocation and queue wait of one sacct row (rules in the module doc)."""
    # sacct may show a pending job with a Start (a backfill estimate, or the moment before its
    # start record lands): the state decides.
    pending = rec.state == "PENDING" or (rec.start is None and rec.end is None)
    running = not pending and rec.end is None
    if pending:
        wall, wait = 0.0, _seconds(rec.submit, now)
    elif rec.start is None:  # left the queue without starting (cancelled while pending)
        wall, wait = 0.0, _seconds(rec.submit, rec.end)
    else:
        if running:
            wall = _seconds(rec.start, now) or 0.0
        else:
            wall = float(rec.elapsed_s) if rec.elapsed_s is not None else _seconds(rec.start, rec.end) or 0.0
        wait = _seconds(rec.submit, rec.start)
    return Life(rec.job_id, rec.state, wall, rec.cpus, rec.gpus, wait, pending, running)


def _shares(members: Sequence[tuple[str, str]], requests: Mapping[str, tuple[float, float]], k: int) -> list[float]:
    """Each member's share of a job's CPUs (k=0) or GPUs (k=1), by what its role asks; equal when
    none of them asks for any (or the config is unknown)."""
    w = [float(requests.get(role, (0.0, 0.0))[k]) for _, role in members]
    total = sum(w)
    return [x / total for x in w] if total > 0 else [1.0 / len(members)] * len(members)


def _hours_row() -> dict:
    return {"components": [], "jobs": 0, "running": 0, "pending": 0, "wall_h": 0.0, "cpu_h": 0.0, "gpu_h": 0.0}


def _add_wait(row: dict, waits: list[float]) -> None:
    row["wait_h"] = sum(waits) / 3600
    row["wait_mean_s"] = sum(waits) / len(waits) if waits else None
    row["wait_max_s"] = max(waits, default=None)


def summarize(
    records: Sequence[JobRecord],
    members: Mapping[str, Sequence[tuple[str, str]]],
    requests: Mapping[str, tuple[float, float]],
    now: dt.datetime,
) -> dict:
    """Per role and in total: lives, running, pending, wall/CPU/GPU-hours, queue wait (total hours,
    mean and max seconds); every life as a row; the run's job ids sacct does not know."""
    roles: dict[str, dict] = {}
    waits: dict[str, list[float]] = {}
    for ms in members.values():
        for name, slurm_role in ms:
            row = roles.setdefault(role_of(name, slurm_role), _hours_row())
            if name not in row["components"]:
                row["components"].append(name)
    total, total_waits, lives = _hours_row(), [], []
    for rec in records:
        ms = members.get(rec.job_id)
        if not ms:
            continue
        life = life_usage(rec, now)
        cpu_share, gpu_share = _shares(ms, requests, 0), _shares(ms, requests, 1)
        seen = set()
        for (name, slurm_role), c, g in zip(ms, cpu_share, gpu_share):
            role = role_of(name, slurm_role)
            row = roles[role]
            row["cpu_h"] += life.wall_s * life.cpus * c / 3600
            row["gpu_h"] += life.wall_s * life.gpus * g / 3600
            if role not in seen:  # a life that holds two components of one role counts once in it
                seen.add(role)
                _count(row, life)
                if life.wait_s is not None:
                    waits.setdefault(role, []).append(life.wait_s)
        _count(total, life)
        total["cpu_h"] += life.wall_s * life.cpus / 3600
        total["gpu_h"] += life.wall_s * life.gpus / 3600
        if life.wait_s is not None:
            total_waits.append(life.wait_s)
        lives.append({**asdict(life), "components": [n for n, _ in ms], "roles": sorted(seen)})
    for role, row in roles.items():
        _add_wait(row, waits.get(role, []))
    _add_wait(total, total_waits)
    del total["components"]
    known = {r.job_id for r in records}
    order = {r: i for i, r in enumerate(ROLES)}
    return {
        "roles": dict(sorted(roles.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))),
        "total": total,
        "jobs": lives,
        "missing_job_ids": [j for j in members if j not in known],
    }


def _count(row: dict, life: Life) -> None:
    row["jobs"] += 1
    row["running"] += life.running
    row["pending"] += life.pending
    row["wall_h"] += life.wall_s / 3600


def local_roles(beats: Sequence[Mapping], alive: set[str], now: float) -> dict[str, dict]:
    """Per role of a local run: its component processes and their wall hours, each from its
    heartbeat record (`started` to its last beat `time`, or to `now` while it is alive)."""
    roles: dict[str, dict] = {}
    for b in beats:
        name = str(b.get("name", ""))
        start, last = b.get("started"), b.get("time")
        if not name or not isinstance(start, (int, float)) or not isinstance(last, (int, float)):
            continue
        row = roles.setdefault(role_of(name), {"components": [], "wall_h": 0.0})
        row["components"].append(name)
        row["wall_h"] += max(0.0, (now if name in alive else last) - start) / 3600
    order = {r: i for i, r in enumerate(ROLES)}
    return dict(sorted(roles.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def apportion(
    role_hours: Mapping[str, Mapping[str, float]], costs: Mapping[str, DomainCosts], metrics: Sequence[str]
) -> tuple[dict[str, dict], dict[str, float]]:
    """Split each role's `metrics` (cpu_h, gpu_h, wall_h) across domains by DOMAIN_RULES.
    Returns ({domain: {metric: hours, "by_role": {role: {metric: hours}}}}, unattributed)."""
    domains = {d: {**{m: 0.0 for m in metrics}, "by_role": {}} for d in sorted(costs)}
    unattributed = {m: 0.0 for m in metrics}
    for role, hours in role_hours.items():
        basis = DOMAIN_RULES.get(role)
        weights = {d: float(getattr(c, basis)) for d, c in costs.items()} if basis else {}
        total = sum(weights.values())
        for m in metrics:
            h = float(hours.get(m, 0.0))
            if total <= 0:
                unattributed[m] += h
                continue
            for d, w in weights.items():
                domains[d][m] += h * w / total
                domains[d]["by_role"].setdefault(role, {})[m] = h * w / total
    return domains, unattributed


def store_costs(run_dir: str | os.PathLike) -> tuple[dict[str, DomainCosts], list[str]]:
    """{domain: DomainCosts} over the run's store and the learner's lineage; and why any part
    could not be read. A finalized shard is summed from its index (hpcrl.rl.store.index: the
    per-domain sums in its head, the trained ones by its id hashes), never by opening its
    segments; only shards without a usable index (still open, or finalized before indexes
    existed) are read segment by segment (their traj and steps tables only)."""
    import numpy as np

    from hpcrl.rl.store.index import id_keys, index_part, member, read_index, step_rows
    from hpcrl.rl.store.layout import SegmentError, list_shards, read_segment
    from hpcrl.rl.store.reader import segments_of

    run_dir = Path(run_dir)
    notes: list[str] = []
    trained = np.zeros(0, "S16")
    if (run_dir / AUDIT_NAME).exists():
        try:
            ids = {i for r in lineage(run_dir / AUDIT_NAME)[0] for i in r.get("trained", ())}
            trained = np.sort(id_keys(ids))
        except (OSError, ValueError) as exc:
            notes.append(f"{AUDIT_NAME} unreadable ({exc}): learner hours unattributed")
    costs: dict[str, DomainCosts] = {}

    def add(sums: dict, keys, domain_of_row, tokens) -> None:
        for d, acc in sums.items():
            c = costs.setdefault(d, DomainCosts())
            c.trajectories += int(acc["trajectories"])
            c.steps += int(acc["steps"])
            c.generate_s += float(acc["generate_s"])
            c.env_s += float(acc["env_s"])
            c.sandbox_s += float(acc["sandbox_s"])
        hit = member(trained, keys)
        if not hit.any():
            return
        doms, inv = np.unique(domain_of_row[hit], return_inverse=True)
        counts = np.bincount(inv, minlength=len(doms))
        toks = np.bincount(inv, np.asarray(tokens)[hit].astype(np.float64), len(doms))
        for i, d in enumerate(doms):
            c = costs.setdefault(str(d), DomainCosts())
            c.trained += int(counts[i])
            c.trained_tokens += int(toks[i])

    for state in list_shards(run_dir / "trajectories"):
        idx = read_index(state.path, state.manifest.segments if state.manifest else None)
        if idx is not None:
            add(idx.sums, idx.keys, np.array(idx.domains, dtype=str)[np.asarray(idx.domain)], idx.tokens)
            continue
        for seg in segments_of(state):
            try:
                cols = read_segment(state.path / seg.name, seg.expect, fields=("traj", "steps"))
                rows = step_rows(cols.traj["step_start"], cols.traj["n_steps"])
                if len(rows) and (rows.min() < 0 or rows.max() >= len(cols.steps)):
                    raise SegmentError("step offsets out of range")
                part = index_part([cols])
            except SegmentError as exc:
                notes.append(f"segment {state.name}/{seg.name} unreadable, left out: {exc}")
                continue
            add(part.sums, part.keys, part.domains.astype(str), part.tokens)
    return costs, notes


def _requests(run_dir: Path) -> dict[str, tuple[float, float]]:
    """(CPUs, GPUs) each slurm role's component asks, from the run's resolved config."""
    from hpcrl.core.config import RESOLVED_NAME, load_config

    slurm = load_config(run_dir / RESOLVED_NAME).slurm
    out = {}
    for role in ("coordinator", "learner", "generator", "sandbox"):
        r = slurm.role(role)
        out[role] = (float(r.tasks_per_node * r.cpus_per_task), float(r.gpus_per_node))
    return out


def account_run(run_dir: str | os.PathLike, now: float | None = None) -> dict:
    """The whole report of a run as one JSON-able dict (see the module doc for every rule).
    Raises SlurmCommandError when a Slurm run's sacct fails."""
    from hpcrl.jobs.launch import read_jobs

    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    jobs = read_jobs(run_dir)
    status = read_status(run_dir) or {}
    costs, notes = store_costs(run_dir)
    out: dict = {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "executor": "slurm" if jobs else "local",
        "state": (jobs or {}).get("state") or status.get("state") or "unknown",
        "now": dt.datetime.fromtimestamp(now).isoformat(timespec="seconds"),
        "sacct": bool(jobs),
    }
    if jobs:
        members = run_members(jobs)
        requests: dict[str, tuple[float, float]] = {}
        if any(len(m) > 1 for m in members.values()):
            try:
                requests = _requests(run_dir)
            except Exception as exc:  # any config problem: the split falls back to equal shares
                notes.append(f"config.resolved.yaml unreadable ({exc}): shared jobs split equally")
        out.update(summarize(queries.job_history(list(members)), members, requests, dt.datetime.fromtimestamp(now)))
        if out["missing_job_ids"]:
            notes.append(
                f"sacct has no record of {len(out['missing_job_ids'])} job id(s) of this run "
                f"({', '.join(out['missing_job_ids'][:5])}): not yet in accounting, purged, or another cluster"
            )
        metrics = ("cpu_h", "gpu_h")
    else:
        from hpcrl.jobs.localrun import live_procs

        stems = sorted(p.stem for p in (run_dir / "heartbeats").glob("*.json"))
        beats = [b for stem in stems for b in read_heartbeats(run_dir, stem) if b.get("name") == stem]
        alive = {str(p.get("name")) for p in live_procs(run_dir)}
        out.update(roles=local_roles(beats, alive, now), total=None, jobs=[], missing_job_ids=[])
        notes.insert(
            0,
            "sacct figures are not available for a local run (executor: local): no CPU-hours, GPU-hours "
            "or queue wait; wall-hours are each component process's last life, start to last heartbeat",
        )
        metrics = ("wall_h",)
    domains, unattributed = apportion(out["roles"], costs, metrics)
    for d, c in costs.items():
        domains[d] = {**asdict(c), **domains[d]}
    out.update(domains=domains, unattributed=unattributed, rules=RULE_TEXT, notes=notes)
    return out


def _hms(s: float | None) -> str:
    if s is None:
        return "-"
    s = round(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def accounting_text(acct: dict, jobs: bool = False) -> str:
    """The report as `hpcrl report RUN` prints it (with `jobs`, one line per job life too)."""
    slurm = acct["sacct"]
    lines = [f"run {acct['run']}  ({acct['executor']}, {acct['state']})  at {acct['now']}"]
    lines += [f"note: {n}" for n in acct["notes"]]
    if slurm:
        lines.append(
            f"{'role':<12} {'comps':>5} {'jobs':>5} {'run':>4} {'pend':>4} {'wall-h':>9} {'CPU-h':>9} "
            f"{'GPU-h':>9} {'wait mean':>10} {'wait max':>9}"
        )
        rows = [*acct["roles"].items(), ("total", {**acct["total"], "components": ()})]
        for role, r in rows:
            lines.append(
                f"{role:<12} {len(r['components']) or '':>5} {r['jobs']:>5} {r['running']:>4} {r['pending']:>4} "
                f"{r['wall_h']:>9.4f} {r['cpu_h']:>9.4f} {r['gpu_h']:>9.4f} {_hms(r['wait_mean_s']):>10} "
                f"{_hms(r['wait_max_s']):>9}"
            )
    else:
        lines.append(f"{'role':<12} {'procs':>5} {'wall-h':>9}")
        lines += [f"{role:<12} {len(r['components']):>5} {r['wall_h']:>9.4f}" for role, r in acct["roles"].items()]
    metrics = ("cpu_h", "gpu_h") if slurm else ("wall_h",)
    heads = {"cpu_h": "CPU-h", "gpu_h": "GPU-h", "wall_h": "wall-h"}
    lines.append("by domain: each role's hours split")
    lines += [f"  {r:<12} {t}" for r, t in acct["rules"].items() if r in acct["roles"]]
    lines.append(
        f"{'domain':<24} {'trajs':>8} {'generate_s':>11} {'env_s':>9} {'sandbox_s':>10} {'trained':>8} "
        f"{'tokens':>10} " + " ".join(f"{heads[m]:>9}" for m in metrics)
    )
    for d, c in acct["domains"].items():
        lines.append(
            f"{d:<24} {c['trajectories']:>8} {c['generate_s']:>11.1f} {c['env_s']:>9.1f} {c['sandbox_s']:>10.1f} "
            f"{c['trained']:>8} {c['trained_tokens']:>10} " + " ".join(f"{c[m]:>9.4f}" for m in metrics)
        )
    lines.append(f"{'unattributed':<24} {'':>61} " + " ".join(f"{acct['unattributed'][m]:>9.4f}" for m in metrics))
    if jobs and slurm:
        lines.append(f"{'job':<14} {'state':<11} {'components':<28} {'wall':>9} {'CPUs':>5} {'GPUs':>5} {'wait':>9}")
        for j in acct["jobs"]:
            wait = _hms(j["wait_s"]) + (" (pending)" if j["pending"] else "")
            lines.append(
                f"{j['job_id']:<14} {j['state']:<11} {','.join(j['components'])[:28]:<28} {_hms(j['wall_s']):>9} "
                f"{j['cpus']:>5} {j['gpus']:>5} {wait:>9}"
            )
    return "\n".join(lines)
