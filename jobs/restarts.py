"""What both supervisors (local and Slurm) decide alike: when a component that ended may start
again, and whether one that is still running is hung.

    when = next_restart(times, now, cfg.supervise)      # None: it spent its budget, the run fails
    why = hung(beats, job_id, since, ranks, now, cfg.supervise)   # None, or why it looks hung
    watch = Watch(run_dir, cfg)                          # both of the above, plus supervision.json

Budgets refill: a component may restart `supervise.restarts` times in any `restart_window_s`
(a sliding window), so a week-long run survives a fault a day while a component that dies in a
loop still ends the run within minutes. Each restart waits `backoff_s`, doubled for every
restart still in the window (capped at `backoff_max_s`): a peer that is down for good is not
hammered, a one-off crash costs a second. While a component waits for its restart, is pending
in the queue, or has not reached its main loop, supervision.json says "starting", and its
clients wait for it (core/liveness.py) instead of failing and spending their own budgets.

A job is hung when the heartbeats of its current incarnation (job id and start time) say so: a
rank that has not reached its main loop `startup_s` after the job started, a rank whose loop
has not turned for `hang_s`, or fewer ranks beating than the job has (one died, the others wait
in a collective). A hung job is killed whole and restarted like a dead one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from hpcrl.core.config import Config, SuperviseConfig
from hpcrl.core.liveness import SUPERVISION_EVERY_S, read_heartbeats, write_supervision

__all__ = ["next_restart", "hung", "role_ranks", "Watch"]

log = logging.getLogger("hpcrl.supervise")

# A heartbeat may be stamped by another node's clock: this much earlier than the job's start
# (as the supervisor's node sees it) still counts as the current incarnation's.
CLOCK_SLACK_S = 30.0


def next_restart(times: Sequence[float], now: float, cfg: SuperviseConfig) -> float | None:
    """When a component that ended at `now` may be restarted (`times`: its earlier restarts), or
    None when it already used `cfg.restarts` within the last `cfg.restart_window_s`."""
    recent = [t for t in times if now - t < cfg.restart_window_s]
    if len(recent) >= cfg.restarts:
        return None
    return now + min(cfg.backoff_max_s, cfg.backoff_s * 2 ** len(recent))


def hung(beats: Sequence[dict], job_id: str, since: float, ranks: int, now: float, cfg: SuperviseConfig) -> str | None:
    """Why a job that is running (since `since`, with `ranks` processes) looks hung, or None."""
    mine = [b for b in beats if str(b.get("job_id")) == str(job_id) and b.get("started", 0) >= since - CLOCK_SLACK_S]
    running = [b for b in mine if b.get("phase") == "running"]
    if cfg.hang_s:
        stale = [b for b in running if now - b["time"] > cfg.hang_s]
        if stale:
            b = max(stale, key=lambda b: now - b["time"])
            return (
                f"{b.get('name', '?')} (pid {b.get('pid')} on {b.get('host')}) has not turned its main loop "
                f"for {now - b['time']:.0f} s (supervise.hang_s={cfg.hang_s:g})"
            )
    if cfg.startup_s and now - since > cfg.startup_s and len(running) < ranks:
        started = len(mine)
        return (
            f"{len(running)} of {ranks} process(es) reached the main loop and {started} started, "
            f"{now - since:.0f} s after the job began (supervise.startup_s={cfg.startup_s:g})"
        )
    return None


def role_ranks(cfg: Config, slurm_role: str) -> int:
    """Processes in one of the role's jobs (locally submitit starts tasks_per_node of them)."""
    r = cfg.slurm.role(slurm_role)
    return r.tasks_per_node * (r.nodes if cfg.executor == "slurm" else 1)


class Watch:
    """Restart budgets, hang checks and supervision.json for one run; `times` restores the
    restart times of a supervisor that ran before (jobs.json on Slurm)."""

    def __init__(self, run_dir: str | Path, cfg: Config, name: str = "hpcrl-run"):
        self.run_dir, self.cfg, self.name = Path(run_dir), cfg, name
        self._written: tuple[dict, float] | None = None

    def schedule(self, component: str, times: Sequence[float], why: str, now: float | None = None) -> float | None:
        """When `component` (which ended: `why`) is to be restarted; None when its budget is spent."""
        now = time.time() if now is None else now
        when = next_restart(times, now, self.cfg.supervise)
        if when is not None:
            log.warning(
                "%s ended (%s); restarting it in %.0f s (%d restart(s) in the last %.0f s, %d allowed)",
                component,
                why[:600],
                when - now,
                sum(now - t < self.cfg.supervise.restart_window_s for t in times),
                self.cfg.supervise.restart_window_s,
                self.cfg.supervise.restarts,
            )
        return when

    def recent(self, times: Sequence[float]) -> int:
        """Restarts within the budget's window, now."""
        return sum(time.time() - t < self.cfg.supervise.restart_window_s for t in times)

    def spent(self, component: str, times: Sequence[float], why: str) -> str:
        """The run's failure message when `component` has no restart left (`why`: one line)."""
        s = self.cfg.supervise
        return (
            f"{component} ended and has used its {s.restarts} restart(s) in the last {s.restart_window_s:.0f} s "
            f"(supervise.restarts, supervise.restart_window_s); last: {why[-600:]}"
        )

    def hung(self, component: str, slurm_role: str, job_id: str, since: float, now: float | None = None) -> str | None:
        now = time.time() if now is None else now
        beats = read_heartbeats(self.run_dir, component)
        return hung(beats, job_id, since, role_ranks(self.cfg, slurm_role), now, self.cfg.supervise)

    def running(self, component: str, job_id: str, since: float, slurm_role: str) -> bool:
        """Every process of the current incarnation has reached its main loop."""
        beats = [
            b
            for b in read_heartbeats(self.run_dir, component)
            if str(b.get("job_id")) == str(job_id)
            and b.get("started", 0) >= since - CLOCK_SLACK_S
            and b.get("phase") == "running"
        ]
        return len(beats) >= role_ranks(self.cfg, slurm_role)

    def publish(self, states: dict[str, str]) -> None:
        """Write supervision.json when a state changed, and at least every SUPERVISION_EVERY_S."""
        now = time.monotonic()
        if self._written and self._written[0] == states and now - self._written[1] < SUPERVISION_EVERY_S:
            return
        try:
            write_supervision(self.run_dir, states, self.name)
        except OSError as exc:  # clients then stop waiting after SUPERVISION_FRESH_S; supervising goes on
            log.warning("could not write supervision.json: %s", exc)
            return
        self._written = (dict(states), now)
