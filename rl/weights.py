"""Policy weights by version, through the run directory: sharded, written off the training
step's critical path, read by generators while they keep sampling.

    store = WeightStore(run_dir)
    store.publish(state_dict, version=12)      # one process: weights/v00000012/{shard-00000.safetensors, index.json}
    pub = ShardPublisher(store, rank, world)   # learner ranks: each writes the tensors it owns
    pub.submit(12, my_part)                    # returns at once; a thread writes (rank 0 then announces)
    watch = WeightStore(run_dir, background=True)
    watch.load_if_newer(model, have=11)        # 12 once read and swapped in; None while still reading

Layout: a version is a folder of safetensors shards, one per learner rank, each holding the
tensors `owned_names` gives that rank (contiguous, balanced by size), in the policy dtype
(bf16 on GPUs), plus `index.json` (tensor -> shard) written by rank 0 once every shard's
`.done` marker is there, and then `latest.json` (atomic) names the version: a reader that sees
version N there always finds it complete. A rank's write runs on a thread, so training step
N+1 starts while version N is on its way to the filesystem; a rank whose previous write is still
running waits for it first (one version in flight per rank). Old versions are pruned, keeping
`keep`, so a slow reader still finds the one it was told.

Generators (`background=True`) read a newer version on a thread while sampling goes on; the
generator's loop then only pauses for the swap itself (a copy into the model's parameters).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from hpcrl.core.files import atomic_write_json
from hpcrl.rl.policy import copy_state

__all__ = ["WeightStore", "ShardPublisher", "owned_names"]

_DIR = re.compile(r"v(\d{8})")


def owned_names(names: Sequence[str], numels: Sequence[int], world: int) -> list[list[str]]:
    """Split tensors into `world` contiguous runs of about equal size (the same on every rank)."""
    total = max(sum(numels), 1)
    out: list[list[str]] = [[] for _ in range(world)]
    acc = 0
    for name, n in zip(names, numels):
        out[min(world - 1, acc * world // total)].append(name)
        acc += n
    return out


class WeightStore:
    def __init__(self, run_dir: str | os.PathLike, keep: int = 3, background: bool = False):
        self.dir = Path(run_dir) / "weights"
        self.keep = keep
        self.background = background
        self._seen_mtime: int | None = None
        self._seen: tuple[int, Path] | None = None
        self._loading: int | None = None  # the version being read on a thread
        self._staged: tuple[int, dict[str, torch.Tensor] | BaseException] | None = None
        self.last_swap_s = 0.0  # how long the last swap into the model took (the generator's pause)

    # -- writing ---------------------------------------------------------------------------

    def version_dir(self, version: int) -> Path:
        return self.dir / f"v{version:08d}"

    def write_shard(self, state: Mapping[str, torch.Tensor], version: int, rank: int) -> Path:
        """One rank's tensors as shard `rank` of `version` (atomic), then its `.done` marker."""
        from safetensors.torch import save_file

        d = self.version_dir(version)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"shard-{rank:05d}.safetensors"
        tmp = d / f".{path.name}.{os.getpid()}.tmp"
        save_file(dict(state), str(tmp), metadata={"version": str(version), "format": "pt"})
        os.replace(tmp, path)
        # Atomic: rank 0 polls for it and reads it at once.
        atomic_write_json(d / f"shard-{rank:05d}.done", sorted(state))
        return path

    def finish_version(self, version: int, world: int, timeout_s: float = 3600.0) -> None:
        """Rank 0: wait for every shard of `version`, write its index, announce it, prune."""
        d = self.version_dir(version)
        deadline = time.monotonic() + timeout_s
        tensors: dict[str, str] = {}
        for r in range(world):
            marker = d / f"shard-{r:05d}.done"
            while not marker.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weights v{version}: shard {r} of {world} not written in {timeout_s:.0f} s")
                time.sleep(0.01)
            tensors.update(dict.fromkeys(json.loads(marker.read_text()), f"shard-{r:05d}.safetensors"))
        atomic_write_json(d / "index.json", {"version": version, "shards": world, "tensors": tensors})
        atomic_write_json(self.dir / "latest.json", {"version": version, "dir": d.name})
        self._prune(version)

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        """Everything from one process: one shard, index, announcement."""
        self.write_shard(state_dict, version, 0)
        self.finish_version(version, 1)
        return self.version_dir(version)

    def discard_above(self, version: int) -> None:
        """Remove the folders of versions after `version`: a previous life's half-published ones
        (some ranks' shards and markers, no announcement), which a resumed learner would
        otherwise complete with its own shards into a mix of two models."""
        for p in self.dir.glob("v*"):
            m = _DIR.fullmatch(p.name)
            if m and int(m.group(1)) > version:
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, newest: int) -> None:
        for p in self.dir.glob("v*"):
            m = _DIR.fullmatch(p.name)
            if m and int(m.group(1)) <= newest - self.keep:
                shutil.rmtree(p, ignore_errors=True)

    # -- reading ---------------------------------------------------------------------------

    def latest(self) -> tuple[int, Path] | None:
        """The announced (version, folder); cached by latest.json's mtime so polling costs one stat."""
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
        self._seen_mtime, self._seen = mtime, (int(data["version"]), self.dir / data["dir"])
        return self._seen

    def read(self, version: int) -> dict[str, torch.Tensor]:
        """Every tensor of a complete version (FileNotFoundError once pruned)."""
        from safetensors.torch import load_file

        d = self.version_dir(version)
        index = json.loads((d / "index.json").read_text())
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["tensors"].values())):
            out.update(load_file(str(d / shard)))
        return out

    def load_if_newer(self, model, have: int) -> int | None:
        """Load the announced weights into `model` when their version is above `have`. With
        `background`, the files are read on a thread: None until they are, then the swap."""
        ann = self.latest()
        if ann is None or ann[0] <= have:
            return None
        if not self.background:
            try:
                state = self.read(ann[0])
            except FileNotFoundError:
                self._seen_mtime = None  # pruned between announcement and read: a newer one is out
                return None
            return self._swap(model, ann[0], state)
        staged = self._staged
        if staged is not None:
            self._staged, self._loading = None, None
            version, state = staged
            if isinstance(state, FileNotFoundError):
                self._seen_mtime = None  # pruned before we read it: a newer one is announced
                return None
            if isinstance(state, BaseException):
                raise state
            return self._swap(model, version, state) if version > have else None
        if self._loading is None:
            self._loading = ann[0]
            threading.Thread(target=self._stage, args=(ann[0],), name="hpcrl-weights-read", daemon=True).start()
        return None

    def _stage(self, version: int) -> None:
        try:
            self._staged = (version, self.read(version))
        except BaseException as exc:  # handed to the caller's thread
            self._staged = (version, exc)

    def _swap(self, model, version: int, state) -> int:
        t0 = time.perf_counter()
        copy_state(model, state, f"weights v{version}")
        self.last_swap_s = time.perf_counter() - t0
        return version


class ShardPublisher:
    """A learner rank's side of publishing: `submit` hands its tensors to a writer thread and
    returns; rank 0's thread also waits for the other ranks' shards and announces the version."""

    def __init__(self, store: WeightStore, rank: int, world: int, on_announced=None):
        self.store, self.rank, self.world = store, rank, world
        self.on_announced = on_announced  # rank 0: called with the version once it is announced
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.write_s = 0.0  # the last write's duration (off the training step)

    def submit(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        self.flush()
        self._thread = threading.Thread(target=self._write, args=(version, state), name="hpcrl-publish", daemon=True)
        self._thread.start()

    def _write(self, version: int, state) -> None:
        t0 = time.perf_counter()
        try:
            self.store.write_shard(state, version, self.rank)
            if self.rank == 0:
                self.store.finish_version(version, self.world)
                if self.on_announced is not None:
                    self.on_announced(version)
        except BaseException as exc:  # raised in the training thread at the next submit/flush
            self._error = exc
        self.write_s = time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for the write in flight; re-raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
