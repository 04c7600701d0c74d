"""Hotter sampling for a task whose last group was wrong every time (generators.explore_temperature).

    tracker = StuckTasks(explore_temperature=2.0, sizes={"sum": 100})   # domain -> its size (1: off)
    t = tracker.temperature(ticket, domain.action.temperature)   # when the episode starts
    tracker.record(ticket, reward)                               # when it ends

Why: GRPO learns nothing from a group whose rewards are all equal (every advantage is 0). A task
the policy answers wrong every time stays wrong until sampling happens to find a better answer;
once a token's probability has collapsed (docs/learning.md §4: the digit 0 at ~1e-4), that takes
longer than a run. An entropy bonus cannot lift such a token (its push is proportional to the
probability) and it keeps every solved answer soft as well. This raises the temperature only
where a task is stuck: one success among a hot group gets the usual group-relative advantage.
At 2.0 (the default) a token at log-probability -10.5 is sampled at ~5e-3: a policy that had
lost `0+0=` for 500 s answered it right again in 97 % of samples after 60-80 s; at 1.5 it had
stayed lost for minutes (docs/learning.md §4.1, §4.4). For a pretrained model with a large
vocabulary such a temperature samples much noise beside the answer; there, keep it near 1.
Solved tasks and tasks that already vary are sampled as the domain asks, so the end of a run
is not capped. A hot group is trained as what it is: its steps record the temperature and the
log-probabilities of the hot distribution that drew them (rl/rollout/engine.py), and the learner scores
the current policy at that temperature too, so each hot sample enters the loss with the
probability it was drawn with (on-policy ratio 1) and its gradient is the policy gradient of
the hot distribution's expected reward for that task: raising a rewarded answer's logit raises
it at every temperature. No sample is trained under a distribution other than the one that
drew it. (A hot success moves the logits about half as far as it would if scored at
temperature 1, where it would wrongly count as a sample the policy itself had drawn.)

A task comes back once per pass over its domain (rl/coordinator/tasks.py: index = pass x size + position),
so it is known by its index modulo the domain's size; a domain without a size (every index a
task of its own) never comes back and is never hot. A group is stuck when at least two of its
episodes ended here with the same reward, below the domain's running mean (an exponential
average over this generator's episodes), so "wrong every time" needs no knowledge of the
reward's scale. Each generator judges from what it ran itself. While most of a domain's groups
are stuck (early in a run, when the policy is still near random), sampling them hot only dilutes
what it is learning (measured on `sum`, docs/learning.md §4: MA 0.50 at 60 s against ~0.7), so
a stuck group's task is sampled hot only while fewer than a fifth of the domain's recent groups
were stuck: exploration is for the tasks left behind.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from hpcrl.rl.coordinator.tasks import EpisodeTicket

__all__ = ["StuckTasks"]

_MEAN_WEIGHT = 0.01  # the running mean's weight on each new episode (about 100 episodes' memory)
_MAX_STUCK_SHARE = 0.2  # hot only while fewer than this share of the domain's recent groups were stuck
_SHARE_WEIGHT = 0.02  # the stuck share's weight on each judged group (about 50 groups' memory)
_MAX_TASKS = 65_536  # tasks remembered; the least recently visited are forgotten first


@dataclass
class _Visit:
    group: int
    hot: bool
    rewards: list[float] = field(default_factory=list)


class StuckTasks:
    """Per task: its latest group's rewards here, and whether that group is sampled hot."""

    def __init__(self, explore_temperature: float, sizes: dict[str, int | None]):
        self.explore_temperature = float(explore_temperature)
        self._sizes = {d: int(n) for d, n in sizes.items() if n}
        self._visits: OrderedDict[tuple[str, int], _Visit] = OrderedDict()
        self._mean: dict[str, float] = {}
        self._share: dict[str, float] = {}  # running share of the domain's judged groups that were stuck
        self.hot_episodes = 0  # episodes started hot

    def temperature(self, ticket: EpisodeTicket, base: float) -> float:
        """The temperature for this episode: `base`, or explore_temperature if its task's last group
        (another group than this one) was stuck. Greedy (`base` 0) stays greedy."""
        if self.explore_temperature <= 1.0 or base <= 0:  # off (the default): nothing kept, nothing looked up
            return base
        key = self._key(ticket)
        if key is None:
            return base
        visit = self._visits.get(key)
        if visit is None or visit.group != ticket.group:
            hot = visit is not None and self._judge(ticket.domain, visit)
            visit = self._visits[key] = _Visit(ticket.group, hot)
        self._visits.move_to_end(key)
        while len(self._visits) > _MAX_TASKS:
            self._visits.popitem(last=False)
        if not visit.hot or base >= self.explore_temperature:
            return base
        self.hot_episodes += 1
        return self.explore_temperature

    def record(self, ticket: EpisodeTicket, reward: float) -> None:
        """An episode of `ticket` ended with `reward`."""
        if self.explore_temperature <= 1.0:
            return
        m = self._mean.get(ticket.domain)
        self._mean[ticket.domain] = reward if m is None else m + _MEAN_WEIGHT * (reward - m)
        visit = self._visits.get(self._key(ticket))
        if visit is not None and visit.group == ticket.group:
            visit.rewards.append(reward)

    def _key(self, ticket: EpisodeTicket) -> tuple[str, int] | None:
        n = self._sizes.get(ticket.domain)
        return (ticket.domain, ticket.task_index % n) if n else None

    def _judge(self, domain: str, visit: _Visit) -> bool:
        """Whether the task's next group is hot, from its last one; counts that one in the share."""
        r = visit.rewards
        if len(r) < 2:
            return False
        stuck = max(r) == min(r) and r[0] < self._mean.get(domain, r[0])
        share = self._share.get(domain, 1.0)  # nothing judged yet: assume the worst
        self._share[domain] = share + _SHARE_WEIGHT * (float(stuck) - share)
        return stuck and share < _MAX_STUCK_SHARE
