"""The generator as a run component: load the policy, link to the run, generate until told to
stop, hand back what it holds, and say why it stopped.

    result = serve_generator(run_dir, "gen-0", cfg.generators, cfg.policy, domains, ["sandbox-0"],
                             seed=0, sandbox_slots=8, stop=stop_event)
    result["stopped_by"]     # "coordinator": the run is over; "signal": asked to stop; "window": a
                             # rollout job's window ended (`should_end`)

`jobs.components.GeneratorComponent` is the picklable shell around it (signals, the component's
files, requeueing); a rollout job (`jobs.rollout`) passes a source wrapper that stops leasing
and its own end condition. On stop, unfinished episodes go back to the coordinator at once and
the store's acknowledgements are awaited before the generator closes, so nothing it produced
is lost; the log line says where the stop's time went (a preempted rollout job's exit delays
whoever preempted it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.core.config import GeneratorConfig, PolicyConfig
from hpcrl.core.liveness import beat
from hpcrl.core.metrics import provide
from hpcrl.core.transport import Node
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.generator import Generator
from hpcrl.rl.rollout.remote import AnnouncedWeights, RemoteTaskSource, ThreadLocalJudge
from hpcrl.rl.rollout.report import GeneratorReport
from hpcrl.rl.store.stream import TrajectorySender
from hpcrl.rl.weights.direct import DirectReceiver, DirectWeights
from hpcrl.rl.weights.shards import WeightStore

__all__ = ["serve_generator"]

log = logging.getLogger("hpcrl.components")  # the name generator components have always logged under


def serve_generator(
    run_dir: Path,
    name: str,
    cfg: GeneratorConfig,
    policy_cfg: PolicyConfig,
    domains: Mapping[str, Any],
    sandbox_services: Sequence[str],
    *,
    seed: int,
    sandbox_slots: int,
    stop: threading.Event,
    signalled_at: Callable[[], float | None] = lambda: None,
    wrap_source: Callable[[RemoteTaskSource], Any] = lambda source: source,
    should_end: Callable[[], bool] = lambda: False,
    on_ready: Callable[[], None] | None = None,
) -> dict:
    """Run one generator until `stop` is set, the coordinator says the run is over or
    `should_end()`; `on_ready` is called once loaded, just before the first lease;
    `signalled_at()` is when a stop signal arrived (None: none did)."""
    policy = Policy.load(policy_cfg, seed=seed)
    with Node(run_dir, name) as node, contextlib.ExitStack() as cleanup:
        judge = ThreadLocalJudge(node, sandbox_services) if any(d.needs_executor for d in domains.values()) else None
        weights = AnnouncedWeights(WeightStore(run_dir, background=True), node)
        if policy_cfg.weight_sync == "direct":
            receiver = DirectReceiver(run_dir, name, device=policy.device)
            cleanup.callback(receiver.close)  # its gloo pair torn down now, not at interpreter exit
            weights = DirectWeights(weights, receiver)
        gen = Generator(
            cfg,
            policy,
            domains,
            run=run_dir.name,
            name=name,
            seed=seed,
            executor=judge,
            weights=weights,
        )
        report = GeneratorReport(gen, sandbox_slots)
        source = wrap_source(RemoteTaskSource(node, name, TrajectorySender(node, "store"), report.stats))
        provide(lambda: report.metrics(source.sender))
        if on_ready is not None:
            on_ready()  # e.g. from here on SIGTERM hands back what it holds
        try:
            gen.run(
                source,
                source.sink,
                stop=lambda: beat() or stop.is_set() or source.should_stop() or should_end(),
            )
            t_loop = time.time()
            held = gen.in_flight()
            source.release(held)  # unfinished episodes go back to the coordinator at once
            # Tell the coordinator before closing: close() waits for environment steps still
            # running (a sandbox run up to its limit), which held the hand-back up as long.
            source.finish(timeout_s=60.0)
            t_acked = time.time()
            gen.close()
        finally:
            source.close()
        # Where a stop's time went (a preempted rollout job's exit delays whoever preempted it).
        t0 = signalled_at() or t_loop
        log.info(
            "%s: stopped (%s): loop ended %.3f s after it, %d episodes handed back and the store's "
            "acknowledgements in %.3f s more, closed %.3f s after it",
            name,
            "signal" if signalled_at() else "no signal",
            t_loop - t0,
            len(held),
            t_acked - t_loop,
            time.time() - t0,
        )
        # "coordinator": the run is over; "signal": asked to stop (the runner may restart it);
        # "window": a rollout job's window ended (jobs/rollout.py: never requeued).
        by = "coordinator" if source.should_stop() else "window" if should_end() else "signal"
        return {"stopped_by": by, "trajectories": gen.stats.trajectories, "busy_fraction": gen.stats.busy_fraction}
