"""Prometheus metrics of one component: an HTTP endpoint (and, for sites that scrape files, a
textfile), filled at scrape time from numbers the component already keeps.

    serve(run_dir, "gen-0", cfg.metrics)             # start_component: endpoint + metrics/gen-0.json
    provide(lambda: {"trajectories_total": n, "busy_fraction": 0.7,
                     "sandbox_results_total:status": {"ok": 40, "timeout": 2}})

A provider returns {name: number} or {"name:label": {label value: number}}; every sample is
`hpcrl_<name>` with the labels `run` and `component` (and `label` for the second form). A name
ending in `_total` is a counter, anything else a gauge. Providers are called at scrape time
only, so a component that is never scraped pays nothing, and a provider that raises costs the
scrape its numbers (logged), never the component. `metrics/<name>.json` names the endpoint's
URL for `hpcrl status --json` (`metrics_url`) and for file-based service discovery. The
endpoint is plain, unauthenticated HTTP, as Prometheus expects: it serves counts and rates,
no text, keys or trajectories; `metrics.bind_host: 127.0.0.1` keeps it on the node.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpcrl.core.files import atomic_write_json

__all__ = ["serve", "provide", "families", "read_endpoints", "PREFIX"]

log = logging.getLogger("hpcrl.metrics")
PREFIX = "hpcrl_"

Provider = Callable[[], dict[str, Any]]
_providers: list[Provider] = []
_labels: dict[str, str] = {}


def provide(fn: Provider) -> None:
    """Add numbers to this process's metrics (called at every scrape)."""
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
            except Exception as exc:  # a provider's bug costs this scrape its numbers, not the component
                log.warning("metrics provider %r failed: %s", fn, exc)
                continue
            yield from families(values, _labels)


def serve(run_dir: str | os.PathLike, name: str, cfg) -> str | None:
    """Start this process's endpoint (and textfile writer) per `cfg` (MetricsConfig); its URL."""
    if not cfg.enabled:
        return None
    from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server, write_to_textfile

    run_dir = Path(run_dir)
    _labels.update(run=run_dir.name, component=name)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    ProcessCollector(registry=registry)  # CPU seconds, memory, open files of this process
    try:
        server, _ = start_http_server(0, addr=cfg.bind_host, registry=registry)
    except OSError as exc:  # no port, a bad bind_host: the component runs on without an endpoint
        log.warning("%s: no metrics endpoint on %s: %s", name, cfg.bind_host, exc)
        return None
    host = socket.gethostname() if cfg.bind_host in ("0.0.0.0", "::", "") else cfg.bind_host
    url = f"http://{host}:{server.server_address[1]}/metrics"
    folder = run_dir / "metrics"
    folder.mkdir(exist_ok=True)
    atomic_write_json(folder / f"{name}.json", {"name": name, "url": url, "pid": os.getpid()})
    if cfg.textfile_dir:
        out = Path(cfg.textfile_dir) / f"hpcrl_{run_dir.name}_{name}.prom"

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
    """{component: metrics URL} from the run's metrics/*.json."""
    import json

    out = {}
    for f in sorted((Path(run_dir) / "metrics").glob("*.json")):
        try:
            rec = json.loads(f.read_text())
            out[str(rec["name"])] = str(rec["url"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
