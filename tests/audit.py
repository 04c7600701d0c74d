"""Reading the learner's audit log (learner/trained.jsonl): the package's own reader (rl/audit/audit.py),
and the accounting the whole-run tests share."""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.rl.audit.audit import lineage
from hpcrl.rl.learner.service import AUDIT_NAME, CURSOR_NAME

__all__ = ["lineage", "account"]


def account(run_dir: Path) -> tuple[list[str], list[str], set[str]]:
    """(trained, dropped, stored) trajectory ids of a finished run, over every learner life.

    Asserts that nothing was trained twice or both trained and dropped, and that every stored
    trajectory is accounted for: trained, dropped, in the learner's buffer at its last cursor, or
    not yet read by it."""
    from hpcrl.rl.store.reader import StoreReader, iter_segments

    records, _ = lineage(run_dir / AUDIT_NAME)
    trained = [i for r in records for i in r["trained"]]
    dropped = [i for r in records for i in r["dropped"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert not set(trained) & set(dropped), "a trajectory was both trained and dropped"
    cursor = json.loads((run_dir / CURSOR_NAME).read_text())
    reader = StoreReader(run_dir)
    reader.load_state_dict(cursor["reader"])
    unread = {t.id for t in reader}
    stored = {cols.trajectory(i).id for _, _, cols in iter_segments(run_dir / "trajectories") for i in range(cols.rows)}
    accounted = set(trained) | set(dropped) | set(cursor["buffered"]) | set(cursor["pending_dropped"]) | unread
    assert stored <= accounted, f"{len(stored - accounted)} stored trajectories were lost"
    return trained, dropped, stored
