"""Policy weights by version, through the run directory.

    pub = WeightStore(run_dir)
    pub.publish(state_dict, version=12)        # weights/policy-v00000012.safetensors, then latest.json
    watch = WeightStore(run_dir)
    watch.latest()                             # (12, Path) or None
    version = watch.load_if_newer(model, have=11)   # 12 after copying the weights in; None if not newer

The learner writes the weight file atomically first and the small `latest.json` announcement
after it (atomically too), so a reader that sees version N in latest.json always finds a
complete file for N. Generators check latest.json between steps (a stat and, on change, a tiny
read); a message-bus announcement can wake them sooner but the file stays the payload.
Old files are pruned, keeping `keep` versions so a slow reader still finds the one it was told.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from hpcrl.core.files import atomic_write_json
from hpcrl.rl.policy import load_weights, save_weights

__all__ = ["WeightStore"]

_NAME = re.compile(r"policy-v(\d{8})\.safetensors")


class WeightStore:
    def __init__(self, run_dir: str | os.PathLike, keep: int = 3):
        self.dir = Path(run_dir) / "weights"
        self.keep = keep
        self._seen_mtime: int | None = None
        self._seen: tuple[int, Path] | None = None

    def path_of(self, version: int) -> Path:
        return self.dir / f"policy-v{version:08d}.safetensors"

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        path = save_weights(state_dict, self.path_of(version), version)
        atomic_write_json(self.dir / "latest.json", {"version": version, "file": path.name})
        self._prune(version)
        return path

    def _prune(self, newest: int) -> None:
        for p in self.dir.glob("policy-v*.safetensors"):
            m = _NAME.fullmatch(p.name)
            if m and int(m.group(1)) <= newest - self.keep:
                p.unlink(missing_ok=True)

    def latest(self) -> tuple[int, Path] | None:
        """The announced (version, file); cached by latest.json's mtime so polling costs one stat."""
        ann = self.dir / "latest.json"
        try:
            mtime = ann.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime == self._seen_mtime and self._seen is not None:
            return self._seen
        try:
            data = json.loads(ann.read_text())
        except (OSError, ValueError):
            return self._seen  # replaced while we read it; the next poll sees the new one
        self._seen_mtime, self._seen = mtime, (int(data["version"]), self.dir / data["file"])
        return self._seen

    def load_if_newer(self, model, have: int) -> int | None:
        """Load the announced weights into `model` when their version is above `have`."""
        ann = self.latest()
        if ann is None or ann[0] <= have:
            return None
        try:
            return load_weights(model, ann[1])
        except FileNotFoundError:
            # Pruned between announcement and read: a newer one is announced already.
            self._seen_mtime = None
            return None
