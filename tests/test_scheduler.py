"""The gap packer (slurm/backfill/packer.py) and the duration estimates (slurm/backfill/estimates.py).

Properties: packing never delays an owner and never puts two tasks on one GPU; tasks fit
their windows by their (rounded-up) estimates; oldest policy version goes first; a preempted
task is re-issued with its old priority; stale tasks can be withdrawn. The indexed packer
must answer exactly like the linear-scan reference on random operation sequences.
"""

from __future__ import annotations

import heapq
import math
import random

import pytest

from hpcrl.slurm.backfill.estimates import DurationEstimator
from hpcrl.slurm.backfill.packer import GapPacker, RolloutTask, fit_length

from packer_ref import ReferencePacker


def task(i: int, est: float, version: int = 0, chunk: float = 0.0) -> RolloutTask:
    return RolloutTask(i, f"d{i % 7}", est, version, episode=i, min_chunk_s=chunk)


# ------------------------------------------------------------------------------ basics
def test_fit_length_rounds_up_by_less_than_a_fifth():
    for est in (0.01, 0.5, 1.0, 3.3, 60.0, 1234.5, 86400.0):
        f = fit_length(est)
        assert est <= f < est * 2**0.25 * 1.000001
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="finite number of seconds"):
            fit_length(bad)


def test_task_waits_for_a_window_that_fits_it():
    p = GapPacker()
    assert p.submit(task(1, 10.0), now=0.0) is None
    assert p.open_window("g0", now=1.0, until=8.0) is None  # 7 s: too short for a 10 s task
    assert p.pending == 1 and p.free_windows == 1
    placed = p.open_window("g1", now=2.0, until=30.0)
    assert placed is not None and placed.gpu == "g1" and placed.task.task_id == 1
    assert placed.deadline == 30.0 and placed.budget_s == pytest.approx(28.0)
    assert p.pending == 0 and p.running == 1


def test_margin_is_kept_free_at_the_window_end():
    p = GapPacker(margin_s=5.0)
    p.open_window("g", 0.0, until=fit_length(10.0) + 4.0)
    assert p.submit(task(1, 10.0), 0.0) is None  # fits the window only without the margin
    p2 = GapPacker(margin_s=5.0)
    p2.open_window("g", 0.0, until=fit_length(10.0) + 5.0)
    assert p2.submit(task(1, 10.0), 0.0).budget_s == pytest.approx(fit_length(10.0))


def test_oldest_version_first_then_submission_order():
    p = GapPacker()
    for i, v in enumerate([3, 1, 2, 1]):
        p.submit(task(i, 5.0, version=v), 0.0)
    order = []
    for n in range(4):
        order.append(p.open_window(f"g{n}", 0.0, 100.0).task.task_id)
    assert order == [1, 3, 2, 0]


def test_arriving_task_takes_the_tightest_window_that_fits():
    p = GapPacker()
    p.open_window("long", 0.0, 500.0)
    p.open_window("short", 0.0, 12.0)
    p.open_window("mid", 0.0, 40.0)
    assert p.submit(task(1, 20.0), 0.0).gpu == "mid"
    assert p.submit(task(2, 5.0), 0.0).gpu == "short"
    assert p.submit(task(3, 5.0), 0.0).gpu == "long"


def test_divisible_task_fits_any_window_of_its_minimum_chunk():
    p = GapPacker()
    assert p.submit(task(1, 300.0, chunk=8.0), 0.0) is None
    assert p.open_window("g", 0.0, 5.0) is None  # shorter than a chunk
    placed = p.open_window("h", 0.0, 20.0)
    assert placed.task.task_id == 1 and placed.budget_s == pytest.approx(20.0)


def test_owner_reclaims_at_once_and_the_preempted_task_is_reissued_first():
    p = GapPacker()
    p.open_window("g", 0.0, 100.0)
    first = p.submit(task(1, 30.0, version=0), 0.0)
    p.submit(task(2, 30.0, version=0), 1.0)  # pending: the only window is taken
    r = p.close_window("g", now=12.0)  # the owner is back early
    assert r.preempted.task == first.task and r.preempted.ran_s == pytest.approx(12.0)
    assert r.replacement is None and p.pending == 2 and p.running == 0
    # Re-issued with its original priority: it runs before task 2, which came later.
    assert p.open_window("h", 13.0, 200.0).task.task_id == 1


def test_finish_refills_updates_the_estimate_or_hands_back():
    p = GapPacker()
    p.open_window("g", 0.0, 100.0)
    p.submit(task(1, 10.0), 0.0)
    p.submit(task(2, 10.0), 0.0)
    assert p.finish("g", 10.0).task.task_id == 2
    assert p.finish("g", 20.0, until=25.0) is None  # the owner now expects to be back at 25
    assert p.window_of("g") == 25.0 and p.free_windows == 1
    p.submit(task(3, 1.0), 21.0)
    assert p.finish("g", 22.0, close=True) is None
    assert p.window_of("g") is None and p.free_windows == 0
    with pytest.raises(ValueError, match="no open window"):
        p.close_window("g", 23.0)


def test_move_window_refits_a_free_gpu_but_never_preempts():
    p = GapPacker()
    p.open_window("g", 0.0, 5.0)
    p.submit(task(1, 20.0), 0.0)
    assert p.move_window("g", 1.0, 50.0).task.task_id == 1
    assert p.move_window("g", 2.0, 3.0) is None and p.running == 1  # shrinking keeps the task
    assert p.close_window("g", 4.0).preempted.task.task_id == 1


def test_withdraw_older_than_removes_exactly_the_stale_tasks():
    p = GapPacker()
    for i in range(40):
        p.submit(task(i, 1.0 + i % 9 * 7.0, version=i % 5), 0.0)
    gone = p.withdraw_older_than(2)
    assert sorted(t.task_id for t in gone) == [i for i in range(40) if i % 5 < 2]
    assert p.pending == 40 - len(gone)
    while (t := p.pop_oldest()) is not None:
        assert t.version >= 2
    assert p.withdraw(3) is None


def test_pop_oldest_takes_any_size():
    p = GapPacker()
    p.submit(task(1, 500.0, version=1), 0.0)
    p.submit(task(2, 1.0, version=0), 0.0)
    p.submit(task(3, 2000.0, version=0), 0.0)
    assert [p.pop_oldest().task_id for _ in range(3)] == [2, 3, 1]
    assert p.pop_oldest() is None


def test_misuse_is_refused_with_a_clear_message():
    p = GapPacker()
    p.open_window("g", 0.0, 10.0)
    with pytest.raises(ValueError, match="already has an open window"):
        p.open_window("g", 0.0, 10.0)
    with pytest.raises(ValueError, match="ends .* before now"):
        p.open_window("h", 5.0, 4.0)
    with pytest.raises(ValueError, match="no borrowed task runs"):
        p.finish("g", 1.0)
    p.submit(task(1, 100.0), 0.0)
    with pytest.raises(ValueError, match="already pending or running"):
        p.submit(task(1, 100.0), 0.0)
    with pytest.raises(ValueError, match="margin_s"):
        GapPacker(margin_s=-1)


# ------------------------------------------------------------------------------ properties
def _owner_timeline(rng: random.Random, horizon: float) -> list[tuple[float, float]]:
    """Alternating idle windows (start, end) of one owner: busy, idle, busy, ..."""
    t, out = 0.0, []
    while t < horizon:
        t += rng.expovariate(1 / 20.0)  # owner busy
        idle = rng.lognormvariate(math.log(15.0), 1.0)
        out.append((t, t + idle))
        t += idle
    return out


@pytest.mark.parametrize("seed", range(6))
def test_packing_never_delays_the_owner_nor_double_books(seed):
    """Owners follow fixed timelines; their windows' ends are *estimates* that are sometimes
    wrong both ways, and tasks sometimes outlive their estimates. Whatever happens, each
    owner gets its GPU back exactly when its timeline says, and no GPU ever runs two tasks."""
    rng = random.Random(seed)
    n_gpus, horizon = 12, 2000.0
    packer = GapPacker(margin_s=0.5)
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t, kind, arg):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, arg))

    truth: dict[int, float] = {}
    for g in range(n_gpus):
        for start, end in _owner_timeline(rng, horizon):
            guess = start + (end - start) * rng.uniform(0.5, 1.5)  # the owner's estimate is off
            push(start, "open", (g, guess))
            push(end, "close", g)
    for i in range(400):
        est = rng.lognormvariate(math.log(4.0), 0.8)
        truth[i] = est * rng.choice([0.3, 0.8, 1.0, 1.6])  # a quarter overrun their estimate
        push(rng.uniform(0, horizon), "submit", task(i, est, version=rng.randrange(4)))

    running: dict[int, tuple[int, float, int]] = {}  # gpu -> (task id, start, run token)
    owner_busy_from: dict[int, float] = {}
    done: dict[int, int] = {}
    tokens = 0

    def start(p):
        nonlocal tokens
        if p is None:
            return
        assert p.gpu not in running, "two tasks on one GPU"
        assert p.gpu not in owner_busy_from, "a task on a GPU its owner is using"
        assert p.start + fit_length(p.task.est_s) + 0.5 <= p.deadline + 1e-9, "placed into a window it does not fit"
        tokens += 1
        running[p.gpu] = (p.task.task_id, p.start, tokens)
        push(p.start + truth[p.task.task_id], "done", (p.gpu, tokens))

    for g in range(n_gpus):
        owner_busy_from[g] = 0.0
    while events:
        now, _, kind, arg = heapq.heappop(events)
        if kind == "open":
            g, guess = arg
            del owner_busy_from[g]
            start(packer.open_window(g, now, max(guess, now)))
        elif kind == "close":
            reclaim = packer.close_window(arg, now)
            if reclaim.preempted is not None:
                tid, began, _ = running.pop(arg)
                assert reclaim.preempted.task.task_id == tid and reclaim.preempted.started == began
            assert arg not in running, "the owner got its GPU back while a borrowed task still ran"
            owner_busy_from[arg] = now
            start(reclaim.replacement)
        elif kind == "submit":
            start(packer.submit(arg, now))
        else:
            g, token = arg
            if g in running and running[g][2] == token:
                tid, began, _ = running.pop(g)
                done[tid] = done.get(tid, 0) + 1
                start(packer.finish(g, now))
    assert all(c == 1 for c in done.values()), "a task completed twice"
    assert len(done) + packer.pending + packer.running == len(truth), "a task was lost"
    assert packer.preemptions > 0 and len(done) > 250  # the scenario exercised both paths


@pytest.mark.parametrize("seed", range(5))
def test_indexed_packer_decides_exactly_like_the_linear_scan(seed):
    rng = random.Random(100 + seed)
    fast, ref = GapPacker(margin_s=0.25), ReferencePacker(margin_s=0.25)
    now, next_id = 0.0, 0
    open_gpus: set[int] = set()
    for _ in range(3000):
        now += rng.expovariate(2.0)
        op = rng.random()
        if op < 0.35:
            chunk = rng.choice([0.0, 0.0, 5.0])
            t = task(next_id, rng.lognormvariate(1.5, 1.2), rng.randrange(6), chunk)
            next_id += 1
            a, b = fast.submit(t, now), ref.submit(t, now)
        elif op < 0.55:
            closed = [g for g in range(60) if g not in open_gpus]
            if not closed:
                continue
            g = rng.choice(closed)
            until = now + rng.choice([math.inf, rng.lognormvariate(2.5, 1.0)])
            open_gpus.add(g)
            a, b = fast.open_window(g, now, until), ref.open_window(g, now, until)
        elif op < 0.72 and open_gpus:
            g = rng.choice(sorted(open_gpus))
            open_gpus.discard(g)
            ra, rb = fast.close_window(g, now), ref.close_window(g, now)
            assert ra == rb
            continue
        elif op < 0.87:
            busy = [g for g in sorted(open_gpus) if fast.running_on(g) is not None]
            if not busy:
                continue
            g = rng.choice(busy)
            until = rng.choice([None, now + rng.uniform(0, 60)])
            a, b = fast.finish(g, now, until=until), ref.finish(g, now, until=until)
        elif op < 0.93 and open_gpus:
            g = rng.choice(sorted(open_gpus))
            until = now + rng.uniform(0, 80)
            a, b = fast.move_window(g, now, until), ref.move_window(g, now, until)
        elif op < 0.97:
            v = rng.randrange(4)
            assert sorted(t.task_id for t in fast.withdraw_older_than(v)) == sorted(
                t.task_id for t in ref.withdraw_older_than(v)
            )
            continue
        else:
            a, b = fast.pop_oldest(), ref.pop_oldest()
        assert a == b
        assert (fast.pending, fast.free_windows) == (ref.pending, ref.free_windows)


# ------------------------------------------------------------------------------ estimates
def test_quantiles_are_nearest_rank_over_the_recent_window():
    est = DurationEstimator(history=10, min_samples=3, prior_s=42.0)
    assert est.quantile("a", 0.9) == 42.0  # nothing known yet
    for x in range(1, 21):  # only the last 10 (11..20) are kept
        est.record("a", float(x))
    assert est.samples("a") == 10
    assert est.quantile("a", 0.5) == 15.0 and est.quantile("a", 0.9) == 19.0 and est.quantile("a", 1.0) == 20.0
    s = est.summary("a")
    assert (s.p50_s, s.p99_s) == (15.0, 20.0)


def test_thin_domains_borrow_the_pooled_history():
    est = DurationEstimator(history=50, min_samples=5, prior_s=1.0)
    for x in range(100):
        est.record(f"busy{x % 3}", 10.0 + x % 10)
    est.record("rare", 1000.0)  # one sample is not enough to trust
    assert 10.0 <= est.quantile("rare", 0.5) <= 20.0
    with pytest.raises(ValueError, match="finite"):
        est.record("a", math.nan)
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\]"):
        est.quantile("a", 0.0)


def test_remaining_time_grows_with_age_under_a_heavy_tail():
    rng = random.Random(1)
    est = DurationEstimator(history=2000, min_samples=10)
    for _ in range(2000):
        est.record("agent", rng.paretovariate(1.5))  # heavy tail, minimum 1 s
    fresh = est.remaining_quantile("agent", 0.0, 0.5)
    assert fresh == pytest.approx(est.quantile("agent", 0.5))
    old = est.remaining_quantile("agent", 5.0, 0.5)
    assert old > fresh  # a run past most of the distribution is likely a long one
    beyond = est.remaining_quantile("agent", 1e9, 0.25)
    assert beyond == pytest.approx(0.25e9)  # past all history: proportional to age
