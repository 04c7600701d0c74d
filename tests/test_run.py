"""`hpcrl run` end to end on this machine (every component a submitit LocalExecutor job), `hpcrl
status`, and killing the learner mid-run: it resumes from its checkpoint, and the trajectories
the final model was trained on hold every stored trajectory once (trained, dropped, buffered
or still unread), none twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.jobs.localrun import pids
from hpcrl.rl.coordinator.report import read_status
from hpcrl.rl.learner.service import AUDIT_NAME, CURSOR_NAME

from audit import lineage
from conftest import RUN_GUARD_S, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _child_setup() -> None:
    # A site umask of 002 (group-writable) must not open the run directory to others.
    os.umask(0o002)
    # Tests stop runs with SIGINT, as Ctrl-C would. A suite started in the background (`make test &`,
    # nohup, a CI runner) hands its children SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: the run would never stop. Give the child the default back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def hpcrl(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    kw.setdefault("preexec_fn", _child_setup)
    return subprocess.Popen(
        [sys.executable, "-m", "hpcrl.jobs.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        **kw,
    )


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # hpcrl run stops its jobs on Ctrl-C
        out, _ = proc.communicate(timeout=90)
        raise AssertionError(f"hpcrl run did not finish in {timeout_s:.0f} s:\n{out[-3000:]}") from None
    return out


def no_processes_left(run_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while any(pids(run_dir, r) for r in ("coordinator", "store", "learner", "gen", "sandbox")):
        assert time.monotonic() < deadline, {r: pids(run_dir, r) for r in ("coordinator", "store", "learner", "gen")}
        time.sleep(0.5)


@pytest.mark.slow
def test_hpcrl_run_learns_and_hpcrl_status_reports(tmp_path):
    proc = hpcrl("run", "config.yaml", f"experiment.run_root={tmp_path}", "learner.max_steps=150", "--run-id", "e2e")
    out = finish(proc, RUN_GUARD_S)
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "e2e"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, 151))
    untrained, trained = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert untrained < 0.1 and trained > max(0.5, untrained + 0.4), (rewards[:5], rewards[-10:])
    assert (run_dir / "reward.png").stat().st_size > 10_000
    assert "reward curve:" in out and f"-> {rewards[-1]:.3f} (step 150)" in out

    status = read_status(run_dir)
    assert status["learner"]["step"] == 150 and status["counts"]["completed"] >= 150 * 256
    assert status["state"] == "finished"  # not "stopping": the coordinator wrote its last word on exit
    assert set(status["busy"]) == {"generator", "learner", "sandbox"}
    assert all(r["traj_per_s"] > 0 for r in rows[10:])
    shared = [str(p) for p in [run_dir, *run_dir.rglob("*")] if not p.is_symlink() and p.stat().st_mode & 0o077]
    assert not shared, f"readable or writable by others under the run directory: {shared[:5]}"
    stat = hpcrl("status", str(run_dir))
    text = finish(stat, 300)
    assert stat.returncode == 0, text
    assert "step 150" in text and "trajectories/s" in text and "arith/copy" in text and "gen-0" in text
    # Per domain: what was issued, trained and dropped, and the length of what was trained.
    stat = hpcrl("status", str(run_dir), "--json")
    domains = json.loads(finish(stat, 300))["domains"]
    assert set(domains) == {"arith/copy", "arith/add1-mod10", "arith/max2"}, domains
    keys = {"issued", "trained", "dropped_stale", "trained_turns_mean", "started_turns_mean"}
    assert all(keys <= set(d) and d["trained"] > 0 and d["trained_turns_mean"] == 1.0 for d in domains.values())
    assert sum(d["trained"] for d in domains.values()) == 150 * 256
    no_processes_left(run_dir)


def _last_audited_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / AUDIT_NAME).read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:  # the line being written
            pass
    return max(steps)


@pytest.mark.slow
def test_killed_learner_resumes_without_losing_or_repeating_trajectories(tmp_path):
    from hpcrl.rl.learner.checkpoints import COMPLETE_NAME, resume_tag
    from hpcrl.rl.store.reader import StoreReader, iter_segments

    proc = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=40",
        "learner.checkpoint_every=10",
        "--run-id",
        "kill",
    )
    run_dir = tmp_path / "kill"
    deadline = time.monotonic() + RUN_GUARD_S
    killed = None
    while killed is None:
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stdout.read()[-3000:] if proc.poll() else "no progress"
        )
        # The audit log is written (and fsynced) at every step; status.json lags it. Kill 1-7 steps
        # past a checkpoint (every 10), so 2+ steps before the next, and the dead life has trained
        # steps its restart must redo, whatever the machine's speed: one read of the log just
        # before the kill, no step counted from a lagging status.
        step = _last_audited_step(run_dir)
        learner = pids(run_dir, "learner")
        if step >= 14 and step % 10 in range(1, 8) and learner:
            os.kill(learner[0], signal.SIGKILL)
            killed = step
            # The newest whole checkpoint at the kill is what the restart must resume from.
            tag = resume_tag(run_dir / "checkpoints")
            saved = json.loads((run_dir / "checkpoints" / tag / COMPLETE_NAME).read_text())["step"]
        time.sleep(0.2)
    assert saved >= 10, tag
    out = finish(proc, RUN_GUARD_S)
    assert proc.returncode == 0, out[-4000:]

    records, lives = lineage(run_dir / AUDIT_NAME)
    assert lives == 2, "the learner should have been restarted once"
    assert [r["step"] for r in records] == list(range(1, 41))
    audit = [json.loads(line) for line in (run_dir / AUDIT_NAME).read_text().splitlines()]
    resumed = [a for a in audit if "resumed_step" in a]
    assert resumed[1]["resumed_step"] == saved and resumed[1]["version"] > killed  # versions only grow

    trained = [i for r in records for i in r["trained"]]
    dropped = [i for r in records for i in r["dropped"]]
    assert len(trained) == len(set(trained)) == 40 * 256, "a trajectory was trained twice"
    assert not set(trained) & set(dropped)
    cursor = json.loads((run_dir / CURSOR_NAME).read_text())
    assert cursor["step"] == 40
    buffered = set(cursor["buffered"]) | set(cursor["pending_dropped"])
    reader = StoreReader(run_dir)
    reader.load_state_dict(cursor["reader"])
    unread = {t.id for t in reader}
    stored = {cols.trajectory(i).id for _, _, cols in iter_segments(run_dir / "trajectories") for i in range(cols.rows)}
    accounted = set(trained) | set(dropped) | buffered | unread
    assert stored <= accounted, (
        f"{len(stored - accounted)} stored trajectories were lost, e.g. {sorted(stored - accounted)[:3]}"
    )
    assert len(stored) > 40 * 256
    no_processes_left(run_dir)
    _plot_and_trace_a_redone_step(run_dir, saved)


def _plot_and_trace_a_redone_step(run_dir: Path, saved: int) -> None:
    """`hpcrl plot` and `hpcrl traj trace` on a finished run whose learner was restarted once."""
    plot = hpcrl("plot", str(run_dir), "--json")
    text = finish(plot, 300)
    assert plot.returncode == 0, text
    summary = json.loads(text)
    names = ("reward", "throughput", "staleness", "domains", "utilisation")
    assert summary["plots"] == [str(run_dir / "plots" / f"{n}.png") for n in names]
    assert all(Path(p).stat().st_size > 10_000 for p in summary["plots"])
    learner = summary["share"]["learner"]
    assert abs(sum(learner.values()) - 1) < 0.01 and learner["training"] > 0 and learner["down"] > 0, learner
    assert abs(sum(summary["share"]["gen-0"].values()) - 1) < 0.01, summary["share"]
    # A trajectory the dead life trained after its last checkpoint: the second life trained (or
    # dropped) it again, and only that second time counts.
    audit = [json.loads(line) for line in (run_dir / AUDIT_NAME).read_text().splitlines()]
    redone = next(a for a in audit if a.get("life") == 1 and a.get("step", 0) > saved)
    tid = redone["trained"][0]
    tr = hpcrl("traj", "trace", str(run_dir), tid)
    text = finish(tr, 300)
    assert tr.returncode == 0, text
    lines = text.splitlines()
    assert lines[0].startswith(f"episode {tid.rsplit('/', 1)[1]}: {tid} (arith/"), text
    whats = [line.split("s  ", 1)[1] for line in lines[1:]]
    assert whats[0].startswith("leased to gen-0") and any(w.startswith("stored as " + tid) for w in whats), text
    first = f"{tid} trained in learner step {redone['step']} "
    assert any(w.startswith(first) and w.endswith("after a restart)") for w in whats), text
    assert any(" life 2" in w and "superseded" not in w for w in whats), text


@pytest.mark.slow
def test_code_domains_run_through_a_sandbox_server(tmp_path):
    """Multi-step code episodes: the generator's env threads call the sandbox server job."""
    from hpcrl.rl.store.reader import StoreReader

    if os.environ.get("HPCRL_REQUIRE_SANDBOX") != "1":
        from hpcrl.core.config import SandboxConfig
        from hpcrl.sandbox.auto import make_backend
        from hpcrl.sandbox.result import SandboxError

        try:
            make_backend(SandboxConfig()).check()
        except SandboxError as exc:
            pytest.skip(f"sandbox unavailable: {exc}")
    proc = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path}",
        "domains=[{name: arith/copy}, {name: code-repair, weight: 0.5}, {name: synth, weight: 0.5}]",
        "learner.max_steps=4",
        "learner.batch_groups=4",
        "learner.group_size=4",
        "generators.max_new_tokens=48",
        "generators.episodes_in_flight=32",
        "--run-id",
        "code",
    )
    out = finish(proc, RUN_GUARD_S)
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "code"
    trajs = list(StoreReader(run_dir))
    code = [t for t in trajs if t.domain in ("code-repair", "synth")]
    assert code and {t.domain for t in code} == {"code-repair", "synth"}
    for t in code:
        assert all(s.sandbox.status in ("ok", "error", "timeout", "oom", "crash") for s in t.steps), t.id
    # an untrained model fails, reads the feedback, and tries again (synth: 2 turns, repair: 3)
    assert any(len(t.steps) == 2 for t in code if t.domain == "synth")
    assert any(len(t.steps) == 3 for t in code if t.domain == "code-repair")
    status = read_status(run_dir)
    assert status["completed_by_domain"].get("synth", 0) > 0
    no_processes_left(run_dir)
    repair = next(t for t in code if t.domain == "code-repair" and len(t.steps) == 3)
    tr = hpcrl("traj", "trace", str(run_dir), repair.id, "--json")
    text = finish(tr, 300)
    assert tr.returncode == 0, text
    events = json.loads(text)["events"]
    steps = [e for e in events if e["what"] == "step"]
    assert [e["data"]["step"] for e in steps] == [1, 2, 3], text
    assert all(e["data"]["sandbox"] == s.sandbox.status for e, s in zip(steps, repair.steps))
    assert [e["time"] for e in events if e["time"]] == sorted(e["time"] for e in events if e["time"])


@pytest.mark.slow
def test_generator_waits_out_a_coordinator_restart_and_a_hung_generator_is_restarted(tmp_path):
    """kill -9 of the coordinator, restarted only after a backoff longer than a generator's own
    patience (4 x 5 s): the generator waits for it (supervision.json) instead of dying too. Then
    SIGSTOP of the generator: its heartbeat goes stale, the supervisor kills and restarts it."""
    from hpcrl.core.liveness import read_heartbeats

    proc = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=40",
        "supervise.backoff_s=25",
        "supervise.hang_s=20",
        "--run-id",
        "faults",
    )
    run_dir = tmp_path / "faults"

    def status() -> dict:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        return read_status(run_dir) or {}

    def step() -> int:
        return (status().get("learner") or {}).get("step", 0)

    try:
        wait_for(lambda: step() >= 5 and pids(run_dir, "coordinator"), RUN_GUARD_S, 0.2, what="learner step 5")
        gen_started = read_heartbeats(run_dir, "gen-0")[0]["started"]
        killed_at = step()
        os.kill(pids(run_dir, "coordinator")[0], signal.SIGKILL)
        wait_for(lambda: step() >= killed_at + 3, RUN_GUARD_S, 0.2, what="training to go on after the restart")
        assert read_heartbeats(run_dir, "gen-0")[0]["started"] == gen_started, "gen-0 was restarted"

        (stopped,) = pids(run_dir, "gen-0")
        # Stop gen-0 while it holds episodes (with the learner behind, it may hold none between
        # batches): a status written after the stop (two status periods, so a sync sent just
        # before it has been handled) counts its leases, which are frozen now.
        while True:
            os.kill(stopped, signal.SIGSTOP)
            stopped_at = time.time()
            wait_for(lambda t=stopped_at: status().get("updated", 0) > t + 2, RUN_GUARD_S, 0.2, what="a status")
            if status()["leases"] > 0:
                break
            os.kill(stopped, signal.SIGCONT)
            wait_for(lambda: status().get("leases", 0) > 0, RUN_GUARD_S, 0.05, what="gen-0 to lease")
        wait_for(
            lambda: read_heartbeats(run_dir, "gen-0")[0]["started"] != gen_started,
            RUN_GUARD_S,
            what="the hung generator to be restarted",
        )
    except BaseException:
        proc.send_signal(signal.SIGINT)
        raise
    out = finish(proc, RUN_GUARD_S)
    assert proc.returncode == 0, out[-4000:]
    assert "coordinator ended (" in out and "restarting it in 25 s" in out, out[-4000:]
    ends = [line for line in out.splitlines() if "gen-0 ended (" in line]
    assert len(ends) == 1 and "hung: gen-0 (pid" in ends[0] and "has not turned its main loop" in ends[0], ends
    records, _ = lineage(run_dir / AUDIT_NAME)
    trained = [i for r in records for i in r["trained"]]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    no_processes_left(run_dir)
    # What the hung gen-0 held was issued again, when its lease ran out or (sooner, when the
    # restart beat the lease) when its successor first synced; the trace says which.
    from hpcrl.rl.coordinator.events import LEASES_NAME, read_jsonl

    lost = [(r.get("expired", {}).get("gen-0"), r.get("orphaned")) for r in read_jsonl(run_dir / LEASES_NAME)]
    expired, orphaned = next((e or o) for e, o in lost if e or o), any(o for _, o in lost)
    tr = hpcrl("traj", "trace", str(run_dir), str(expired[0]))
    text = finish(tr, 300)
    said = "gen-0 restarted: its previous process held it" if orphaned else "gen-0 went silent past the lease"
    assert tr.returncode == 0 and said in text and text.count("leased to gen-0") == 2, text


@pytest.mark.slow
def test_hpcrl_resume_continues_a_run_whose_launcher_was_killed(tmp_path):
    proc = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=30",
        "learner.checkpoint_every=5",
        "--run-id",
        "resume",
    )
    run_dir = tmp_path / "resume"

    def step() -> int:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        return ((read_status(run_dir) or {}).get("learner") or {}).get("step", 0)

    wait_for(lambda: step() >= 8, RUN_GUARD_S, 0.2, what="learner step 8")
    proc.kill()  # kill -9 of the launcher: its components drain and stop by themselves
    proc.wait(timeout=30)
    resumed = hpcrl("resume", str(run_dir))
    lock = run_dir / "run.lock"
    wait_for(
        lambda: resumed.poll() is not None or lock.read_text().startswith(f"pid {resumed.pid} "),
        RUN_GUARD_S,
        what="hpcrl resume to take the run over",
    )
    second = hpcrl("resume", str(run_dir))
    text = finish(second, 300)
    assert second.returncode == 2 and f"is driven by pid {resumed.pid}" in text, text
    out = finish(resumed, RUN_GUARD_S)
    assert resumed.returncode == 0 and "resuming run resume" in out, out[-4000:]

    records, lives = lineage(run_dir / AUDIT_NAME)
    assert lives == 2 and [r["step"] for r in records] == list(range(1, 31))
    trained = [i for r in records for i in r["trained"]]
    assert len(trained) == len(set(trained)) == 30 * 256, "a trajectory was trained twice"
    again = hpcrl("resume", str(run_dir))
    text = finish(again, 300)
    assert again.returncode == 2 and "is finished" in text, text
    no_processes_left(run_dir)
