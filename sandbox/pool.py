"""A pool of sandbox slots: N worker threads, each with its own backend (own uid on bwrap), fed
from one bounded queue.

    pool = SlotPool.from_config(cfg.sandbox, slots=4)
    ok = pool.try_submit(lambda backend: backend.run(spec), on_done)   # False: queue full
    results = pool.map(lambda backend, spec: backend.run(spec), specs) # blocking, in order
    pool.close()

A slot runs one sandbox at a time on a uid of its own (bwrap as root: taken from the host's
pool when the pool is built), so no two live sandboxes share a uid. The
queue holds at most `queue_max` waiting jobs beyond the busy slots; `try_submit` refuses more
instead of blocking, which is the server's backpressure.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hpcrl.sandbox.auto import make_backend
from hpcrl.sandbox.backend import Backend

log = logging.getLogger(__name__)

__all__ = ["SlotPool"]

Done = Callable[[Any, BaseException | None], None]


class SlotPool:
    def __init__(self, backends: Sequence[Backend], queue_max: int = 64):
        if not backends:
            raise ValueError("SlotPool needs at least one backend")
        if queue_max < 0:
            raise ValueError(f"queue_max must be >= 0 (got {queue_max})")
        self.backends = list(backends)
        self.queue_max = queue_max
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding = 0  # queued + running, counted under the condition's lock
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(b,), name=f"sandbox-slot-{i}", daemon=True)
            for i, b in enumerate(self.backends)
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def from_config(cls, cfg, slots: int | None = None) -> SlotPool:
        """`slots` backends of `cfg.backend` (default `cfg.slots`); on bwrap as root each on its own
        free uid of the host's pool (hpcrl.sandbox.uids), given back when the pool closes."""
        n = cfg.slots if slots is None else slots
        backends: list[Backend] = []
        try:
            for _ in range(n):
                backends.append(make_backend(cfg))
        except BaseException:
            for b in backends:  # the uids taken so far go back
                b.close()
            raise
        return cls(backends, queue_max=cfg.queue)

    @property
    def uids(self) -> list[int]:
        """The host uids the slots run as (bwrap as root), else []."""
        if os.geteuid() != 0:
            return []
        return [b.uid for b in self.backends if b.name == "bwrap"]

    @property
    def slots(self) -> int:
        return len(self.backends)

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def queued(self) -> int:
        return self._outstanding - self._busy

    def try_submit(self, fn: Callable[[Backend], Any], done: Done) -> bool:
        """Queue `fn(backend)`; `done(result, exception)` runs in the slot's thread. False when full."""
        return self._submit(fn, done, block=False)

    def submit(self, fn: Callable[[Backend], Any], done: Done) -> None:
        """Like `try_submit`, but wait for room instead of refusing."""
        self._submit(fn, done, block=True)

    def _submit(self, fn: Callable[[Backend], Any], done: Done, block: bool) -> bool:
        with self._cond:
            while self._outstanding >= self.slots + self.queue_max:
                if not block:
                    return False
                self._cond.wait()
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            self._outstanding += 1
            self._q.put((fn, done))
        return True

    def map(self, fn: Callable[[Backend, Any], Any], items: Iterable[Any]) -> list[Any]:
        """Run `fn(backend, item)` for every item across the slots; results in input order, errors re-raised."""
        items = list(items)
        results: list[Any] = [None] * len(items)
        errors: list[BaseException] = []
        finished = threading.Semaphore(0)

        def job(i: int, item: Any) -> None:
            def done(res: Any, exc: BaseException | None) -> None:
                results[i] = res
                if exc is not None:
                    errors.append(exc)
                finished.release()

            self.submit(lambda backend: fn(backend, item), done)

        for i, item in enumerate(items):
            job(i, item)
        for _ in items:
            finished.acquire()
        if errors:
            raise errors[0]
        return results

    def _work(self, backend: Backend) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, done = job
            with self._cond:
                self._busy += 1
            try:
                try:
                    res, exc = fn(backend), None
                except BaseException as e:  # handed to the caller's callback
                    res, exc = None, e
                try:
                    done(res, exc)
                except Exception:  # a callback bug must not kill the slot
                    log.exception("sandbox pool: completion callback failed")
            finally:
                with self._cond:
                    self._busy -= 1
                    self._outstanding -= 1
                    self._cond.notify_all()

    def close(self) -> None:
        """Stop the slots after the jobs already queued."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()
        for b in self.backends:
            b.close()
