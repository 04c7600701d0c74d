"""Rollout task leases on the shared filesystem: atomic claims, atomic results, re-issue on loss.

    q = DirTaskQueue(run_dir / "rollout-queue")
    q.put(RolloutTask(7, "code-17", est_s=12.0), {"prompt_id": 123})
    if q.claim(7, owner="slurm-4242"):             # inside a rollout job
        q.complete(7, "slurm-4242", {"reward": 1.0})
    q.release("slurm-4242")                        # coordinator: the job is gone -> re-issue

A Slurm rollout job can vanish at any moment (time limit, preemption, a reclaimed GPU,
scancel). The queue makes that harmless: claiming a task is one rename from pending/ into
claimed/<owner>/ (rename is atomic, so two jobs cannot both win), a result is written to a
temporary name and renamed into results/ only when complete, and `release(owner)` puts
every task the owner claimed but did not finish back into pending/ and deletes the owner's
temporary files. Nothing half-written is ever visible under results/.

Layout: pending/<id>.json, claimed/<owner>/<id>.json, results/<id>.json, results/.tmp-*.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from pathlib import Path

from hpcrl.slurm.backfill.packer import RolloutTask

__all__ = ["DirTaskQueue", "TaskQueueError"]

_OWNER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class TaskQueueError(RuntimeError):
    """The queue folder holds something it cannot read (names the file)."""


class DirTaskQueue:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.pending_dir = self.root / "pending"
        self.claimed_dir = self.root / "claimed"
        self.results_dir = self.root / "results"
        for d in (self.pending_dir, self.claimed_dir, self.results_dir):
            d.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- coordinator side
    def put(self, task: RolloutTask, payload: dict | None = None) -> None:
        doc = {"task": asdict(task), "payload": payload or {}}
        _write_atomic(self.pending_dir / f"{task.task_id}.json", doc, self.pending_dir / f".tmp-{task.task_id}")

    def release(self, owner: str) -> list[int]:
        """The owner is gone: re-issue what it claimed and did not finish; drop its partial files."""
        _check_owner(owner)
        reissued = []
        mine = self.claimed_dir / owner
        if mine.is_dir():
            for path in sorted(mine.glob("*.json")):
                task_id = int(path.stem)
                if (self.results_dir / path.name).exists():
                    path.unlink(missing_ok=True)  # finished just before the end
                else:
                    os.rename(path, self.pending_dir / path.name)
                    reissued.append(task_id)
            _rmdir_quiet(mine)
        for tmp in self.results_dir.glob(f".tmp-*-{owner}"):
            tmp.unlink(missing_ok=True)
        return reissued

    def pending_tasks(self) -> list[RolloutTask]:
        out = []
        for p in sorted(self.pending_dir.glob("*.json")):
            try:
                out.append(self._load(p)[0])
            except FileNotFoundError:
                continue  # claimed by a worker between the listing and the read
        return out

    def results(self) -> dict[int, dict]:
        return {int(p.stem): _read_json(p) for p in sorted(self.results_dir.glob("*.json"))}

    def claimed(self) -> dict[str, list[int]]:
        return {
            d.name: sorted(int(p.stem) for p in d.glob("*.json"))
            for d in sorted(self.claimed_dir.iterdir())
            if d.is_dir()
        }

    def owners(self, prefix: str = "") -> list[str]:
        """Owners holding claims (or an empty claim folder), optionally those starting with `prefix`."""
        return sorted(d.name for d in self.claimed_dir.iterdir() if d.is_dir() and d.name.startswith(prefix))

    def counts(self) -> dict[str, int]:
        return {
            "pending": sum(1 for _ in self.pending_dir.glob("*.json")),
            "claimed": sum(len(v) for v in self.claimed().values()),
            "done": sum(1 for _ in self.results_dir.glob("*.json")),
        }

    # ---------------------------------------------------------------- worker side
    def claim(self, task_id: int, owner: str) -> bool:
        """Take a pending task for `owner`; False when another owner got it first."""
        _check_owner(owner)
        mine = self.claimed_dir / owner
        mine.mkdir(exist_ok=True)
        try:
            os.rename(self.pending_dir / f"{task_id}.json", mine / f"{task_id}.json")
        except FileNotFoundError:
            return False
        return True

    def claimed_payload(self, task_id: int, owner: str) -> tuple[RolloutTask, dict]:
        return self._load(self.claimed_dir / owner / f"{task_id}.json")

    def complete(self, task_id: int, owner: str, result: dict) -> None:
        """Store the result (atomically) and drop the claim."""
        _check_owner(owner)
        _write_atomic(self.results_dir / f"{task_id}.json", result, self.results_dir / f".tmp-{task_id}-{owner}")
        (self.claimed_dir / owner / f"{task_id}.json").unlink(missing_ok=True)

    def _load(self, path: Path) -> tuple[RolloutTask, dict]:
        doc = _read_json(path)
        try:
            return RolloutTask(**doc["task"]), doc.get("payload", {})
        except (KeyError, TypeError) as exc:
            raise TaskQueueError(f"{path}: not a task record ({exc}); remove it or re-put the task") from None


def _check_owner(owner: str) -> None:
    if not _OWNER_RE.match(owner):
        raise ValueError(f"task queue owner {owner!r}: use letters, digits, '_', '.', '-' (e.g. slurm-4242)")


def _write_atomic(path: Path, doc: dict, tmp: Path) -> None:
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise TaskQueueError(f"{path}: unreadable ({exc})") from None


def _rmdir_quiet(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
