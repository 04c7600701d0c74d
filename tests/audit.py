"""Reading the learner's audit log (learner/trained.jsonl) the way the final model sees it."""

from __future__ import annotations

import json
import os
from pathlib import Path


def lineage(audit_path: str | os.PathLike) -> tuple[list[dict], int]:
    """The step records the final model descends from: steps redone after a restart replace the
    dead life's records from `resumed_step` on. Returns (records, number of lives)."""
    records: list[dict] = []
    lives = 0
    for line in Path(audit_path).read_text().splitlines():
        rec = json.loads(line)
        if "resumed_step" in rec:
            lives += 1
            records = [r for r in records if r["step"] <= rec["resumed_step"]]
        else:
            records.append(rec)
    return records, lives
