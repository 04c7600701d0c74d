"""What the learner's audit log says the final model was trained on, checked against the store.

    records, lives = lineage_of(all_records)    # the step records the final model descends from
    acct = account(run_dir)                            # Accounting: trained, dropped and why, lost, twice
    rewards = step_rewards(run_dir)                    # {step: reward} of the lineage (metrics.jsonl)

A restarted learner resumes from its newest whole checkpoint and trains the steps after it
again; `learner/trained.jsonl` marks each new life with `resumed_step`, and the records of the
dead life from that step on are replaced by the new life's (`lineage`). `account` then asks the
questions a run that went through faults must answer (`hpcrl chaos`, tests): does the lineage
hold every step once, was any trajectory trained twice, and is every trajectory the store
acknowledged trained, dropped with a reason, still buffered in the last checkpoint, or not yet
read, so that none was lost.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.rl.coordinator.report import METRICS_NAME

# hpcrl imports inside functions here would load h5py, numpy for every importer of this module (start-up speed).

__all__ = ["AUDIT_NAME", "CURSOR_NAME", "lineage", "Accounting", "account", "step_rewards"]

AUDIT_NAME = "learner/trained.jsonl"  # one JSON line per life and per step, written by the learner (rank 0)
CURSOR_NAME = "learner/cursor.json"  # what the last checkpoint holds: step, reader cursor, buffered ids


def read_audit(audit_path: str | os.PathLike) -> list[dict]:
    lines = Path(audit_path).read_text().splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except ValueError:
            # Only the last line can be torn (a learner killed while appending); the step it
            # describes was never checkpointed, so the next life trains it again.
            if n < len(lines):
                raise ValueError(f"{audit_path}:{n}: not a JSON line; the audit log is damaged") from None
    return out


def lineage(audit_path: str | os.PathLike) -> tuple[list[dict], int]:
    """The step records the final model descends from: steps redone after a restart replace the
    dead life's records from `resumed_step` on. Returns (records, number of lives)."""
    return lineage_of(read_audit(audit_path))


def lineage_of(all_records: list[dict]) -> tuple[list[dict], int]:
    records: list[dict] = []
    lives = 0
    for rec in all_records:
        if "resumed_step" in rec:
            lives += 1
            records = [r for r in records if r["step"] <= rec["resumed_step"]]
        else:
            records.append(rec)
    return records, lives


@dataclass(frozen=True)
class Accounting:
    lives: int  # learner lives (1 + restarts that resumed)
    resumes: list[tuple[int, float]]  # (step, time) each life started from (step 0: the initial weights)
    steps: list[int]  # the lineage's steps in order (1..max_steps when whole)
    steps_redone: int  # steps trained by a life that died after its last checkpoint, then trained again
    cursor_step: int | None  # the step the last checkpoint's cursor holds
    trained: int  # trajectories trained in the lineage
    trained_twice: int  # ... of them trained in two steps of the lineage (must be 0)
    dropped: int  # trajectories the lineage dropped
    # rl/learner/batch.py DROP_REASONS -> trajectories; "unknown": no reason recorded
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    stored: int = 0  # trajectories in the store (acknowledged to their generators)
    buffered: int = 0  # ... held in the last checkpoint's buffer, or dropped and not yet audited
    unread: int = 0  # ... after the last checkpoint's reader cursor
    lost: int = 0  # stored, and neither trained, dropped, buffered nor unread (must be 0)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "steps"} | {"last_step": max(self.steps, default=0)}


def account(run_dir: str | os.PathLike) -> Accounting:
    """The audit log checked against the store and the last checkpoint's cursor (see the module doc)."""
    from hpcrl.rl.store.reader import StoreReader, iter_segments

    run_dir = Path(run_dir)
    all_records = read_audit(run_dir / AUDIT_NAME)
    records, lives = lineage_of(all_records)
    steps = [r["step"] for r in records]
    redone = sum(1 for r in all_records if "step" in r) - len(records)
    trained = [i for r in records for i in r["trained"]]
    dropped = [i for r in records for i in r["dropped"]]
    why: collections.Counter[str] = collections.Counter()
    for r in records:
        reasons = r.get("dropped_why")
        if reasons is None or len(reasons) != len(r["dropped"]):
            reasons = ["unknown"] * len(r["dropped"])
        why.update(reasons)
    try:
        cursor = json.loads((run_dir / CURSOR_NAME).read_text())
    except FileNotFoundError:
        cursor = None
    buffered: set[str] = set()
    reader = StoreReader(run_dir / "trajectories", refresh_s=0.0)
    if cursor is not None:
        buffered = set(cursor["buffered"]) | set(cursor["pending_dropped"])
        reader.load_state_dict(cursor["reader"])
    unread = {t.id for t in reader}
    stored = {i for _, _, cols in iter_segments(run_dir / "trajectories") for i in cols.ids()}
    accounted = set(trained) | set(dropped) | buffered | unread
    return Accounting(
        lives=lives,
        resumes=[(int(r["resumed_step"]), float(r.get("time", 0.0))) for r in all_records if "resumed_step" in r],
        steps=steps,
        steps_redone=redone,
        cursor_step=None if cursor is None else int(cursor["step"]),
        trained=len(trained),
        trained_twice=len(trained) - len(set(trained)),
        dropped=len(dropped),
        dropped_by_reason=dict(why),
        stored=len(stored),
        buffered=len(buffered & stored),
        unread=len(unread),
        lost=len(stored - accounted),
    )


def step_rewards(run_dir: str | os.PathLike) -> dict[int, tuple[float, float]]:
    """{step: (reward, time)} from metrics.jsonl; a step trained again after a restart keeps the
    reward of its last training (the one the final model descends from)."""
    out: dict[int, tuple[float, float]] = {}
    path = Path(run_dir) / METRICS_NAME
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(row.get("step"), int) and isinstance(row.get("reward"), (int, float)):
            out[row["step"]] = (float(row["reward"]), float(row.get("time", 0.0)))
    return out
