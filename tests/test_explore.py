"""Hotter sampling for stuck tasks (rl/rollout/explore.py): which groups are hot, and that the generator
samples exactly those at generators.explore_temperature and the rest at the domain's own, and
records each step's temperature and the log-probabilities of the distribution that drew it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from hpcrl.core.config import GeneratorConfig, PolicyConfig, TinyModelConfig
from hpcrl.rl.coordinator.tasks import EpisodeTicket, LocalTaskSource, TaskSampler
from hpcrl.rl.domains import PromptDomain
from hpcrl.rl.model.logprobs import PolicyHead, Shaping
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.explore import StuckTasks
from hpcrl.rl.rollout.generator import Generator


def _group(tracker, task, group, rewards, base=1.0):
    temps = []
    for i in range(len(rewards)):
        t = EpisodeTicket("d", task, episode=group * 100 + i, group=group)
        temps.append(tracker.temperature(t, base))
    for i, r in enumerate(rewards):
        tracker.record(EpisodeTicket("d", task, episode=group * 100 + i, group=group), r)
    return temps


def _settle(tracker, task=1, first_group=1000, n=100):
    """n groups of a solved task: the domain's stuck share falls from 1 (nothing judged) to 0.98^n."""
    for g in range(first_group, first_group + n):
        assert _group(tracker, task, g, [1.0, 1.0]) == [1.0, 1.0]


def test_only_the_group_after_one_wrong_every_time_is_hot():
    s = StuckTasks(1.5, {"d": 10})
    assert _group(s, 0, 1, [0.0, 0.0, 0.0, 0.0]) == [1.0] * 4  # first visit; the mean is 0 too
    assert _group(s, 0, 2, [0.0, 0.0, 0.0, 0.0]) == [1.0] * 4  # stuck, but nothing is solved yet
    _settle(s)  # the domain's other task is solved in 100 groups: the mean is high, few stuck
    # Group 2 is judged when group 3 starts, against the mean then: all 0 < mean, share low.
    assert _group(s, 0, 3, [0.0, 0.0, 0.0, 0.0]) == [1.5] * 4
    assert _group(s, 0, 4, [0.0, 1.0, 0.0, 0.0]) == [1.5] * 4  # still hot: its last group was stuck
    assert _group(s, 0, 5, [0.0, 0.0, 0.0, 0.0]) == [1.0] * 4  # group 4 varied: sampled as asked
    assert _group(s, 1, 6, [1.0, 1.0, 1.0, 1.0]) == [1.0] * 4  # equal but above the mean: not stuck
    assert s.hot_episodes == 8  # groups 3 and 4
    # A domain's own temperature: hotter only upwards, greedy stays greedy.
    assert _group(s, 0, 7, [0.0, 0.0]) == [1.5, 1.5]
    assert _group(s, 0, 8, [0.0, 0.0], base=2.0) == [2.0, 2.0]
    assert _group(s, 0, 9, [0.0, 0.0], base=0.0) == [0.0, 0.0]
    assert s.hot_episodes == 10  # group 7 as well; a domain already as hot, or greedy, is not counted
    # The task of index i comes back as i + size in the next pass.
    assert _group(s, 10, 11, [0.0, 0.0]) == [1.5, 1.5]
    # While a fifth or more of the domain's groups are stuck, none is hot (early in a run).
    for g in range(12, 40):
        _group(s, 2 + g % 5, g, [0.0, 0.0])  # five tasks, wrong every time
    assert s._share["d"] >= 0.2
    assert _group(s, 2, 40, [0.0, 0.0]) == [1.0, 1.0]
    # 1 turns it off; a domain without a size never comes back, so it is never hot.
    for off in (StuckTasks(1.0, {"d": 10}), StuckTasks(1.5, {"d": None})):
        _settle(off)
        for g in range(1, 4):
            assert _group(off, 0, g, [0.0, 0.0]) == [1.0, 1.0]
    # A group of one episode says nothing about variance.
    one = StuckTasks(1.5, {"d": 10})
    _settle(one)
    _group(one, 0, 2, [0.0])
    assert _group(one, 0, 3, [0.0]) == [1.0]


def _wrong_on_task_0(action, task, feedback=None):
    return float(int(task.id) % 10 != 0)


def test_the_generator_samples_a_stuck_tasks_next_group_hot():
    # Task 0 of 10 is wrong whatever the policy says, the others right: once the domain's stuck
    # share has fallen below a fifth, task 0's groups are hot, the others' never.
    dom = PromptDomain("d", [(f"{i}+{i}=", "x") for i in range(10)], reward=_wrong_on_task_0, max_tokens=2)
    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    policy = Policy.load(PolicyConfig(tiny=tiny, device="cpu"), seed=0)
    cfg = GeneratorConfig(episodes_in_flight=8, explore_temperature=1.7)
    gen = Generator(cfg, policy, {"d": dom}, run="r", name="g", seed=0)
    seen = []
    submit = gen.engine.submit

    def spy(ep, context, max_new, spec, keep):  # what the engine is asked to sample with
        seen.append((ep.ticket, spec.temperature))
        return submit(ep, context, max_new, spec, keep=keep)

    gen.engine.submit = spy
    out = []
    source = LocalTaskSource(TaskSampler({"d": 1.0}, group_size=4, seed=0))
    gen.run(source, out.append, stop=lambda: len(out) >= 1600)
    gen.close()
    by_group = {}
    for ticket, temp in seen:
        by_group.setdefault((ticket.task_index % 2, ticket.group), set()).add(temp)
    hot = {k for k, v in by_group.items() if v == {1.7}}
    assert all(v in ({1.0}, {1.7}) for v in by_group.values())  # one temperature per group
    assert hot and all(task == 0 for task, _ in hot)
    first0 = sorted(g for task, g in by_group if task == 0)
    assert (0, first0[0]) not in hot  # nothing is known about a task before its first group ends
    assert (0, first0[-1]) in hot  # ... and by the end the share is low
    assert gen.stuck.hot_episodes == sum(1 for _, temp in seen if temp == 1.7)
    # Each step says what it was drawn with, and its log-probabilities are that distribution's:
    # the learner's head, scoring at the step's temperature, gives them back (ratio 1).
    hot_trajs = [t for t in out if t.steps[0].temperature == 1.7]
    cold = [t for t in out if t.steps[0].temperature == 1.0]
    assert hot_trajs and cold and len(hot_trajs) + len(cold) == len(out)
    head = PolicyHead(policy.model)
    for t in hot_trajs[:4] + cold[:2]:
        s = t.steps[0]
        ids = torch.from_numpy(np.concatenate([s.prompt_tokens, s.action_tokens]).astype(np.int64))[None]
        n = ids.shape[1] - 1
        shaping = Shaping(torch.full((1, n), s.temperature), torch.ones(1, n), torch.zeros(1, n, dtype=torch.long))
        with torch.no_grad():
            lq, _, own = head(ids, shaping=shaping)
        a = len(s.action_tokens)
        assert torch.allclose(lq[0, -a:], torch.tensor(s.action_logprobs), atol=1e-4)
        assert (s.temperature == 1.0) == torch.allclose(own[0, -a:], torch.tensor(s.action_logprobs), atol=1e-4)
