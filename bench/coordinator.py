"""The coordinator's ceiling: N simulated generators lease and settle episodes over the real
CURVE sockets; how many episodes per second it serves, at what latency and CPU, as N grows.

    .venv/bin/python bench/coordinator.py [--max-generators 1024] [--per-sync 4] [--period-s 0.25]
                                          [--level-s 4] [--quick] [--json]

The coordinator (rl/coordinator/coordinator.py, unchanged: its request handler, lease log and status file)
serves in a process of its own. One driver process runs N generators, each a DEALER of its own
with the generator's request client: every `--period-s` (open loop: a late reply does not
lower the offered rate, the next sync goes out at once) a generator syncs, reporting done the
`--per-sync` episodes its last sync leased and asking for as many new ones; a simulated learner
reports a step each second. So each generator offers per_sync / period_s episodes per second,
leased and settled, the way a generator with many episodes in flight syncs as they finish.

For N = 1, 2, 4, ... up to --max-generators, after a warm-up: episodes/s settled (done reports
answered), sync latency (median, p99, from send to reply), the coordinator process's CPU
(fraction of one core) and CPU per 1000 episodes, the driver's own CPU (on a small machine
the driver, which does the same CURVE work, can be what saturates: read its column), and
`handler_us_per_sync`: the coordinator's request handler called directly in this process with
N generators' leases (no sockets), which shows what of its cost grows with N.

The knee: the smallest N whose settled rate is within 10 % of the highest rate measured; past
it, more generators add latency, not episodes. --json prints
{"knee_generators", "max_episodes_per_s", "p99_ms_at_knee"} plus each level's figures and
`coordinator_cpu_ms_per_1000_episodes` at the busiest level (the cost that sets the ceiling
of one coordinator process on any machine: 1 core / that cost).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from hpcrl.core.config import CoordinatorConfig
from hpcrl.core.rpc import RequestClient
from hpcrl.core.transport import Node, read_endpoint
from hpcrl.core.wire import WireLimits
from hpcrl.rl.coordinator.coordinator import Coordinator
from hpcrl.rl.coordinator.tasks import ticket_from_row

WEIGHTS = {"arith/copy": 3.0, "code-repair": 1.0}
GROUP = 8


def serve(run_dir: str) -> None:
    """Child: the coordinator, serving until SIGTERM."""
    cfg = CoordinatorConfig(lease_s=3600.0, max_groups_ahead=10**9, sync_wait_s=0.25)
    coord = Coordinator(run_dir, WEIGHTS, GROUP, 64, 2, 10**9, 0, cfg)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Node(run_dir, "coordinator", WireLimits(), bind_host="127.0.0.1") as node:
        coord.serve(node, stop)


def handler_us_per_sync(n: int, per_sync: int, root: Path) -> float:
    """The request handler alone (no sockets), in this process: microseconds per sync with `n`
    generators each holding `per_sync` leases; what grows with N here grows in the service."""
    cfg = CoordinatorConfig(lease_s=3600.0, max_groups_ahead=10**9, sync_wait_s=0.0)
    coord = Coordinator(root / f"handler-{n}", WEIGHTS, GROUP, 64, 2, 10**9, 0, cfg)
    held = {}

    def sync(name: str) -> None:
        body = {"generator": name, "want": per_sync, "done": held.get(name, []), "failed": [], "released": [],
                "stats": {}, "life": "bench"}  # fmt: skip
        held[name] = [ticket_from_row(r).episode for r in coord.handle("sync", body)["tickets"]]

    names = [f"gen-{i}" for i in range(n)]
    for name in names:
        sync(name)
    rounds = max(1, 2000 // n)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for name in names:
            sync(name)
    dt = time.perf_counter() - t0
    coord.lease_log.close()
    coord.timeline.close()
    return dt / (rounds * n) * 1e6


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Driver:
    """N generators (one request client each) and a learner, in one thread."""

    def __init__(self, node: Node, per_sync: int, period_s: float):
        self.node, self.per_sync, self.period_s = node, per_sync, period_s
        self.gens: list[dict] = []
        self.learner = RequestClient(node, "coordinator", timeout_s=120.0, retries=0)
        self.done_total = 0
        self.step = 0

    def grow(self, n: int) -> None:
        while len(self.gens) < n:
            i = len(self.gens)
            client = RequestClient(self.node, "coordinator", timeout_s=120.0, retries=0)
            self.gens.append({"name": f"gen-{i}", "client": client, "held": [], "due": 0.0, "pending": None})

    def run(self, seconds: float) -> dict:
        """Drive every generator for `seconds`; what was settled and each sync's latency."""
        poller = zmq.Poller()
        lat: list[float] = []
        settled = 0
        end = time.monotonic() + seconds
        next_learner = time.monotonic() + 1.0
        now = time.monotonic()
        for i, g in enumerate(self.gens):  # spread over one period, not all at once
            g["due"] = now + self.period_s * i / len(self.gens)
        while True:
            now = time.monotonic()
            if now >= end and not any(g["pending"] for g in self.gens):
                break
            for g in self.gens:
                if g["pending"] is None and g["due"] <= now and now < end:
                    body = {"generator": g["name"], "want": self.per_sync, "done": g["held"], "failed": [],
                            "released": [], "stats": {"busy_fraction": 1.0}, "life": "bench"}  # fmt: skip
                    g["pending"], g["sent"], g["reporting"] = g["client"].start("sync", body), now, len(g["held"])
                    poller.register(g["pending"]._sock, zmq.POLLIN)
            if now >= next_learner:
                self.step += 1
                self.learner.request(
                    "learner",
                    {"step": self.step, "version": self.step, "trained_groups": self.done_total // GROUP,
                     "dropped_groups": 0},
                )  # fmt: skip
                next_learner = now + 1.0
            wake = min([g["due"] for g in self.gens if g["pending"] is None and g["due"] > now] + [now + 0.05])
            ready = dict(poller.poll(max(0.0, min(wake, end) - now) * 1000))
            for g in self.gens:
                p = g["pending"]
                if p is None or p._sock not in ready:
                    continue
                env = p.poll(0)
                if env is None:
                    continue
                t = time.monotonic()
                poller.unregister(p._sock)
                lat.append(t - g["sent"])
                settled += g["reporting"]
                self.done_total += g["reporting"]
                g["held"] = [ticket_from_row(r).episode for r in env.body["tickets"]]
                g["pending"] = None
                g["due"] = max(g["due"] + self.period_s, t)  # late: the next one at once
        return {"settled": settled, "latencies": lat}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-generators", type=int, default=1024)
    ap.add_argument("--per-sync", type=int, default=4, help="episodes reported done and asked for per sync")
    ap.add_argument("--period-s", type=float, default=0.25, help="each generator syncs this often")
    ap.add_argument("--level-s", type=float, default=4.0, help="seconds measured per N (after 1 s of warm-up)")
    ap.add_argument("--quick", action="store_true", help="up to 64 generators, 2 s per level")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        serve(a.child)
        return 0
    if a.quick:
        a.max_generators, a.level_s = min(a.max_generators, 64), 2.0
    run = Path(tempfile.mkdtemp(prefix="hpcrl-bench-coord-"))
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(run)])
    levels = []
    try:
        read_endpoint(run, "coordinator", 60.0)
        with Node(run, "bench-driver") as node:
            node.ctx.set(zmq.MAX_SOCKETS, a.max_generators + 64)  # one DEALER per generator (default cap 1023)
            driver = Driver(node, a.per_sync, a.period_s)
            n = 1
            while n <= a.max_generators:
                driver.grow(n)
                driver.run(1.0)  # warm-up: connections made, leases held
                c0, d0, t0 = cpu_s(proc.pid), cpu_s(os.getpid()), time.monotonic()
                got = driver.run(a.level_s)
                wall = time.monotonic() - t0
                c1, d1 = cpu_s(proc.pid), cpu_s(os.getpid())
                lat = sorted(got["latencies"])
                level = {
                    "generators": n,
                    "offered_episodes_per_s": round(n * a.per_sync / a.period_s, 1),
                    "episodes_per_s": round(got["settled"] / wall, 1),
                    "syncs_per_s": round(len(lat) / wall, 1),
                    "median_ms": round(statistics.median(lat) * 1e3, 2) if lat else None,
                    "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 2) if lat else None,
                    "coordinator_cpu": round((c1 - c0) / wall, 3),
                    "coordinator_cpu_ms_per_1000_episodes": round((c1 - c0) / max(got["settled"], 1) * 1e6, 1),
                    "driver_cpu": round((d1 - d0) / wall, 3),
                    "handler_us_per_sync": round(handler_us_per_sync(n, a.per_sync, run), 1),
                }
                levels.append(level)
                if not a.json:
                    print(
                        f"N={n:5d}  offered {level['offered_episodes_per_s']:8.0f}/s  settled "
                        f"{level['episodes_per_s']:8.0f}/s  syncs {level['syncs_per_s']:7.0f}/s  latency median "
                        f"{level['median_ms']:7.2f} ms p99 {level['p99_ms']:8.2f} ms  coordinator CPU "
                        f"{level['coordinator_cpu']:.2f} ({level['coordinator_cpu_ms_per_1000_episodes']:.0f} ms/1000 "
                        f"episodes)  driver CPU {level['driver_cpu']:.2f}  handler alone "
                        f"{level['handler_us_per_sync']:.0f} us/sync",
                        flush=True,
                    )
                n *= 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    best = max(lv["episodes_per_s"] for lv in levels)
    knee = next(lv for lv in levels if lv["episodes_per_s"] >= 0.9 * best)
    # At the busiest level: fixed costs (status.json each second, the timeline) are spread thinnest.
    cost = max(levels, key=lambda lv: lv["episodes_per_s"])["coordinator_cpu_ms_per_1000_episodes"]
    out = {
        "knee_generators": knee["generators"],
        "max_episodes_per_s": best,
        "p99_ms_at_knee": knee["p99_ms"],
        "coordinator_cpu_ms_per_1000_episodes": cost,
        "per_sync": a.per_sync,
        "period_s": a.period_s,
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "levels": levels,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(
            f"knee: {knee['generators']} generators, {best:.0f} episodes/s at most, p99 {knee['p99_ms']:.1f} ms there; "
            f"the coordinator spends {cost:.0f} ms of CPU per 1000 episodes (one core: ~{1e6 / cost:.0f} episodes/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
