"""Several experiments' generators on shared GPUs, against the same GPUs split between them.

    result = compare([trace_a, trace_b], efficiency=0.9)      # `hpcrl sim --experiments A B --json`
    print(format_comparison(result))

The live way to share is Slurm's GRES shards: a generator asks for a share of a GPU
(`slurm.generator.gpu_shards`, --gres=shard:N) instead of a whole one, so generators of several
experiments run on the same GPUs, and while one waits on its sandboxes another's decodes. Here:

* **split**: experiment i runs its G_i generators on G_i GPUs of its own, one generator per GPU,
  each keeping `episodes_in_flight` (k_i) episodes open.
* **shared**: the same sum of GPUs is one pool; experiment i runs N x G_i generators of 1/N GPU
  each (N experiments), so every GPU holds N generators, of different experiments where the
  counts allow. A generator's memory is its share, so the experiment's k_i x G_i episodes in
  flight are spread over its N x G_i generators: it keeps the episodes in flight it had.
* **contention**: a GPU runs the turns of its generators by processor sharing. With m turns
  decoding at once, each advances at efficiency(m) / m of its speed alone, efficiency(1) = 1
  and efficiency(m > 1) = `efficiency` (time-slicing and cache pressure between processes;
  0.9 by default, an assumption, not a measurement). A generator waiting on sandboxes or on
  new weights takes nothing from the others. Memory bandwidth, KV-cache capacity and weights'
  copies are not modelled beyond the smaller share of episodes.
* Every experiment is the live run as policy backfill simulates it without rollout jobs:
  the coordinator's flow control, lending (`lend_episodes`), the staleness bound, its own
  learner GPUs (never shared) and its own sandbox slots.

Both run for the same simulated time (the shortest run's time to its last step in split, or
`hours`); `busy` is GPU time spent on the experiment's work (training, and its share of the
GPUs its generators ran on) over its GPUs (learner + generators) x that time, and
`trajectories_per_gpu_h` the trajectories it completed in that time (trained, or complete and
fresh enough to be: not a whole batch's step at the horizon) per GPU-hour of its GPUs.
Shared, an experiment's busy can exceed 100%: its generators decoded in GPU time the others
left idle. The totals are over all GPUs and never do.
"""

from __future__ import annotations

import math
from collections import deque

from hpcrl.slurm.backfill.lending import episodes_to_take
from hpcrl.slurm.sim.backfill import coordinator_max_ahead
from hpcrl.slurm.sim.engine import Episode, EventLoop, SandboxPool, TrainingLedger
from hpcrl.slurm.sim.replay import SimInputError
from hpcrl.slurm.sim.trace import Trace, World

__all__ = ["compare", "format_comparison"]


class _Gpu:
    """One GPU shared by processor sharing among the turns its generators decode."""

    __slots__ = ("loop", "eff", "active", "last", "busy_s")

    def __init__(self, loop: EventLoop, efficiency: float):
        self.loop, self.eff = loop, efficiency
        self.active: dict[_Gen, list] = {}  # generator -> [episode, work left (s alone), token]
        self.last = 0.0
        self.busy_s = 0.0

    def rate(self) -> float:
        m = len(self.active)
        return (1.0 if m == 1 else self.eff) / m

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt > 0 and self.active:
            m, rate = len(self.active), self.rate()
            for gen, run in self.active.items():
                run[1] -= dt * rate
                gen.exp.gen_gpu_s += dt / m  # its share of the GPU's time
            self.busy_s += dt
        self.last = now

    def start(self, gen: _Gen, ep: Episode, now: float) -> None:
        self.advance(now)
        self.active[gen] = [ep, ep.gen_left, 0]
        self._reschedule(now)

    def _reschedule(self, now: float) -> None:
        rate = self.rate() if self.active else 1.0
        for gen, run in self.active.items():
            run[2] += 1
            self.loop.at(now + max(run[1], 0.0) / rate, self._done, (gen, run[2]))

    def _done(self, arg, now: float) -> None:
        gen, token = arg
        run = self.active.get(gen)
        if run is None or run[2] != token:
            return
        self.advance(now)
        del self.active[gen]
        self._reschedule(now)
        gen.turn = None
        gen.exp.turn_done(gen, run[0], now)


class _Gen:
    __slots__ = ("exp", "gpu", "k", "own", "ready", "fresh", "waiting", "reloading", "reload_due", "turn")

    def __init__(self, exp: _Exp, gpu: _Gpu, k: int):
        self.exp, self.gpu, self.k = exp, gpu, k
        self.own: set[Episode] = set()
        self.ready: deque[Episode] = deque()
        self.fresh: deque[Episode] = deque()
        self.waiting = 0
        self.reloading = self.reload_due = False
        self.turn: Episode | None = None


class _Exp:
    """One experiment's run: its learner, generators, sandboxes and flow control."""

    def __init__(self, trace: Trace, loop: EventLoop, steps: int | None):
        t = trace.training
        self.trace, self.loop, self.t = trace, loop, t
        self.world = World(trace)
        self.steps = steps  # None: never finishes (measured at the horizon)
        self.train = TrainingLedger(t.batch_size, t.max_staleness, drop=t.drop_stale)
        self.sandbox = SandboxPool(trace.cluster.sandbox_slots, loop, self._sandbox_done)
        self.max_ahead = coordinator_max_ahead(t.max_staleness, t.batch_size)
        self.gens: list[_Gen] = []
        self.in_flight = self.started = 0
        self.published = 0
        self.training = self.syncing = False
        self.train_start = 0.0
        self.train_gpu_s = self.gen_gpu_s = 0.0
        self.finished_at: float | None = None
        self.waits: dict[int, _Gen] = {}  # episode in a sandbox step -> its generator

    def start(self, now: float) -> None:
        for g in self.gens:
            self.top_up(g, now)

    def acquire(self) -> Episode | None:
        if self.in_flight + self.train.ready >= self.max_ahead:
            return None
        ep = Episode(self.world.episode(self.started), self.published)
        self.started += 1
        self.in_flight += 1
        return ep

    def refill(self, g: _Gen) -> None:
        for _ in range(episodes_to_take(g.k, len(g.own), g.waiting, self.t.lend_episodes)):
            ep = self.acquire()
            if ep is None:
                return
            g.own.add(ep)
            g.fresh.append(ep)

    def top_up(self, g: _Gen, now: float) -> None:
        self.refill(g)
        self.gen_try(g, now)

    def gen_try(self, g: _Gen, now: float) -> None:
        if g.turn is not None or g.reloading or self.finished_at is not None:
            return
        if g.reload_due:
            g.reload_due, g.reloading = False, True
            self.loop.at(now + self.t.reload_s, self._reloaded, g)
            return
        while g.ready or g.fresh:
            ep = g.ready.popleft() if g.ready else g.fresh.popleft()
            if self.train.doomed(ep):
                self._abort(g, ep)
                self.refill(g)
                continue
            g.turn = ep
            ep.newest = self.published  # reloaded above whenever a version was published
            g.gpu.start(g, ep, now)
            return

    def _reloaded(self, g: _Gen, now: float) -> None:
        g.reloading = False
        self.gen_try(g, now)

    def _abort(self, g: _Gen, ep: Episode) -> None:
        ep.alive = False
        self.in_flight -= 1
        g.own.discard(ep)

    def turn_done(self, g: _Gen, ep: Episode, now: float) -> None:
        if self.train.doomed(ep):
            self._abort(g, ep)
            self.refill(g)
        else:
            g.waiting += 1
            self.waits[ep.index] = g
            self.sandbox.submit(ep, now)
            if self.t.lend_episodes:
                self.refill(g)
        self.gen_try(g, now)

    def _sandbox_done(self, ep: Episode, now: float) -> None:
        g = self.waits.pop(ep.index)
        g.waiting -= 1
        ep.advance()
        if self.train.doomed(ep):
            self._abort(g, ep)
            self.top_up(g, now)
        elif ep.done:
            self.in_flight -= 1
            self.train.add(ep)
            g.own.discard(ep)
            self.top_up(g, now)
            self.learner_try(now)
        else:
            g.ready.append(ep)
            self.gen_try(g, now)

    def learner_try(self, now: float) -> None:
        if self.training or self.syncing or self.finished_at is not None or self.train.take_batch() is None:
            return
        self.training, self.train_start = True, now
        self.loop.at(now + self.t.train_s, self._trained)
        for g in self.gens:  # the batch left the ready set: flow control has room again
            self.top_up(g, now)

    def _trained(self, _: object, now: float) -> None:
        self.train_gpu_s += (now - self.train_start) * self.trace.cluster.learner_gpus
        self.training = False
        self.train.version += 1
        if self.steps is not None and self.train.version >= self.steps:
            self.finished_at = now
            return
        self.syncing = True
        self.loop.at(now + self.t.weight_sync_s, self._synced)

    def _synced(self, _: object, now: float) -> None:
        self.syncing = False
        self.published = self.train.version
        for g in self.gens:
            g.reload_due = True
            self.top_up(g, now)
        self.learner_try(now)

    def measure(self, now: float) -> dict:
        gpus = self.trace.cluster.learner_gpus + self.trace.cluster.generator_gpus
        train = self.train_gpu_s + ((now - self.train_start) * self.trace.cluster.learner_gpus if self.training else 0)
        cap_h = gpus * now / 3600.0
        # Trained, or complete and fresh enough to be: else a batch's step at the horizon would
        # decide the count.
        done = self.train.consumed + self.train.fresh_ready()
        return {
            "busy": (train + self.gen_gpu_s) / (gpus * now),
            "trajectories_per_gpu_h": done / cap_h,
            "trained": done,
            "gpus": gpus,
            "busy_gpu_h": (train + self.gen_gpu_s) / 3600.0,
        }


def _placement(traces: list[Trace], shared: bool) -> list[list[int]]:
    """For each pool GPU, the experiments whose generators it holds (one each, per slot)."""
    if not shared:
        return [[i] for i, t in enumerate(traces) for _ in range(t.cluster.generator_gpus)]
    n = len(traces)
    left = [n * t.cluster.generator_gpus for t in traces]
    out = []
    for _ in range(sum(t.cluster.generator_gpus for t in traces)):
        slots: list[int] = []
        for _ in range(n):
            order = sorted(range(n), key=lambda i: (left[i] <= 0, i in slots, -left[i], i))
            i = order[0]
            slots.append(i)
            left[i] -= 1
        out.append(slots)
    return out


def _rows(trace: Trace, n: int) -> list[int]:
    """Episodes in flight of each of the experiment's n x G generators: its k x G spread evenly."""
    gens, total = n * trace.cluster.generator_gpus, trace.training.episodes_in_flight * trace.cluster.generator_gpus
    return [total // gens + (1 if j < total % gens else 0) for j in range(gens)]


def _run(traces: list[Trace], shared: bool, efficiency: float, horizon: float | None):
    """Run the experiments together; until `horizon`, or (None) until the first has trained its steps."""
    loop = EventLoop()
    exps = [_Exp(t, loop, None if horizon is not None else t.training.steps) for t in traces]
    n = len(traces) if shared else 1
    rows = [iter(_rows(t, n)) for t in traces]
    gpus = []
    for slots in _placement(traces, shared):
        gpu = _Gpu(loop, efficiency)
        gpus.append(gpu)
        for i in slots:
            k = next(rows[i])
            if k > 0:  # fewer episodes than generator shares: the rest of its shares stay empty
                exps[i].gens.append(_Gen(exps[i], gpu, k))
    for e in exps:
        e.start(0.0)
        e.learner_try(0.0)
    if horizon is not None:
        loop.at(horizon, lambda _, now: None)
        loop.run(lambda: loop.now >= horizon)
    else:
        loop.run(lambda: any(e.finished_at is not None for e in exps))
    end = loop.now
    for gpu in gpus:
        gpu.advance(end)
    return end, [e.measure(end) for e in exps], sum(g.busy_s for g in gpus) / (len(gpus) * end)


def compare(traces: list[Trace], efficiency: float = 0.9, hours: float | None = None) -> dict:
    """Shared against split, side by side (see the module doc); JSON-able."""
    if len(traces) < 2:
        raise SimInputError("--experiments needs at least two traces")
    if not 0 < efficiency <= 1:
        raise SimInputError(f"--share-efficiency must be in (0, 1] (got {efficiency})")
    names = [t.name for t in traces]
    if len(set(names)) != len(names):
        raise SimInputError(f"--experiments: two traces are named alike ({', '.join(names)}); give each its own name")
    horizon = hours * 3600.0 if hours is not None else None
    if horizon is not None and not horizon > 0:
        raise SimInputError(f"--hours must be > 0 (got {hours})")
    end, split, split_pool = _run(traces, False, efficiency, horizon)
    _, shared, shared_pool = _run(traces, True, efficiency, end)
    n = len(traces)

    def total(rows):
        gpus = sum(r["gpus"] for r in rows)
        return {
            "busy": sum(r["busy_gpu_h"] for r in rows) / (gpus * end / 3600.0),
            "trajectories_per_gpu_h": sum(r["trained"] for r in rows) / (gpus * end / 3600.0),
            "trained": sum(r["trained"] for r in rows),
            "gpus": gpus,
        }

    return {
        "horizon_s": end,
        "model": {
            "efficiency": efficiency,
            "generators_per_gpu": {"split": 1, "shared": n},
            # per experiment, split and shared alike
            "episodes_in_flight": {t.name: t.training.episodes_in_flight * t.cluster.generator_gpus for t in traces},
        },
        "experiments": [
            {"trace": t.name, "gpus": s["gpus"], "shared": _pick(sh), "split": _pick(s)}
            for t, s, sh in zip(traces, split, shared)
        ],
        "total": {"shared": _pick(total(shared)), "split": _pick(total(split))},
        "generator_pool_busy": {"shared": shared_pool, "split": split_pool},
    }


def _pick(row: dict) -> dict:
    return {"busy": row["busy"], "trajectories_per_gpu_h": row["trajectories_per_gpu_h"], "trained": row["trained"]}


def format_comparison(result: dict) -> str:
    head = (
        f"{'experiment':<20} {'GPUs':>5} {'busy split':>10} {'shared':>7} {'traj/GPU-h split':>16} {'shared':>7} "
        f"{'ratio':>6}"
    )
    lines = [
        f"{len(result['experiments'])} experiments for {result['horizon_s'] / 3600:.2f} simulated hours; shared: "
        f"{result['model']['generators_per_gpu']['shared']} generators per GPU, efficiency "
        f"{result['model']['efficiency']:g} when they decode at once",
        head,
        "-" * len(head),
    ]
    rows = [(e["trace"], e["gpus"], e["split"], e["shared"]) for e in result["experiments"]]
    rows.append(
        ("total", sum(e["gpus"] for e in result["experiments"]), *(result["total"][k] for k in ("split", "shared")))
    )
    for name, gpus, s, sh in rows:
        ratio = sh["trajectories_per_gpu_h"] / s["trajectories_per_gpu_h"] if s["trajectories_per_gpu_h"] else math.nan
        lines.append(
            f"{name:<20} {gpus:>5} {s['busy']:>10.1%} {sh['busy']:>7.1%} {s['trajectories_per_gpu_h']:>16.2f} "
            f"{sh['trajectories_per_gpu_h']:>7.2f} {ratio:>5.2f}x"
        )
    pool = result["generator_pool_busy"]
    lines.append(
        f"generator GPUs busy: split {pool['split']:.1%}, shared {pool['shared']:.1%} (an experiment's busy over "
        "100% used GPU time the others left idle)"
    )
    return "\n".join(lines)
