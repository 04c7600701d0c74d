"""Sandbox faults roll back, they do not poison training: two real sandbox
servers (`hpcrl sandbox serve` processes, bwrap sandboxes, CURVE ZeroMQ), 20 live session-repair
episodes stepped by a scripted policy, and one server SIGKILLed once every episode has done two
steps. With `on_fault: resume` every episode continues on the other server from its last good
step and earns its scripted fix's reward 1; with `reissue` the faulted attempts are dropped as
`sandbox_error` (through the real LocalTaskSource re-issue) and their re-issues earn reward 1.
In neither is any reward taken from a faulted step.

The episodes are driven as the generator drives them (one pool thread per step, a failure of the
step reported to the task source, a StepResult's info turned into the step's sandbox outcome by
the generator's own `_outcome`); the model is a script, so no policy is needed.
Needs bubblewrap and root; skips without, fails with HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_session_env import FIXES, VISIBLE

from hpcrl.core.transport import Node, read_endpoint
from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
from hpcrl.rl.domains.session_repair import SessionRepairDomain
from hpcrl.rl.rollout.generator import _outcome
from hpcrl.rl.rollout.remote import ThreadLocalJudge
from hpcrl.sandbox.result import SandboxError

from conftest import require_bwrap

UIDS = (61400, 61410)  # server i's slots: UIDS[i], UIDS[i] + 1; apart from other tests' slot uids
EPISODES = 20


@pytest.fixture(scope="module")
def bwrap_ok():
    for uid in UIDS:
        require_bwrap(uid)


def _serve(run_dir: Path, tmp_path: Path, i: int) -> subprocess.Popen:
    config = tmp_path / f"sandbox-{i}.yaml"
    config.write_text(f"sandbox:\n  uid_base: {UIDS[i]}\n  session_dir: /var/tmp/hpcrl-sessions-faulttest-{i}\n")
    cmd = [sys.executable, "-m", "hpcrl.jobs.cli", "sandbox", "serve", "--slots", "2"]
    cmd += ["--run-dir", str(run_dir), "--name", f"sandbox-{i}", "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            read_endpoint(run_dir, f"sandbox-{i}")
            return proc
        except Exception:  # not published yet
            pass
        if proc.poll() is not None:
            raise AssertionError(f"sandbox-{i} exited: {proc.stderr.read().decode()}")
        time.sleep(0.05)
    raise AssertionError(f"sandbox-{i} did not publish its endpoint in 60 s")


class _Source(LocalTaskSource):
    """The local task source (re-issue first in line), keeping the reasons episodes failed for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lock = threading.Lock()
        self.reasons: dict[int, list[str]] = {}

    def failed(self, ticket, reason, permanent=False):
        with self.lock:
            self.reasons.setdefault(ticket.episode, []).append(reason)
            super().failed(ticket, reason, permanent)


def _run(mode: str, run_dir: Path, tmp_path: Path):
    servers = [_serve(run_dir, tmp_path, i) for i in (0, 1)]
    # A dead server is noticed when a request has had no answer for client_timeout_s.
    domain = SessionRepairDomain(client_timeout_s=15.0)
    source = _Source(TaskSampler({domain.name: 1.0}, group_size=1, seed=0, sizes={domain.name: domain.size}))
    tickets = source.take(EPISODES)
    progress: dict[int, int] = {}
    cond = threading.Condition()
    gate = threading.Event()
    finished: dict[int, tuple] = {}  # episode -> (steps' outcomes, rewards, env)
    errors: list[BaseException] = []

    def episode(ticket, ex):
        """One attempt, stepped as the generator steps it; a fault fails it to the source."""
        task = domain.task(ticket.task_index)
        path, fix = FIXES[task.data["problem"]]
        env = domain.make_env(task, ex)
        env.on_fault = mode  # what the generator sets from generators.session_fault
        actions = [VISIBLE, f'<read path="{path}"/>', f'<write path="{path}">{fix}</write>{VISIBLE}', "<submit/>"]
        rewards, outcomes = [], []
        try:
            env.reset()
            for k, action in enumerate(actions):
                if k == 2 and ticket.attempt == 0:
                    with cond:
                        progress[ticket.episode] = 2
                        cond.notify_all()
                    gate.wait()
                try:
                    r = env.step(action)
                except SandboxError as exc:
                    env.close()
                    source.failed(ticket, f"sandbox_error: step {k + 1}: {exc}")  # as Generator._apply_step
                    return None
                rewards.append(r.reward)
                outcomes.append(_outcome(r.info.get("feedback"), r.info))
                if r.done:
                    break
            finished[ticket.episode] = (outcomes, rewards, env, ticket.attempt)
            source.done(ticket)
        except BaseException as exc:  # reported below, not lost in a thread
            errors.append(exc)

    try:
        with Node(run_dir, "gen-0") as node:
            ex = ThreadLocalJudge(node, ["sandbox-0", "sandbox-1"])
            threads = [threading.Thread(target=episode, args=(t, ex)) for t in tickets]
            for t in threads:
                t.start()
            with cond:
                assert cond.wait_for(lambda: len(progress) == EPISODES or errors, timeout=300), progress
            assert not errors, errors
            servers[0].send_signal(signal.SIGKILL)
            gate.set()  # the steps after the kill: those on sandbox-0 meet a dead server
            servers[0].wait()
            for t in threads:
                t.join(300)
            # The re-issued attempts are first in the source's line: take and run them.
            while len(finished) < EPISODES and not errors:
                again = source.take(EPISODES - len(finished))
                assert all(t.attempt > 0 and t.episode not in finished for t in again), again
                extra = [threading.Thread(target=episode, args=(t, ex)) for t in again]
                for t in extra:
                    t.start()
                for t in extra:
                    t.join(300)
            assert not errors, errors
    finally:
        for p in servers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
    return source, finished


def _check_no_reward_from_a_fault(finished):
    """Every episode ended by its scripted submit, reward 1, the earlier steps 0: nothing scored
    a fault (a faulted step counted as the model's failure would have ended an episode at 0)."""
    assert sorted(finished) == list(range(EPISODES))
    for outcomes, rewards, _, _ in finished.values():
        assert rewards == [0.0, 0.0, 0.0, 1.0]
        assert outcomes[3].command == "submit" and outcomes[3].tests_passed == 1
        assert outcomes[2].command.startswith("write ") and "; run python3 -m unittest -q" in outcomes[2].command
        assert outcomes[2].tests_total >= 1 and outcomes[2].tests_passed == outcomes[2].tests_total


def test_killing_a_server_mid_episode_resumes_every_episode_on_the_other(bwrap_ok, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source, finished = _run("resume", run_dir, tmp_path)
    _check_no_reward_from_a_fault(finished)
    assert source.reasons == {} and source.reissued == 0
    resumed = [e for e, (o, _, env, _) in finished.items() if env.resumes]
    # Environments spread over both servers: those that were on the killed one resumed, once each.
    assert 0 < len(resumed) < EPISODES
    for e in resumed:
        outcomes, _, env, _ = finished[e]
        assert env.resumes == 1 and "sandbox-0" in env.fault
        assert sum(o.resumes for o in outcomes) == 1 and outcomes[2].resumes == 1  # the step after the kill
    # The first step's visible tests failed (the bug): the model's failure, not a fault.
    first = next(iter(finished.values()))[0][0]
    assert first.status == "error" and first.tests_passed < first.tests_total


def test_killing_a_server_mid_episode_reissues_every_faulted_episode(bwrap_ok, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source, finished = _run("reissue", run_dir, tmp_path)
    _check_no_reward_from_a_fault(finished)
    assert 0 < len(source.reasons) < EPISODES and source.reissued == len(source.reasons)
    for e, reasons in source.reasons.items():
        assert len(reasons) == 1 and reasons[0].startswith("sandbox_error: step 3: ") and "sandbox-0" in reasons[0]
        _, _, env, attempt = finished[e]
        assert attempt == 1 and env.resumes == 0  # issued again, from the start, and completed
    assert all(finished[e][3] == 0 for e in finished if e not in source.reasons)
