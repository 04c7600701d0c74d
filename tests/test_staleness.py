"""Staleness without length bias: a slow, multi-turn domain is trained in its issued share.

Two domains share a run: `fast` answers in one token and is judged at once; `slow` runs three
turns, each environment step taking three learner steps (it waits for the learner's version to
move on by three: a condition, not a clock). A slow episode therefore starts a dozen policy
versions before it can be trained, though its newest action is only a few behind. The real
coordinator issues the groups (its default flow control: max_staleness x batch_groups groups
outstanding), the real generator samples them with the tiny model (weights published by version
to a real weight store, taken between decode steps: `weight_swap: continue`), and the real
GroupBuffer admits them; the learner's optimizer step itself is left out (its version moves on
per batch), as what is tested is which data it gets. At the end the coordinator stops issuing
and what is in flight finishes (environment steps no longer wait), so everything issued is
trained, dropped, or one short batch left over. The slow domain's trained share is within 10 %
(relative) of its issued share, every trained group's newest action is within max_staleness of
the learner, and most slow episodes trained started further back than that: the rule that
measured a group by its oldest step would have dropped them.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading
from typing import Any

from hpcrl.core.config import CoordinatorConfig, GeneratorConfig, PolicyConfig, TinyModelConfig
from hpcrl.rl.coordinator.coordinator import Coordinator
from hpcrl.rl.coordinator.tasks import ticket_from_row
from hpcrl.rl.domains import ActionSpec, Domain, Environment, PromptDomain, StepResult, Task
from hpcrl.rl.learner.batch import GroupBuffer
from hpcrl.rl.model.policy import Policy, full_state_dict
from hpcrl.rl.rollout.generator import Generator
from hpcrl.rl.weights.shards import WeightStore

GROUP, BATCH, MAX_STALENESS = 2, 2, 8
AHEAD = MAX_STALENESS * BATCH  # the coordinator's default window (groups outstanding)
ENV_STEPS = 3  # learner steps one slow environment step takes
TURNS = 3  # slow episodes' turns
STEPS = 60  # learner steps before the coordinator stops issuing


class LearnerClock:
    """The learner's policy version; environment steps wait on it."""

    def __init__(self) -> None:
        self.version = 0
        self.draining = False  # nothing more is issued: environment steps no longer wait
        self.cond = threading.Condition()

    def advance(self) -> None:
        with self.cond:
            self.version += 1
            self.cond.notify_all()

    def wait_for(self, version: int) -> None:
        with self.cond:
            done = self.cond.wait_for(lambda: self.version >= version or self.draining, timeout=120)
            assert done, "the learner stopped stepping"

    def drain(self) -> None:
        with self.cond:
            self.draining = True
            self.cond.notify_all()


class SlowEnv(Environment):
    def __init__(self, task: Task, clock: LearnerClock):
        self.task, self.clock, self.turn = task, clock, 0

    def reset(self) -> str:
        return self.task.prompt

    def step(self, action: str) -> StepResult:
        self.clock.wait_for(self.clock.version + ENV_STEPS)
        self.turn += 1
        done = self.turn >= TURNS
        return StepResult("" if done else " again:", float(done and len(action) % 2 == 1), done, {})


class SlowDomain(Domain):
    name = "slow"
    action = ActionSpec(max_tokens=1)
    needs_executor = True  # stepped on the generator's thread pool, as a sandboxed domain is
    size = 16
    multi_step = True

    def __init__(self, clock: LearnerClock):
        self.clock = clock

    def task(self, index: int) -> Task:
        return Task(self.name, str(index), f"{index % self.size}:")

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return SlowEnv(task, self.clock)


class CoordinatorSource:
    """A generator's task source on the coordinator in this process (its sync requests as the
    remote source sends them)."""

    def __init__(self, coord: Coordinator):
        self.coord, self._done = coord, []

    def take(self, n: int):
        body = {"generator": "gen-0", "want": n, "done": self._done, "failed": [], "released": []}
        self._done = []
        return [ticket_from_row(t) for t in self.coord.handle("sync", body)["tickets"]]

    def done(self, ticket) -> None:
        self._done.append(ticket.episode)

    def failed(self, ticket, reason: str, permanent: bool = False) -> None:
        raise AssertionError(f"episode {ticket.episode} failed: {reason}")


def test_a_slow_multi_turn_domain_is_trained_in_its_issued_share_within_the_bound(tmp_path):
    clock = LearnerClock()
    fast = PromptDomain("fast", [(f"{i}+{i}=", str(2 * i)) for i in range(5)], max_tokens=1)
    domains = {"fast": fast, "slow": SlowDomain(clock)}
    coord = Coordinator(tmp_path, {"fast": 3.0, "slow": 1.0}, group_size=GROUP, batch_groups=BATCH,
                        max_staleness=MAX_STALENESS, max_steps=10**6, seed=0, cfg=CoordinatorConfig())  # fmt: skip
    assert coord.max_ahead == AHEAD
    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    policy = Policy.load(PolicyConfig(tiny=tiny, device="cpu"), seed=0)
    store = WeightStore(tmp_path)
    state = full_state_dict(policy.model)
    store.publish(state, 0)
    cfg = GeneratorConfig(episodes_in_flight=AHEAD * GROUP * 2, env_threads=AHEAD * GROUP, weight_swap="continue")
    gen = Generator(cfg, policy, domains, run="r", name="gen-0", seed=0, executor=object(), weights=store)
    buf = GroupBuffer(GROUP)
    ages: list[tuple[str, int, int]] = []  # per trained trajectory: domain, newest group action's age, oldest step's

    def learner_turn() -> bool:
        """One learner step when a batch is ready (the generator's stop check runs every loop);
        True once the run is over: issuing stopped and nothing is left in flight."""
        assert coord.groups_issued - coord._consumed() <= AHEAD  # flow control held
        groups = buf.pop(BATCH, clock.version, MAX_STALENESS)
        counts = {"trained_groups": len(ages) // GROUP, "dropped_groups": buf.dropped_groups}
        if groups is None:
            coord.handle("progress", {**counts, "domains": buf.domain_counts()})
            return clock.draining and not gen.episodes
        for g in groups:
            newest = clock.version - max(t.max_policy_version for t in g)
            assert newest <= MAX_STALENESS  # the configured bound holds for every trained group
            ages.extend((t.domain, newest, clock.version - t.min_policy_version) for t in g)
        clock.advance()
        store.publish(state, clock.version)
        counts["trained_groups"] = len(ages) // GROUP
        coord.handle("learner", {"step": clock.version, "version": clock.version, "reward": 0.0, **counts,
                                 "domains": buf.domain_counts()})  # fmt: skip
        if clock.version == STEPS:
            coord.handle("stop", {})
            clock.drain()
        return False

    gen.run(CoordinatorSource(coord), buf.add, stop=learner_turn)
    gen.close()

    report = coord.domains()
    slow, fast_ = report["slow"], report["fast"]
    shares = {d: {k: r[k] for k in ("issued_share", "trained_share", "dropped")} for d, r in report.items()}
    print("per domain:", shares)
    assert slow["trained"] + fast_["trained"] == len(ages) >= STEPS * BATCH * GROUP
    assert slow["trained"] > 0.15 * len(ages), report
    rel = abs(slow["trained_share"] - slow["issued_share"]) / slow["issued_share"]
    assert rel < 0.10, report
    # Trained in full: a slow episode's turns are all there, as many as it started with.
    assert slow["trained_turns_mean"] == slow["started_turns_mean"] == TURNS
    # The data did straddle the bound: most slow episodes started further back than it allows.
    slow_ages = [oldest for d, _, oldest in ages if d == "slow"]
    assert sum(a > MAX_STALENESS for a in slow_ages) > 0.8 * len(slow_ages), slow_ages
    assert slow["dropped"] <= 0.05 * slow["trained"], report
    # Flow control stayed consistent: everything issued was trained or dropped, but a short batch.
    assert coord._consumed() == len(ages) // GROUP + buf.dropped_groups
    assert coord.groups_issued - coord._consumed() == buf.complete_groups < BATCH and not buf.open_trajectories
    assert set(slow) >= {"issued", "trained", "dropped_stale", "trained_turns_mean", "started_turns_mean"}
