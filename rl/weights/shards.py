"""Policy weights by version, through the run directory: sharded, written off the training
step's critical path, read by generators while they keep sampling.

    store = WeightStore(run_dir)
    store.publish(state_dict, version=12)      # one process: weights/v00000012/{shard-00000.safetensors, index.json}
    pub = ShardPublisher(store, rank, world)   # learner ranks: each writes the tensors it owns
    pub.submit(12, my_part)                    # returns at once; a thread writes (rank 0 then announces)
    watch = WeightStore(run_dir, background=True)
    watch.load_if_newer(model, have=11)        # 12 once mapped and swapped in; None while still reading
    bucket = Bucket([(name, torch.bfloat16, shape), ...])   # one flat host buffer; bucket.tensors are views

Layout: a version is a folder of safetensors shards, one per learner rank, each holding the
tensors `owned_names` gives that rank (contiguous, balanced by size), in the policy dtype
(bf16 on GPUs), plus `index.json` (tensor -> shard) written by rank 0 once every shard's
`.done` marker is there, and then `latest.json` (atomic) names the version: a reader that sees
version N there always finds it complete. A rank's write runs on a thread, so training step
N+1 starts while version N is on its way to the filesystem; a rank whose previous write is still
running waits for it first (one version in flight per rank). Old versions are pruned, keeping
`keep`, so a slow reader still finds the one it was told.

A shard is written once, straight from the memory the learner gathered the parameters into
(a `Bucket` per gather chunk): the safetensors header, then every tensor's bytes in one
`writev`, with no serialised copy in between. Readers map the file (`mmap`, private pages) and
get tensors that are views of it; a generator (`background=True`) maps and pre-faults a newer
version on a thread while sampling goes on, then pauses only for the swap (a copy into the
model's parameters).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from hpcrl.core.files import atomic_write_json
from hpcrl.rl.model.policy import copy_state

__all__ = ["Bucket", "WeightStore", "ShardPublisher", "owned_names", "read_shard", "write_shard_file"]

_DIR = re.compile(r"v(\d{8})")
# safetensors' dtype names.
_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}  # fmt: skip
_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}
_ALIGN = 64  # a tensor's start inside a Bucket (cache line; any dtype's alignment)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_PAGE = mmap.PAGESIZE


def owned_names(names: Sequence[str], numels: Sequence[int], world: int) -> list[list[str]]:
    """Split tensors into `world` contiguous runs of about equal size (the same on every rank)."""
    total = max(sum(numels), 1)
    out: list[list[str]] = [[] for _ in range(world)]
    acc = 0
    for name, n in zip(names, numels):
        out[min(world - 1, acc * world // total)].append(name)
        acc += n
    return out


class Bucket:
    """Tensors laid out in one flat host buffer (`buffer`, uint8; `tensors` are views of it):
    what a learner gathers one chunk of parameters into, what a shard is written from and what
    the direct path sends as one message. `specs` are (name, dtype, shape); the layout is a pure
    function of them, so a receiver rebuilds the views from the specs and the bytes alone."""

    def __init__(self, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]], pin: bool = False, buffer=None):
        self.specs = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in specs]
        starts, end = _layout(self.specs)
        self.nbytes = end
        if buffer is None:
            buffer = torch.empty(end, dtype=torch.uint8, pin_memory=pin)
        elif buffer.dtype != torch.uint8 or buffer.numel() != end:
            raise ValueError(f"a bucket of these tensors takes {end} bytes, the buffer holds {buffer.numel()}")
        self.buffer = buffer
        self.tensors = {
            name: buffer[s : s + _numel(shape) * _itemsize(dtype)].view(dtype).view(shape)
            for (name, dtype, shape), s in zip(self.specs, starts)
        }

    @staticmethod
    def bytes_for(specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> int:
        return _layout(specs)[1]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor], pin: bool = False) -> Bucket:
        """A bucket holding a copy of `state` (for callers that did not gather into one)."""
        b = cls([(k, v.dtype, v.shape) for k, v in state.items()], pin=pin)
        for k, v in state.items():
            b.tensors[k].copy_(v)
        return b

    @classmethod
    def pack(cls, state: Mapping[str, torch.Tensor], max_numel: int, pin: bool = False) -> list[Bucket]:
        """Copies of `state` in buckets of consecutive tensors, each of at most `max_numel`
        elements (or one tensor), as a learner gathers them."""
        out, part, numel = [], {}, 0
        for k, v in state.items():
            if part and numel + v.numel() > max_numel:
                out.append(cls.of(part, pin))
                part, numel = {}, 0
            part[k] = v.detach()
            numel += v.numel()
        return out + ([cls.of(part, pin)] if part else [])


def _layout(specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[list[int], int]:
    starts, end = [], 0
    for _, dtype, shape in specs:
        end = -(-end // _ALIGN) * _ALIGN
        starts.append(end)
        end += _numel(shape) * _itemsize(dtype)
    return starts, end


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_shard_file(path: str | os.PathLike, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """`state` as a safetensors file at `path`, written from the tensors' own memory in one
    `writev` (no serialised copy). Tensors go largest element first, so every tensor in the
    file starts aligned to its element size (a memory-mapped reader views them in place)."""
    items = sorted(state.items(), key=lambda kv: -kv[1].element_size())  # stable: keeps the given order
    header: dict = {"__metadata__": dict(metadata)}
    views, off = [], 0
    for name, t in items:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        if n:
            views.append(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _writev_all(fd, [memoryview(struct.pack("<Q", len(raw)) + raw), *(memoryview(v) for v in views)])
    finally:
        os.close(fd)


def _writev_all(fd: int, bufs: list[memoryview]) -> None:
    """Write every buffer in order, resuming after short writes (Linux caps one call near 2 GiB)."""
    bufs = [b.cast("B") for b in bufs if b.nbytes]
    i = 0
    while i < len(bufs):
        n = os.writev(fd, bufs[i : i + _IOV_MAX])
        while n and i < len(bufs):
            if n >= bufs[i].nbytes:
                n -= bufs[i].nbytes
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


def read_shard(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """Every tensor of a safetensors file as a view of a private memory map of it (reading a
    page faults it in from the page cache; writing one copies it, never the file), and the map.
    A file shorter or longer than its header says is refused, not mapped (a read past the end
    of a map is a SIGBUS)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: {size} bytes, not a safetensors file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        (n,) = struct.unpack_from("<Q", mm, 0)
        header = json.loads(bytes(mm[8 : 8 + n])) if n <= size - 8 else None
        if not isinstance(header, dict):
            raise ValueError("no header")
        header.pop("__metadata__", None)
        base, data = 8 + n, size - 8 - n
        entries, end = [], 0
        for name, h in header.items():
            (s, e), dtype, shape = h["data_offsets"], _ST_DTYPES[h["dtype"]], tuple(int(d) for d in h["shape"])
            if not 0 <= s <= e <= data or e - s != _numel(shape) * _itemsize(dtype):
                raise ValueError(f"{name} spans bytes {s}-{e} of {data}")
            entries.append((name, dtype, shape, base + s))
            end = max(end, e)
        if end != data:
            raise ValueError(f"{data} bytes of data, the header accounts for {end}")
    except (KeyError, TypeError, ValueError) as exc:
        mm.close()
        raise ValueError(f"{path}: not a complete safetensors file ({exc}); the file is damaged") from exc
    out = {
        name: torch.frombuffer(mm, dtype=dtype, count=_numel(shape), offset=at).view(shape)
        if _numel(shape)
        else torch.empty(shape, dtype=dtype)
        for name, dtype, shape, at in entries
    }
    return out, mm


def _prefault(maps: Sequence[mmap.mmap]) -> None:
    """Bring every page of `maps` into memory now (a read per page), so the swap that copies
    from them later waits for no filesystem."""
    for mm in maps:
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_WILLNEED)
        pages = np.frombuffer(mm, dtype=np.uint8)[::_PAGE]
        int(pages.max(initial=0))


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
        d = self.version_dir(version)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"shard-{rank:05d}.safetensors"
        tmp = d / f".{path.name}.{os.getpid()}.tmp"
        try:
            write_shard_file(tmp, state, {"version": str(version), "format": "pt"})
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        # Atomic (rank 0 polls for it and reads it at once), not fsynced: it is a signal to rank
        # 0, whose index.json and latest.json are; a sync here would also wait, on a journalled
        # local filesystem, for the shard's data just written.
        marker = d / f"shard-{rank:05d}.done"
        tmp_marker = d / f".{marker.name}.{os.getpid()}.tmp"
        tmp_marker.write_text(json.dumps(sorted(state)))
        os.replace(tmp_marker, marker)
        return path

    def finish_version(self, version: int, world: int, timeout_s: float = 3600.0, prune: bool = True) -> None:
        """Rank 0: wait for every shard of `version`, write its index, announce it, prune (after
        the announcement: removing old versions delays no reader)."""
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
        if prune:
            self.prune(version)

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

    def prune(self, newest: int) -> None:
        """Remove the versions `keep` or more below `newest`."""
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
        """Every tensor of a complete version, as views of its memory-mapped shards
        (FileNotFoundError once pruned; a map outlives a prune, the views stay valid)."""
        return self._map(version)[0]

    def _map(self, version: int) -> tuple[dict[str, torch.Tensor], list[mmap.mmap]]:
        d = self.version_dir(version)
        index = json.loads((d / "index.json").read_text())
        out: dict[str, torch.Tensor] = {}
        maps = []
        for shard in sorted(set(index["tensors"].values())):
            tensors, mm = read_shard(d / shard)
            out.update(tensors)
            maps.append(mm)
        return out, maps

    def load_if_newer(self, model, have: int) -> int | None:
        """Load the announced weights into `model` when their version is above `have`. With
        `background`, the files are mapped and read on a thread: None until they are, then the
        swap (the only pause: a copy from memory into the model)."""
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
            state, maps = self._map(version)
            _prefault(maps)  # the swap then copies from memory, not from the filesystem
            self._staged = (version, state)
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
