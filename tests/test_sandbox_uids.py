"""Any number of sandboxes, runs and users on one host: slot uids come from the host's pool.

Two concurrent `hpcrl sandbox exec`, two runs' sandbox servers started as `hpcrl run` starts
them, and two runs' servers on one dev-cluster node all work, on distinct uids; a dead holder's
uids come back, but not while a process still runs as one. Needs root (slot uids exist only
there) and, but for the pool's own test, bubblewrap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.core.config import load_config
from hpcrl.sandbox.result import SandboxUnavailable
from hpcrl.sandbox.spec import ExecSpec
from hpcrl.sandbox.uids import claim_free_uid, lock_dir

from conftest import require_bwrap, wait_for

BASE = 62600  # this file's pools: apart from the other sandbox tests' slot uids
POOL = 8
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="slot uids exist only when sandboxes start as root")


def _config(tmp_path: Path, base: int = BASE) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(f"sandbox:\n  uid_base: {base}\n  uid_pool: {POOL}\n  slots: 2\n")
    return p


def _held_by(pid: int) -> set[int]:
    """The slot uids whose lock file names `pid` as its holder (and whose lock is held)."""
    import fcntl

    out = set()
    for p in Path(lock_dir()).glob("uid-*.lock"):
        try:
            if p.read_text().strip() != str(pid):
                continue
            with open(p) as fh:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # got it: nobody holds it
        except BlockingIOError:
            out.add(int(p.stem[4:]))
        except OSError:
            continue
    return out


def test_the_pool_skips_held_and_running_uids_and_takes_back_a_dead_holders():
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom hpcrl.sandbox.uids import claim_free_uid\n"
            f"print(claim_free_uid({BASE}, {POOL}).uid, flush=True)\nsys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    leftover = None
    claims = []
    try:
        theirs = int(holder.stdout.readline())
        claims.append(claim_free_uid(BASE, POOL))
        assert claims[-1].uid != theirs  # held by another process
        # A process still running as a uid nobody holds (a dead holder's sandbox, not yet reaped).
        stray = next(u for u in range(BASE, BASE + POOL) if u not in (theirs, claims[0].uid))
        leftover = subprocess.Popen(
            ["setpriv", f"--reuid={stray}", f"--regid={stray}", "--clear-groups", "sleep", "600"]
        )
        wait_for(lambda: _runs_as(stray), 30, 0.05, what="the stray process")
        taken = {theirs, claims[0].uid}
        while len(taken) < POOL - 1:  # every uid but the stray one, and then none
            claims.append(claim_free_uid(BASE, POOL))
            taken.add(claims[-1].uid)
        assert stray not in taken
        with pytest.raises(
            SandboxUnavailable,
            match=rf"no free slot uid in the pool {BASE}..{BASE + POOL - 1} .*\(7 held by sandboxes, 1 still used by",
        ):
            claim_free_uid(BASE, POOL)
        holder.kill()  # SIGKILL: nothing released by hand; the kernel drops its lock
        holder.wait(30)
        claims.append(claim_free_uid(BASE, POOL))
        assert claims[-1].uid == theirs
        leftover.kill()
        leftover.wait(30)
        claims.append(wait_for(lambda: _try_claim(), 30, 0.05, what="the stray uid to come free"))
        assert claims[-1].uid == stray
    finally:
        for c in claims:
            c.release()
        for p in (holder, leftover):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)


def _runs_as(uid: int) -> bool:
    from hpcrl.sandbox.uids import uids_in_use

    return uid in uids_in_use()


def _try_claim():
    try:
        return claim_free_uid(BASE, POOL)
    except SandboxUnavailable:
        return None


def test_a_pool_of_accounts_only_is_refused_in_one_line(tmp_path):
    import pwd

    account = next(p for p in pwd.getpwall() if p.pw_uid >= 1000)  # nobody (65534) at least
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"sandbox:\n  uid_base: {account.pw_uid}\n  uid_pool: 1\n")
    prog = tmp_path / "p.py"
    prog.write_text("print(1)\n")
    r = _hpcrl("sandbox", "exec", "--config", str(cfg), "--lang", "python", str(prog))
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1, r.stderr
    assert f"no free slot uid in the pool {account.pw_uid}..{account.pw_uid}".encode() in r.stderr
    assert b"1 accounts' or groups'" in r.stderr
    r = _hpcrl("sandbox", "serve", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 1 and b"hpcrl sandbox serve: bwrap backend: no free slot uid" in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr


def _hpcrl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.jobs.cli", *args], capture_output=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def bwrap_ok():
    require_bwrap(BASE)


def test_two_concurrent_sandbox_execs_on_one_host(bwrap_ok, tmp_path):
    cfg = _config(tmp_path)
    slow, quick = tmp_path / "slow.py", tmp_path / "quick.py"
    slow.write_text("import time\ntime.sleep(300)\n")
    quick.write_text("print('second')\n")
    first = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.jobs.cli", "sandbox", "exec", "--config", str(cfg), "--lang", "python"]
        + [str(slow), "--timeout-s", "300"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: _held_by(first.pid) or first.poll() is not None, 120, what="the first exec's slot uid")
        assert first.poll() is None, first.stderr.read()
        r = _hpcrl("sandbox", "exec", "--config", str(cfg), "--lang", "python", str(quick), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["stdout"] == "second\n"
        assert first.poll() is None  # both held a uid at once
    finally:
        first.kill()
        first.wait(60)


def _serve(cfg: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpcrl.jobs.cli", "sandbox", "serve", "--config", str(cfg)]
        + ["--run-dir", str(run_dir), "--name", "sandbox-0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _exec_on(run_dir: Path, text: str) -> str:
    from hpcrl.core.transport import Node
    from hpcrl.sandbox.client import SandboxClient

    with Node(run_dir, "gen-0") as node:
        client = SandboxClient(node, "sandbox-0")
        try:
            return client.run(ExecSpec.single("python", f"print({text!r})")).stdout.decode()
        finally:
            client.close()


def _wait_serving(run_dir: Path, job, timeout_s: float) -> None:
    """Until the server of `run_dir` (a submitit job) has taken its uids; fails if the job ended."""
    wait_for(lambda: _uids_of(run_dir) or job.done(), timeout_s, what=f"{run_dir.name}'s server to take its uids")
    assert not job.done(), job.stderr()


def _uids_of(run_dir: Path) -> set[int]:
    path = run_dir / "uids" / "sandbox-0.json"
    return set(json.loads(path.read_text())["uids"]) if path.exists() else set()


def test_two_runs_sandbox_servers_started_as_a_run_starts_them_share_the_host(bwrap_ok, tmp_path):
    """Each run's `hpcrl run` starts its sandbox servers as submitit jobs of the local executor;
    both runs use the default pool here."""
    from hpcrl.jobs.launch import make_executor, plan
    from hpcrl.rl.domains import load_domains

    cfg = load_config(_config(tmp_path), ["domains=[{name: synth}]"])
    jobs, runs = [], [tmp_path / "run-a", tmp_path / "run-b"]
    try:
        for run_dir in runs:
            run_dir.mkdir()
            role = next(r for r in plan(cfg, run_dir, load_domains(cfg.domains)) if r.slurm_role == "sandbox")
            ex = make_executor("local", cfg.slurm, "sandbox", run_dir / "submitit", job_name=f"hpcrl-{role.name}")
            jobs.append(ex.submit(role.component))
        for run_dir, job in zip(runs, jobs):
            _wait_serving(run_dir, job, 180)
        a, b = (_uids_of(r) for r in runs)
        assert len(a) == len(b) == 2 and not a & b, (a, b)
        assert [_exec_on(r, r.name) for r in runs] == ["run-a\n", "run-b\n"]
    finally:
        for job in jobs:
            job.cancel(check=False)
    for run_dir, job in zip(runs, jobs):
        wait_for(job.done, 120, what="the server to stop")
        assert not _uids_of(run_dir), "the record goes with the uids"


@pytest.mark.slurm
def test_two_runs_sandbox_servers_on_one_dev_cluster_node(slurm_cluster, bwrap_ok, tmp_path):
    from hpcrl.jobs.components import SandboxComponent
    from hpcrl.jobs.launch import make_executor

    cfg = load_config(_config(tmp_path), ["slurm.sandbox.time_min=10", "slurm.sandbox.signal_delay_s=30"])
    runs = [tmp_path / "run-a", tmp_path / "run-b"]
    jobs = []
    try:
        for run_dir in runs:
            run_dir.mkdir()
            ex = make_executor("slurm", cfg.slurm, "sandbox", run_dir / "submitit", job_name="hpcrl-uids-test")
            ex.update_parameters(additional_parameters={"nodelist": "n1"})  # one node, two runs
            jobs.append(ex.submit(SandboxComponent(run_dir, cfg.sandbox, "sandbox-0")))
        for run_dir, job in zip(runs, jobs):
            _wait_serving(run_dir, job, 300)
        a, b = (_uids_of(r) for r in runs)
        assert len(a) == len(b) == 2 and not a & b, (a, b)
        assert [_exec_on(r, r.name) for r in runs] == ["run-a\n", "run-b\n"]
    finally:
        for job in jobs:
            job.cancel(check=False)
    for job in jobs:
        wait_for(job.done, 180, what="the job to leave the queue")


def test_a_killed_server_gives_its_uids_back(bwrap_ok, tmp_path):
    cfg = _config(tmp_path)
    first = _serve(cfg, tmp_path / "a")
    try:
        wait_for(lambda: _uids_of(tmp_path / "a") or first.poll() is not None, 120, what="the first server")
        theirs = _uids_of(tmp_path / "a")
        first.send_signal(signal.SIGKILL)
        first.wait(60)
        # A fresh server finds the pool whole again: the same lowest uids (no sandbox was running).
        second = _serve(cfg, tmp_path / "b")
        try:
            wait_for(lambda: _uids_of(tmp_path / "b") or second.poll() is not None, 120, what="the second server")
            assert _uids_of(tmp_path / "b") == theirs, second.stderr.read() if second.poll() is not None else ""
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 0
        assert not _uids_of(tmp_path / "b")
    finally:
        if first.poll() is None:
            first.kill()
