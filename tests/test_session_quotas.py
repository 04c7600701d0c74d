"""Disk a session can take on a sandbox node: its snapshots count against its quota and against
the server's `sandbox.session_dir_mb`; a workspace whose quota is measured (no tmpfs) stops a
command that writes past it and refuses the next one until a restore brings it back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpcrl.sandbox.client import SandboxClient
from hpcrl.sandbox.session import SessionManager, SessionOp

from conftest import require_bwrap, sandbox_client, session_server

UID = 62640  # this file's slot uids: apart from the other sandbox tests'
MIB = 1 << 20


@pytest.fixture
def session_dir(tmp_path):
    d = Path("/var/tmp") / f"hpcrl-sessions-quotas-{tmp_path.name}"  # not under /tmp: sessions refuse it
    yield str(d)
    shutil.rmtree(d, ignore_errors=True)


def do(mgr: SessionManager, **op) -> dict:
    return mgr.execute(SessionOp.from_wire(op), None)  # no sandbox: files and snapshots only


def test_snapshots_count_against_the_sessions_quota_and_the_servers_cap(session_dir):
    mgr = SessionManager(session_dir, max_disk_bytes=2 * MIB)
    try:
        a, b = (do(mgr, op="open", limits={"work_mb": 2})["session"] for _ in range(2))
        blob = "x" * (5 * MIB // 4)  # 1.25 MiB: one snapshot of it fits a session's 2 MiB, two do not
        for sid in (a, b):
            assert do(mgr, op="write", session=sid, path="blob", content=blob)["ok"]
        assert do(mgr, op="snapshot", session=a)["ok"]
        again = do(mgr, op="snapshot", session=a)
        assert not again["ok"] and "over their quota of 2 MiB" in again["error"], again
        full = do(mgr, op="snapshot", session=b)  # fits b's quota, not the server's cap beside a's
        assert not full["ok"] and "sandbox.session_dir_mb" in full["error"], full
        assert do(mgr, op="close", session=a)["ok"]  # a's snapshot goes with it
        assert do(mgr, op="snapshot", session=b)["ok"]
        assert 5 * MIB // 4 <= mgr.disk <= 2 * MIB
    finally:
        mgr.close_all()
    assert mgr.disk == 0


@pytest.fixture(scope="module")
def bwrap_ok():
    require_bwrap(UID)


def ok(c: SandboxClient, **op) -> dict:
    res = c.session(op)
    assert res["ok"], (op, res)
    return res


def refused(c: SandboxClient, **op) -> str:
    res = c.session(op)
    assert res["ok"] is False and "\n" not in res["error"], (op, res)
    return res["error"]


def test_a_measured_workspace_holds_a_command_to_its_quota(bwrap_ok, tmp_path, session_dir):
    run_dir = tmp_path / "run"
    overrides = ["sandbox.session_tmpfs=false", f"sandbox.session_dir={session_dir}", "sandbox.uid_pool=4"]
    with session_server(run_dir, UID, *overrides), sandbox_client(run_dir) as c:
        opened = ok(c, op="open", limits={"work_mb": 4, "wall_s": 120, "cpu_s": 120})
        sid = opened["session"]
        assert opened["quota"] == "measured"
        ok(c, op="write", session=sid, path="keep.txt", content="kept")
        snap = ok(c, op="snapshot", session=sid)["snapshot"]
        # One file may not outgrow the room left: the kernel stops it (RLIMIT_FSIZE).
        big = "open('big', 'wb').write(b'x' * (64 << 20))"
        res = ok(c, op="run", session=sid, cmd=["python3", "-c", big])
        assert res["status"] != "ok"
        ok(c, op="run", session=sid, cmd=["rm", "big"])  # it stayed within the quota: commands go on
        # Many files, each small, with no end: stopped once seen over the quota, long before its wall limit.
        flood = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * 65536)\n    i += 1\n"
        assert "over the workspace's quota" in refused(c, op="run", session=sid, cmd=["python3", "-c", flood])
        # Over it, the workspace runs nothing and takes no write until a restore brings it back.
        assert "over its quota" in refused(c, op="run", session=sid, cmd=["true"])
        assert "over its quota" in refused(c, op="write", session=sid, path="more", content="x")
        ok(c, op="restore", session=sid, snapshot=snap)
        assert ok(c, op="run", session=sid, cmd=["cat", "keep.txt"])["stdout"] == b"kept"
        ok(c, op="close", session=sid)
