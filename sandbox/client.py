"""Client of a sandbox server (hpcrl.sandbox.server), with the same calls as a local backend.

    with Node(run_dir, "gen-0") as node:
        client = SandboxClient(node, "sandbox-0")
        result = client.run(ExecSpec.single("python", "print(1)"))      # ExecResult
        verdict = client.judge_function(FunctionTask.humaneval(p, completion))

Each call is one request id, sent again on a fresh socket every `attempt_s` until it is
answered or its deadline passes (`timeout_s`; by default three times the run's own limits
plus `slack_s`, at least 60 s). Resending is cheap and safe: the server never runs an id twice
while it lives (a resent id that is still running only moves where the answer goes), and a
lost or restarted server is found again through its endpoint file within one attempt. A `busy`
answer (the server's queue is full: nothing ran) is retried under a new id after a backoff.
Failures raise: `SandboxError` (the server's sandbox failed), `ValueError` (the server refused
the request as malformed), `RequestTimeout` (no answer in time), `SandboxBusy` (still busy at
the deadline).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from hpcrl.core.rpc import RequestClient, RequestTimeout
from hpcrl.core.transport import Node, TransportError, read_endpoint
from hpcrl.sandbox.judge import FunctionTask, IOCase, Verdict
from hpcrl.sandbox.languages import get_language
from hpcrl.sandbox.result import ExecResult, SandboxError, lift_bytes, sink_bytes
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile

__all__ = ["SandboxClient", "SandboxBusy", "RequestTimeout"]


class SandboxBusy(TransportError):
    """The server's queue stayed full until the call's deadline."""


class SandboxClient:
    def __init__(
        self,
        node: Node,
        service: str = "sandbox-0",
        *,
        total_timeout_s: float | None = None,
        attempt_s: float = 1.0,
        slack_s: float = 5.0,
        discover_timeout_s: float = 30.0,
    ):
        self.node = node
        self.service = service
        self.total_timeout_s = total_timeout_s
        self.attempt_s = attempt_s
        self.slack_s = slack_s
        self.discover_timeout_s = discover_timeout_s
        self._rc = RequestClient(node, service, discover_timeout_s=discover_timeout_s)
        self._instance: str | None = None

    # -- calls -------------------------------------------------------------------------------
    def run(self, spec: ExecSpec, *, timeout_s: float | None = None) -> ExecResult:
        env = self._call(
            "exec", spec.to_wire(), self._budget(spec.language, spec.limits, spec.compile_limits), timeout_s
        )
        return ExecResult.from_wire(env.body)

    def judge_io(
        self,
        language: str,
        source: str | bytes | Sequence[SourceFile],
        cases: Sequence[IOCase],
        limits: Limits | None = None,
        *,
        stop_on_fail: bool = True,
        timeout_s: float | None = None,
    ) -> Verdict:
        lang = get_language(language)
        files = tuple(source) if isinstance(source, (list, tuple)) else (SourceFile(lang.main_file, source),)
        lim = limits or Limits()
        body = {
            "language": language,
            "files": [[f.path, bytes(f.data), f.executable] for f in files],
            "cases": [[bytes(c.stdin), bytes(c.expected)] for c in cases],
            "limits": _limits_wire(limits),
            "stop_on_fail": stop_on_fail,
        }
        budget = self._budget(language, lim, None, runs=len(cases))
        return Verdict.from_wire(self._call("judge_io", body, budget, timeout_s).body)

    def judge_function(
        self, task: FunctionTask, limits: Limits | None = None, *, timeout_s: float | None = None
    ) -> Verdict:
        body = {
            "program": task.program,
            "entry_point": task.entry_point,
            "test": task.test,
            "trusted_prelude": task.trusted_prelude,
            "name": task.name,
            "limits": _limits_wire(limits),
            "files": [list(f) for f in task.files],
            "language": task.language,
        }
        budget = (limits.wall_s if limits else 10.0) + self.slack_s
        return Verdict.from_wire(self._call("judge_function", body, budget, timeout_s).body)

    def session(self, op: dict, *, timeout_s: float | None = None) -> dict:
        """One session operation (hpcrl.sandbox.session: {"op": ..., "session": ID, ...}); its result
        mapping, with `ok` and `error`. A run's budget is its timeout_s; other operations are quick."""
        t = op.get("timeout_s") if op.get("op") == "run" else None
        budget = (t if isinstance(t, (int, float)) and not isinstance(t, bool) else 10.0) + self.slack_s
        # Text as bytes, so that a big write travels as a frame: the wire caps a header at 1 MiB.
        op = {k: v.encode() if k in ("content", "stdin") and isinstance(v, str) else v for k, v in op.items()}
        body, frames = lift_bytes(op)
        return self._call("session", body, budget, timeout_s, frames).body

    def info(self, *, timeout_s: float = 10.0) -> dict:
        return self._call("info", {}, timeout_s, timeout_s).body

    def close(self) -> None:
        self._rc.close()

    # -- machinery ---------------------------------------------------------------------------
    def _budget(self, language: str, limits: Limits, compile_limits: Limits | None, runs: int = 1) -> float:
        lang = get_language(language)
        t = limits.wall_s * max(runs, 1) + self.slack_s
        if lang.compiled:
            t += (compile_limits or lang.compile_limits).wall_s
        return t

    def _call(self, kind: str, body: Any, budget_s: float, timeout_s: float | None, arrays: Sequence = ()):
        total = timeout_s or self.total_timeout_s or max(60.0, 3 * budget_s)
        deadline = time.monotonic() + total
        backoff = 0.05
        while True:
            self._follow_restarts()
            left = deadline - time.monotonic()
            attempt = min(self.attempt_s, max(left, 0.05))
            retries = max(0, math.ceil(left / attempt) - 1)
            try:
                env = self._rc.request(kind, body, arrays, timeout_s=attempt, retries=retries)
            except RequestTimeout as exc:
                raise RequestTimeout(f"{exc} (sandbox {kind}, {total:.0f} s budget)") from None
            if env.kind == "busy":
                if time.monotonic() + backoff >= deadline:
                    raise SandboxBusy(
                        f"{self.service}: queue full ({env.body}) until the {total:.0f} s deadline; "
                        "add slots or servers, or lower the request rate"
                    )
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 1.0)
                continue
            if env.kind == "sandbox_failed":
                raise SandboxError(f"{self.service}: {(env.body or {}).get('message')}")
            if env.kind == "bad_request":
                raise ValueError(f"{self.service} refused the {kind} request: {(env.body or {}).get('message')}")
            return dataclasses.replace(env, body=sink_bytes(env.body, env.arrays), arrays=())

    def _follow_restarts(self) -> None:
        """Drop the socket when the server published a new instance: the old address is dead."""
        try:
            ep = read_endpoint(self.node.run_dir, self.service, self.discover_timeout_s)
        except TransportError:
            return  # request() will say what is missing
        if self._instance is not None and ep.instance != self._instance:
            self._rc.close()
        self._instance = ep.instance


def _limits_wire(limits: Limits | None) -> dict | None:
    return limits.to_wire() if limits else None
