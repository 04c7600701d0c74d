"""A generator's links to the rest of a run: coordinator, trajectory store, sandboxes, policy versions.

    source = RemoteTaskSource(node, "gen-0", TrajectorySender(node, "store"), stats=gen_stats_fn)
    gen.run(source, sink=source.sink, stop=source.should_stop)
    judge = ThreadLocalJudge(node, ["sandbox-0"])       # a CodeJudge; one client per env thread
    weights = AnnouncedWeights(WeightStore(run_dir), node)   # load_if_newer, woken by PUB/SUB

An episode is reported done to the coordinator only once the store acknowledged its
trajectory, so the lease of an episode whose trajectory died with its generator runs out and
the episode is issued again. Failed episodes are reported with their reason at the next sync.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from hpcrl.core.rpc import RequestClient, RequestTimeout, VersionSubscriber
from hpcrl.core.transport import TransportError, read_endpoint
from hpcrl.rl.coordinator.tasks import EpisodeTicket, ticket_from_row
from hpcrl.rl.record.trajectory import Trajectory

# hpcrl imports inside functions here would load yaml for every importer of this module (start-up speed).

__all__ = ["RemoteTaskSource", "ThreadLocalJudge", "AnnouncedWeights"]

log = logging.getLogger("hpcrl.generator")


class RemoteTaskSource:
    def __init__(
        self,
        node,
        name: str,
        sender,
        stats: Callable[[], dict] = dict,
        *,
        timeout_s: float = 5.0,
        idle_sync_s: float = 0.5,
        empty_backoff_s: float = 0.05,
    ):

        self.name = name
        # Tells the coordinator this process from a predecessor of the same name that died
        # holding leases (it re-issues those at once instead of renewing them for us).
        self.life = uuid.uuid4().hex
        self.sender = sender
        # Episodes become done (or failed) when the store answers for their trajectory.
        sender.on_settled = self._on_settled
        self.stats = stats
        # A coordinator the supervisor is restarting is waited for, not given up on (core/liveness.py).
        self.client = RequestClient(
            node, "coordinator", timeout_s=timeout_s, retries=3, discover_timeout_s=120.0, wait_restarting=True
        )
        self.idle_sync_s, self.empty_backoff_s = idle_sync_s, empty_backoff_s
        self._awaiting_ack: dict[str, int] = {}  # trajectory id -> episode
        self._done: list[int] = []
        self._failed: list[list] = []
        self._released: list[int] = []
        self._last_sync = 0.0
        self._sync_sent = 0.0
        self._last_empty = False
        self._inflight = None  # the sync request on its way (a PendingRequest), if any
        self._inflight_want = 0
        self._inflight_body: dict = {}
        self._ready: list[EpisodeTicket] = []  # tickets answered, not yet taken
        self.stop_requested = False
        self.learner_version: int | None = None

    # -- TaskSource -------------------------------------------------------------------------

    def take(self, n: int) -> Sequence[EpisodeTicket]:
        """Tickets the last sync brought (never blocks), and a new sync sent off when one is due."""
        self._collect_acks()
        self._poll_sync(0.0)
        tickets, self._ready = self._ready[: max(n, 0)], self._ready[max(n, 0) :]
        want = n - len(tickets)
        if self._inflight is None and self._sync_due(want):
            self._start_sync(want)
        return tickets

    def idle(self, timeout_s: float) -> None:
        """The generator has nothing to do: wait up to `timeout_s`, less if the coordinator answers."""
        if self._inflight is None:
            time.sleep(timeout_s)
        else:
            self._poll_sync(timeout_s)

    def done(self, ticket: EpisodeTicket) -> None:
        pass  # reported when the store acknowledges the trajectory (see sink)

    def failed(self, ticket: EpisodeTicket, reason: str, permanent: bool = False) -> None:
        self._failed.append([ticket.episode, reason[:500], bool(permanent)])

    def release(self, tickets: Sequence[EpisodeTicket]) -> None:
        """Episodes this generator will not finish (it is stopping): issued again, same attempt."""
        self._released.extend(t.episode for t in tickets)

    # -- the generator's sink and stop condition ------------------------------------------------

    def sink(self, traj: Trajectory) -> None:
        self._awaiting_ack[traj.id] = traj.episode
        self.sender.send(traj)

    def should_stop(self) -> bool:
        return self.stop_requested

    # -- machinery ----------------------------------------------------------------------------

    def _collect_acks(self) -> None:
        self.sender.pump()  # answers from the store arrive through _on_settled

    def _on_settled(self, traj_id: str, stored: bool, reason: str) -> None:
        episode = self._awaiting_ack.pop(traj_id, None)
        if episode is None:
            return
        if stored:
            self._done.append(episode)
        else:
            self._failed.append([episode, f"store rejected the trajectory: {reason}"[:500]])

    # Syncs are pipelined: take() sends one and returns; its answer is picked up by a later
    # take() or idle(). A blocking round trip per generator iteration made the generator wait
    # for the coordinator process to be scheduled, each time, on a machine short of cores.

    def _sync_due(self, want: int) -> bool:
        now = time.monotonic()
        # Measured from when the empty sync was sent: a coordinator that held it while it found
        # no work (coordinator.sync_wait_s) has waited already, so ask again at once.
        quiet = now - self._sync_sent < (self.empty_backoff_s if self._last_empty else 0.0)
        nothing_to_say = not self._done and not self._failed and not self._released
        return not ((want <= 0 or quiet) and nothing_to_say and now - self._last_sync < self.idle_sync_s)

    def _start_sync(self, want: int) -> None:
        body = {
            "generator": self.name,
            "want": max(0, want),
            "done": self._done,
            "failed": self._failed,
            "released": self._released,
            "stats": self.stats(),
            "life": self.life,
        }
        # Reported once sent: a retry resends the same request, and the coordinator answers a
        # repeated id from its replay cache, so nothing is reported twice or lost.
        self._inflight = self.client.start("sync", body)
        self._sync_sent = time.monotonic()
        self._inflight_want = max(0, want)
        self._inflight_body = body
        self._done, self._failed, self._released = [], [], []

    def _poll_sync(self, wait_s: float | None) -> None:
        """Take the answer to the sync in flight if it arrives within `wait_s` (None: wait for it)."""
        if self._inflight is None:
            return
        reply = None
        try:
            while reply is None:
                reply = self._inflight.poll(3600.0 if wait_s is None else wait_s)
                if wait_s is not None:
                    break
        except RequestTimeout:
            # Never answered: what it reported is reported again by whoever syncs next.
            body, self._inflight = self._inflight_body, None
            self._done[:0], self._failed[:0], self._released[:0] = body["done"], body["failed"], body["released"]
            raise
        if reply is None:
            return
        self._inflight = None
        self._last_sync = time.monotonic()
        tickets = [ticket_from_row(r) for r in reply.body["tickets"]]
        self._ready.extend(tickets)
        self._last_empty = self._inflight_want > 0 and not tickets
        self.stop_requested = bool(reply.body.get("stop"))
        self.learner_version = reply.body.get("version")

    def sync(self, want: int) -> list[EpisodeTicket]:
        """One blocking round trip (after the one in flight, if any); returns every ticket at hand."""
        self._poll_sync(None)
        self._start_sync(want)
        self._poll_sync(None)
        tickets, self._ready = self._ready, []
        return tickets

    def finish(self, timeout_s: float = 60.0) -> bool:
        """Wait for the store to acknowledge what was sent, and report it; True if all was."""
        ok = self.sender.wait_acked(timeout_s)
        self._collect_acks()
        self._poll_sync(None)
        # Tickets that arrived after the generator stopped taking: back to the coordinator.
        self._released.extend(t.episode for t in self._ready)
        self._ready = []
        self.sync(0)
        return ok

    def close(self) -> None:
        self.client.close()


class ThreadLocalJudge:
    """A CodeJudge for a thread pool: each thread gets its own SandboxClient (ZeroMQ sockets are
    not thread-safe), threads spread over the servers round-robin."""

    def __init__(self, node, services: Sequence[str], limits=None):
        if not services:
            raise ValueError("ThreadLocalJudge: no sandbox services; start at least one sandbox server")
        self.node, self.services, self.limits = node, list(services), limits
        self._local = threading.local()
        self._next = itertools.count()
        self._lock = threading.Lock()

    def _judge(self):
        j = getattr(self._local, "judge", None)
        if j is None:
            from hpcrl.rl.domains import SandboxJudge
            from hpcrl.sandbox.client import SandboxClient

            with self._lock:
                service = self.services[next(self._next) % len(self.services)]
            j = self._local.judge = SandboxJudge(SandboxClient(self.node, service), self.limits)
        return j

    def judge_io(self, language, source, cases, stop_on_fail=False):
        return self._judge().judge_io(language, source, cases, stop_on_fail)

    def judge_function(self, program, entry_point, test, prelude=""):
        return self._judge().judge_function(program, entry_point, test, prelude)


class AnnouncedWeights:
    """`load_if_newer` for the generator: cheap when nothing changed. The learner's PUB/SUB
    announcement says when to look; the weight file in the run directory is checked anyway every
    `poll_s` (a restarted learner announces from a new address the subscriber finds only then)."""

    def __init__(self, store, node, poll_s: float = 2.0):
        self.store, self.node, self.poll_s = store, node, poll_s
        self._sub = None
        self._instance = None
        self._checked = 0.0
        self._announced = -1  # newest version announced so far

    def _subscriber(self):

        try:
            ep = read_endpoint(self.node.run_dir, "policy")
        except TransportError:
            return None
        if ep.instance != self._instance:
            if self._sub is not None:
                self._sub.sock.close(0)
            self._sub = VersionSubscriber(self.node, "policy")
            self._instance = ep.instance
        return self._sub

    def load_if_newer(self, model, have: int) -> int | None:
        now = time.monotonic()
        due = now - self._checked >= self.poll_s
        if due:
            self._checked = now
            self._subscriber()
        announced = self._sub.poll(0.0) if self._sub is not None else None
        if announced is not None:
            self._announced = max(self._announced, announced)
        # Announced but not loaded yet: the files may still be being written (or read on a
        # thread), so look again on every call until it is in; a stat each time.
        if self._announced > have or due or have < 0:
            return self.store.load_if_newer(model, have)
        return None
