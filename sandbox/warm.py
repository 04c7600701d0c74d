"""Harness sandboxes and checkers started ahead of the next candidate, so judging skips the start-up wait.

    warm = WarmHarness(backend, spares=2)       # starts two harness sandboxes now
    for task in tasks:
        verdict = judge_function(backend, task, warm=warm)   # takes it, starts the next
    warm.close()                                # kills the one waiting

Starting a sandbox and a Python in it takes ~15 ms of wall time, most of which the judge
would spend waiting. The function harness receives its candidate on stdin (pyharness.py),
so it can be started before the candidate is known: while one candidate is judged, the next
sandboxes boot (`spares` of them: with one, a quick judgement still waits for the rest of its
successor's boot). Each candidate gets a fresh sandbox of its own; a spare has run no code
but the harness. Its wall clock starts when it is taken, not when it was started. The same goes
for the checker processes the test code runs in (judge.start_checker): `spares` of them wait
for their test, one per judgement.

Spares run as the same slot uid while the taken one runs a candidate: they share no namespace
(processes, files, network, IPC) and each has its own cgroup, but "one sandbox per uid at a
time" becomes "one candidate per uid at a time" on a slot that uses this.
"""

from __future__ import annotations

import time
from collections import deque

from hpcrl.sandbox.backend import Backend, Session
from hpcrl.sandbox.judge import HARNESS_LIMITS, start_checker, start_harness
from hpcrl.sandbox.spec import Limits

__all__ = ["WarmHarness"]

# A spare older than this is replaced at the next take() (it costs a few MiB and no CPU while
# it waits, but a long-lived process is one more thing that can go stale).
IDLE_S = 600.0


class WarmHarness:
    def __init__(self, backend: Backend, limits: Limits | None = None, spares: int = 1):
        if spares < 1:
            raise ValueError(f"spares must be >= 1 (got {spares})")
        self.backend = backend
        self.limits = limits or HARNESS_LIMITS
        self.spares = spares
        self._spares: deque[tuple[float, Session]] = deque()
        self._checkers: deque[tuple[float, Session]] = deque()
        self._closed = False
        for _ in range(spares):
            self._checkers.append(self._start(self._new_checker))
            self._spares.append(self._start(self._new_harness))

    def _new_harness(self) -> Session:
        return start_harness(self.backend, self.limits)

    def _new_checker(self) -> Session:
        return start_checker(self.limits)

    def _start(self, new) -> tuple[float, Session]:
        s = new()
        s.restart_clock(IDLE_S + 60)  # its real wall clock starts when it is taken
        return time.monotonic(), s

    def take(self) -> Session:
        """A started harness sandbox (the oldest live spare), and start one to replace it."""
        return self._take(self._spares, self._new_harness)

    def take_checker(self) -> Session:
        """A started checker process (the oldest live spare), and start one to replace it."""
        return self._take(self._checkers, self._new_checker)

    def _take(self, spares: deque, new) -> Session:
        if self._closed:
            raise RuntimeError("WarmHarness is closed")
        taken = None
        while spares and taken is None:
            born, s = spares.popleft()
            if s.alive() and time.monotonic() - born < IDLE_S:
                taken = s
            else:
                s.kill()  # crashed or stale: reap it
                s.finish()
        while len(spares) < self.spares:
            spares.append(self._start(new))
        return taken if taken is not None else self._start(new)[1]

    def close(self) -> None:
        """Kill and reap the waiting spares."""
        self._closed = True
        for spares in (self._spares, self._checkers):
            while spares:
                _, s = spares.popleft()
                s.kill()
                s.finish()

    def __enter__(self) -> WarmHarness:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
