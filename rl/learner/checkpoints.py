"""Which learner checkpoint to resume from: the newest one that is whole.

    mark_complete(ckpt_dir / "step00000100", step=100, version=100)   # rank 0, after every rank saved
    prune_checkpoints(ckpt_dir, keep=2, saved="step00000100")          # rotation keeps whole ones
    tag = resume_tag(ckpt_dir)        # "step00000100", an older tag if that one is damaged, or None

DeepSpeed's own `latest` file is a plain write by rank 0 that can name a tag other ranks have
not finished saving (the learner no longer writes it: `save_latest=False`), and a truncated
`latest` or shard makes every restart fail the same way: a restart loop. So rank 0 writes
`hpcrl_complete.json` into a tag's folder once every rank has saved it (sizes of all its
files), and a resume takes the newest tag whose files are all there with those sizes,
skipping (with a warning naming it) any newer one that is not. Sizes
catch what a crash or a full disk leaves (truncated or missing files) without reading a 70B
model's optimizer state twice.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from hpcrl.core.files import atomic_write_json

__all__ = ["COMPLETE_NAME", "CheckpointError", "mark_complete", "prune_checkpoints", "resume_tag", "checkpoint_problem"]

log = logging.getLogger("hpcrl.learner")
COMPLETE_NAME = "hpcrl_complete.json"


class CheckpointError(RuntimeError):
    """Checkpoints were finished, and none of them is whole now: nothing to resume from safely."""


def _files(tag_dir: Path) -> dict[str, int]:
    return {
        str(p.relative_to(tag_dir)): p.stat().st_size
        for p in sorted(tag_dir.rglob("*"))
        if p.is_file() and p.name != COMPLETE_NAME
    }


def mark_complete(tag_dir: str | Path, step: int, version: int) -> None:
    tag_dir = Path(tag_dir)
    atomic_write_json(tag_dir / COMPLETE_NAME, {"step": step, "version": version, "files": _files(tag_dir)})


def prune_checkpoints(ckpt_dir: str | Path, keep: int, saved: str) -> list[str]:
    """Delete checkpoints older than the `keep` newest whole ones (`saved`, just marked, among
    them); returns the tags deleted. Damaged tags never count as kept, so rotation cannot leave
    a run whose only remaining checkpoints are damaged ones."""
    ckpt_dir = Path(ckpt_dir)
    tags = sorted((p for p in ckpt_dir.glob("step*") if p.is_dir()), reverse=True)
    whole = [d for d in tags if d.name == saved or checkpoint_problem(d) is None][: max(1, keep)]
    if not whole:
        return []
    oldest_kept = min(d.name for d in whole)
    gone = [d for d in tags if d.name < oldest_kept]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return [d.name for d in gone]


def checkpoint_problem(tag_dir: str | Path) -> str | None:
    """None if the checkpoint is whole, else what is wrong with it (one line)."""
    tag_dir = Path(tag_dir)
    try:
        want = json.loads((tag_dir / COMPLETE_NAME).read_bytes().decode())["files"]
    except FileNotFoundError:
        return f"no {COMPLETE_NAME} (a save that did not finish)"
    except (ValueError, KeyError, TypeError) as exc:
        return f"{COMPLETE_NAME} unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(want, dict) or not want:
        return f"{COMPLETE_NAME} lists no files"
    for name, size in want.items():
        try:
            have = (tag_dir / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if have != size:
            return f"{name} has {have} bytes, {size} when saved"
    return None


def resume_tag(ckpt_dir: str | Path) -> str | None:
    """The newest whole checkpoint's tag, or None for a fresh start (no checkpoint ever finished).

    Raises CheckpointError when checkpoints finished but none is whole any more: starting from
    the initial weights would silently throw away the run, so that is left to the operator."""
    ckpt_dir = Path(ckpt_dir)
    tags = sorted((p for p in ckpt_dir.glob("step*") if p.is_dir()), reverse=True)
    if not any((d / COMPLETE_NAME).exists() for d in tags):
        legacy = _deepspeed_latest(ckpt_dir)
        if legacy is not None:  # saved before completion marks existed
            msg = "%s: no %s (saved by an older hpcrl): resuming from DeepSpeed's latest, %s"
            log.warning(msg, ckpt_dir, COMPLETE_NAME, legacy)
            return legacy
        if tags:
            log.warning("no checkpoint in %s finished saving: starting from the initial weights", ckpt_dir)
        return None
    problems = []
    for d in tags:
        problem = checkpoint_problem(d)
        if problem is None:
            if problems:
                log.warning("resuming from %s, the newest whole checkpoint (skipped: %s)", d, "; ".join(problems))
            return d.name
        log.warning("checkpoint %s is not whole: %s", d, problem)
        problems.append(f"{d.name}: {problem}")
    raise CheckpointError(
        f"no whole checkpoint in {ckpt_dir} ({'; '.join(problems)}); restore one, "
        f"or move {ckpt_dir} aside to start from the initial weights"
    )


def _deepspeed_latest(ckpt_dir: Path) -> str | None:
    try:
        tag = (ckpt_dir / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if tag and (ckpt_dir / tag).is_dir() else None
