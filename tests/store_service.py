"""A stand-alone store writer service for the transport and crash tests: receives trajectories
over CURVE ZeroMQ, writes shards, acknowledges.

    python tests/store_service.py RUN_DIR [--name store-0] [--service store]

Binds a ROUTER socket, publishes `RUN_DIR/endpoints/<service>.json`, writes shards under
`RUN_DIR/trajectories` with the run's `store` config (from config.resolved.yaml when present;
--flush-every/--flush-interval override it) and acknowledges each trajectory once its flush
is durable. SIGTERM/SIGINT flush, finalize the shard and exit 0. Killed with SIGKILL, a
restart with the same --name recovers the open shard and deduplicates resent trajectories.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from pathlib import Path

from hpcrl.core.config import RESOLVED_NAME, StoreConfig, load_config
from hpcrl.core.schema import ConfigError, from_dict
from hpcrl.core.transport import Node
from hpcrl.rl.store.layout import StoreError
from hpcrl.rl.store.stream import TrajectoryReceiver
from hpcrl.rl.store.writer import ShardWriter


def store_config(run_dir: Path, overrides: dict) -> StoreConfig:
    resolved = run_dir / RESOLVED_NAME
    base = load_config(resolved).store if resolved.exists() else StoreConfig()
    return from_dict(StoreConfig, {**dataclasses.asdict(base), **overrides}, "store")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tests/store_service.py", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("--name", default="store-0", help="writer and CURVE key name (default store-0)")
    p.add_argument("--service", default="store", help="endpoint name senders look up (default store)")
    p.add_argument("--bind-host", default="*", help="interface to bind (default all); 127.0.0.1 for tests")
    p.add_argument("--flush-every", type=int)
    p.add_argument("--flush-interval", type=float)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {
        k: v for k, v in (("flush_every", args.flush_every), ("flush_interval_s", args.flush_interval)) if v is not None
    }
    try:
        cfg = store_config(args.run_dir, overrides)
        writer = ShardWriter(args.run_dir / "trajectories", args.name, cfg)
    except (ConfigError, StoreError) as exc:
        print(f"store_service: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Node(args.run_dir, args.name, bind_host=args.bind_host) as node:
        receiver = TrajectoryReceiver(node, args.service, writer)
        print(f"ready {receiver.endpoint.address}", flush=True)
        receiver.serve(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
