"""tests/test_session_faults.py's fault test through the real pipeline: `hpcrl run` (every component a local submitit
job: store, coordinator, two sandbox servers, learner, generator with the tiny untrained model)
on session episodes, and kill -9 of one sandbox server once 20 or more episodes hold open
sessions. Run once with `generators.session_fault=resume` and once with `reissue`; then:

- the supervisor restarted the killed server;
- every episode leased before the kill was stored exactly once (reissue: its faulted attempt
  failed with `sandbox_error` in coordinator/leases.jsonl and was leased again; resume: nothing
  failed, and some stored trajectories carry `resumes` and the fault, `hpcrl traj show` prints them);
- no reward came from a fault: every stored episode ended by its own check with reward 1, which
  a resumed episode earns only when its workspace was restored on the other server
  (tests/session_probe.py: the untrained model hardly ever writes a tool call, so the domain
  makes every step a session operation);
- nothing was lost: every leased episode was stored or was still in flight when the run
  stopped, and the learner trained no trajectory twice and none that was not stored.

Prints what it measured (episodes in flight at the kill, resumed/re-issued, failover time).
Needs bubblewrap as root (skips without; fails with HPCRL_REQUIRE_SANDBOX=1).
Run: .venv/bin/pytest tests/test_session_faults_run.py -s
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import session_probe

from hpcrl.core.metrics import read_endpoints
from hpcrl.jobs.localrun import pids
from hpcrl.rl.coordinator.events import LEASES_NAME, read_jsonl
from hpcrl.rl.coordinator.report import read_status
from hpcrl.rl.learner.service import AUDIT_NAME
from hpcrl.rl.store.reader import iter_segments

from audit import lineage
from conftest import RUN_GUARD_S, require_bwrap, wait_for
from test_run import finish, hpcrl, no_processes_left

HERE = Path(__file__).resolve().parent
UID_BASE = 61500  # server i's slots: 61500 + 2i + k; apart from other tests' slot uids
SESSION_DIR = "/var/tmp/hpcrl-sessions-faultrun"
IN_FLIGHT = 20  # open sessions (episodes past reset, not yet ended) at the kill
AFTER_STEPS = 3  # learner steps the run goes on for after the kill
MIN_DEEP = 3  # live episodes on the victim past their first step at the kill


def _past_first_step(log: Path, service: str) -> int:
    """Episodes whose session is on `service`, with a step finished and not ended (session_probe's log)."""
    last: dict[str, tuple[str, str]] = {}
    try:
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                last[parts[0]] = (parts[1], parts[2])
    except OSError:
        return 0
    return sum(1 for svc, what in last.values() if svc == service and what != "done")


def _sessions(run_dir: Path) -> dict[str, int]:
    """Open sessions per live sandbox server, from its Prometheus endpoint."""
    out = {}
    for name, url in read_endpoints(run_dir).items():
        if not name.startswith("sandbox-"):
            continue
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:  # not up yet, or the killed one
            continue
        m = re.search(r"^hpcrl_sandbox_sessions(?:\{[^}]*\})? (\S+)$", text, re.M)
        if m:
            out[name] = int(float(m.group(1)))
    return out


class Leases:
    """coordinator/leases.jsonl folded per episode: attempts leased, done count, failure reasons."""

    def __init__(self, run_dir: Path):
        self.leased: dict[int, list[int]] = collections.defaultdict(list)
        self.done: collections.Counter = collections.Counter()
        self.failed: dict[int, list[str]] = collections.defaultdict(list)
        self.lost: set[int] = set()  # expired, orphaned, released or requeued: issued again
        for rec in read_jsonl(run_dir / LEASES_NAME):
            for ep, attempt in rec.get("leased", ()):
                self.leased[int(ep)].append(int(attempt))
            for ep in rec.get("done", ()):
                self.done[int(ep)] += 1
            for ep, reason in rec.get("failed", ()):
                self.failed[int(ep)].append(str(reason))
            for key in ("orphaned", "released", "requeued"):
                self.lost.update(int(e) for e in rec.get(key, ()))
            for eps in (rec.get("expired") or {}).values():
                self.lost.update(int(e) for e in eps)


def _stored(run_dir: Path) -> list:
    return [cols.trajectory(i) for _, _, cols in iter_segments(run_dir / "trajectories") for i in range(cols.rows)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["resume", "reissue"])
def test_killing_a_sandbox_server_under_live_session_episodes(tmp_path, monkeypatch, mode):
    for k in range(4):
        require_bwrap(UID_BASE + k)
    probe_log = tmp_path / "probe.log"
    monkeypatch.setenv("HPCRL_PROBE_LOG", str(probe_log))  # the generator inherits it
    shutil.copy(HERE / "session_probe.py", tmp_path / "session_probe.py")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("domains:\n  - name: session-probe\n    module: session_probe:make_domain\n")
    proc = hpcrl(
        "run",
        str(cfg),
        f"experiment.run_root={tmp_path / 'runs'}",
        "learner.max_steps=100000",  # stopped (Ctrl-C) once the checks' conditions hold
        "learner.group_size=4",
        "learner.batch_groups=4",
        # Up to 32 episodes issued beyond what the learner consumed: 20+ live at once.
        "coordinator.max_groups_ahead=8",
        "generators.episodes_in_flight=32",
        f"generators.session_fault={mode}",
        "sandbox.servers=2",
        f"sandbox.uid_base={UID_BASE}",
        f"sandbox.session_dir={SESSION_DIR}",
        "metrics.bind_host=127.0.0.1",  # _sessions() reads the servers' endpoints
        "--run-id",
        mode,
    )
    run_dir = tmp_path / "runs" / mode

    def step() -> int:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        return ((read_status(run_dir) or {}).get("learner") or {}).get("step", 0)

    try:
        # -- the kill: sandbox-0 under IN_FLIGHT+ open sessions, some on each server, and the
        # live episodes one step or more in on average: a resume then has notes to restore.
        def crowded():
            step()
            s = _sessions(run_dir)
            gen = (((read_status(run_dir) or {}).get("generators") or {}).get("gen-0") or {}).get("stats") or {}
            live_steps = gen.get("steps", 0) - session_probe.STEPS * gen.get("trajectories", 0)
            # Episodes on sandbox-0 with a finished step and not ended: their resume must restore
            # what earlier steps wrote (the probe's own progress lines say where each one is).
            deep = _past_first_step(probe_log, "sandbox-0")
            if len(s) == 2 and min(s.values()) > 0 and sum(s.values()) >= IN_FLIGHT and deep >= MIN_DEEP:
                return {**s, "live_steps": live_steps, "sandbox0_past_first_step": deep}
            return None

        at_kill = wait_for(crowded, RUN_GUARD_S, 0.1, what=f"{IN_FLIGHT} open sessions over both sandbox servers")
        (victim,) = pids(run_dir, "sandbox-0")
        os.kill(victim, signal.SIGKILL)
        killed_at, killed_step = time.time(), step()
        before = Leases(run_dir)
        pre_kill = set(before.leased)
        live_at_kill = len(pre_kill - set(before.done) - set(before.failed))  # leased, not yet settled

        # -- the run goes on: the server is restarted, every pre-kill episode settles -----------
        wait_for(
            lambda: step() >= 0 and [p for p in pids(run_dir, "sandbox-0") if p != victim],
            RUN_GUARD_S,
            0.2,
            what="the supervisor to restart sandbox-0",
        )

        def settled() -> bool:
            leases = Leases(run_dir)
            return step() >= killed_step + AFTER_STEPS and all(leases.done[e] for e in pre_kill)

        wait_for(settled, RUN_GUARD_S, 0.5, what="every episode leased before the kill to be stored")
    finally:
        proc.send_signal(signal.SIGINT)
    out = finish(proc, RUN_GUARD_S)
    assert "sandbox-0 ended (" in out and "Traceback" not in out, out[-4000:]
    no_processes_left(run_dir)

    # -- exactly once, nothing lost ------------------------------------------------------------
    leases = Leases(run_dir)
    stored = _stored(run_dir)
    ids = [t.id for t in stored]
    assert len(ids) == len(set(ids)), "a trajectory was stored twice"
    by_episode = {int(t.id.rsplit("/", 1)[1]): t for t in stored}
    assert all(by_episode.get(e) for e in pre_kill), sorted(pre_kill - set(by_episode))
    assert all(leases.done[e] == 1 for e in pre_kill)
    assert set(leases.done) <= set(by_episode) <= set(leases.leased)
    # Leased = stored + in flight when the run stopped; a failed attempt was leased again.
    for e, reasons in leases.failed.items():
        assert len(leases.leased[e]) > len(reasons) or e not in pre_kill, (e, reasons, leases.leased[e])

    # -- no reward from a fault: every stored episode ran to its own check, and passed ------------
    for t in stored:
        assert [s.reward for s in t.steps] == [0.0] * (session_probe.STEPS - 1) + [1.0], (t.id, t.fault)
        assert t.truncation == "none", t.id
    records, _ = lineage(run_dir / AUDIT_NAME)
    trained = [i for r in records for i in r["trained"]]
    assert trained and len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert set(trained) <= set(ids), "the learner trained a trajectory the store does not hold"

    resumed = [t for t in stored if any(s.sandbox.resumes for s in t.steps)]
    failed = {e: r for e, r in leases.failed.items() if any(x.startswith("sandbox_error: ") for x in r)}
    if mode == "resume":
        assert not leases.failed, dict(leases.failed)
        assert resumed, "no episode met the killed server"
        # A step after the first was resumed: its restored workspace held earlier steps' notes.
        assert any(s.sandbox.resumes for t in resumed for s in t.steps[1:]), [t.id for t in resumed]
        for t in resumed:
            assert "sandbox-0" in t.fault, t.fault
            assert int(t.id.rsplit("/", 1)[1]) in pre_kill and t.started_at < killed_at
        show = hpcrl("traj", "show", str(run_dir), resumed[0].id)
        text = finish(show, 300)
        n = sum(s.sandbox.resumes for s in resumed[0].steps)
        assert show.returncode == 0 and f"resumed {n}x after a sandbox fault" in text, text
        assert f"  fault: {resumed[0].fault}" in text, text
    else:
        assert not resumed, [t.id for t in resumed]
        assert failed and set(failed) <= pre_kill, dict(leases.failed)
        for e, reasons in failed.items():
            assert all("sandbox-0" in r for r in reasons), reasons
            assert leases.leased[e] == list(range(len(reasons) + 1)), leases.leased[e]  # issued again, each time
            assert by_episode[e].started_at > killed_at  # what was stored is the re-issue, from the start

    # -- what it measured ------------------------------------------------------------------------
    faulted = [(i, s) for t in resumed for i, s in enumerate(t.steps) if s.sandbox.resumes]
    figures = {
        "mode": mode,
        "open_sessions_at_kill": at_kill,
        "episodes_in_flight_at_kill": live_at_kill,
        "leased_before_kill": len(pre_kill),
        "learner_step_at_kill": killed_step,
        "resumed_trajectories": len(resumed),
        "reissued_episodes": len(failed),
        "stored": len(stored),
        "trained": len(trained),
        "resumed_step_env_s": sorted(round(s.env_s, 2) for _, s in faulted),
        "resumed_step_numbers": sorted(i + 1 for i, _ in faulted),
        "kill_to_first_resumed_trajectory_stored_s": (
            round(min(t.finished_at for t in resumed) - killed_at, 2) if resumed else None
        ),
        "kill_to_first_reissue_stored_s": (
            round(min(by_episode[e].finished_at for e in failed) - killed_at, 2) if failed else None
        ),
        "client_timeout_s": session_probe.CLIENT_TIMEOUT_S,
    }
    print("session fault figures:", json.dumps(figures))
