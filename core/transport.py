"""ZeroMQ message layer: msgpack envelopes, zero-copy numpy frames, CURVE on every socket.

Components of one run talk over TCP; everything below is shared by the trajectory path,
control requests (e.g. the sandbox server) and policy-version announcements.

API
---
Envelopes are `hpcrl.core.wire` (msgpack header, zero-copy array frames; never pickle).

Per-run security and discovery (files in the run directory)::

    keys = RunKeys(run_dir)             # <run>/keys/ (0700): <name>.key public, <name>.key_secret (0600)
    pair = keys.ensure("gen-0")         # KeyPair(public, secret): created once, then reused
    keys.allowed()                      # every public key in keys/: the ZAP allow-list
    publish_endpoint(run_dir, "store", "tcp://host:5555", pair.public)   # <run>/endpoints/store.json, atomic
    ep = read_endpoint(run_dir, "store", timeout_s=30)                  # Endpoint(address, public_key, instance)

Sockets, one Node per process (owns the context and the ZAP authenticator thread)::

    node = Node(run_dir, "gen-0", limits=WireLimits(), bind_host="*")
    sock, ep = node.bind(zmq.ROUTER, "store")      # CURVE server on a free port, endpoint published
    sock, ep = node.connect(zmq.DEALER, "store")   # CURVE client of the published endpoint
    node.log_events()                              # log handshake failures/disconnects seen on bound sockets
    node.close()

Patterns built on these: `hpcrl.core.rpc` (RequestServer/RequestClient with
timeouts, retries and idempotent replays; VersionPublisher/VersionSubscriber over PUB/SUB)
and `hpcrl.rl.store.stream` (TrajectorySender/TrajectoryReceiver: acknowledged, lossless,
deduplicated delivery to the shard writer).

Security model: every server socket is a CURVE server with the ZAP domain "hpcrl"; a client
is admitted only if its public key is one of the run's `keys/*.key` files (the directory is
0700, so only the run's owner can add one). A client with an unknown key, or one that does
not know the server's key, never completes the handshake; the server counts it (the metric
`hpcrl_transport_handshake_failures_total`, by reason), logs it at a bounded rate (one line
per kind per `LOG_EVERY_S`, the next one saying how many came meanwhile: a stranger looping
on handshakes cannot fill the run directory's logs) and carries on.
Inbound frames over `max_message_bytes` make libzmq drop the connection (ZMQ_MAXMSGSIZE);
messages whose frames add up to more, malformed envelopes, disallowed dtypes and unknown
kinds are dropped by `decode` callers with a log line. Heartbeats (ZMQ_HEARTBEAT_*) detect
dead peers; high-water marks bound queues.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from hpcrl.core.files import atomic_write_json
from hpcrl.core.metrics import provide
from hpcrl.core.wire import WireLimits

__all__ = [
    "TransportError",
    "KeyPair",
    "RunKeys",
    "Endpoint",
    "publish_endpoint",
    "read_endpoint",
    "Node",
    "Throttled",
    "HANDSHAKE_FAILURES",
]

log = logging.getLogger("hpcrl.transport")

LOG_EVERY_S = 30.0  # a kind of refused or dropped peer is logged at most once per this many seconds
ZAP_DOMAIN = "hpcrl"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class TransportError(Exception):
    """The transport cannot do what was asked (keys, endpoints); the message says what to fix."""


# Failed CURVE handshakes on this process's bound sockets, by reason (auth: unknown key;
# protocol: e.g. the wrong server key; no_detail: plaintext or garbage).
HANDSHAKE_FAILURES: dict[str, int] = {"auth": 0, "protocol": 0, "no_detail": 0}
provide(lambda: {"transport_handshake_failures_total:reason": dict(HANDSHAKE_FAILURES)})


class Throttled:
    """A log line at most once per `every_s`; the ones held back meanwhile are counted and the
    next line says how many (a peer that fails in a loop costs a line per interval, not per try)."""

    def __init__(self, every_s: float = LOG_EVERY_S):
        self.every_s = every_s
        self._last = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def __call__(self, emit, msg: str, *args: Any) -> bool:
        """`emit(msg, *args)` unless a line went out less than `every_s` ago; True if it did."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._held += 1
                return False
            held, self._held, self._last = self._held, 0, now
        if held:
            msg += f" (and {held} more like it since the last such line)"
        emit(msg, *args)
        return True


# -- keys ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes


class RunKeys:
    """The run's CURVE keys: one pair per component name, public halves form the allow-list."""

    def __init__(self, run_dir: str | os.PathLike):
        self.dir = Path(run_dir) / "keys"

    def _ensure_dir(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = stat.S_IMODE(self.dir.stat().st_mode)
        if mode & 0o077:
            raise TransportError(
                f"{self.dir} has mode {mode:04o}; run `chmod 700 {self.dir}`: other users must "
                "not read the run's secret keys"
            )

    def ensure(self, name: str) -> KeyPair:
        """Load `name`'s key pair, creating it (secret file 0600, written atomically) if absent."""
        if not _NAME_RE.fullmatch(name):
            raise TransportError(f"component name {name!r}: use letters, digits, '_', '.', '-' (max 64)")
        self._ensure_dir()
        secret_path = self.dir / f"{name}.key_secret"
        public_path = self.dir / f"{name}.key"
        if not secret_path.exists():
            public, secret = zmq.curve_keypair()
            try:
                self._write(secret_path, public, secret, 0o600)
            except FileExistsError:
                pass  # another process of the same component won the race: use its keys
        mode = stat.S_IMODE(secret_path.stat().st_mode)
        if mode & 0o077:
            raise TransportError(f"secret key {secret_path} has mode {mode:04o}; run `chmod 600 {secret_path}`")
        public, secret = zmq.auth.load_certificate(str(secret_path))
        if secret is None:
            raise TransportError(f"{secret_path} holds no secret key; delete it to generate a new pair")
        # The public half is derived from the secret file, so a crash or a race between two
        # processes of one component can never leave a public key that does not match.
        if not public_path.exists() or zmq.auth.load_certificate(str(public_path))[0] != public:
            self._write(public_path, public, None, 0o644)
        return KeyPair(public, secret)

    @staticmethod
    def _write(path: Path, public: bytes, secret: bytes | None, mode: int) -> None:
        lines = [
            "#   hpcrl run CURVE " + ("secret key: keep it 0600" if secret else "public key"),
            "metadata",
            "curve",
            f'    public-key = "{public.decode()}"',
        ]
        if secret:
            lines.append(f'    secret-key = "{secret.decode()}"')
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if secret is None:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # raises FileExistsError: a secret in use is never overwritten
        finally:
            os.unlink(tmp)

    def allowed(self) -> set[bytes]:
        out = set()
        if self.dir.is_dir():
            for p in self.dir.glob("*.key"):
                try:
                    out.add(zmq.auth.load_certificate(str(p))[0])
                except (OSError, ValueError) as exc:
                    log.warning("ignoring unreadable public key %s: %s", p, exc)
        return out


class _AllowList:
    """ZAP credentials provider: admits the run's public keys, re-reading keys/ for newcomers.

    A component writes its key before it connects, which changes the folder's mtime; so an
    unknown key makes us re-read keys/ only when the folder changed since the last read (one
    stat), or when the last read is `rescan_s` old (filesystems with coarse mtimes). Many
    unknown keys (a scan, a misconfigured client) therefore cost stats, not directory reads
    of the shared filesystem, and a rejection is logged once per key per `negative_ttl_s`.
    """

    def __init__(self, keys: RunKeys, negative_ttl_s: float = 1.0, rescan_s: float = 5.0):
        self.keys = keys
        self.negative_ttl_s, self.rescan_s = negative_ttl_s, rescan_s
        self._stamp, self._scanned_at = self._dir_stamp(), time.monotonic()
        self._allowed = keys.allowed()
        self._rejected: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._log = Throttled()
        self.scans = 1

    def _dir_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.keys.dir.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ctime_ns

    def callback(self, domain: str, key: bytes) -> bool:
        """True if `key` may connect (runs in the ZAP thread for every CURVE handshake)."""
        with self._lock:
            if key in self._allowed:
                return True
            now = time.monotonic()
            stamp = self._dir_stamp()
            if stamp != self._stamp or now - self._scanned_at >= self.rescan_s:
                self._stamp, self._scanned_at = stamp, now
                self._allowed = self.keys.allowed()
                self.scans += 1
                if key in self._allowed:
                    self._rejected.pop(key, None)
                    return True
            if now - self._rejected.get(key, float("-inf")) < self.negative_ttl_s:
                return False  # logged a moment ago
            if len(self._rejected) > 10_000:
                self._rejected.clear()
            self._rejected[key] = now
        self._log(
            log.warning,
            "rejected CURVE client key %s...: not in the run's allow-list (%s)",
            key[:8].decode(errors="replace"),
            self.keys.dir,
        )
        return False


# -- endpoints -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    service: str
    address: str
    public_key: bytes
    instance: str  # changes each time the service starts: clients reconnect and resend


def _endpoint_path(run_dir: str | os.PathLike, service: str) -> Path:
    if not _NAME_RE.fullmatch(service):
        raise TransportError(f"service name {service!r}: use letters, digits, '_', '.', '-' (max 64)")
    return Path(run_dir) / "endpoints" / f"{service}.json"


def publish_endpoint(run_dir: str | os.PathLike, service: str, address: str, public_key: bytes) -> Endpoint:
    """Write endpoints/<service>.json atomically and durably: readers never see half."""
    path = _endpoint_path(run_dir, service)
    path.parent.mkdir(parents=True, exist_ok=True)
    ep = Endpoint(service, address, public_key, os.urandom(8).hex())
    data = {
        "service": service,
        "address": address,
        "public_key": public_key.decode(),
        "instance": ep.instance,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": time.time(),
    }
    atomic_write_json(path, data)
    return ep


def read_endpoint(run_dir: str | os.PathLike, service: str, timeout_s: float = 0.0) -> Endpoint:
    """The published endpoint of `service`, waiting up to `timeout_s` for it to appear."""
    path = _endpoint_path(run_dir, service)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = json.loads(path.read_text())
            return Endpoint(service, data["address"], data["public_key"].encode(), data["instance"])
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"service {service!r} has not published an endpoint ({path} is missing "
                    f"after {timeout_s:.0f} s); is it running in this run directory?"
                ) from None
        except (ValueError, KeyError) as exc:
            raise TransportError(f"endpoint file {path} is damaged ({exc}); restart service {service!r}") from None
        time.sleep(0.05)


# -- sockets ---------------------------------------------------------------------------------


_EVENT_NAMES = {getattr(zmq, n): n[6:] for n in dir(zmq) if n.startswith("EVENT_") and isinstance(getattr(zmq, n), int)}
_LOGGED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


class Node:
    """One process's transport: a context, its CURVE identity, the ZAP allow-list, sockets."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        name: str,
        limits: WireLimits = WireLimits(),
        *,
        bind_host: str = "*",
        advertise_host: str | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.name = name
        self.limits = limits
        self.keys = RunKeys(run_dir)
        self.pair = self.keys.ensure(name)
        self.bind_host = bind_host
        self.advertise_host = advertise_host or (
            bind_host if bind_host not in ("*", "0.0.0.0") else socket.gethostname()
        )
        self.ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._monitors: list[tuple[zmq.Socket, str]] = []
        self._log_failed, self._log_gone = Throttled(), Throttled()
        self._closed = False

    def _options(self, sock: zmq.Socket) -> None:
        lim = self.limits
        sock.linger = int(lim.linger_s * 1000)
        sock.sndhwm, sock.rcvhwm = lim.sndhwm, lim.rcvhwm
        sock.maxmsgsize = lim.max_message_bytes
        sock.heartbeat_ivl = int(lim.heartbeat_ivl_s * 1000)
        sock.heartbeat_timeout = int(lim.heartbeat_timeout_s * 1000)
        sock.heartbeat_ttl = int(lim.heartbeat_ttl_s * 1000)

    def _start_auth(self) -> None:
        if self._auth is None:
            self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("hpcrl.transport.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_AllowList(self.keys))

    def bind(self, socket_type: int, service: str, publish: bool = True) -> tuple[zmq.Socket, Endpoint]:
        """A CURVE server socket on a free port, its endpoint published for clients to find."""
        self._start_auth()
        sock = self.ctx.socket(socket_type)
        self._options(sock)
        sock.curve_server = True
        sock.curve_secretkey = self.pair.secret
        sock.curve_publickey = self.pair.public
        sock.zap_domain = ZAP_DOMAIN.encode()
        if socket_type == zmq.ROUTER:
            sock.router_handover = 1  # a reconnecting peer with a fixed routing id takes over its slot
        mon = sock.get_monitor_socket(_LOGGED_EVENTS)
        self._monitors.append((mon, service))
        sock.bind(f"tcp://{self.bind_host}:*")
        port = sock.last_endpoint.decode().rsplit(":", 1)[1]
        address = f"tcp://{self.advertise_host}:{port}"
        if publish:
            ep = publish_endpoint(self.run_dir, service, address, self.pair.public)
        else:
            ep = Endpoint(service, address, self.pair.public, "")
        log.info("%s: %s bound at %s", self.name, service, address)
        return sock, ep

    def connect(
        self, socket_type: int, target: str | Endpoint, timeout_s: float = 30.0, routing_id: bytes | None = None
    ) -> tuple[zmq.Socket, Endpoint]:
        """A CURVE client socket connected to `target` (a service name or an Endpoint)."""
        ep = target if isinstance(target, Endpoint) else read_endpoint(self.run_dir, target, timeout_s)
        sock = self.ctx.socket(socket_type)
        self._options(sock)
        sock.curve_serverkey = ep.public_key
        sock.curve_publickey = self.pair.public
        sock.curve_secretkey = self.pair.secret
        if routing_id is not None:
            sock.routing_id = routing_id
        sock.connect(ep.address)
        return sock, ep

    def monitor_sockets(self) -> list[zmq.Socket]:
        return [m for m, _ in self._monitors]

    def log_events(self) -> None:
        """Log (without blocking) the security and connection events of bound sockets."""
        for mon, service in self._monitors:
            while mon.poll(0):
                try:
                    ev = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                name = _EVENT_NAMES.get(ev["event"], str(ev["event"]))
                peer = ev.get("endpoint", b"").decode(errors="replace")
                if name.startswith("HANDSHAKE_FAILED"):
                    reason = name[len("HANDSHAKE_FAILED_") :].lower()
                    HANDSHAKE_FAILURES[reason] = HANDSHAKE_FAILURES.get(reason, 0) + 1
                    self._log_failed(
                        log.warning,
                        "%s: rejected a peer at %s during the CURVE handshake (%s, code %s)",
                        service,
                        peer,
                        name,
                        ev["value"],
                    )
                elif name == "DISCONNECTED":
                    self._log_gone(
                        log.info,
                        "%s: peer at %s disconnected (or was dropped: oversized frame, dead heartbeat)",
                        service,
                        peer,
                    )
                else:
                    log.debug("%s: %s %s", service, name, peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for mon, _ in self._monitors:
            mon.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.destroy(linger=int(self.limits.linger_s * 1000))

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: Iterable) -> None:
        self.close()
