"""The simulator's machinery: a discrete-event loop, GPU accounting, sandboxes, the training side.

The policies (slurm/sim/policies.py, slurm/sim/backfill.py) build on `SimBase`; this module
knows nothing about scheduling. Its job is to keep the books honest:

* `GpuLedger` holds every GPU's state at every instant: idle, or running its holder's work (a
  generation turn or a training step). The run's fixed GPUs are held for the whole run, a
  rollout job's GPU from its start to its end. A GPU runs one task at a time: starting a second
  raises. Work thrown away after it ran (an episode a rollout job handed back unfinished: it is
  run again from the start elsewhere) moves from busy to `lost`. `packed` (borrowed work) is
  always 0 now that no policy lends a GPU to another's task; it stays for the output's shape.
* Every task's run time is also tallied by the policy, separately from the ledger. At the end
  `check_conservation` demands, per role, owner + packed + lost (from the tallies) + idle
  (from the ledger) = the GPU time held. A double-booked GPU, a task counted twice or an
  interval never closed makes the run fail instead of reporting a flattering number.
* Every started episode ends the run in exactly one state (`Episode.fate`): trained, dropped
  (too stale to train on), or open (in flight, or complete and waiting for a batch).
  `check_work` demands that the busy GPU time is exactly training plus the generation time
  of the episodes, split by fate: busy = training + trained + dropped + open, so `useful`
  (training + trained) can never exceed busy and no GPU-second is claimed twice.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hpcrl.slurm.sim.trace import EpisodeSpec

IDLE, OWNER = 0, 1
KINDS = ("idle", "owner", "packed", "lost")  # accounting categories (packed: always 0, see the module doc)


class SimInvariantError(AssertionError):
    """The simulation broke one of its own rules (a bug, never a property of the trace)."""


class EventLoop:
    """Time-ordered callbacks; ties run in scheduling order, so runs are deterministic."""

    __slots__ = ("now", "_heap", "_seq", "events")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, object]] = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callable[[object, float], None], arg: object = None) -> None:
        if t < self.now:
            raise SimInvariantError(f"event scheduled in the past ({t} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def run(self, stop: Callable[[], bool]) -> None:
        heap = self._heap
        while heap and not stop():
            t, _, fn, arg = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(arg, t)
        if not stop():
            raise SimInvariantError("the simulation ran out of events before finishing its steps (a deadlock)")


class GpuLedger:
    """Per-GPU state over time; optionally keeps every interval for the utilization plot.

    GPUs 0..n-1 are held from time 0 to the end of the run; `add` holds one more from a time
    on (a rollout job's GPU), `release` gives it back. Capacity is the time each was held."""

    def __init__(self, roles: list[str], keep_intervals: bool = False):
        self.roles = roles
        n = len(roles)
        self.state = [IDLE] * n
        self.since = [0.0] * n
        self.totals = [[0.0] * len(KINDS) for _ in range(n)]
        self.held = [[0.0, math.nan] for _ in range(n)]  # [from, until] (until nan: still held)
        self.intervals: list[tuple[int, int, float, float]] | None = [] if keep_intervals else None

    def add(self, role: str, now: float) -> int:
        self.roles.append(role)
        self.state.append(IDLE)
        self.since.append(now)
        self.totals.append([0.0] * len(KINDS))
        self.held.append([now, math.nan])
        return len(self.roles) - 1

    def release(self, g: int, now: float) -> None:
        if self.state[g] != IDLE or not math.isnan(self.held[g][1]):
            raise SimInvariantError(f"GPU {g} ({self.roles[g]}) released while busy or not held at t={now:.3f}")
        self._close(g, 0, now)
        self.held[g][1] = now

    def held_s(self, g: int, end: float) -> float:
        start, until = self.held[g]
        return (end if math.isnan(until) else until) - start

    def move(self, g: int, seconds: float, spans: list[int], from_kind: int = 1, to_kind: int = 3) -> None:
        """Reclassify `seconds` of g's time (its intervals `spans`): work that was thrown away
        after it ran (an episode a rollout job handed back) is lost, not busy."""
        self.totals[g][from_kind] -= seconds
        self.totals[g][to_kind] += seconds
        if self.intervals is not None:
            for i in spans:
                gg, kind, a, b = self.intervals[i]
                self.intervals[i] = (gg, to_kind if kind == from_kind else kind, a, b)

    def _close(self, g: int, kind_index: int, now: float) -> int:
        start = self.since[g]
        self.totals[g][kind_index] += now - start
        index = -1
        if self.intervals is not None and now > start:
            index = len(self.intervals)
            self.intervals.append((g, kind_index, start, now))
        self.since[g] = now
        return index

    def begin(self, g: int, state: int, now: float) -> None:
        if self.state[g] != IDLE:
            raise SimInvariantError(f"GPU {g} ({self.roles[g]}) double-booked at t={now:.3f}")
        self._close(g, 0, now)
        self.state[g] = state

    def end(self, g: int, now: float) -> int:
        """g's task ended; the index of its interval (-1 when intervals are not kept)."""
        if self.state[g] == IDLE:
            raise SimInvariantError(f"GPU {g} ({self.roles[g]}) released while idle at t={now:.3f}")
        index = self._close(g, 1, now)
        self.state[g] = IDLE
        return index

    def finish(self, now: float) -> None:
        """Close every interval of the GPUs still held at the end of the run (work still running
        counts as busy)."""
        for g, state in enumerate(self.state):
            if math.isnan(self.held[g][1]):
                self._close(g, 0 if state == IDLE else 1, now)
                self.state[g] = IDLE


@dataclass(frozen=True)
class RoleUsage:
    role: str
    gpus: int
    capacity_s: float
    owner_s: float  # the GPUs' own work (training, generation turns)
    packed_s: float  # borrowed work (no policy lends a GPU any more: 0)
    lost_s: float  # generation of episodes handed back unfinished by a rollout job (run again elsewhere)
    idle_s: float

    @property
    def busy_s(self) -> float:
        return self.owner_s + self.packed_s

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.capacity_s if self.capacity_s else 0.0


def check_conservation(ledger: GpuLedger, tally: dict[str, list[float]], makespan: float) -> dict[str, RoleUsage]:
    """Busy time from task tallies + idle time from the ledger must equal capacity, per role."""
    usage = {}
    for role in tally:
        members = [g for g, r in enumerate(ledger.roles) if r == role]
        cap = math.fsum(ledger.held_s(g, makespan) for g in members)
        led = [sum(ledger.totals[g][k] for g in members) for k in range(len(KINDS))]
        owner, packed, lost = tally[role]
        idle = led[0]
        tol = 1e-6 * max(cap, 1.0)
        for name, from_tasks, from_ledger in (
            ("owner", owner, led[1]),
            ("packed", packed, led[2]),
            ("lost", lost, led[3]),
        ):
            if abs(from_tasks - from_ledger) > tol:
                raise SimInvariantError(
                    f"{role}: {name} time {from_tasks:.6f} s from tasks != {from_ledger:.6f} s on the GPUs"
                )
        if idle < -tol or abs(owner + packed + lost + idle - cap) > tol:
            raise SimInvariantError(
                f"{role}: GPU-time not conserved: busy {owner + packed:.3f} + lost {lost:.3f} + idle {idle:.3f} "
                f"!= capacity {cap:.3f}"
            )
        usage[role] = RoleUsage(role, len(members), cap, owner, packed, lost, idle)
    return usage


OPEN, TRAINED, DROPPED = "open", "trained", "dropped"  # an episode's fate at the end of the run


class Episode:
    """One episode in flight: which turn it is at, which policy version started it and which
    generated its latest turn (what its staleness is measured by, as the live learner does), who
    owns it."""

    __slots__ = (
        "spec",
        "version",
        "newest",
        "turn",
        "owner",
        "alive",
        "sbx_start",
        "gpu_s",
        "gen_left",
        "fate",
        "epoch",
        "spans",
    )

    def __init__(self, spec: EpisodeSpec, version: int):
        self.spec = spec
        self.epoch = 0  # bumped when a rollout job hands it back: its sandbox run in flight no longer counts
        self.spans: list[int] = []  # its generation intervals on the ledger (kept for a hand-back)
        self.fate = OPEN
        self.version = version
        self.newest = version  # the weights version of its latest generated turn
        self.turn = 0
        self.owner = -1  # generator GPU index, or -1 while no generator holds it
        self.alive = True
        self.sbx_start = math.nan
        self.gpu_s = 0.0  # GPU time of its generation runs (not preempted attempts; a cut-off one at the end)
        self.gen_left = spec.gen_s[0]  # generation still to do in the current turn

    @property
    def index(self) -> int:
        return self.spec.index

    def advance(self) -> None:
        """The current turn's sandbox run finished: on to the next turn."""
        self.turn += 1
        if self.turn < len(self.spec.gen_s):
            self.gen_left = self.spec.gen_s[self.turn]

    @property
    def done(self) -> bool:
        return self.turn >= len(self.spec.gen_s)


class SandboxPool:
    """`slots` concurrent executions, FIFO queue beyond that (the CPU partition)."""

    def __init__(self, slots: int, loop: EventLoop, on_done: Callable[[Episode, float], None]):
        self.free = slots
        self.loop = loop
        self.on_done = on_done
        self.queue: deque[Episode] = deque()
        self.busy_s = 0.0
        self.runs = 0

    def submit(self, ep: Episode, now: float) -> None:
        ep.sbx_start = math.nan
        if self.free:
            self._start((ep, ep.epoch), now)
        else:
            self.queue.append((ep, ep.epoch))

    def _start(self, item: tuple[Episode, int], now: float) -> None:
        ep, _ = item
        self.free -= 1
        self.runs += 1
        ep.sbx_start = now
        d = ep.spec.sandbox_s[ep.turn]
        self.busy_s += d
        self.loop.at(now + d, self._done, item)

    def _done(self, item: tuple[Episode, int], now: float) -> None:
        self.free += 1
        while self.queue:
            ep, epoch = self.queue.popleft()
            if ep.epoch == epoch:  # a handed-back episode's queued run is dropped
                self._start((ep, epoch), now)
                break
        ep, epoch = item
        if ep.epoch == epoch:  # a handed-back episode's result is not wanted any more
            self.on_done(ep, now)


class TrainingLedger:
    """Completed trajectories waiting for the learner; staleness is checked when a batch is taken.

    drop=True: a finished trajectory whose latest turn was generated more than `max_staleness`
    versions ago is dropped, the live learner's rule (by a group's newest action, so a long
    episode is not dropped for having started long ago); one still running is never dropped,
    since its next turn is generated with the weights of then.
    drop=False: none is ever dropped; every one is trained whatever its staleness (off-policy
    correction only), and the staleness counts grow as far as they need to.
    """

    def __init__(self, batch_size: int, max_staleness: int, drop: bool = True):
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.drop = drop
        self.version = 0
        self._ready: list[tuple[int, int, Episode]] = []
        self.consumed = 0
        self.dropped = 0
        self.staleness = [0] * (max_staleness + 1)

    @property
    def ready(self) -> int:
        return len(self._ready)

    def add(self, ep: Episode) -> None:
        heapq.heappush(self._ready, (ep.newest, ep.index, ep))  # the stalest first

    def fresh_ready(self) -> int:
        """Complete trajectories that a later batch may still contain."""
        return sum(1 for _, _, ep in self._ready if not self.doomed(ep))

    def doomed(self, ep: Episode) -> bool:
        """Finished, and its latest turn so old that no future batch may contain it (never, with
        drop=False)."""
        return self.drop and ep.done and ep.newest < self.version - self.max_staleness

    def take_batch(self) -> list[Episode] | None:
        """The stalest `batch_size` usable trajectories, dropping those too stale to train on."""
        ready = self._ready
        while ready and self.doomed(ready[0][2]):
            heapq.heappop(ready)[2].fate = DROPPED
            self.dropped += 1
        if len(ready) < self.batch_size:
            return None
        batch = [heapq.heappop(ready)[2] for _ in range(self.batch_size)]
        for ep in batch:
            age = self.version - ep.newest
            if age < 0 or (self.drop and age > self.max_staleness):
                raise SimInvariantError(f"episode {ep.index} trained at staleness {age} (bound {self.max_staleness})")
            if ep.fate != OPEN or not ep.done:
                raise SimInvariantError(f"episode {ep.index} trained while {ep.fate}, at turn {ep.turn}")
            while age >= len(self.staleness):
                self.staleness.append(0)
            self.staleness[age] += 1
            ep.fate = TRAINED
        self.consumed += len(batch)
        return batch


@dataclass(frozen=True)
class WorkSplit:
    """Busy GPU time by what it went into, seconds (busy = training + trained + dropped + open)."""

    training_s: float  # learner steps (on every GPU that trains)
    trained_s: float  # generation of the trajectories that were trained on
    dropped_s: float  # generation of episodes dropped as too stale
    open_s: float  # generation of episodes in flight or waiting for a batch when the run ended
    trained: int
    dropped: int
    open: int

    @property
    def useful_s(self) -> float:
        return self.training_s + self.trained_s


def check_work(episodes: list[Episode], busy_s: float, training_s: float, open_expected: int) -> WorkSplit:
    """Every started episode is trained, dropped or open, and their GPU time plus training is
    the busy time of the ledger (to rounding): no work is counted twice or lost from the books."""
    split = {OPEN: [0.0, 0], TRAINED: [0.0, 0], DROPPED: [0.0, 0]}
    for ep in episodes:
        entry = split.get(ep.fate)
        if entry is None:
            raise SimInvariantError(f"episode {ep.index} ended the run as {ep.fate!r}")
        if ep.fate == TRAINED and not ep.done:
            raise SimInvariantError(f"episode {ep.index} trained before its last turn")
        entry[0] += ep.gpu_s
        entry[1] += 1
    if split[OPEN][1] != open_expected:
        raise SimInvariantError(
            f"{split[OPEN][1]} episodes neither trained nor dropped, but {open_expected} in flight or waiting"
        )
    total = training_s + split[OPEN][0] + split[TRAINED][0] + split[DROPPED][0]
    if abs(total - busy_s) > 1e-6 * max(busy_s, 1.0):
        raise SimInvariantError(
            f"busy GPU time {busy_s:.3f} s != training {training_s:.3f} + episodes' generation "
            f"{total - training_s:.3f} s"
        )
    return WorkSplit(
        training_s,
        split[TRAINED][0],
        split[DROPPED][0],
        split[OPEN][0],
        split[TRAINED][1],
        split[DROPPED][1],
        split[OPEN][1],
    )


@dataclass(frozen=True)
class Lengths:
    """An episode-length distribution, seconds: count, mean, p99 (nearest rank), max."""

    n: int
    mean: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Lengths:
        if not values:
            return cls(0, 0.0, 0.0, 0.0)
        xs = sorted(values)
        n = len(xs)
        return cls(n, math.fsum(xs) / n, xs[min(n - 1, max(0, math.ceil(0.99 * n) - 1))], xs[-1])

    def to_json(self) -> dict:
        return {"n": self.n, "mean": self.mean, "p99": self.p99, "max": self.max}
