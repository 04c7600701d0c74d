"""The coordinator: hands out episodes across domains, leases them, watches the run, writes its record.

    coord = Coordinator(run_dir, weights={"arith/copy": 1.0}, group_size=8, batch_groups=32,
                        max_staleness=2, max_steps=300, seed=0, cfg=cfg.coordinator)
    coord.serve(stop_event)        # RequestServer "coordinator" over the run's CURVE transport

Requests (transport envelopes; body -> reply body):

    sync     {generator, want, done: [episode], failed: [[episode, reason]], released: [episode], stats}
             -> {tickets: [[domain, task_index, episode, group, attempt]], stop, version}
             (a sync that wants work and finds none is answered when some appears, at most
             `sync_wait_s` later: the generator hears of the learner's next step at once)
    learner  {step, version, reward, ..., trained_groups, dropped_groups, domains}  -> {stop, abandoned}
    progress {trained_groups, dropped_groups, domains}   -> {abandoned}   (consumed without a step)
    stop     {}  -> {}           (the run is over: generators are told to stop)

Episodes are leased to the generator that took them; each sync renews that generator's leases.
A generator silent for `lease_s` is presumed gone and its episodes are issued again (same
episode number, attempt + 1), first in line; so are episodes a generator reports failed (a
sandbox that vanished mid-step), up to `max_attempts`. Duplicates from a generator that was
only slow are dropped downstream by episode number. Groups are issued only while fewer than
`max(1, max_staleness) x batch_groups` are outstanding beyond what the learner consumed
(trained, or dropped: stale, filtered, abandoned): generators never run so far ahead that their
work would arrive too stale to train. A group one of whose episodes was given up can never be
complete: the learner's replies name it (`abandoned`, the most recent ones), and the learner
closes it and counts it consumed, once.

Per domain, status.json's `domains` and each metrics.jsonl line's (`domain_report`): episodes
issued, and from the learner's counts what arrived (finished), was trained and was dropped and
why, with the mean turns and tokens of the episodes trained and of all that finished
(`started_*`): a rule that drops long episodes, or a slow domain's, shows as a gap there.

Files in the run directory: `status.json` (rewritten every `status_every_s`: step, reward,
trajectories/s, busy fraction per role, leases, generators), `metrics.jsonl` (one line per
learner step, with the coordinator's throughput at that moment) and `coordinator/state.json`
(sampler position and outstanding episodes, so a restarted coordinator issues no task twice
and re-issues what was in flight; episode numbers are reserved in it ahead of use, so a successor
never reuses one the lost last second handed out; the copy it replaced stays as state.json.prev,
taken with a warning if state.json is found corrupt). `coordinator/leases.jsonl` and
`coordinator/timeline.jsonl` record each lease's life and each generator's busy seconds for
`hpcrl traj trace` and `hpcrl plot` (rl/coordinator/events.py).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.core.config import CoordinatorConfig
from hpcrl.core.files import read_state_json
from hpcrl.core.liveness import beat
from hpcrl.rl.coordinator.events import LEASES_NAME, TIMELINE_NAME, JsonLines
from hpcrl.rl.coordinator.report import METRICS_NAME, RunReport, atomic_json, finite_json
from hpcrl.rl.coordinator.tasks import EpisodeTicket, TaskSampler, domain_report, ticket_row

# hpcrl imports inside functions here would load msgpack, numpy, zmq for every importer of this module (start-up speed).

__all__ = ["Coordinator"]

log = logging.getLogger("hpcrl.coordinator")
# Episode numbers reserved in state.json ahead of those handed out (_reserve): one save per this
# many episodes, a few seconds of a busy run.
_RESERVE_EPISODES = 4096
_TELL_ABANDONED = 4096  # the most recent groups with a given-up episode named in each reply to the learner


@dataclass
class _Lease:
    ticket: EpisodeTicket
    generator: str
    renewed: float


def _check_state(state: dict) -> None:
    """What `_restore` needs of state.json (KeyError/TypeError: read_state_json takes the .prev)."""
    state["sampler"], int(state["groups_issued"])
    for row in state["outstanding"]:
        if len(row) != 5:
            raise ValueError(f"an outstanding episode row of {len(row)} fields, not 5")


class Coordinator(RunReport):
    def __init__(
        self,
        run_dir: str | os.PathLike,
        weights: Mapping[str, float],
        group_size: int,
        batch_groups: int,
        max_staleness: int,
        max_steps: int,
        seed: int,
        cfg: CoordinatorConfig,
        sizes: Mapping[str, int | None] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.sampler = TaskSampler(weights, group_size, seed, sizes)  # sizes: domains' task counts
        self.group_size, self.batch_groups, self.max_steps = group_size, batch_groups, max_steps
        self.max_ahead = cfg.max_groups_ahead or max(1, max_staleness) * batch_groups
        self.queue: collections.deque[EpisodeTicket] = collections.deque()  # issued next, re-issues first
        self.leases: dict[int, _Lease] = {}
        self.generators: dict[str, dict] = {}
        self.learner: dict = {}
        self.counts = collections.Counter()
        self.done_by_domain = collections.Counter()
        self.groups_issued = 0
        # Groups counted consumed here (every episode given up), by a coordinator before the learner
        # closed such groups itself; kept from its state.json.
        self.abandoned_groups: set[int] = set()
        # Groups with an episode given up: never complete; the learner is told, closes and counts them.
        self.unfinishable: dict[int, None] = {}
        self.learner_domains: dict = {}  # the learner's per-domain counts, as last reported
        self.stopping = False
        self.stop_requested = False  # by `hpcrl run` (the end, Ctrl-C), as opposed to max_steps reached
        self.started = time.time()
        self._done_times: collections.deque[float] = collections.deque()
        self._last_status = 0.0
        self._last_timeline = 0.0
        self._lock = threading.Lock()
        (self.run_dir / "coordinator").mkdir(parents=True, exist_ok=True)
        self.lease_log = JsonLines(self.run_dir / LEASES_NAME)  # rl/coordinator/events.py: for `hpcrl traj trace`
        self.timeline = JsonLines(self.run_dir / TIMELINE_NAME)  # ... and for `hpcrl plot`
        self._reserved = (0, 0)  # (episode, group) numbers state.json says may have been handed out
        self._restore()

    # -- persistence -----------------------------------------------------------------------

    @property
    def _state_path(self) -> Path:
        return self.run_dir / "coordinator" / "state.json"

    def _reserve(self) -> None:
        """Write ahead the numbers about to be handed out. state.json is saved once a second, so
        a coordinator that dies loses up to a second of issued episodes; its successor starts
        numbering above the reservation, never reusing an episode or group number that a
        generator may still deliver to the store (trajectory ids are run/generator/episode)."""
        episode, group = self.sampler.next_numbers
        self._reserved = (episode + _RESERVE_EPISODES, group + _RESERVE_EPISODES // self.group_size + 1)
        self._save()
        self._save()  # state.json.prev too: a fallback to it must not reuse these numbers either

    def _save(self) -> None:
        outstanding = [list(ticket_row(t)) for t in self.queue] + [
            list(ticket_row(lease.ticket)) for lease in self.leases.values()
        ]
        atomic_json(
            self._state_path,
            {
                "sampler": self.sampler.state(),
                "outstanding": outstanding,
                "groups_issued": self.groups_issued,
                "counts": dict(self.counts),
                "abandoned_groups": sorted(self.abandoned_groups),
                "unfinishable_groups": list(self.unfinishable)[-_TELL_ABANDONED:],
                "reserved": list(self._reserved),
                # What the learner consumed: without it a successor's flow control counts the
                # window full until the learner next reports, and a learner waiting for data
                # reports only when its counts change: the run stalled (seen in CI).
                "consumed": {k: int(self.learner.get(k, 0)) for k in ("trained_groups", "dropped_groups")},
            },
            keep_previous=True,  # a state.json found corrupt later falls back to the one before
        )

    def _restore(self) -> None:
        state = read_state_json(
            self._state_path,
            check=_check_state,
            # Not "start afresh": a new coordinator numbers episodes from 0 again, and the store
            # takes trajectories with ids it already holds for resends and drops them.
            advice="restore a good copy; a coordinator started without one would reuse episode numbers",
        )
        if state is None:
            return
        self.sampler.restore(state["sampler"])
        consumed = state.get("consumed")
        if isinstance(consumed, dict):
            self.learner.update({k: int(v) for k, v in consumed.items() if k in ("trained_groups", "dropped_groups")})
        self.sampler.skip_to(*state.get("reserved", (0, 0)))  # above whatever the lost second issued
        self._reserved = self.sampler.next_numbers
        self.groups_issued = int(state["groups_issued"])
        self.counts.update(state.get("counts", {}))
        self.abandoned_groups = set(state.get("abandoned_groups", []))
        # A predecessor that counted partly given-up groups itself (abandoned_episodes) never told
        # the learner of them: it is told now.
        for g in [*state.get("abandoned_episodes", {}), *state.get("unfinishable_groups", [])]:
            self.unfinishable[int(g)] = None
        # Whatever was queued or in flight when the old coordinator died is issued again.
        for row in state["outstanding"]:
            d, idx, ep, grp, att = row
            self.queue.append(EpisodeTicket(d, int(idx), int(ep), int(grp), int(att) + 1))
        self.counts["reissued"] += len(state["outstanding"])
        if state["outstanding"]:
            self.lease_log.write({"t": time.time(), "requeued": [int(row[2]) for row in state["outstanding"]]})
        log.info(
            "coordinator resumed: %d episodes re-issued, %d groups issued before", len(self.queue), self.groups_issued
        )

    # -- requests --------------------------------------------------------------------------

    def handle(self, kind: str, body: Any) -> dict:
        with self._lock:
            if kind == "sync":
                return self._sync(body)
            if kind == "learner":
                return self._learner(body)
            if kind == "progress":
                self.learner.update(trained_groups=body["trained_groups"], dropped_groups=body["dropped_groups"])
                self.learner_domains = body.get("domains") or self.learner_domains
                return {"abandoned": self._tell_abandoned()}
            if kind == "stop":
                self.stopping = self.stop_requested = True
                self.write_status()
                return {}
            raise ValueError(f"unknown request {kind!r}; known: sync, learner, progress, stop")

    def _sync(self, body: dict) -> dict:
        name = str(body["generator"])
        now = time.monotonic()
        gen = self.generators.setdefault(name, {"first_seen": time.time()})
        event: dict[str, list] = collections.defaultdict(list)  # what this sync settled, for leases.jsonl
        life = body.get("life")
        if life is not None and gen.get("life") not in (None, life):
            # A new process under the name of one that died (a supervisor restart, a requeued job):
            # what its predecessor held will never be reported, and this one's syncs would renew
            # those leases for ever. Issue them again now rather than never.
            orphans = [ep for ep, lease in self.leases.items() if lease.generator == name]
            self._reissue(orphans)
            if orphans:
                event["orphaned"] = orphans
                log.warning("%s restarted: re-issuing the %d episodes its previous process held", name, len(orphans))
        gen.update(last_seen=time.time(), stats=body.get("stats", {}), lost=False, life=life)
        for ep in body.get("done", []):
            lease = self._settle(name, ep, "done")
            if lease is not None:
                event["done"].append(lease.ticket.episode)
                self.counts["completed"] += 1
                self.done_by_domain[lease.ticket.domain] += 1
                self._done_times.append(now)
        for ep, reason, *flags in body.get("failed", []):
            lease = self._settle(name, ep, "failed")
            if lease is None:
                continue
            self.counts["failed"] += 1
            t = lease.ticket
            event["failed"].append([t.episode, str(reason)[:200]])
            # permanent: the task cannot succeed as posed (a prompt past max_context); another
            # attempt would fail the same way, so it is abandoned at once.
            if (flags and flags[0] is True) or t.attempt + 1 >= self.cfg.max_attempts:
                self.counts["abandoned"] += 1
                event["abandoned"].append(t.episode)
                # Its group can never be complete. The learner, told in its replies, closes it and
                # counts it consumed once, whatever of it arrived (the coordinator cannot know
                # what the learner already holds: counted in both, the window would grow).
                self.unfinishable.pop(t.group, None)
                self.unfinishable[t.group] = None
                while len(self.unfinishable) > 4 * _TELL_ABANDONED:  # long closed by the learner
                    del self.unfinishable[next(iter(self.unfinishable))]
                log.warning(
                    "episode %d (%s task %d) abandoned after %d attempts: %s",
                    t.episode,
                    t.domain,
                    t.task_index,
                    t.attempt + 1,
                    reason,
                )
            else:
                self.queue.appendleft(EpisodeTicket(t.domain, t.task_index, t.episode, t.group, t.attempt + 1))
                self.counts["reissued"] += 1
        for ep in body.get("released", []):
            lease = self._settle(name, ep, "released")
            if lease is not None:
                self.queue.appendleft(lease.ticket)
                self.counts["released"] += 1
                event["released"].append(lease.ticket.episode)
        for lease in self.leases.values():
            if lease.generator == name:
                lease.renewed = now
        return self._answer(name, int(body.get("want", 0)), now, event)

    def _answer(self, name: str, want: int, now: float, event: dict | None = None) -> dict:
        """A sync's reply: up to `want` tickets leased to generator `name`."""
        event = event if event is not None else {}
        tickets = [] if self.stopping else self._issue(name, want, now)
        if tickets:
            event["leased"] = [[t.episode, t.attempt] for t in tickets]
        if event:
            self.lease_log.write({"t": time.time(), "g": name, **event})
        return {
            "tickets": [list(ticket_row(t)) for t in tickets],
            "stop": self.stopping,
            "version": self.learner.get("version"),
        }

    def _settle(self, generator: str, episode: Any, what: str) -> _Lease | None:
        """End the lease of `episode` if `generator` holds it. A report for a lease held by
        another generator is ignored: the episode was re-issued after this one went silent (its
        late result is a trajectory of its own, which the learner drops as a duplicate), or the
        report is not genuine; either way it must not end the other generator's lease."""
        lease = self.leases.get(int(episode))
        if lease is None:
            return None
        if lease.generator != generator:
            self.counts["foreign_reports"] += 1
            log.warning(
                "%s reported episode %s %s, but %s holds its lease; ignored", generator, episode, what, lease.generator
            )
            return None
        return self.leases.pop(int(episode))

    def _consumed(self) -> int:
        """Groups no longer outstanding: trained, dropped by the learner, or abandoned here."""
        return (
            int(self.learner.get("trained_groups", 0))
            + int(self.learner.get("dropped_groups", 0))
            + len(self.abandoned_groups)
        )

    def _issue(self, generator: str, want: int, now: float) -> list[EpisodeTicket]:
        consumed = self._consumed()
        while len(self.queue) < want and self.groups_issued - consumed < self.max_ahead:
            self.queue.extend(self.sampler.next_group())
            self.groups_issued += 1
            if self.sampler.next_numbers[0] > self._reserved[0] or self.sampler.next_numbers[1] > self._reserved[1]:
                self._reserve()
        out = []
        while self.queue and len(out) < want:
            t = self.queue.popleft()
            self.leases[t.episode] = _Lease(t, generator, now)
            out.append(t)
        self.counts["issued"] += len(out)
        return out

    def _tell_abandoned(self) -> list[int]:
        return list(self.unfinishable)[-_TELL_ABANDONED:]

    def domains(self) -> dict[str, dict]:
        return domain_report(self.sampler.issued(), self.learner_domains, self.done_by_domain)

    def _learner(self, body: dict) -> dict:
        self.learner_domains = body.get("domains") or self.learner_domains
        body = dict(body, domains=self.domains())
        self.learner = dict(body, reported_at=time.time())
        row = {**body, "time": time.time(), "elapsed_s": time.time() - self.started, **self.throughput()}
        with open(self.run_dir / METRICS_NAME, "a") as f:
            # Strict JSON: a statistic with no value this step (a skipped update's ratio) is null, not NaN.
            f.write(json.dumps(finite_json(row), allow_nan=False) + "\n")
        # A learner that restarted from an earlier checkpoint after reaching max_steps needs data again.
        self.stopping = self.stop_requested or int(body.get("step", 0)) >= self.max_steps
        return {"stop": self.stopping, "abandoned": self._tell_abandoned()}

    # -- housekeeping ------------------------------------------------------------------------

    def expire(self) -> int:
        """Re-issue the episodes of generators silent for lease_s; returns how many."""
        with self._lock:
            now = time.monotonic()
            dead = [ep for ep, lease in self.leases.items() if now - lease.renewed > self.cfg.lease_s]
            holders: dict[str, list[int]] = collections.defaultdict(list)
            for ep in dead:
                holders[self.leases[ep].generator].append(ep)
                if self.leases[ep].generator in self.generators:
                    self.generators[self.leases[ep].generator]["lost"] = True
            self._reissue(dead)
            if dead:
                self.lease_log.write({"t": time.time(), "expired": holders})
                log.warning("re-issuing %d episodes of silent generators", len(dead))
            return len(dead)

    def _reissue(self, episodes: list[int]) -> None:
        """End these leases and queue their episodes first, as the next attempt."""
        for ep in episodes:
            t = self.leases.pop(ep).ticket
            self.queue.appendleft(EpisodeTicket(t.domain, t.task_index, t.episode, t.group, t.attempt + 1))
        self.counts["reissued"] += len(episodes)

    def tick(self) -> None:
        self.expire()
        if time.monotonic() - self._last_status >= self.cfg.status_every_s:
            with self._lock:
                self.write_status()
                self._save()
        if time.monotonic() - self._last_timeline >= self.cfg.timeline_every_s:
            with self._lock:
                self._sample_timeline()

    def _answer_parked(self, server, parked: dict) -> None:
        """Answer the parked syncs that can have work now (oldest first), or whose wait is over."""
        from hpcrl.core.rpc import Reply

        now = time.monotonic()
        for rid, (name, life, want, deadline) in list(parked.items()):
            with self._lock:
                if self.generators.get(name, {}).get("life") != life:
                    # Its process was replaced meanwhile: tickets leased to the name now would be
                    # renewed by the successor's syncs and never worked on.
                    reply = self._answer(name, 0, now)
                elif self.stopping or now >= deadline or self._can_issue():
                    reply = self._answer(name, want, now)
                else:
                    continue
            del parked[rid]
            server.reply(rid, Reply("ok", reply))

    def _can_issue(self) -> bool:
        return bool(self.queue) or self.groups_issued - self._consumed() < self.max_ahead

    def serve(self, node, stop: threading.Event) -> None:
        """Answer requests until `stop` is set; status and state are written on the way out too."""
        from hpcrl.core.rpc import DEFERRED, Reply, RequestServer

        # Syncs that found no work, answered when work appears or at their deadline: request id ->
        # (generator, its life, want, deadline). A generator that polled instead would learn of
        # the learner's next step up to one poll interval late, every step.
        parked: dict[str, tuple[str, Any, int, float]] = {}

        def on_request(env):
            reply = self.handle(env.kind, env.body)
            want = int(env.body.get("want", 0)) if env.kind == "sync" else 0
            if want > 0 and not reply["tickets"] and not reply["stop"] and self.cfg.sync_wait_s > 0:
                deadline = time.monotonic() + self.cfg.sync_wait_s
                parked[env.msg_id] = (str(env.body["generator"]), env.body.get("life"), want, deadline)
                return DEFERRED
            return Reply("ok", reply)

        server = RequestServer(node, "coordinator", on_request)
        try:
            while not stop.is_set():
                beat()
                wake = min((p[3] for p in parked.values()), default=float("inf"))
                server.poll_once(max(0.0, min(0.1, wake - time.monotonic())))
                self._answer_parked(server, parked)
                self.tick()
        finally:
            # Answered now rather than left to time out; "stop" only if the run is over (this
            # process may be stopping for a restart, which the generators wait out).
            with self._lock:
                now = time.monotonic()
                replies = {rid: self._answer(name, 0, now) for rid, (name, *_) in parked.items()}
            for rid, reply in replies.items():
                server.reply(rid, Reply("ok", reply))
            with self._lock:
                self.write_status(final=True)
                self._save()
                self._sample_timeline()
                self.lease_log.close()
                self.timeline.close()
