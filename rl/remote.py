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
from typing import Callable, Sequence

from hpcrl.rl.coordinator import ticket_from_row
from hpcrl.rl.tasks import EpisodeTicket
from hpcrl.rl.trajectory import Trajectory

__all__ = ["RemoteTaskSource", "ThreadLocalJudge", "AnnouncedWeights"]

log = logging.getLogger("hpcrl.generator")


class RemoteTaskSource:
    def __init__(self, node, name: str, sender, stats: Callable[[], dict] = dict, *, timeout_s: float = 5.0,
                 idle_sync_s: float = 0.5, empty_backoff_s: float = 0.05):
        from hpcrl.jobs.transport_rpc import RequestClient

        self.name = name
        self.sender = sender
        # Episodes become done (or failed) when the store answers for their trajectory.
        sender.on_settled = self._on_settled
        self.stats = stats
        self.client = RequestClient(node, "coordinator", timeout_s=timeout_s, retries=3, discover_timeout_s=120.0)
        self.idle_sync_s, self.empty_backoff_s = idle_sync_s, empty_backoff_s
        self._awaiting_ack: dict[str, int] = {}  # trajectory id -> episode
        self._done: list[int] = []
        self._failed: list[list] = []
        self._released: list[int] = []
        self._last_sync = 0.0
        self._last_empty = False
        self.stop_requested = False
        self.learner_version: int | None = None

    # -- TaskSource -------------------------------------------------------------------------

    def take(self, n: int) -> Sequence[EpisodeTicket]:
        self._collect_acks()
        now = time.monotonic()
        quiet = now - self._last_sync < (self.empty_backoff_s if self._last_empty else 0.0)
        nothing_to_say = not self._done and not self._failed
        if (n <= 0 or quiet) and nothing_to_say and now - self._last_sync < self.idle_sync_s:
            return []
        return self.sync(n)

    def done(self, ticket: EpisodeTicket) -> None:
        pass  # reported when the store acknowledges the trajectory (see sink)

    def failed(self, ticket: EpisodeTicket, reason: str) -> None:
        self._failed.append([ticket.episode, reason[:500]])

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

    def sync(self, want: int) -> list[EpisodeTicket]:
        body = {"generator": self.name, "want": max(0, want), "done": self._done, "failed": self._failed,
                "released": self._released, "stats": self.stats()}
        reply = self.client.request("sync", body)
        self._done, self._failed, self._released = [], [], []
        self._last_sync = time.monotonic()
        tickets = [ticket_from_row(r) for r in reply.body["tickets"]]
        self._last_empty = want > 0 and not tickets
        self.stop_requested = bool(reply.body.get("stop"))
        self.learner_version = reply.body.get("version")
        return tickets

    def finish(self, timeout_s: float = 60.0) -> bool:
        """Wait for the store to acknowledge what was sent, and report it; True if all was."""
        ok = self.sender.wait_acked(timeout_s)
        self._collect_acks()
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

    def judge_io(self, language, source, cases):
        return self._judge().judge_io(language, source, cases)

    def judge_function(self, program, entry_point, test):
        return self._judge().judge_function(program, entry_point, test)


class AnnouncedWeights:
    """`load_if_newer` for the generator: cheap when nothing changed. The learner's PUB/SUB
    announcement says when to look; the weight file in the run directory is checked anyway every
    `poll_s` (a restarted learner announces from a new address the subscriber finds only then)."""

    def __init__(self, store, node, poll_s: float = 2.0):
        self.store, self.node, self.poll_s = store, node, poll_s
        self._sub = None
        self._instance = None
        self._checked = 0.0

    def _subscriber(self):
        from hpcrl.jobs.transport import TransportError, read_endpoint
        from hpcrl.jobs.transport_rpc import VersionSubscriber

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
        if (announced is not None and announced > have) or due or have < 0:
            return self.store.load_if_newer(model, have)
        return None
