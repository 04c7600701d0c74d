"""Episodes on a sandbox session: the model acts on a workspace with tool calls, over many steps.

    domain = get_domain("session-repair")                 # or session-repair/median
    env = domain.make_env(domain.task(0), executor)       # executor: the generator's sandbox client
    obs = env.reset()                                     # opens a session, writes the task's files
    obs, reward, done, info = env.step('<run>python3 -m unittest -q</run>')
    obs, reward, done, info = env.step('<write path="stats/core.py">...</write><submit/>')

reset opens a session on a sandbox server (hpcrl.sandbox.session) and writes the project once;
each step parses the action's tool calls (toolcalls.py) and runs each as one session operation,
so only what the model writes travels, never the workspace. The observation is every call's
outcome, one block each; an action that does not parse is answered with the reason and runs
nothing. `<submit/>` runs the hidden check (session_tasks.py): reward 1 if it passes, else 0,
and the episode ends; it also ends, reward 0 and truncation max_steps, when the model has used
the domain's `max_ops` tool calls. The session is closed when the episode ends or the
environment is closed (the generator closes abandoned episodes; the server's idle expiry is
the backstop).

Infrastructure failures (the server unreachable, the session gone with a restarted server, a
sandbox_error run) raise `SandboxError`, as the code domains do: the generator fails the
episode (the coordinator issues it again) instead of scoring the model on it.

The executor is what the generator hands every code domain: a `ThreadLocalJudge` (its node and
sandbox services), or a `SandboxClient`, or a `SandboxJudge` over one. The environment opens its
own client to one service, since a session lives on the server that opened it and the
generator steps an episode on whichever pool thread is free (one thread at a time).
"""

from __future__ import annotations

import itertools
import secrets
import shlex
import threading
from collections.abc import Sequence
from typing import Any

from hpcrl.rl.domains.base import ActionSpec, Domain, Environment, ExecFeedback, StepResult, Task
from hpcrl.rl.domains.code import _outcome
from hpcrl.rl.domains.session_tasks import HIDDEN_HARNESS, SESSION_PROBLEMS, VISIBLE_CMD, SessionProblem
from hpcrl.rl.domains.toolcalls import SYNTAX, ListFiles, Read, Run, Submit, ToolCall, Write, parse_action
from hpcrl.sandbox.result import SandboxError

__all__ = ["SessionEnv", "SessionRepairDomain", "make_session_repair"]

_OUTPUT_CHARS = 2000  # of a read file or a run's output, per call: the context is the model's budget
_GONE = "no open session"  # the server's words for a session it does not hold (SessionManager._take)
_services = itertools.count()  # spreads environments over the sandbox services round-robin


def _session_target(executor: Any) -> tuple[Any, str]:
    """(node, sandbox service) for the environment's own client; ValueError if the executor has none."""
    from hpcrl.sandbox.client import SandboxClient

    target = getattr(executor, "sandbox", executor)  # a SandboxJudge wraps a client or a local backend
    if isinstance(target, SandboxClient):
        return target.node, target.service
    services: Sequence[str] = getattr(executor, "services", ())
    if getattr(executor, "node", None) is not None and services:
        return executor.node, services[next(_services) % len(services)]
    raise ValueError(
        "session domains need a sandbox server (sessions live there); give the generator a sandbox client "
        f"(hpcrl run starts sandbox servers), not {type(executor).__name__}"
    )


class SessionEnv(Environment):
    def __init__(
        self,
        task: Task,
        executor: Any,
        max_ops: int,
        run_timeout_s: float = 10.0,
        client_timeout_s: float | None = None,
    ):
        self.task, self.max_ops, self.run_timeout_s = task, max_ops, run_timeout_s
        self._node, self._service = _session_target(executor)
        self._client_timeout_s = client_timeout_s
        self._client = None
        self._sid: str | None = None
        self.ops = 0  # tool calls the model made (a malformed action counts as one)
        self.sent_bytes = 0  # file content sent to the server, setup included
        self.done = False
        self._lock = threading.Lock()  # held by a step; close() from another thread defers to it
        self._close_requested = False

    @property
    def session(self) -> str | None:
        return self._sid

    # -- Environment ------------------------------------------------------------------------
    def reset(self) -> str:
        from hpcrl.sandbox.client import SandboxClient

        with self._lock:
            self._end()
            self._client = SandboxClient(self._node, self._service, total_timeout_s=self._client_timeout_s)
            try:
                self._sid = self._op({"op": "open", "language": "python"})["session"]
                for path, content in self.task.data["files"]:
                    r = self._op({"op": "write", "path": path, "content": content})
                    if not r["ok"]:  # our own files: not the model's doing
                        raise SandboxError(f"writing the task's {path} into the session failed: {r['error']}")
                    self.sent_bytes += len(content.encode())
            except BaseException:
                self._end()
                raise
            self.ops, self.done = 0, False
            if self._close_requested:  # closed (an abandoned episode) while the session opened
                self._end()
            return self.task.prompt

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() after the episode ended; call reset()")
        if self._sid is None:
            raise RuntimeError(f"{self.task.domain}/{self.task.id}: step() before reset()")
        with self._lock:
            try:
                return self._step(action)
            except BaseException:
                self.done = True
                self._end()
                raise
            finally:
                if self._close_requested or self.done:
                    self._end()

    def close(self) -> None:
        # The generator may close an abandoned episode while a pool thread still steps it:
        # that step closes the session when it returns, rather than two threads on one socket.
        if self._lock.acquire(blocking=False):
            try:
                self._end()
            finally:
                self._lock.release()
        else:
            self._close_requested = True

    # -- the loop -----------------------------------------------------------------------------
    def _step(self, action: str) -> StepResult:
        parsed = parse_action(action)
        blocks: list[str] = []
        fb: ExecFeedback | None = None
        if parsed.error is not None:
            self.ops += 1
            blocks.append(f"[error] {parsed.error}")
        for call in parsed.calls:
            if isinstance(call, Submit):
                self.ops += 1
                return self._submit()
            if self.ops >= self.max_ops:
                break
            self.ops += 1
            text, call_fb = self._call(call)
            blocks.append(text)
            fb = call_fb or fb
        info: dict[str, Any] = {"ops": self.ops}
        if fb is not None:
            info["feedback"] = fb  # the step's last run: the trajectory's per-step sandbox outcome
        if self.ops >= self.max_ops:
            self.done = True
            return StepResult("", 0.0, True, {**info, "truncation": "max_steps"})
        left = self.max_ops - self.ops
        return StepResult("\n".join(blocks) + f"\n[{left} tool calls left; <submit/> when done]\n", 0.0, False, info)

    def _call(self, call: ToolCall) -> tuple[str, ExecFeedback | None]:
        if isinstance(call, Write):
            r = self._op({"op": "write", "path": call.path, "content": call.content})
            self.sent_bytes += len(call.content.encode())
            return (f"[write {call.path}] " + (f"ok, {r['bytes']} bytes" if r["ok"] else f"error: {r['error']}")), None
        if isinstance(call, Read):
            r = self._op({"op": "read", "path": call.path})
            if not r["ok"]:
                return f"[read {call.path}] error: {r['error']}", None
            return f"[read {call.path}]\n{_text(r['content'])}", None
        if isinstance(call, ListFiles):
            r = self._op({"op": "list"})
            if not r["ok"]:
                return f"[list] error: {r['error']}", None
            names = [e["path"] + ("/" if e["type"] == "dir" else "") for e in r["entries"]]
            return "[list] " + (" ".join(sorted(names)) or "(empty)"), None
        assert isinstance(call, Run)
        head = f"[run {shlex.join(call.argv)}]"
        r = self._op({"op": "run", "cmd": list(call.argv), "timeout_s": call.timeout_s or self.run_timeout_s})
        if not r["ok"]:
            return f"{head} error: {r['error']}", None
        fb = _feedback(r, "exit 0" if r.get("exit_code") == 0 else "failed")
        out = _text(bytes(r.get("stdout") or b"") + bytes(r.get("stderr") or b""))
        return f"{head} {fb.status}, exit code {fb.exit_code}\n{out}", fb

    def _submit(self) -> StepResult:
        self.done = True
        p: str = self.task.data["hidden"]
        nonce = secrets.token_hex(16)
        path = f".check_{secrets.token_hex(8)}.py"  # a name the model cannot have taken
        w = self._op({"op": "write", "path": path, "content": HIDDEN_HARNESS.format(body=p)})
        if not w["ok"]:  # the model filled the workspace: its failure, reported as such
            fb = ExecFeedback(0, 1, "error", -1, 0.0, f"the hidden tests could not be written: {w['error']}")
            return StepResult("", 0.0, True, {"feedback": fb, "ops": self.ops})
        r = self._op(
            {"op": "run", "cmd": ["python3", "-I", path], "stdin": nonce + "\n", "timeout_s": self.run_timeout_s}
        )
        passed = bool(r["ok"]) and r.get("exit_code") == 0 and bytes(r["stdout"]).split()[-1:] == [nonce.encode()]
        status, code, wall = _outcome(_Result(r)) if r["ok"] else ("error", -1, 0.0)
        if not passed and status == "ok":
            status = "error"  # it ran but a check failed: the store's "error", as judge_function reports it
        # Only the verdict: the hidden cases' values and output never reach the model or the store.
        verdict = "hidden tests passed" if passed else "hidden tests failed"
        fb = ExecFeedback(int(passed), 1, status, code, wall, verdict)
        return StepResult("", float(passed), True, {"feedback": fb, "ops": self.ops})

    # -- machinery ------------------------------------------------------------------------------
    def _op(self, op: dict) -> dict:
        """One session operation; SandboxError when the failure is the infrastructure's."""
        from hpcrl.core.transport import TransportError

        if op["op"] != "open":
            op = {**op, "session": self._sid}
        try:
            r = self._client.session(op)
        except (TransportError, SandboxError, ValueError) as exc:  # unreachable, timed out, refused by the server
            raise SandboxError(f"sandbox session {op['op']} on {self._service}: {type(exc).__name__}: {exc}") from None
        if not r.get("ok") and (op["op"] == "open" or _GONE in str(r.get("error"))):
            # A restarted server swept the session (or never opened one): the model's work is gone.
            raise SandboxError(f"sandbox session {op['op']} on {self._service}: {r.get('error')}")
        if r.get("ok") and op["op"] == "run" and r.get("status") == "sandbox_error":
            _outcome(_Result(r))  # raises SandboxError, as the code domains' judge does
        return r

    def _end(self) -> None:
        """Close the session (best effort: an unreachable server expires it) and the client."""
        sid, client, self._sid, self._client = self._sid, self._client, None, None
        if client is None:
            return
        try:
            if sid is not None:
                # Briefly: the generator closes finished episodes from its loop; a server that
                # does not answer expires the session itself.
                client.session({"op": "close", "session": sid}, timeout_s=min(self._client_timeout_s or 5.0, 5.0))
        except Exception:  # the server's idle expiry removes what we could not close
            pass
        finally:
            client.close()


class _Result:
    """The attributes of an ExecResult that `_outcome` reads, over a session run's result mapping."""

    def __init__(self, r: dict):
        self.status, self.exit_code, self.signal = r.get("status"), r.get("exit_code"), r.get("signal")
        self.wall_s = float(r.get("wall_s") or 0.0)
        self.stderr = bytes(r.get("stderr") or b"")


def _feedback(r: dict, message: str) -> ExecFeedback:
    status, code, wall = _outcome(_Result(r))
    return ExecFeedback(int(code == 0 and status == "ok"), 1, status, code, wall, message)


def _text(data: bytes) -> str:
    text = bytes(data).decode("utf-8", "replace")
    return (
        text if len(text) <= _OUTPUT_CHARS else f"...({len(text) - _OUTPUT_CHARS} chars cut)\n" + text[-_OUTPUT_CHARS:]
    )


class SessionRepairDomain(Domain):
    """`session-repair[/problem]`: fix a bug in a small project with tool calls, judged by hidden tests."""

    needs_executor = True
    # Several calls per action: room for a rewritten module; stopping at submit saves the rest.
    action = ActionSpec(max_tokens=512, stop=("<submit/>",))

    def __init__(
        self,
        variant: str | None = None,
        max_ops: int = 64,
        run_timeout_s: float = 10.0,
        client_timeout_s: float | None = None,
    ):
        problems = SESSION_PROBLEMS
        if variant:
            problems = tuple(p for p in SESSION_PROBLEMS if p.name == variant)
            if not problems:
                names = ", ".join(p.name for p in SESSION_PROBLEMS)
                raise ValueError(f"session-repair: unknown problem {variant!r}; problems: {names} (or no variant)")
        self.name = f"session-repair/{variant}" if variant else "session-repair"
        self.problems, self.max_ops, self.run_timeout_s = problems, max_ops, run_timeout_s
        self.client_timeout_s = client_timeout_s  # None: the sandbox client's own deadline
        self.size = len(problems)

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"{self.name}: task index must be >= 0 (got {index})")
        p: SessionProblem = self.problems[index % len(self.problems)]
        prompt = (
            f"Fix the bug in this Python project, then submit. {p.statement}\n"
            f"Files: {', '.join(path for path, _ in p.files)}\n"
            f"Run the visible tests with <run>{shlex.join(VISIBLE_CMD)}</run>; hidden tests judge the submission.\n"
            f"Act with tool calls (up to 8 per message, {self.max_ops} in all): {SYNTAX}\n"
        )
        data = {"files": [list(f) for f in p.files], "hidden": p.hidden, "problem": p.name}
        return Task(self.name, f"{p.name}-{index}", prompt, data)

    def make_env(self, task: Task, executor: Any = None) -> Environment:
        return SessionEnv(task, executor, self.max_ops, self.run_timeout_s, self.client_timeout_s)


def make_session_repair(variant: str | None) -> SessionRepairDomain:
    return SessionRepairDomain(variant)
