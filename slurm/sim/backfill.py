"""`backfill`, our policy in the simulator: async with the staleness bound, plus gap packing.

Everything async does, and every idle GPU window is lent out through the same `GapPacker`
the real components use (slurm/backfill/packer.py):

* a generator whose own episodes all wait on sandboxes lends its GPU until the earliest time
  one of them is expected back (`reclaim_quantile` of the remaining sandbox time, given how
  long it has run); when a turn comes back, the generator takes its GPU back at once,
  preempting the borrowed task (which is re-queued, never half-kept);
* the learner lends its GPUs while it waits for a batch (until the batch is expected to be
  full: the reclaim_quantile of a Gamma wait at the recent trajectory rate) and while it
  broadcasts weights (exact), and takes them back the instant a batch is ready;
* the borrowed work is *floating* episodes: when a window is free and nothing pending fits,
  a new episode starts (the staleness bound still caps episodes in flight, and the backlog
  stays at about one pending turn per GPU); a generator with room for another episode
  adopts the oldest floating one first, so long turns that fit no window still finish;
* a borrowed generation turn is divisible (min_chunk_s): it runs until its window's end and
  the rest resumes elsewhere, paying resume_s of re-prefill, as interruptible generation does.

Task estimates are the `fit_quantile` of the domain's recent generation times
(slurm/backfill/estimates.py): the scheduler never sees a task's true duration before it ends.
"""

from __future__ import annotations

import math
from collections import deque

from hpcrl.slurm.backfill.estimates import DurationEstimator, arrival_eta
from hpcrl.slurm.backfill.packer import GapPacker, Placement, RolloutTask
from hpcrl.slurm.sim.engine import BORROW, OWNER, Episode
from hpcrl.slurm.sim.policies import SYNC, AsyncPolicy
from hpcrl.slurm.sim.trace import Trace, World

# A free window whose end has passed is re-estimated, but at most this often (simulated s).
_MIN_REFRESH_S = 0.5


class BackfillPolicy(AsyncPolicy):
    name = "backfill"

    def __init__(self, trace: Trace, world: World | None = None, keep_intervals: bool = False):
        super().__init__(trace, world, keep_intervals)
        s = trace.scheduler
        self.fit_q = s.fit_quantile
        self.reclaim_q = s.reclaim_quantile
        self.min_chunk = s.min_chunk_s
        self.packer = GapPacker(margin_s=s.window_margin_s)
        self.gen_est = DurationEstimator(s.history, s.min_samples, s.prior_s)
        self.sbx_est = DurationEstimator(s.history, s.min_samples, s.prior_s)
        self.floating: dict[int, Episode] = {}
        self._recent: deque[float] = deque(maxlen=64)  # completion times, for the batch-ready estimate
        self._serial = [0] * (self.L + self.G)
        self._sync_end = 0.0

    # ---------------------------------------------------------------- packer plumbing
    def task_of(self, ep: Episode) -> RolloutTask:
        """The packer's view of ep's next generation: an estimate, never the true duration
        (slurm/backfill/estimates.py decides it, as for the live components)."""
        if ep.resumed:  # a turn already cut once: what is left of the domain's quantile
            done = ep.spec.gen_s[ep.turn] - ep.gen_left  # known: the chunks that ran
            est = self.gen_est.task_estimate(
                ep.spec.domain, self.fit_q, done_s=done, resume_s=self.trace.training.resume_s
            )
        else:
            est = self.gen_est.task_estimate(ep.spec.domain, self.fit_q)
        return RolloutTask(ep.index, ep.spec.domain, est, ep.version, ep.index, self.min_chunk)

    def place(self, p: Placement | None, now: float) -> None:
        if p is not None:
            self.start_gen(p.gpu, self.floating[p.task.episode], BORROW, now, p.budget_s)

    def reclaim(self, g: int, now: float) -> None:
        r = self.packer.close_window(g, now)
        if r.preempted is not None:
            self.preempt(g, now)
        self.place(r.replacement, now)

    def open_or_move(self, g: int, until: float, now: float) -> None:
        if self.packer.window_of(g) is None:
            self.place(self.packer.open_window(g, now, until), now)
        else:
            self.place(self.packer.move_window(g, now, until), now)
        self._serial[g] += 1
        if math.isfinite(until):
            self.loop.at(max(until, now + _MIN_REFRESH_S), self._refresh, (g, self._serial[g]))

    def _refresh(self, arg: tuple[int, int], now: float) -> None:
        g, serial = arg
        if serial != self._serial[g] or self.packer.window_of(g) is None or self._run[g] is not None:
            return  # superseded, closed, or busy (a finishing task re-estimates anyway)
        self.open_or_move(g, self.window_end(g, now), now)
        self.feed(now)

    def feed(self, now: float) -> None:
        """Free windows that nothing pending fits: start floating episodes for them.

        The backlog of pending borrowed turns is kept to about one per GPU: enough that a GPU
        freeing up has a candidate, few enough that a turn does not queue much longer than one
        task (every queued minute ages the episode towards the staleness bound and a drop).
        """
        budget = self.packer.free_windows
        while budget > 0 and self.packer.pending < self.L + self.G and self.admission_ok():
            budget -= 1
            ep = self.new_episode(self.published)
            self.in_flight += 1
            self.floating[ep.index] = ep
            self.place(self.packer.submit(self.task_of(ep), now), now)

    # ---------------------------------------------------------------- window estimates
    def window_end(self, g: int, now: float) -> float:
        return self.learner_eta(now) if g < self.L else self.owner_back(g, now)

    def owner_back(self, g: int, now: float) -> float:
        """When the first of g's own episodes is expected back from its sandbox."""
        waits = ((ep.spec.domain, None if math.isnan(ep.sbx_start) else ep.sbx_start) for ep in self.own[g])
        return self.sbx_est.next_return(now, waits, self.reclaim_q)

    def learner_eta(self, now: float) -> float:
        """When the learner's batch is expected full (exact while it broadcasts weights)."""
        if self.state == SYNC:
            return self._sync_end
        return arrival_eta(now, self._recent, self.trace.training.batch_size - self.train.ready, self.reclaim_q)

    # ---------------------------------------------------------------- generators
    def acquire(self, g: int, now: float) -> Episode | None:
        task = self.packer.pop_oldest()
        if task is not None:  # adopt a floating episode: its turns now run here, as own work
            return self.floating.pop(task.episode)
        return super().acquire(g, now)

    def abort(self, ep: Episode) -> None:
        super().abort(ep)
        if ep.owner < 0:
            self.floating.pop(ep.index, None)

    def gen_try(self, g: int, now: float) -> None:
        if self.reloading[g]:
            return
        run = self._run[g]
        if run is not None and run[2] == OWNER:
            return
        urgent = bool(self.ready[g])  # an own turn came back: it must not wait
        if run is not None:
            if not urgent:
                return  # new episodes and weight reloads wait for the borrowed task's end
            self.reclaim(g, now)
        elif self.packer.window_of(g) is not None:
            if not (urgent or self.fresh[g] or self.reload_due[g]):
                return
            self.reclaim(g, now)
        if self.reload_due[g]:
            self.start_reload(g, now)
            return
        if self.run_own(g, now):
            return
        self.open_or_move(g, self.owner_back(g, now), now)
        self.feed(now)

    def gen_done(self, g: int, ep: Episode, kind: int, now: float, turn_done: bool) -> None:
        if turn_done:  # the turn's total generation time is known only once it is complete
            self.gen_est.record(ep.spec.domain, ep.spec.gen_s[ep.turn])
        if kind == OWNER:
            super().gen_done(g, ep, kind, now, turn_done)
            return
        # A borrowed task completed: its episode moves on, the GPU goes back to lending or owner.
        if g >= self.L and (self.ready[g] or self.fresh[g] or self.reload_due[g]):
            self.packer.finish(g, now, close=True)
            self.gen_try(g, now)
        else:
            self.place(self.packer.finish(g, now, until=self.window_end(g, now)), now)
        if turn_done:
            self.turn_generated(ep, now)
        else:  # cut at the window's budget: the rest of the turn goes back to the pool
            self.turn_ready(ep, now)
        self.feed(now)

    def turn_ready(self, ep: Episode, now: float) -> None:
        if ep.owner >= 0:
            super().turn_ready(ep, now)
        else:
            self.place(self.packer.submit(self.task_of(ep), now), now)
            self.feed(now)

    def _sandbox_done(self, ep: Episode, now: float) -> None:
        self.sbx_est.record(ep.spec.domain, ep.spec.sandbox_s[ep.turn])
        super()._sandbox_done(ep, now)

    def complete(self, ep: Episode, now: float) -> None:
        self.floating.pop(ep.index, None)
        self._recent.append(now)
        super().complete(ep, now)

    # ---------------------------------------------------------------- learner
    def learner_waiting(self, now: float) -> None:
        until = self.learner_eta(now)
        for g in self.learner_gpus:
            self.open_or_move(g, until, now)
        self.feed(now)

    def learner_reclaim(self, now: float) -> None:
        for g in self.learner_gpus:
            if self.packer.window_of(g) is not None:
                self.reclaim(g, now)

    def train_done(self, now: float) -> None:
        # Pending turns of episodes that can no longer be trained on are withdrawn, not run.
        if self.train.drop:
            for task in self.packer.withdraw_older_than(self.train.version - self.train.max_staleness):
                self.abort(self.floating[task.episode])
        self._sync_end = now + self.trace.training.weight_sync_s
        super().train_done(now)

    def learner_syncing(self, now: float) -> None:
        for g in self.learner_gpus:
            self.open_or_move(g, self._sync_end, now)
        self.feed(now)
