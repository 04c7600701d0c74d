"""The machine's load while a benchmark's run is going, sampled beside it: a figure taken on a
busy machine says so (imported by the bench scripts that start whole runs)."""

from __future__ import annotations

import os
import threading


class LoadSampler:
    """The 1-minute load average every few seconds while a run is going."""

    def __init__(self, every_s: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [float("nan")]
        return {"start": round(s[0], 2), "mean": round(sum(s) / len(s), 2), "max": round(max(s), 2)}
