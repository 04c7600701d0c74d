"""What a generator and a rollout job decide about episodes (pure; the live components and the
simulator call the same functions).

    take = episodes_to_take(cap=8, open_=8, waiting=3, lend=4)   # 3: rows idle while 3 wait on sandboxes
    may_lease(time_left_s, episode_s, drain_s)                   # a rollout job takes one more episode?
    must_end(time_left_s, drain_s, leasing, open_episodes)       # ... or hands back and exits
    room_for_another_generator(queued, outstanding, max_ahead)   # would one more generator get work?

Lending (rl/rollout/generator.py): an episode in an environment step (a sandbox run) leaves its row of
the continuous batch idle, so a generator takes up to `generators.lend_episodes` more episodes
meanwhile, still decoding at most `episodes_in_flight` rows at once. A rollout job
(jobs/rollout.py) leases only while one more episode fits before its drain starts, and ends
when the drain starts or nothing is left in flight. The run's planner starts rollout jobs only
while the coordinator's flow control has room for more episodes.
"""

from __future__ import annotations

__all__ = ["episodes_to_take", "may_lease", "must_end", "room_for_another_generator"]


def episodes_to_take(cap: int, open_: int, waiting: int, lend: int) -> int:
    """New episodes a generator takes now: up to `cap` (episodes_in_flight) that are not waiting
    on an environment, and never more than cap + lend open in all."""
    return max(min(cap - (open_ - waiting), cap + lend - open_), 0)


def may_lease(time_left_s: float, episode_s: float, drain_s: float) -> bool:
    """Take a new episode only if one more fits before the drain starts."""
    return time_left_s > episode_s + drain_s


def must_end(time_left_s: float, drain_s: float, leasing: bool, open_episodes: int) -> bool:
    """Hand back and exit: the drain margin is reached, or nothing is left to finish."""
    return time_left_s <= drain_s or (not leasing and open_episodes == 0)


def room_for_another_generator(queued: int, outstanding: int, max_ahead: int) -> bool:
    """The coordinator would hand episodes to one more generator: episodes are queued for
    re-issue, or fewer than `max_ahead` are outstanding beyond what the learner consumed.
    When flow control is full the learner is the bottleneck: another generator would only
    hold a GPU idle."""
    return queued > 0 or outstanding < max_ahead
