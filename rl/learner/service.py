"""The learner as a run component: read the store, train, publish, report, checkpoint, resume.

    run_learner(run_dir, cfg.learner, cfg.policy, seed, stop_event)   # one call per rank

Rank 0 reads trajectories from the store (arrival order, exactly-once cursor), groups them
(GroupBuffer: complete groups whose newest action is fresh enough) and broadcasts each batch to
the other ranks, so every rank trains on the same groups whatever each one would have seen on
the filesystem. After each step rank 0 announces the new policy version (PUB/SUB), reports the
step to the coordinator (with its per-domain counts: what arrived, was trained, was dropped and
why, and their lengths) and appends to `learner/trained.jsonl` which trajectories were trained
and which were dropped (stale, duplicate, late, filtered, abandoned). The coordinator's answers
name the groups it gave an episode of up; the buffer closes them (they can never be complete).
Every `checkpoint_every` steps, and at the end, the
DeepSpeed checkpoint stores model, optimizer, the store cursor and the buffered trajectories;
a restarted learner resumes from there: what it had trained since is trained again by the
restored model (`trained.jsonl` marks the new life with `resumed_step`), and nothing is lost
or trained twice in the lineage the final model descends from.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from hpcrl.core.config import LearnerConfig, PolicyConfig
from hpcrl.core.files import atomic_write_json
from hpcrl.core.liveness import beat
from hpcrl.core.metrics import provide
from hpcrl.core.rpc import RequestClient, VersionPublisher
from hpcrl.core.transport import Node
from hpcrl.rl.audit.audit import AUDIT_NAME, CURSOR_NAME
from hpcrl.rl.common.meter import BusyMeter
from hpcrl.rl.learner.batch import GroupBuffer
from hpcrl.rl.learner.learner import Learner
from hpcrl.rl.rollout.remote import ThreadLocalJudge

# hpcrl imports inside functions here would load h5py, transformers for every importer of this module (start-up speed).

__all__ = ["run_learner", "AUDIT_NAME", "CURSOR_NAME"]

log = logging.getLogger("hpcrl.learner")
_WAIT_S = 1.0  # rank 0 tells the others at least this often that it is still waiting for data


class _Rank0:
    """What only rank 0 does: store, buffer, transport, audit."""

    def __init__(self, run_dir: Path, cfg: LearnerConfig, learner: Learner, extra: dict, policy: PolicyConfig):
        from hpcrl.rl.store.reader import StoreReader

        self.run_dir, self.cfg, self.learner = run_dir, cfg, learner
        self.node = Node(run_dir, "learner")
        self.pub = VersionPublisher(self.node)
        self.coord = RequestClient(self.node, "coordinator", timeout_s=2.0, retries=1, discover_timeout_s=60.0)
        (run_dir / "trajectories").mkdir(exist_ok=True)
        # Staleness is the buffer's call, per group. The refresh interval paces the whole pipeline:
        # the learner sees a flushed segment only at its next refresh (0.5 s halved throughput).
        self.reader = StoreReader(run_dir / "trajectories", refresh_s=cfg.store_refresh_s)
        self.reader.load_state_dict(extra.get("reader", {}))
        self.buffer = GroupBuffer(cfg.group_size, filter_zero_variance=cfg.filter_groups)
        self.buffer.load_state_dict(extra.get("buffer", {}))
        self.trained_groups = int(extra.get("trained_groups", 0))
        self.life = int(extra.get("life", 0)) + 1
        (run_dir / "learner").mkdir(exist_ok=True)
        self.audit = open(run_dir / AUDIT_NAME, "a")
        self._write({"life": self.life, "resumed_step": learner.step, "version": learner.version, "time": time.time()})
        self.pub.publish(learner.version)
        self._busy = 0.0
        self._meter = BusyMeter()
        self.wait_s = 0.0  # waiting for data since the last step
        self.checkpoint_s = 0.0  # checkpointing since the last step's report (hpcrl plot's timeline)
        self.last: dict = {}  # the last step's metrics, for the Prometheus endpoint
        self.trained_trajectories = self.wait_total_s = 0
        self.evaluator = None
        if cfg.eval.every_steps:
            from hpcrl.rl.rollout.evaluate import PeriodicEvaluator

            # A thread with its own copy of the policy: training goes on while it samples.
            self.evaluator = PeriodicEvaluator(run_dir, cfg.eval, policy, self._sandbox_judge)
        provide(self.metrics)

    def _sandbox_judge(self):
        """The run's sandbox servers (as generators use them), for evaluating code domains."""

        services = sorted(p.stem for p in (self.run_dir / "endpoints").glob("sandbox-*.json"))
        return ThreadLocalJudge(self.node, services)

    def metrics(self) -> dict:
        """What rank 0's Prometheus endpoint shows (core/metrics.py)."""
        m = self.last
        out = {
            "learner_step": self.learner.step,
            "policy_version": self.learner.version,
            "learner_trained_groups_total": self.trained_groups,
            "learner_trained_trajectories_total": self.trained_trajectories,
            "learner_dropped_groups_total": self.buffer.dropped_groups,
            "learner_dropped_stale_total": self.buffer.dropped_stale,
            "learner_buffered_groups:state": self.buffer.depth,
            "learner_wait_seconds_total": self.wait_total_s + self.wait_s,
            "learner_busy_fraction": self._meter.fraction(self._busy),
            "learner_staleness_bound": self.cfg.max_staleness,
        }
        for key in ("reward", "loss", "entropy", "staleness_max", "step_s", "action_tokens", "grad_norm"):
            if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool):
                out["learner_" + key] = m[key]
        return out

    def _write(self, rec: dict) -> None:
        self.audit.write(json.dumps(rec) + "\n")
        self.audit.flush()
        os.fsync(self.audit.fileno())

    def next_groups(self, deadline: float):
        t0 = time.perf_counter()
        try:
            return self._next_groups(deadline)
        finally:
            self.wait_s += time.perf_counter() - t0

    def _next_groups(self, deadline: float):
        while True:
            got = self.buffer.pop(self.cfg.batch_groups, self.learner.version, self.cfg.max_staleness)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                self._progress()
                return None
            batch = self.reader.next_batch(256, timeout_s=min(0.2, max(0.0, deadline - time.monotonic())), min_size=1)
            for t in batch.trajectories:
                self.buffer.add(t)
            self.pub.tick()

    def _counts(self) -> dict:
        # Filtered (zero-variance) groups were consumed too: the coordinator issues new ones for them.
        return {"trained_groups": self.trained_groups, "dropped_groups": self.buffer.dropped_groups}

    def _progress(self) -> None:
        """While waiting for data (about once a second), tell the coordinator what was consumed
        (dropped groups count): its flow control issues new groups only against consumption it
        has heard of; and hear which groups it gave an episode of up, which never complete: a
        learner that waited for those to report would wait for ever."""
        try:
            reply = self.coord.request("progress", dict(self._counts(), domains=self.buffer.domain_counts()))
        except Exception as exc:  # a missing coordinator must not stop training
            log.warning("could not report progress to the coordinator: %s", exc)
            return
        self._abandon(reply.body)

    def _abandon(self, reply) -> None:
        groups = reply.get("abandoned") if isinstance(reply, dict) else None
        if groups and self.buffer.abandon(groups):
            self._progress()  # consumed: the coordinator may issue their replacements now

    def after_step(self, groups, m: dict, train_s: float) -> None:
        self.trained_groups += len(groups)
        self._busy += train_s
        dropped = self.buffer.drained()
        self._write(
            {
                "life": self.life,
                "step": m["step"],
                "version": m["version"],
                "trained": [t.id for g in groups for t in g],
                "dropped": [i for i, _ in dropped],
                "dropped_why": [why for _, why in dropped],  # rl/learner/batch.py DROP_REASONS, one per dropped id
                "time": time.time(),  # for `hpcrl traj trace`
            }
        )
        self.pub.publish(self.learner.version)
        if self.evaluator is not None:
            if self.evaluator.due(m["step"]):
                self.evaluator.submit(m["step"], self.learner.version)
            m = dict(m, **self.evaluator.results())  # an evaluation that finished since the last step
        m = dict(
            m,
            **self._counts(),
            domains=self.buffer.domain_counts(),
            dropped_stale=self.buffer.dropped_stale,
            duplicates=self.buffer.duplicates,
            filtered=self.buffer.filtered,
            wait_s=self.wait_s,
            checkpoint_s=self.checkpoint_s,
            busy_fraction=self._meter.fraction(self._busy),
            life=self.life,
        )
        self.last = m
        self.trained_trajectories += sum(len(g) for g in groups)
        self.wait_total_s += self.wait_s
        self.wait_s = self.checkpoint_s = 0.0
        try:
            reply = self.coord.request("learner", m)
        except Exception as exc:
            log.warning("could not report step %d to the coordinator: %s", m["step"], exc)
            return
        self._abandon(reply.body)

    def extra(self) -> dict[str, Any]:
        return {
            "reader": self.reader.state_dict(),
            "buffer": self.buffer.state_dict(),
            "trained_groups": self.trained_groups,
            "life": self.life,
        }

    def write_cursor(self, extra: dict) -> None:
        """The state the last checkpoint holds, readable without DeepSpeed (status, tests)."""
        buf = extra["buffer"]
        data = {
            "step": self.learner.step,
            "version": self.learner.version,
            "reader": extra["reader"],
            "buffered": [r["id"] for r in buf["open"] + buf["complete"]],
            "pending_dropped": buf["dropped"],
        }
        atomic_write_json(self.run_dir / CURSOR_NAME, data)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        self.audit.close()
        self.coord.close()
        self.node.close()


def run_learner(
    run_dir: str | os.PathLike, cfg: LearnerConfig, policy: PolicyConfig, seed: int, stop: threading.Event | None = None
) -> int:
    """Train until cfg.max_steps (or `stop`); returns the optimizer step reached."""
    run_dir = Path(run_dir)
    stop = stop or threading.Event()
    learner = Learner(cfg, policy, run_dir, seed=seed)
    extra = learner.setup()
    rank0 = _Rank0(run_dir, cfg, learner, extra, policy) if learner.rank == 0 else None
    log.info(
        "learner rank %d/%d ready at step %d, version %d", learner.rank, learner.world, learner.step, learner.version
    )
    try:
        while learner.step < cfg.max_steps:
            beat()  # every rank: one stuck in a collective stops beating (jobs/restarts.py)
            msg: list = [None]
            if rank0 is not None:
                msg[0] = "stop" if stop.is_set() else rank0.next_groups(time.monotonic() + _WAIT_S)
            if learner.world > 1:
                # Pickles the whole batch (~5 % of the learner's time at 256 trajectories): only
                # when another rank is there to receive it.
                msg = [learner.comm.broadcast_object(msg[0], src=0)]
            if msg[0] == "stop":
                break
            if msg[0] is None:
                continue
            t0 = time.perf_counter()
            m = learner.train_step(msg[0])
            if rank0 is not None:
                rank0.after_step(msg[0], m, time.perf_counter() - t0)
            if learner.step % cfg.checkpoint_every == 0 or learner.step >= cfg.max_steps:
                _checkpoint(learner, rank0)
        if stop.is_set() and learner.step % cfg.checkpoint_every:
            _checkpoint(learner, rank0)  # asked to stop (time limit, cancel): keep the progress
    finally:
        if rank0 is not None:
            rank0.close()
        learner.close()
    return learner.step


def _checkpoint(learner: Learner, rank0: _Rank0 | None) -> None:
    # Every rank saves the same client state: whichever rank's file DeepSpeed reads back, it holds rank 0's cursor.
    t0 = time.perf_counter()
    extra = learner.comm.broadcast_object(rank0.extra() if rank0 is not None else None, src=0)
    learner.checkpoint(extra)
    if rank0 is not None:
        rank0.write_cursor(extra)
        rank0.checkpoint_s += time.perf_counter() - t0
