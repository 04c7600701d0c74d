"""One trajectory's life, from the run's own records: `hpcrl traj trace RUN ID`.

    events, trajs = trace(run_dir, "12")              # episode 12, every attempt and copy
    events, trajs = trace(run_dir, "r1/gen-0/12")     # one trajectory id (run/generator/episode)
    for e in events: print(e.time, e.what, e.detail)

Three records are joined, none of them written for this alone:
  coordinator/leases.jsonl   leased to which generator (attempt), done, failed and why, released
                             (handed back unfinished), expired (its generator went silent),
                             orphaned (its generator restarted), requeued (in flight when a
                             coordinator died), abandoned (rl/coordinator/events.py)
  trajectories/              the stored record: domain, task, each step (policy version, tokens,
                             reward, sandbox outcome, seconds generating and in the environment),
                             the shard and segment that hold it and when that segment was flushed
  learner/trained.jsonl      the step that trained it, or dropped it and why; a step redone by a
                             later learner life after a restart is marked superseded, because the
                             final model descends from the redone step, not from this one
Episode numbers are the coordinator's and unique per run; a retried episode keeps its number on
another generator, so a trajectory id names one attempt's result and an episode number names all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hpcrl.rl.audit.audit import AUDIT_NAME, lineage_of, read_audit
from hpcrl.rl.coordinator.events import LEASES_NAME, read_jsonl

# hpcrl imports inside functions here would load h5py, numpy for every importer of this module (start-up speed).

__all__ = ["Event", "StoredCopy", "TraceError", "parse_ident", "trace"]

# rl/learner/batch.py DROP_REASONS in words; an unknown reason (a newer learner's) is printed as it is.
_WHY = {
    "stale": "stale: more than learner.max_staleness versions behind when read (its group's newest action)",
    "late": "late: its group had already been trained or dropped (a re-issued episode finished twice)",
    "duplicate": "duplicate: the same episode twice in one open group",
    "filtered": "filtered: every reward in its group was equal (learner.filter_groups)",
    "abandoned": "abandoned: its group can never be complete (the coordinator gave up one of its episodes)",
    "unknown": "no reason recorded (an older learner)",
}


class TraceError(ValueError):
    """The id is malformed, or the run holds no record of it."""


@dataclass(frozen=True)
class Event:
    time: float  # unix seconds; 0.0 when the record has no time (an older run's audit log)
    what: str  # leased | started | step | finished | done | failed | released | expired | orphaned
    #            | requeued | abandoned | stored | trained | dropped
    episode: int
    detail: str  # one human line
    generator: str | None = None
    data: dict | None = None  # the facts behind `detail`, for --json


@dataclass(frozen=True)
class StoredCopy:
    id: str
    domain: str
    task: str
    shard: str
    segment: str
    row: int
    flushed_at: float
    final_reward: float
    truncation: str


def parse_ident(ident: str) -> tuple[int, str | None]:
    """'12' -> (12, None); 'gen-0/12' or 'run/gen-0/12' -> (12, 'gen-0/12' suffix to match)."""
    parts = ident.strip().split("/")
    try:
        episode = int(parts[-1])
    except ValueError:
        raise TraceError(
            f"{ident!r} is not a trajectory id: give an episode number (12) or an id run/generator/episode "
            "(as `hpcrl traj export` prints it)"
        ) from None
    if episode < 0 or len(parts) > 3 or any(not p for p in parts):
        raise TraceError(f"{ident!r} is not a trajectory id: give an episode number or run/generator/episode")
    return episode, None if len(parts) == 1 else "/".join(parts)


def id_matches(tid: str, episode: int, suffix: str | None) -> bool:
    if suffix is None:
        return tid.rsplit("/", 1)[-1] == str(episode)
    return tid == suffix or tid.endswith("/" + suffix)


def _lease_events(run_dir: Path, episode: int) -> Iterator[Event]:
    for rec in read_jsonl(run_dir / LEASES_NAME):
        t, g = float(rec.get("t", 0.0)), rec.get("g")
        # In the order the coordinator settles one sync: a restarted generator's predecessor's
        # leases, the reports, then the new leases.
        if episode in rec.get("orphaned", []):
            yield Event(t, "orphaned", episode, f"{g} restarted: its previous process held it; issued again", g)
        if episode in rec.get("done", []):
            yield Event(t, "done", episode, f"{g} reported it done (stored and acknowledged)", g)
        for ep, reason in rec.get("failed", []):
            if ep == episode:
                yield Event(t, "failed", ep, f"{g} reported it failed: {reason}", g, {"reason": reason})
        if episode in rec.get("abandoned", []):
            yield Event(t, "abandoned", episode, "abandoned: out of attempts (coordinator.max_attempts)", g)
        if episode in rec.get("released", []):
            yield Event(t, "released", episode, f"{g} handed it back unfinished; queued again first", g)
        for gen, eps in (rec.get("expired") or {}).items():
            if episode in eps:
                yield Event(t, "expired", episode, f"{gen} went silent past the lease; issued again", gen)
        if episode in rec.get("requeued", []):
            yield Event(t, "requeued", episode, "in flight when the coordinator died; its successor issued it again")
        for ep, attempt in rec.get("leased", []):
            if ep == episode:
                yield Event(t, "leased", ep, f"leased to {g} (attempt {attempt})", g, {"attempt": attempt})


def _stored(run_dir: Path, episode: int, suffix: str | None) -> list[tuple[StoredCopy, object]]:
    """Every stored copy that matches, with its Trajectory (read only for the rows that match)."""
    from hpcrl.rl.store.layout import list_shards
    from hpcrl.rl.store.reader import segments_of
    from hpcrl.rl.store.segment_read import SegmentError, load_segment, read_segment

    out = []
    for state in list_shards(run_dir / "trajectories"):
        for seg in segments_of(state):
            path = state.path / seg.name
            try:
                ids = read_segment(path, seg.expect, fields=("traj",)).ids()
            except SegmentError:
                continue  # damaged or being written: `hpcrl traj verify` reports it
            rows = [i for i, tid in enumerate(ids) if id_matches(tid, episode, suffix)]
            if not rows:
                continue
            try:
                cols, info = load_segment(path, seg.expect)
            except SegmentError:
                continue
            for i in rows:
                t = cols.trajectory(i)
                copy = StoredCopy(
                    t.id, t.domain, t.task, state.name, seg.name, i, info.flushed_at, t.final_reward, t.truncation
                )
                out.append((copy, t))
    return out


def _trajectory_events(copy: StoredCopy, traj) -> Iterator[Event]:
    g, ep = traj.generator, traj.episode
    if traj.started_at:
        yield Event(traj.started_at, "started", ep, f"{g} started it: {copy.domain} task {copy.task}", g)
    t = traj.started_at
    for n, s in enumerate(traj.steps, 1):
        t += s.generate_s + s.env_s  # a step's end, as its own durations place it
        sandbox = "" if s.sandbox.status == "none" else f", sandbox {s.sandbox.status} ({s.sandbox.duration_s:.3f} s)"
        yield Event(
            min(t, traj.finished_at or t) if traj.started_at else 0.0,
            "step",
            ep,
            f"step {n}: policy v{s.policy_version}, {len(s.prompt_tokens)} prompt + {len(s.action_tokens)} action"
            f" + {len(s.observation_tokens)} observation tokens, reward {s.reward:g}{sandbox};"
            f" {s.generate_s:.3f} s generating, {s.env_s:.3f} s environment",
            g,
            {"step": n, "policy_version": s.policy_version, "reward": s.reward, "sandbox": s.sandbox.status},
        )
    if traj.finished_at:
        yield Event(
            traj.finished_at,
            "finished",
            ep,
            f"finished: reward {traj.final_reward:g}, ended by {traj.truncation}",
            g,
            {"final_reward": traj.final_reward, "truncation": traj.truncation},
        )
    yield Event(
        copy.flushed_at,
        "stored",
        ep,
        f"stored as {copy.id} in {copy.shard}/{copy.segment}, row {copy.row}",
        g,
        {"id": copy.id, "shard": copy.shard, "segment": copy.segment, "row": copy.row},
    )


def _learner_events(run_dir: Path, episode: int, suffix: str | None) -> Iterator[Event]:
    path = run_dir / AUDIT_NAME
    if not path.exists():
        return
    records = read_audit(path)
    final = {id(r) for r in lineage_of(records)[0]}
    for r in records:
        if "step" not in r:
            continue
        late = "" if id(r) in final else " (superseded: a later learner life redid this step after a restart)"
        t = float(r.get("time", 0.0))
        for tid in r.get("trained", []):
            if id_matches(tid, episode, suffix):
                what = (
                    f"trained in learner step {r['step']} (which made policy v{r['version']}), life {r['life']}{late}"
                )
                data = {"id": tid, "step": r["step"], "life": r["life"], "superseded": bool(late)}
                yield Event(t, "trained", episode, f"{tid} {what}", None, data)
        why = r.get("dropped_why") or ["unknown"] * len(r.get("dropped", []))
        for tid, reason in zip(r.get("dropped", []), why):
            if id_matches(tid, episode, suffix):
                what = f"dropped by learner step {r['step']}, {_WHY.get(reason, reason)}; life {r['life']}{late}"
                data = {"id": tid, "step": r["step"], "reason": reason, "superseded": bool(late)}
                yield Event(t, "dropped", episode, f"{tid} {what}", None, data)


def trace(run_dir: str | os.PathLike, ident: str) -> tuple[list[Event], list[StoredCopy]]:
    """(events in time order, stored copies) of the trajectory or episode `ident`; TraceError if the
    run knows nothing of it."""
    run_dir = Path(run_dir)
    episode, suffix = parse_ident(ident)
    leases = list(_lease_events(run_dir, episode))
    if suffix is not None:  # one trajectory: only its generator's leases (another attempt is another id)
        gen = suffix.split("/")[-2]
        leases = [e for e in leases if e.generator in (None, gen)]
    stored = _stored(run_dir, episode, suffix)
    events = leases + [e for copy, t in stored for e in _trajectory_events(copy, t)]
    learner = list(_learner_events(run_dir, episode, suffix))
    if not events and not learner:
        raise TraceError(
            f"{run_dir}: no record of {ident!r} in {LEASES_NAME}, the store or {AUDIT_NAME}; "
            "check the id with `hpcrl traj export RUN`"
        )
    # sorted() is stable, so events of one time keep the order they were found in (a lease's
    # release before its re-lease). An audit record without a time (an older run) goes last.
    timed = sorted(events + [e for e in learner if e.time], key=lambda e: e.time)
    return timed + [e for e in learner if not e.time], [c for c, _ in stored]
