"""The baseline policies of the simulator: `sync`, `sync-split`, `async` (the live run, `backfill`: backfill.py).

GPUs 0..L-1 are the learner's, L..L+G-1 one generator each. A generation turn runs on one
GPU at a time for the episode's drawn duration; a sandbox execution holds one CPU slot and
leaves the GPU free (the engine's model: an episode waiting on its sandbox occupies no GPU,
and its next turn may run on any GPU at no extra cost).

sync       -- the strongest synchronous design, on-policy, one phase after another. Every
              GPU (learner and generators alike) generates: the step's batch is one shared
              pool, and a GPU that frees up takes the oldest turn back from a sandbox, else the
              next new episode of the pool, so no GPU idles while any turn of the batch is
              ready to run (work-conserving list scheduling; episodes run to completion). New
              episodes start longest-expected first (the fit_quantile of their domain's past
              episode lengths, slurm/backfill/estimates.py), so the long ones that make the
              barrier wait start early; turns back from a sandbox come before new episodes. When
              the whole batch is done (barrier) all L+G GPUs train it, data-parallel:
              train_base_s + train_per_traj_s x batch x L / (L+G) seconds (per-trajectory work
              scales perfectly with the GPUs, the fixed part does not). Every rank then holds
              the new weights: no broadcast, only the reload into the inference engine
              (reload_s) before the next step's generation; the run ends when the last step
              has trained. It is non-clairvoyant like the others: it never sees a duration
              before the task ends.
sync-split -- the weaker synchronous baseline of a disaggregated cluster: the batch's episodes
              are sharded statically over the generators (episode i on generator i mod G), each
              generator serves whichever of its episodes has a turn ready; learner GPUs never
              generate and generators never train. When the whole batch is done the learner
              trains on it (generators idle), broadcasts the weights (everyone idle) and the
              generators reload them. A generator idles while all its episodes run in
              sandboxes, after its shard is done, and during training and sync.
async      -- generation decoupled from training: each generator keeps `episodes_in_flight`
              episodes of its own going and runs their turns as they come back from the
              sandboxes; the learner trains whenever a batch of fresh-enough trajectories is
              ready. New episodes start only while in-flight + ready < (max_staleness + 1) x
              batch (AReaL's bound), trajectories older than the bound are dropped. No packing:
              a generator whose episodes all wait on sandboxes idles, and so does a learner
              waiting for data.

With training.drop_stale false (`hpcrl sim --no-drop`), async and backfill drop nothing: every
episode is trained whatever its staleness (off-policy correction only), and every policy starts
exactly steps x batch_size episodes, so all of them train the same episodes 0..N-1.
"""

from __future__ import annotations

import heapq
from collections import deque

from hpcrl.slurm.backfill.estimates import DurationEstimator
from hpcrl.slurm.sim.engine import (
    DROPPED,
    OWNER,
    Episode,
    EventLoop,
    GpuLedger,
    SandboxPool,
    SimInvariantError,
    TrainingLedger,
)
from hpcrl.slurm.sim.trace import Trace, World

WAIT, TRAIN, SYNC = "wait", "train", "sync"


class SimBase:
    """GPUs, the event loop, task start/stop bookkeeping and the training side."""

    name = "base"

    def __init__(self, trace: Trace, world: World | None = None, keep_intervals: bool = False):
        self.trace = trace
        self.world = world or World(trace)
        c, t = trace.cluster, trace.training
        self.L, self.G = c.learner_gpus, c.generator_gpus
        self.learner_gpus = range(self.L)
        self.generator_gpus = range(self.L, self.L + self.G)
        self.loop = EventLoop()
        self.ledger = GpuLedger(["learner"] * self.L + ["generator"] * self.G, keep_intervals)
        self.roles = self.ledger.roles  # grows when a rollout job's GPU joins (backfill)
        # [owner, packed, lost] seconds per role, summed from task records, not from the ledger.
        self.tally = {"learner": [0.0, 0.0, 0.0], "generator": [0.0, 0.0, 0.0], "rollout": [0.0, 0.0, 0.0]}
        self.sandbox = SandboxPool(c.sandbox_slots, self.loop, self._sandbox_done)
        self.train = TrainingLedger(t.batch_size, self._staleness_bound(), drop=t.drop_stale)
        self.steps_done = 0
        self.end_time: float | None = None
        self.episodes: list[Episode] = []  # every episode started, in start order
        self.aborted = 0
        self.in_flight = 0  # started, neither complete nor dropped (async and backfill count them)
        # At most this many episodes are ever started (None: no cap): with drop_stale off,
        # exactly the steps' trajectories, so that every policy trains the same episodes.
        self.episode_cap = None if t.drop_stale else t.steps * t.batch_size
        self.train_gpu_s = 0.0  # GPU time of training steps, every training GPU counted
        self._train_gpus: range | list[int] = self.learner_gpus
        self._training = False
        n = self.L + self.G
        # (episode, start) of the generation turn each GPU runs
        self._run: list[tuple[Episode, float] | None] = [None] * n
        self._token = [0] * n
        self._train_start = 0.0

    def _staleness_bound(self) -> int:
        return self.trace.training.max_staleness

    # ---------------------------------------------------------------- lifecycle
    def run(self) -> SimBase:
        self.start()
        self.loop.run(lambda: self.end_time is not None)
        return self

    def start(self) -> None:
        raise NotImplementedError

    def finish(self, now: float) -> None:
        if self._training:
            raise SimInvariantError("the run ended while the learner was training")
        for g, run in enumerate(self._run):
            if run is not None:  # work cut off by the end of the run still occupied the GPU
                ep, start = run
                self.tally[self.roles[g]][0] += now - start
                ep.gpu_s += now - start  # busy time of an open episode
        self.ledger.finish(now)
        self.end_time = now

    @property
    def episodes_started(self) -> int:
        return len(self.episodes)

    def may_start_episode(self) -> bool:
        return self.episode_cap is None or len(self.episodes) < self.episode_cap

    def new_episode(self, version: int) -> Episode:
        if not self.may_start_episode():
            raise SimInvariantError(f"episode {len(self.episodes)} started beyond the cap of {self.episode_cap}")
        ep = Episode(self.world.episode(len(self.episodes)), version)
        self.episodes.append(ep)
        return ep

    def open_episodes(self) -> int:
        """Episodes that are neither trained nor dropped now: in flight, or waiting for a batch."""
        return self.in_flight + self.train.ready

    def weights_version(self) -> int:
        """The policy version a turn started now is generated with."""
        return self.train.version

    # ---------------------------------------------------------------- generation tasks
    def start_gen(self, g: int, ep: Episode, now: float) -> None:
        """Run ep's current turn on GPU g."""
        ep.newest = self.weights_version()
        self.ledger.begin(g, OWNER, now)
        self._token[g] += 1
        self._run[g] = (ep, now)
        self.loop.at(now + ep.gen_left, self._gen_event, (g, self._token[g]))

    def _gen_event(self, arg: tuple[int, int], now: float) -> None:
        g, token = arg
        if token != self._token[g]:
            return  # that run was stopped (its rollout job ended)
        ep, start = self._run[g]
        self._run[g] = None
        span = self.ledger.end(g, now)
        if span >= 0:
            ep.spans.append(span)
        self.tally[self.roles[g]][0] += now - start
        ep.gpu_s += now - start
        ep.gen_left = 0.0
        self.gen_done(g, ep, now)

    def gen_done(self, g: int, ep: Episode, now: float) -> None:
        raise NotImplementedError

    def _sandbox_done(self, ep: Episode, now: float) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- training
    def begin_train(self, now: float, gpus: range | list[int] | None = None, duration: float | None = None) -> None:
        """A training step on `gpus` (default: the learner's) for `duration` (default train_s)."""
        self._train_gpus = self.learner_gpus if gpus is None else gpus
        self._training = True
        for g in self._train_gpus:
            self.ledger.begin(g, OWNER, now)
        self._train_start = now
        self.loop.at(now + (self.trace.training.train_s if duration is None else duration), self._train_event)

    def _train_event(self, _: object, now: float) -> None:
        for g in self._train_gpus:
            self.ledger.end(g, now)
            self.tally[self.roles[g]][0] += now - self._train_start
        self.train_gpu_s += (now - self._train_start) * len(self._train_gpus)
        self._training = False
        self.train.version += 1
        self.steps_done += 1
        self.train_done(now)

    def train_done(self, now: float) -> None:
        raise NotImplementedError


class SyncSplitPolicy(SimBase):
    """Generate on the generators only -> train on the learner only, statically sharded (the
    weaker baseline; see the module docstring)."""

    name = "sync-split"

    def _staleness_bound(self) -> int:
        return 0  # every batch is generated by the weights it trains

    def start(self) -> None:
        self._begin_step(None, 0.0)

    def _begin_step(self, _: object, now: float) -> None:
        B = self.trace.training.batch_size
        self.ready = {g: deque() for g in self.generator_gpus}
        self.remaining = B
        for i in range(B):
            ep = self.new_episode(self.train.version)
            ep.owner = self.L + i % self.G  # static sharding; an episode stays on its generator
            self.ready[ep.owner].append(ep)
        for g in self.generator_gpus:
            self._next(g, now)

    def _next(self, g: int, now: float) -> None:
        if self._run[g] is None and self.ready[g]:
            self.start_gen(g, self.ready[g].popleft(), now)

    def gen_done(self, g: int, ep: Episode, now: float) -> None:
        self.sandbox.submit(ep, now)  # the GPU idles unless another of its episodes is ready
        self._next(g, now)

    def _sandbox_done(self, ep: Episode, now: float) -> None:
        ep.advance()
        if not ep.done:
            self.ready[ep.owner].append(ep)
            self._next(ep.owner, now)
            return
        self.train.add(ep)
        self.remaining -= 1
        if self.remaining:
            return  # the batch is not complete: finished generators wait (barrier)
        if self.train.take_batch() is None:
            raise SimInvariantError("sync-split: a finished batch is not a full batch")
        self.begin_train(now)

    def train_done(self, now: float) -> None:
        t = self.trace.training
        if self.steps_done == t.steps:
            self.loop.at(now + t.weight_sync_s, lambda _, when: self.finish(when))
        else:
            self.loop.at(now + t.weight_sync_s + t.reload_s, self._begin_step)


class SyncPolicy(SimBase):
    """Every GPU generates from one shared pool, then every GPU trains (see the module docstring)."""

    name = "sync"

    def _staleness_bound(self) -> int:
        return 0  # every batch is generated by the weights it trains

    def train_seconds(self) -> float:
        """One data-parallel step on all L+G GPUs: the per-trajectory part scales with them."""
        t = self.trace.training
        return t.train_base_s + t.train_per_traj_s * t.batch_size * self.L / (self.L + self.G)

    def start(self) -> None:
        s = self.trace.scheduler
        self.length_est = DurationEstimator(s.history, s.min_samples, s.prior_s)  # whole episodes, per domain
        self.idle = list(range(self.L + self.G))  # a heap: the lowest free GPU takes the next turn
        self.all_gpus = range(self.L + self.G)
        self._begin_step(None, 0.0)

    def _begin_step(self, _: object, now: float) -> None:
        batch = [self.new_episode(self.train.version) for _ in range(self.trace.training.batch_size)]
        self.pool = deque(self.start_order(batch))
        self.back: deque[Episode] = deque()  # turns back from their sandbox, oldest first
        self.remaining = len(self.pool)
        self._dispatch(now)

    def start_order(self, batch: list[Episode]) -> list[Episode]:
        """Longest expected first: the fit_quantile of the domain's past episode lengths."""
        q = self.trace.scheduler.fit_quantile
        return sorted(batch, key=lambda ep: (-self.length_est.quantile(ep.spec.domain, q), ep.index))

    def _dispatch(self, now: float) -> None:
        """Every free GPU takes a turn: one back from a sandbox first, else a new episode."""
        while self.idle and (self.back or self.pool):
            ep = self.back.popleft() if self.back else self.pool.popleft()
            self.start_gen(heapq.heappop(self.idle), ep, now)

    def gen_done(self, g: int, ep: Episode, now: float) -> None:
        heapq.heappush(self.idle, g)
        self.sandbox.submit(ep, now)  # the GPU is free for another episode's turn meanwhile
        self._dispatch(now)

    def _sandbox_done(self, ep: Episode, now: float) -> None:
        ep.advance()
        if not ep.done:
            self.back.append(ep)
            self._dispatch(now)
            return
        self.length_est.record(ep.spec.domain, ep.spec.length_s)  # known now that it has ended
        self.train.add(ep)
        self.remaining -= 1
        if self.remaining:
            return  # the batch is not complete: free GPUs wait (barrier)
        if self.train.take_batch() is None or len(self.idle) != self.L + self.G:
            raise SimInvariantError("sync: a finished batch is not a full batch, or a GPU is still generating")
        self.begin_train(now, self.all_gpus, self.train_seconds())

    def train_done(self, now: float) -> None:
        t = self.trace.training
        if self.steps_done == t.steps:
            self.finish(now)  # every rank holds the final weights
        else:
            self.loop.at(now + t.reload_s, self._begin_step)  # weights into the inference engine


class AsyncPolicy(SimBase):
    """Decoupled generation and training with a staleness bound, no packing."""

    name = "async"

    def __init__(self, trace: Trace, world: World | None = None, keep_intervals: bool = False):
        super().__init__(trace, world, keep_intervals)
        self.k = trace.training.episodes_in_flight
        self.own: dict[int, set[Episode]] = {g: set() for g in self.generator_gpus}
        # Turns of own episodes back from the sandbox (latency matters), and episodes the
        # generator took on but has not started.
        self.ready: dict[int, deque[Episode]] = {g: deque() for g in self.generator_gpus}
        self.fresh: dict[int, deque[Episode]] = {g: deque() for g in self.generator_gpus}
        self.reloading = {g: False for g in self.generator_gpus}
        self.reload_due = {g: False for g in self.generator_gpus}
        self.published = 0  # the weights version generators start new episodes with
        self.state = WAIT
        b = trace.training
        self.admit_limit = (b.max_staleness + 1) * b.batch_size

    def weights_version(self) -> int:
        # A generator reloads before its next turn whenever a version is published (gen_try).
        return self.published

    # ---------------------------------------------------------------- episodes
    def admission_ok(self) -> bool:
        return self.in_flight + self.train.ready < self.admit_limit and self.may_start_episode()

    def start(self) -> None:
        for g in self.generators():
            self.top_up(g, 0.0)
        self.learner_try(0.0)

    def generators(self) -> list[int]:
        """The GPUs that generate now (backfill: with its rollout jobs' GPUs)."""
        return list(self.generator_gpus)

    def acquire(self, g: int, now: float) -> Episode | None:
        """A new episode for generator g, if the staleness bound allows one."""
        if not self.admission_ok():
            return None
        self.in_flight += 1
        return self.new_episode(self.published)

    def refill(self, g: int, now: float) -> None:
        while len(self.own[g]) < self.k:
            ep = self.acquire(g, now)
            if ep is None:
                return
            ep.owner = g
            self.own[g].add(ep)
            self.fresh[g].append(ep)

    def top_up(self, g: int, now: float) -> None:
        self.refill(g, now)
        self.gen_try(g, now)

    def abort(self, ep: Episode) -> None:
        """Too stale to ever be trained on: stop spending resources on it."""
        ep.alive = False
        ep.fate = DROPPED
        self.in_flight -= 1
        self.aborted += 1
        if ep.owner >= 0:
            self.own[ep.owner].discard(ep)

    def gen_try(self, g: int, now: float) -> None:
        if self._run[g] is not None or self.reloading[g]:
            return
        if self.reload_due[g]:
            self.start_reload(g, now)
            return
        self.run_own(g, now)

    def run_own(self, g: int, now: float) -> bool:
        """Start g's next own turn (returning turns first); False when it has none."""
        ready, fresh = self.ready[g], self.fresh[g]
        while ready or fresh:
            ep = ready.popleft() if ready else fresh.popleft()
            if self.train.doomed(ep):
                self.abort(ep)
                self.refill(g, now)
                continue
            self.start_gen(g, ep, now)
            return True
        return False

    def start_reload(self, g: int, now: float) -> None:
        self.reload_due[g] = False
        self.reloading[g] = True
        self.loop.at(now + self.trace.training.reload_s, self._reload_done, g)

    def _reload_done(self, g: int, now: float) -> None:
        self.reloading[g] = False
        self.gen_try(g, now)

    def gen_done(self, g: int, ep: Episode, now: float) -> None:
        self.turn_generated(ep, now)
        self.gen_try(g, now)

    def turn_generated(self, ep: Episode, now: float) -> None:
        if self.train.doomed(ep):
            self.abort(ep)
            if ep.owner >= 0:
                self.refill(ep.owner, now)
            return
        self.send_to_sandbox(ep, now)

    def send_to_sandbox(self, ep: Episode, now: float) -> None:
        self.sandbox.submit(ep, now)

    def _sandbox_done(self, ep: Episode, now: float) -> None:
        ep.advance()
        if self.train.doomed(ep):
            self.abort(ep)
            if ep.owner >= 0:
                self.top_up(ep.owner, now)
            return
        if ep.done:
            self.complete(ep, now)
        else:
            self.turn_ready(ep, now)

    def turn_ready(self, ep: Episode, now: float) -> None:
        self.ready[ep.owner].append(ep)
        self.gen_try(ep.owner, now)

    def complete(self, ep: Episode, now: float) -> None:
        self.in_flight -= 1
        self.train.add(ep)
        if ep.owner >= 0:
            self.own[ep.owner].discard(ep)
            self.top_up(ep.owner, now)
        self.learner_try(now)

    # ---------------------------------------------------------------- learner
    def learner_try(self, now: float) -> None:
        if self.state != WAIT:
            return
        if self.train.take_batch() is None:
            return  # the learner waits for data
        self.state = TRAIN
        self.begin_train(now)
        # The batch left the ready set: the staleness bound admits new episodes again.
        for g in self.generators():
            self.top_up(g, now)

    def train_done(self, now: float) -> None:
        self.state = SYNC
        self.loop.at(now + self.trace.training.weight_sync_s, self._sync_done)

    def _sync_done(self, _: object, now: float) -> None:
        if self.steps_done == self.trace.training.steps:
            self.finish(now)
            return
        self.published = self.train.version
        self.state = WAIT
        for g in self.generators():
            self.reload_due[g] = True
            self.top_up(g, now)
        self.learner_try(now)
