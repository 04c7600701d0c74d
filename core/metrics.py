"""Prometheus metrics of one component: a textfile by default, an HTTP endpoint when asked,
filled from numbers the component already keeps.

    serve(run_dir, "gen-0", cfg.metrics)             # start_component: textfile (+ endpoint) + metrics/gen-0.json
    provide(lambda: {"trajectories_total": n, "busy_fraction": 0.7,
                     "sandbox_results_total:status": {"ok": 40, "timeout": 2}})

A provider returns {name: number} or {"name:label": {label value: number}}; every sample is
`hpcrl_<name>` with the labels `run` and `component` (and `label` for the second form). A name
ending in `_total` is a counter, anything else a gauge. A provider that raises costs one
collection its numbers (logged), never the component.

Where they go: every `metrics.textfile_every_s` into `hpcrl_<run>_<component>.prom` in
`metrics.textfile_dir` (node_exporter's textfile collector: no socket of ours) or, without
one, `<name>.prom` in the run's metrics/ folder (as private as the run). An HTTP endpoint only
with `metrics.bind_host`: it is plain, unauthenticated HTTP, as Prometheus expects, readable by
whoever reaches that address (127.0.0.1: every user of the node); it shows counts, rates, the
run's and components' names and the process's CPU, memory and open files; no text, keys or
trajectories. It answers from one thread, holds at most `MAX_CONNECTIONS` connections (a new one
pushes out the oldest) and drops one that has not sent its request within `TIMEOUT_S`.
`metrics/<name>.json` names the URL (if any) and the textfile for `hpcrl status --json`
(`metrics_url`) and for file-based service discovery.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpcrl.core.files import atomic_write_json

__all__ = ["serve", "provide", "families", "read_endpoints", "MetricsEndpoint", "PREFIX"]

log = logging.getLogger("hpcrl.metrics")
PREFIX = "hpcrl_"
MAX_CONNECTIONS = 16  # open at once; the oldest goes when another comes
TIMEOUT_S = 5.0  # a connection that has not sent its request (or read its answer) by then is closed
_MAX_REQUEST_BYTES = 8192

Provider = Callable[[], dict[str, Any]]
_providers: list[Provider] = []
_labels: dict[str, str] = {}


def provide(fn: Provider) -> None:
    """Add numbers to this process's metrics (called at every collection)."""
    _providers.append(fn)


def families(values: dict[str, Any], labels: dict[str, str]) -> Iterator[Any]:
    """Prometheus metric families for one provider's values (pure: tested without a server)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    names = sorted(labels)
    for key, value in sorted(values.items()):
        name, _, extra = key.partition(":")
        counter = name.endswith("_total")
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        full = PREFIX + (name[: -len("_total")] if counter else name)
        if isinstance(value, dict):
            fam = kind(full, f"hpcrl {name} by {extra}", labels=[*names, extra])
            for sub, v in sorted(value.items()):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    fam.add_metric([*(labels[n] for n in names), str(sub)], float(v))
            yield fam
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            fam = kind(full, f"hpcrl {name}", labels=names)
            fam.add_metric([labels[n] for n in names], float(value))
            yield fam


class _Collector:
    def collect(self):
        for fn in list(_providers):
            try:
                values = fn()
            except Exception as exc:  # a provider's bug costs this collection its numbers, not the component
                log.warning("metrics provider %r failed: %s", fn, exc)
                continue
            yield from families(values, _labels)


class _Conn:
    __slots__ = ("sock", "inbuf", "out", "deadline")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.inbuf, self.out, self.deadline = sock, b"", b"", deadline


class MetricsEndpoint:
    """GET /metrics over HTTP/1.0 from one thread: bounded connections, each with a deadline."""

    def __init__(
        self,
        host: str,
        body: Callable[[], bytes],
        *,
        port: int = 0,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = TIMEOUT_S,
    ):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=64)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self._body, self.max_connections, self.timeout_s = body, max_connections, timeout_s
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # insertion order: oldest first
        self._stop = threading.Event()
        self.served = self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="hpcrl-metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for key, events in self._sel.select(timeout=0.5):
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj in self._conns:
                        self._service(self._conns[key.fileobj], events)
                now = time.monotonic()
                for c in [c for c in self._conns.values() if c.deadline <= now]:
                    self._drop(c)
        finally:
            for c in list(self._conns.values()):
                self._drop(c)
            self._sel.close()
            self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: shed the oldest, try again on the next event
                log.warning("metrics endpoint: accept failed: %s", exc)
                if self._conns:
                    self._drop(next(iter(self._conns.values())))
                return
            if len(self._conns) >= self.max_connections:
                self._drop(next(iter(self._conns.values())))
            sock.setblocking(False)
            self._conns[sock] = _Conn(sock, time.monotonic() + self.timeout_s)
            self._sel.register(sock, selectors.EVENT_READ)

    def _service(self, c: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_READ and not c.out:
                data = c.sock.recv(4096)
                if not data:
                    return self._drop(c)
                c.inbuf += data
                if b"\r\n\r\n" not in c.inbuf and b"\n\n" not in c.inbuf:
                    if len(c.inbuf) > _MAX_REQUEST_BYTES:
                        self._drop(c)
                    return
                c.out = self._answer(c.inbuf)
                self._sel.modify(c.sock, selectors.EVENT_WRITE)
            if c.out:
                n = c.sock.send(c.out)
                c.out = c.out[n:]
                if not c.out:
                    self.served += 1
                    self._drop(c, counted=False)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)

    def _answer(self, request: bytes) -> bytes:
        line = request.split(b"\n", 1)[0].decode("latin-1").split()
        if len(line) < 2 or line[0] not in ("GET", "HEAD"):
            return _response(405, b"only GET /metrics\n")
        if line[1].split("?", 1)[0] not in ("/", "/metrics"):
            return _response(404, b"GET /metrics\n")
        try:
            body = self._body()
        except Exception as exc:
            log.warning("metrics endpoint: collection failed: %s", exc)
            return _response(500, b"collection failed\n")
        return _response(200, b"" if line[0] == "HEAD" else body, "text/plain; version=0.0.4; charset=utf-8")

    def _drop(self, c: _Conn, counted: bool = True) -> None:
        if self._conns.pop(c.sock, None) is None:
            return
        self.dropped += counted
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()


def _response(code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> bytes:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}[code]
    head = f"HTTP/1.0 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + body


def serve(run_dir: str | os.PathLike, name: str, cfg) -> str | None:
    """Start this process's textfile writer (and endpoint, with `cfg.bind_host`); the URL or None."""
    if not cfg.enabled:
        return None
    from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest, write_to_textfile

    run_dir = Path(run_dir)
    _labels.update(run=run_dir.name, component=name)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    ProcessCollector(registry=registry)  # CPU seconds, memory, open files of this process
    folder = run_dir / "metrics"
    folder.mkdir(exist_ok=True)
    url = None
    if cfg.bind_host:
        try:
            endpoint = MetricsEndpoint(cfg.bind_host, lambda: generate_latest(registry))
        except OSError as exc:  # no port, a bad bind_host: the component runs on without an endpoint
            log.warning("%s: no metrics endpoint on %s: %s", name, cfg.bind_host, exc)
        else:
            host = socket.gethostname() if cfg.bind_host in ("0.0.0.0", "::") else cfg.bind_host
            url = f"http://{host}:{endpoint.address[1]}/metrics"
            log.info(
                "%s: metrics at %s, unauthenticated: readable by whoever reaches %s (counts, rates, run and "
                "component names, process CPU and memory; no text, keys or trajectories)",
                name,
                url,
                "this node" if cfg.bind_host in ("127.0.0.1", "::1", "localhost") else cfg.bind_host,
            )
    if cfg.textfile_dir:
        out = Path(cfg.textfile_dir) / f"hpcrl_{run_dir.name}_{name}.prom"
    else:
        out = folder / f"{name}.prom"
    atomic_write_json(folder / f"{name}.json", {"name": name, "url": url, "textfile": str(out), "pid": os.getpid()})

    def write() -> None:
        while True:
            try:
                write_to_textfile(str(out), registry)
            except OSError as exc:
                log.warning("%s: cannot write %s: %s", name, out, exc)
            threading.Event().wait(cfg.textfile_every_s)

    threading.Thread(target=write, name="hpcrl-metrics-textfile", daemon=True).start()
    return url


def read_endpoints(run_dir: str | os.PathLike) -> dict[str, str]:
    """{component: metrics URL} from the run's metrics/*.json (components with an endpoint)."""
    import json

    out = {}
    for f in sorted((Path(run_dir) / "metrics").glob("*.json")):
        try:
            rec = json.loads(f.read_text())
            if rec.get("url"):
                out[str(rec["name"])] = str(rec["url"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out
