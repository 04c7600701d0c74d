"""Who am I in the learner's process group, and the run's own rendezvous for torch.distributed.

    env = resolve_dist_env(run_key="r1")         # rank, world size, local rank (then exported for DeepSpeed)
    init_process_group(env, "gloo", run_dir)     # the default group, on the run's store
    server = StoreServer(run_dir, "weights-direct", bind_host=node_address())   # a store of one's own
    store = RunStore(run_dir, "weights-direct", "gen-0")                       # a torch Store client of it

Ranks: RANK/WORLD_SIZE (torchrun, the deepspeed launcher, submitit, or set by hand);
SLURM_PROCID/SLURM_NTASKS (srun); an MPI launcher (OMPI_COMM_WORLD_SIZE or PMI_SIZE, ranks
from mpi4py); otherwise a single process.

Rendezvous: torch's own TCPStore listens on every interface whatever address it is given,
admits anyone who connects, and lists, reads and writes its keys for them. The groups here
never use one. A `StoreServer` (rank 0 of the learner, or the direct weight sender) holds the
keys in a thread behind a CURVE ZeroMQ socket of the run (hpcrl.core.transport): it binds to
this node's address (loopback when every rank is on this node), on a port the kernel picks,
and completes a handshake only with holders of the run's keys (keys/ in the run directory, the
owner's alone). `RunStore` is a torch.distributed Store that sends every operation there, so
gloo and NCCL exchange their addresses and ids through it; a stranger who finds the port can
neither join nor read, write or delete a key. Clients find the server through
endpoints/<service>.json; the learner's service is named after the launch (job id, restart
count, launcher's address) so its ranks never meet an earlier launch's store. One process
alone uses a store in its own memory, and listens nowhere.

What the store does not cover: the collectives' own connections (gloo's TCP pairs, NCCL's
sockets) that the ranks open to each other once they know the addresses; see docs/security.md.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from hpcrl.core.rpc import DEFERRED, Reply, RequestClient, RequestServer
from hpcrl.core.transport import Node
from hpcrl.slurm.parse import expand_hostlist

__all__ = [
    "DistEnv",
    "resolve_dist_env",
    "init_process_group",
    "StoreServer",
    "RunStore",
    "node_address",
    "PG_TIMEOUT",
]

log = logging.getLogger("hpcrl.distenv")
# DeepSpeed's own default for its process group (DEEPSPEED_TIMEOUT minutes), which this replaces.
PG_TIMEOUT = datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", "30")))
_STORE_MAX_BYTES = 64 << 20  # addresses and ids, not tensors: far more than any group needs


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str  # the host of rank 0 (loopback when every rank is on one node)
    master_port: int  # MASTER_PORT if the launcher set one; nothing listens on it (the store picks its own)
    source: str  # env | slurm | mpi | single

    def export(self) -> None:
        """Set the variables DeepSpeed and torch.distributed read for the process's place."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def _port() -> int:
    return int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else 0


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_dist_env(run_key: str = "hpcrl") -> DistEnv:
    """This process's rank and world from its launcher's environment (`run_key` is kept for callers)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int_env("RANK"), _int_env("WORLD_SIZE")
        local = int(env.get("LOCAL_RANK", rank))
        return _checked(DistEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), _port(), "env"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or socket.gethostname()
        master = env.get("MASTER_ADDR") or expand_hostlist(nodes)[0]
        rank, world = _int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS")
        return _checked(DistEnv(rank, world, int(env.get("SLURM_LOCALID", 0)), master, _port(), "slurm"))
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        master = comm.bcast(socket.gethostname() if comm.rank == 0 else None, root=0)
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("MPI_LOCALRANKID", 0)))
        return _checked(DistEnv(comm.rank, comm.size, local, env.get("MASTER_ADDR", master), _port(), "mpi"))
    return DistEnv(0, 1, 0, "127.0.0.1", _port(), "single")


def _checked(d: DistEnv) -> DistEnv:
    if not 0 <= d.rank < d.world_size:
        raise ValueError(f"rank {d.rank} is outside world size {d.world_size} (from {d.source} environment variables)")
    return d


# -- the run's store ----------------------------------------------------------------------------


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return host == "localhost"


def node_address(toward: str | None = None) -> str:
    """The address of this node that the run's other processes reach it by: loopback if `toward`
    (the host they know us by, e.g. MASTER_ADDR) is loopback; else the address this node's name
    resolves to, or the one its route to `toward` leaves from; "*" (every interface) only when
    none can be found."""
    if toward is not None and _loopback(toward):
        return "127.0.0.1"
    candidates = []
    try:
        candidates = [i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    for target in [t for t in (toward, "192.0.2.1") if t]:  # 192.0.2.1: a documentation address, never sent to
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))  # a UDP connect sends nothing: it only picks the route
                candidates.append(s.getsockname()[0])
        except OSError:
            continue
    for addr in candidates:
        if ipaddress.ip_address(addr).is_loopback:
            continue
        try:
            with socket.socket() as s:
                s.bind((addr, 0))  # one of ours
            return addr
        except OSError:
            continue
    log.warning(
        "cannot tell this node's address (%s resolves to loopback only): the store listens on every interface",
        socket.gethostname(),
    )
    return "*"


class StoreServer:
    """A store's keys, served to the run's key holders from a thread (see the module docstring)."""

    def __init__(
        self, run_dir: str | os.PathLike, service: str, *, name: str | None = None, bind_host: str = "127.0.0.1"
    ):
        """Serve `service` (endpoints/<service>.json) as the run's component `name` (its key; default the service)."""
        self.run_dir, self.service, self.name = Path(run_dir), service, name or service
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._waiting: list[tuple[str, str, list[str], float]] = []  # (request id, op, keys, deadline)
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(bind_host,), name=f"hpcrl-store-{service}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self, bind_host: str) -> None:
        try:
            node = Node(self.run_dir, self.name, bind_host=bind_host)
            self.server = RequestServer(node, self.service, self._handle, replay_cache=1024)
            self.endpoint = self.server.endpoint
        except BaseException as exc:  # e.g. a bad keys/ folder: raised in the constructor's thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                self.server.poll_once(0.05)
                self._expire()
        finally:
            self.server.close()
            node.close()

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(10)
            (self.run_dir / "endpoints" / f"{self.service}.json").unlink(missing_ok=True)

    # -- in the serving thread -----------------------------------------------------------------
    def _handle(self, env):
        b = env.body if isinstance(env.body, dict) else {}
        op, keys = env.kind, [str(k) for k in b.get("keys", [])]
        if op == "set":
            self._put(keys[0], bytes(b["value"]))
            return Reply("ok")
        if op == "add":
            value = int(self._data.get(keys[0], b"0")) + int(b["amount"])
            self._put(keys[0], str(value).encode())
            return Reply("ok", value)
        if op == "compare_set":
            current, expected, desired = self._data.get(keys[0]), bytes(b["expected"]), bytes(b["desired"])
            if (current is None and not expected) or current == expected:
                self._put(keys[0], desired)
                return Reply("ok", desired)
            return Reply("ok", expected if current is None else current)
        if op == "append":
            self._put(keys[0], self._data.get(keys[0], b"") + bytes(b["value"]))
            return Reply("ok")
        if op == "multi_set":
            for k, v in zip(keys, b["values"]):
                self._put(k, bytes(v))
            return Reply("ok")
        if op == "check":
            return Reply("ok", all(k in self._data for k in keys), remember=False)
        if op == "delete":
            value = self._data.pop(keys[0], None)
            self._bytes -= len(value or b"")
            return Reply("ok", value is not None)
        if op == "num_keys":
            return Reply("ok", len(self._data), remember=False)
        if op == "list_keys":
            return Reply("ok", list(self._data), remember=False)
        if op in ("get", "wait", "multi_get"):
            if all(k in self._data for k in keys):
                return self._answer(op, keys)
            self._waiting.append((env.msg_id, op, keys, time.monotonic() + float(b.get("wait_s", 300.0))))
            return DEFERRED
        raise ValueError(f"unknown store operation {op!r}")

    def _put(self, key: str, value: bytes) -> None:
        old = self._data.get(key)
        size = self._bytes - len(old or b"") + len(value)
        if size > _STORE_MAX_BYTES:
            raise ValueError(f"store {self.service} is full ({_STORE_MAX_BYTES} bytes)")
        self._data[key], self._bytes = value, size
        self._wake()

    def _answer(self, op: str, keys: list[str]) -> Reply:
        if op == "get":
            return Reply("ok", self._data[keys[0]])
        if op == "multi_get":
            return Reply("ok", [self._data[k] for k in keys])
        return Reply("ok")

    def _wake(self) -> None:
        still = []
        for rid, op, keys, deadline in self._waiting:
            if all(k in self._data for k in keys):
                self.server.reply(rid, self._answer(op, keys))
            else:
                still.append((rid, op, keys, deadline))
        self._waiting = still

    def _expire(self) -> None:
        now = time.monotonic()
        if any(w[3] <= now for w in self._waiting):
            for rid, _, keys, _ in [w for w in self._waiting if w[3] <= now]:
                self.server.reply(rid, Reply("timeout", {"keys": keys}))
            self._waiting = [w for w in self._waiting if w[3] > now]


class RunStore(dist.Store):
    """A torch.distributed Store whose keys live in a `StoreServer` of the run (CURVE, run keys).

    Safe to use from several threads (each gets its own socket), as NCCL's watchdog does. Keep
    a reference for as long as a group uses it: torch holds only its C++ half."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        service: str,
        name: str,
        timeout: datetime.timedelta = datetime.timedelta(minutes=5),
    ):
        super().__init__()
        self.run_dir, self.service = Path(run_dir), service
        self.node = Node(run_dir, name)
        self._local = threading.local()
        self._timeout_s = timeout.total_seconds()

    def _client(self) -> RequestClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = RequestClient(
                self.node, self.service, timeout_s=10.0, retries=3, discover_timeout_s=self._timeout_s
            )
        return client

    def _call(self, op: str, keys=(), wait_s: float | None = None, **body):
        body["keys"] = list(keys)
        if wait_s is not None:
            body["wait_s"] = wait_s
            # The server answers by wait_s (a value or "timeout"); a margin on top for the wire.
            env = self._client().request(op, body, timeout_s=wait_s + 10.0, retries=1)
        else:
            env = self._client().request(op, body)
        if env.kind == "timeout":
            raise dist.DistStoreError(
                f"store {self.service}: timed out after {wait_s:.0f} s waiting for {', '.join(map(str, keys))}"
            )
        if env.kind != "ok":
            raise RuntimeError(f"store {self.service}: {env.kind}: {env.body}")
        return env.body

    def close(self) -> None:
        self.node.close()

    # -- the torch.distributed.Store interface -----------------------------------------------
    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def set(self, key: str, value) -> None:
        self._call("set", [key], value=_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", [key], wait_s=self._timeout_s)

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", [key], amount=int(amount)))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", [key], expected=_bytes(expected), desired=_bytes(desired))

    def append(self, key: str, value) -> None:
        self._call("append", [key], value=_bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys, wait_s=self._timeout_s)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._call("multi_set", keys, values=[_bytes(v) for v in values])

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call("wait", keys, wait_s=wait_s)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", [key]))

    def num_keys(self) -> int:
        return int(self._call("num_keys"))

    def list_keys(self) -> list[str]:
        return list(self._call("list_keys"))

    def has_extended_api(self) -> bool:
        return True


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _launch_id(env: DistEnv, run_key: str) -> str:
    """The same for every rank of one launch of the learner, different for the next launch."""
    keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "SUBMITIT_LOCAL_JOB_ID", "TORCHELASTIC_RUN_ID")
    parts = [run_key, env.source, str(env.world_size), env.master_addr, str(env.master_port)]
    return hashlib.sha256("\0".join(parts + [os.environ.get(k, "") for k in keys]).encode()).hexdigest()[:12]


# The learner's store and its client live as long as the process (NCCL's watchdog asks the store).
# torch keeps only the C++ half of a Python Store: the Python object (its sockets) must be held here.
_kept: list = []


def init_process_group(
    env: DistEnv, backend: str, run_dir: str | os.PathLike, timeout: datetime.timedelta = PG_TIMEOUT
) -> None:
    """torch.distributed's default group for the learner's ranks, on the run's store (rank 0
    serves it); nothing when it exists already. One rank alone keeps its store in memory."""
    if dist.is_initialized():
        return
    if env.world_size == 1:
        store: dist.Store = dist.HashStore()
    else:
        service = f"learner-store-{_launch_id(env, str(Path(run_dir).resolve()))}"
        if env.rank == 0:
            _kept.append(StoreServer(run_dir, service, name="learner-store", bind_host=node_address(env.master_addr)))
        store = RunStore(run_dir, service, f"learner-rank{env.rank}", timeout)
        _kept.append(store)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
