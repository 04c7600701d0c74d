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

Infrastructure faults (the server unreachable or not answering within a run's limit plus the
client's slack, the session gone with a restarted server, a sandbox_error run) are never the
model's: its own code failing or timing out under its own limit is an ordinary observation.
What a fault does is `on_fault` (the generator sets it from `generators.session_fault`):

  resume   the environment opens a session on the next sandbox service (the same one, restarted,
           where there is only one), restores the workspace there and runs the faulted step's
           action again, up to `max_resumes` times per step; the step's info says `resumes` and
           `fault`. The workspace is rebuilt by replaying a client-side log of the good steps'
           operations that can change it (the task's files, then the model's writes and runs, in
           order; a run's output is discarded), not from a server snapshot: a server's
           snapshots live in its session_dir and die with it, while the log is what the model
           already sent (no extra operation per step). So files a run made or edited (a build,
           `sed -i`) come back too, at the price of running those commands again on a fault.
  reissue  the fault raises `SandboxError`; the generator drops the episode unstored and untrained
           (reason "sandbox_error: ...") and the coordinator issues it again from the start.

Either way a step whose operations faulted gets no reward: it is retried or the episode is dropped.

The executor is what the generator hands every code domain: a `ThreadLocalJudge` (its node and
sandbox services), or a `SandboxClient`, or a `SandboxJudge` over one. The environment opens its
own client to one service, since a session lives on the server that opened it and the
generator steps an episode on whichever pool thread is free (one thread at a time).
"""

from __future__ import annotations

import itertools
import logging
import re
import shlex
import threading
from collections.abc import Sequence
from typing import Any

from hpcrl.rl.domains.base import Domain, Environment, ExecFeedback, StepResult, Task
from hpcrl.rl.domains.code import sandbox_outcome
from hpcrl.rl.domains.toolcalls import ListFiles, Read, Run, Submit, ToolCall, Write, parse_action
from hpcrl.sandbox.judge import FunctionTask
from hpcrl.sandbox.result import SandboxError

# hpcrl imports inside functions here would load msgpack, zmq for every importer of this module (start-up speed).

__all__ = ["SessionEnv", "SessionDomain", "FAULT_POLICIES"]

log = logging.getLogger(__name__)

_OUTPUT_CHARS = 2000  # of a read file or a run's output, per call: the context is the model's budget
_GONE = "no open session"  # the server's words for a session it does not hold (SessionManager._take)
_services = itertools.count()  # spreads environments over the sandbox services round-robin
_UNITTEST_RAN = re.compile(rb"^Ran (\d+) tests? in ", re.M)
_UNITTEST_BAD = re.compile(rb"^FAILED \((?:failures=(\d+))?(?:, )?(?:errors=(\d+))?", re.M)
FAULT_POLICIES = ("resume", "reissue")


def _session_target(executor: Any) -> tuple[Any, list[str]]:
    """(node, sandbox services, this environment's first) for its own client; ValueError if the
    executor has none. The others are where a faulted session resumes."""
    from hpcrl.sandbox.client import SandboxClient

    target = getattr(executor, "sandbox", executor)  # a SandboxJudge wraps a client or a local backend
    if isinstance(target, SandboxClient):
        return target.node, [target.service]
    services: Sequence[str] = getattr(executor, "services", ())
    if getattr(executor, "node", None) is not None and services:
        k = next(_services) % len(services)
        return executor.node, list(services[k:]) + list(services[:k])
    raise ValueError(
        "session domains need a sandbox server (sessions live there); give the generator a sandbox client "
        f"(hpcrl run starts sandbox servers), not {type(executor).__name__}"
    )


class SessionEnv(Environment):
    #: the sandbox language the session opens with (its tools must exist on the server); a
    #: subclass for another language's projects sets it (c_repair.CRepairEnv: "c")
    language = "python"

    def __init__(
        self,
        task: Task,
        executor: Any,
        max_ops: int,
        run_timeout_s: float = 10.0,
        client_timeout_s: float | None = None,
        on_fault: str = "resume",
        max_resumes: int = 2,
    ):
        self.task, self.max_ops, self.run_timeout_s = task, max_ops, run_timeout_s
        self._node, self._services = _session_target(executor)
        self._service = self._services[0]
        self._client_timeout_s = client_timeout_s
        if on_fault not in FAULT_POLICIES:
            raise ValueError(f"session on_fault must be one of {', '.join(FAULT_POLICIES)} (got {on_fault!r})")
        self.on_fault, self.max_resumes = on_fault, max_resumes
        self.resumes = 0  # sessions reopened after faults, this episode
        self.fault = ""  # the last infrastructure fault met, this episode
        # The good steps' writes and runs, in order: what a resume replays on a new session.
        self._replay: list[dict] = []
        self._step_replay: list[dict] = []
        self._step_calls: list[str] = []  # what this step ran, for its command summary
        self._client = None
        self._sid: str | None = None
        # The server did not answer, or no longer holds the session: closing it would only wait
        # out another timeout (holding a pool thread and delaying the resume); its expiry cleans up.
        self._lost = False
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
        with self._lock:
            self._replay = [{"op": "write", "path": str(p), "content": str(c)} for p, c in self.task.data["files"]]
            self.resumes, self.fault = 0, ""
            # Nothing of the model's is lost yet: a server that fails to open is passed over
            # whatever `on_fault` says, each service tried once.
            for i in range(len(self._services)):
                try:
                    self._open()
                    break
                except SandboxError as exc:
                    self.fault = str(exc)
                    if i + 1 == len(self._services):
                        raise
                    self._service = self._next_service()
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
                return self._step_resuming(action)
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
    def _step_resuming(self, action: str) -> StepResult:
        """`_step`, and with on_fault resume, again on a reopened session after a fault: the
        faulted attempt's effects are discarded with its session, so the model's action is judged
        once, on the workspace of its last good step."""
        ops0, attempt = self.ops, 0
        while True:
            self._step_replay, self._step_calls = [], []
            try:
                if attempt:
                    self._reopen()
                self.ops, self.done = ops0, False
                result = self._step(action)
                break
            except SandboxError as exc:
                self.fault = str(exc)
                attempt += 1
                if self.on_fault != "resume" or attempt > self.max_resumes or self._close_requested:
                    raise
                log.warning("%s/%s: resuming after %s", self.task.domain, self.task.id, exc)
        self._replay += self._step_replay
        self.resumes += attempt
        info = dict(result.info or {})
        info["command"] = "; ".join(self._step_calls)
        if attempt:
            info.update(resumes=attempt, fault=self.fault)
        return result._replace(info=info)

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
        self._step_calls.append(_label(call))
        if isinstance(call, Write):
            r = self._op({"op": "write", "path": call.path, "content": call.content})
            self.sent_bytes += len(call.content.encode())
            if r["ok"]:
                self._step_replay.append({"op": "write", "path": call.path, "content": call.content})
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
        op = {"op": "run", "cmd": list(call.argv), "timeout_s": call.timeout_s or self.run_timeout_s}
        r = self._op(op)
        if not r["ok"]:
            return f"{head} error: {r['error']}", None
        self._step_replay.append(op)  # it may have changed the workspace (a build, a sed -i)
        fb = _feedback(r, "exit 0" if r.get("exit_code") == 0 else "failed")
        out = _text(bytes(r.get("stdout") or b"") + bytes(r.get("stderr") or b""))
        return f"{head} {fb.status}, exit code {fb.exit_code}\n{out}", fb

    def _submit(self) -> StepResult:

        self._step_calls.append("submit")
        d = self.task.data
        files = self._package_files(d["packages"])
        if isinstance(files, str):
            return self._verdict(False, "error", -1, 0.0, "hidden tests failed", files)
        task = FunctionTask("", d["entry_point"], d["hidden"], name=f"{self.task.domain}/{self.task.id}", files=files)
        return self._judged(task)

    def lay_out(self, files: dict[str, str]) -> None:
        """Write `files` into the workspace as the model's writes would (tools: `hpcrl domains
        check`); ValueError naming a file the server refuses."""
        for path, content in files.items():
            r = self._op({"op": "write", "path": path, "content": content})
            if not r["ok"]:
                raise ValueError(f"{path}: {r['error']}")
            self._replay.append({"op": "write", "path": path, "content": content})

    # -- judging a submission, outside the workspace ---------------------------------------------
    def _read(self, paths) -> dict[str, str] | str:
        """{path: text} of workspace files, or why not (the model's doing: a missing or odd file)."""
        out = {}
        for path in paths:
            r = self._op({"op": "read", "path": path})
            if not r["ok"]:
                return f"cannot read {path}: {r['error']}"
            try:
                out[path] = bytes(r["content"]).decode("utf-8")
            except UnicodeDecodeError:
                return f"{path} is not UTF-8 text"
        return out

    def _package_files(self, packages, max_files: int = 64) -> tuple[tuple[str, str], ...] | str:
        """The .py files under the package directories, as the model left them."""
        r = self._op({"op": "list"})
        if not r["ok"]:
            return f"cannot list the workspace: {r['error']}"
        paths = sorted(
            e["path"]
            for e in r["entries"]
            if e["type"] == "file" and e["path"].endswith(".py") and e["path"].split("/")[0] in packages
        )
        if len(paths) > max_files:
            return f"more than {max_files} files under {', '.join(packages)}"
        got = self._read(paths)
        return got if isinstance(got, str) else tuple(got.items())

    def _judged(self, task, what: str = "hidden tests") -> StepResult:
        """End the episode with the server's judge_function verdict on `task`."""
        v = self._judge_call(lambda client: client.judge_function(task))
        status, code, wall = sandbox_outcome(v.result)  # a sandbox_error raises: the infrastructure's
        return self._verdict(v.passed, status, code, wall, f"{what} passed" if v.passed else f"{what} failed", v.reason)

    def _verdict(self, passed: bool, status: str, code: int, wall: float, message: str, reason: str = "") -> StepResult:
        self.done = True
        if not passed and status == "ok":
            status = "error"  # it ran but a check failed: the store's "error", as judge_function reports it
        fb = ExecFeedback(int(passed), 1, status, code, wall, message)
        return StepResult("", float(passed), True, {"feedback": fb, "ops": self.ops, "reason": reason or message})

    def _judge_call(self, fn):
        """fn(client) on this session's server; SandboxError when the failure is the infrastructure's."""
        from hpcrl.core.transport import TransportError
        from hpcrl.sandbox.client import SandboxBusy

        try:
            return fn(self._client)
        except (TransportError, SandboxError, ValueError) as exc:
            self._lost = isinstance(exc, TransportError) and not isinstance(exc, SandboxBusy)
            raise SandboxError(f"sandbox judge on {self._service}: {type(exc).__name__}: {exc}") from None

    # -- machinery ------------------------------------------------------------------------------
    def _open(self) -> None:
        """A new session on `self._service` with the good steps replayed; SandboxError on a fault."""
        from hpcrl.sandbox.client import SandboxClient

        self._end()
        self._lost = False
        self._client = SandboxClient(self._node, self._service, total_timeout_s=self._client_timeout_s)
        try:
            self._sid = self._op({"op": "open", "language": self.language})["session"]
            for op in self._replay:
                r = self._op(op)
                if op["op"] == "write":
                    if not r["ok"]:  # written before without complaint: the infrastructure's doing
                        raise SandboxError(f"restoring {op['path']} into the session failed: {r['error']}")
                    self.sent_bytes += len(op["content"].encode())
        except BaseException:
            self._end()
            raise

    def _next_service(self) -> str:
        return self._services[(self._services.index(self._service) + 1) % len(self._services)]

    def _reopen(self) -> None:
        """After a fault: the workspace of the last good step, in a session on the next service."""
        self._service = self._next_service()
        self._open()

    def _op(self, op: dict) -> dict:
        """One session operation; SandboxError when the failure is the infrastructure's."""
        from hpcrl.core.transport import TransportError
        from hpcrl.sandbox.client import SandboxBusy

        if op["op"] != "open":
            op = {**op, "session": self._sid}
        try:
            r = self._client.session(op)
        except (TransportError, SandboxError, ValueError) as exc:  # unreachable, timed out, refused by the server
            self._lost = isinstance(exc, TransportError) and not isinstance(exc, SandboxBusy)
            raise SandboxError(f"sandbox session {op['op']} on {self._service}: {type(exc).__name__}: {exc}") from None
        if not r.get("ok") and (op["op"] == "open" or _GONE in str(r.get("error"))):
            self._lost = True
            # A restarted server swept the session (or never opened one): the model's work is gone.
            raise SandboxError(f"sandbox session {op['op']} on {self._service}: {r.get('error')}")
        if r.get("ok") and op["op"] == "run" and r.get("status") == "sandbox_error":
            sandbox_outcome(_Result(r))  # raises SandboxError, as the code domains' judge does
        return r

    def _end(self) -> None:
        """Close the session (best effort: an unreachable server expires it) and the client."""
        sid, client, self._sid, self._client = self._sid, self._client, None, None
        if client is None:
            return
        try:
            if sid is not None and not self._lost:
                # Briefly: the generator closes finished episodes from its loop; a server that
                # does not answer expires the session itself.
                client.session({"op": "close", "session": sid}, timeout_s=min(self._client_timeout_s or 5.0, 5.0))
        except Exception:  # the server's idle expiry removes what we could not close
            pass
        finally:
            client.close()


class _Result:
    """The attributes of an ExecResult that `sandbox_outcome` reads, over a session run's result mapping."""

    def __init__(self, r: dict):
        self.status, self.exit_code, self.signal = r.get("status"), r.get("exit_code"), r.get("signal")
        self.wall_s = float(r.get("wall_s") or 0.0)
        self.stderr = bytes(r.get("stderr") or b"")


def _feedback(r: dict, message: str) -> ExecFeedback:
    """A run's outcome; tests passed/total from unittest's summary where it printed one, else
    the run itself as one test (passed when it exited 0)."""
    status, code, wall = sandbox_outcome(_Result(r))
    passed, total = int(code == 0 and status == "ok"), 1
    out = bytes(r.get("stdout") or b"") + bytes(r.get("stderr") or b"")
    ran = _UNITTEST_RAN.findall(out)
    if ran and int(ran[-1]) > 0:
        total = int(ran[-1])
        bad = _UNITTEST_BAD.findall(out)
        failed = sum(int(x or 0) for x in bad[-1]) if bad else 0
        passed = max(total - failed, 0) if status in ("ok", "error") else 0
    return ExecFeedback(passed, total, status, code, wall, message)


def _label(call: ToolCall) -> str:
    """A short name of a tool call for the step's command summary."""
    if isinstance(call, Write):
        return f"write {call.path}"
    if isinstance(call, Read):
        return f"read {call.path}"
    if isinstance(call, ListFiles):
        return "list"
    if isinstance(call, Run):
        return f"run {shlex.join(call.argv)}"
    return "submit"


def _text(data: bytes) -> str:
    text = bytes(data).decode("utf-8", "replace")
    return (
        text if len(text) <= _OUTPUT_CHARS else f"...({len(text) - _OUTPUT_CHARS} chars cut)\n" + text[-_OUTPUT_CHARS:]
    )


class SessionDomain(Domain):
    """What the session domains share for tools: the workspace is the task's files, and a
    submission is laid over it and submitted as an episode would."""

    def workspace(self, task: Task) -> dict[str, str]:
        return {str(path): str(content) for path, content in task.data["files"]}

    def submit(self, task: Task, files: dict[str, str], executor: Any) -> StepResult:
        env = self.make_env(task, executor)
        try:
            env.reset()
            env.lay_out(files)
            return env.step("<submit/>")
        finally:
            env.close()
