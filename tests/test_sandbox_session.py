"""Sandbox sessions with real bwrap sandboxes, over the real sandbox server and its
CURVE ZeroMQ transport, and through `hpcrl sandbox session --json`: files persist, runs have
their own limits in the workspace, snapshots roll back, paths cannot leave the workspace,
quotas and caps give clean errors, idle sessions expire and leave nothing behind.

Needs bubblewrap and root; skips without, fails with HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.core.rpc import RequestClient
from hpcrl.core.transport import read_endpoint
from hpcrl.sandbox.apptainer import apptainer_args
from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.client import SandboxClient
from hpcrl.sandbox.launcher import bwrap_args
from hpcrl.sandbox.session import SessionManager, SessionOp
from hpcrl.sandbox.spec import Limits

from conftest import require_bwrap, sandbox_client, session_server, wait_for
from residue import adopt_orphans, host_residue, reap_orphans

UID = 61180
UIDS = range(UID, UID + 4)
SESSION_DIR = "/var/tmp/hpcrl-sessions"


@pytest.fixture(scope="module")
def bwrap_ok():
    require_bwrap(UID)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


def server(run_dir: Path, *overrides: str, slots: int = 2):
    return session_server(run_dir, UID, *overrides, slots=slots)


def client(run_dir: Path):
    return sandbox_client(run_dir)


def ok(c: SandboxClient, **op) -> dict:
    res = c.session(op)
    assert res["ok"], (op, res)
    return res


def refused(c: SandboxClient, **op) -> str:
    res = c.session(op)
    assert res["ok"] is False and isinstance(res["error"], str) and "\n" not in res["error"], (op, res)
    return res["error"]


def test_a_50_operation_episode_keeps_its_files_and_runs_in_the_workspace(bwrap_ok, run_dir):
    with server(run_dir) as srv, client(run_dir) as c:
        sid = ok(c, op="open")["session"]
        ok(c, op="write", session=sid, path="main.py", content="import os\nprint(os.getcwd())\n")
        assert ok(c, op="run", session=sid, cmd=["python3", "main.py"])["stdout"] == b"/work\n"
        ops = 3
        # A counter the program keeps in the workspace: each run reads what the last one left.
        ok(c, op="write", session=sid, path="state/n", content="0")
        step = "p='state/n'; n=int(open(p).read()); open(p,'w').write(str(n+1)); print(n+1)"
        ok(c, op="write", session=sid, path="step.py", content=step)
        ops += 2
        for k in range(1, 15):
            assert ok(c, op="run", session=sid, cmd=["python3", "step.py"])["stdout"] == f"{k}\n".encode()
            assert ok(c, op="read", session=sid, path="state/n")["content"] == str(k).encode()
            ok(c, op="write", session=sid, path=f"log/{k}.txt", content=f"step {k}")
            ops += 3
        entries = {e["path"]: e for e in ok(c, op="list", session=sid)["entries"]}
        assert {f"log/{k}.txt" for k in range(1, 15)} <= set(entries) and entries["state"]["type"] == "dir"
        assert ok(c, op="read", session=sid, path="main.py")["content"].startswith(b"import os")
        ops += 2
        assert ops == 50 - 1  # the close makes 50
        ok(c, op="close", session=sid)
        assert srv.sessions is not None and len(srv.sessions) == 0
    assert host_residue(UIDS) == []


def test_a_run_has_its_own_timeout_and_the_session_lives_on(bwrap_ok, run_dir):
    with server(run_dir) as _, client(run_dir) as c:
        sid = ok(c, op="open")["session"]
        ok(c, op="run", session=sid, cmd=["sh", "-c", "echo started > s.txt"])
        res = ok(c, op="run", session=sid, cmd=["sleep", "30"], timeout_s=0.5)
        assert res["status"] == "timeout"
        assert ok(c, op="read", session=sid, path="s.txt")["content"] == b"started\n"
        assert ok(c, op="run", session=sid, cmd=["sh", "-c", "exit 3"])["status"] == "nonzero_exit"
        assert "timeout_s" in refused(c, op="run", session=sid, cmd=["true"], timeout_s=-1)
        assert "ceiling" in refused(c, op="run", session=sid, cmd=["true"], timeout_s=10_000)
        ok(c, op="close", session=sid)


def test_snapshot_restore_roundtrip(bwrap_ok, run_dir):
    with server(run_dir) as _, client(run_dir) as c:
        sid = ok(c, op="open")["session"]
        ok(c, op="write", session=sid, path="keep.txt", content="v1")
        ok(c, op="write", session=sid, path="bin/tool.sh", content="#!/bin/sh\necho tool\n", executable=True)
        snap = ok(c, op="snapshot", session=sid)["snapshot"]
        ok(c, op="write", session=sid, path="keep.txt", content="v2")
        ok(c, op="run", session=sid, cmd=["sh", "-c", "echo new > after.txt; mkdir later; rm bin/tool.sh"])
        ok(c, op="restore", session=sid, snapshot=snap)
        paths = {e["path"] for e in ok(c, op="list", session=sid)["entries"]}
        assert paths == {"keep.txt", "bin", "bin/tool.sh"}
        assert ok(c, op="read", session=sid, path="keep.txt")["content"] == b"v1"
        # Restored files are the slot's again: the sandboxed program can run and rewrite them.
        res = ok(c, op="run", session=sid, cmd=["sh", "-c", "./bin/tool.sh && echo v3 > keep.txt && cat keep.txt"])
        assert res["stdout"] == b"tool\nv3\n", res
        assert "no snapshot" in refused(c, op="restore", session=sid, snapshot="nope")
        ok(c, op="close", session=sid)


def test_paths_cannot_leave_the_workspace(bwrap_ok, run_dir):
    with server(run_dir) as _, client(run_dir) as c:
        sid = ok(c, op="open")["session"]
        assert "'..'" in refused(c, op="write", session=sid, path="../evil", content="x")
        assert "'..'" in refused(c, op="read", session=sid, path="a/../../etc/passwd")
        assert "absolute" in refused(c, op="read", session=sid, path="/etc/passwd")
        assert "absolute" in refused(c, op="write", session=sid, path="/tmp/evil", content="x")
        outside = Path(SESSION_DIR).parent / f"hpcrl-session-target-{os.getpid()}"
        outside.write_text("host file")
        try:
            # Links made by sandboxed code, pointing outside the workspace (to host paths).
            ok(c, op="run", session=sid, cmd=["sh", "-c", f"ln -s {outside} f; ln -s {outside.parent} d; mkfifo p"])
            assert "symlink" in refused(c, op="read", session=sid, path="f")
            assert "symlink" in refused(c, op="read", session=sid, path=f"d/{outside.name}")
            assert "symlink" in refused(c, op="write", session=sid, path=f"d/{outside.name}", content="pwned")
            assert "not a regular file" in refused(c, op="read", session=sid, path="p")
            ok(c, op="write", session=sid, path="f", content="replaced the link, not its target")
            assert outside.read_text() == "host file"
            entries = {e["path"]: e["type"] for e in ok(c, op="list", session=sid)["entries"]}
            assert entries == {"f": "file", "d": "symlink", "p": "other"}
            # A snapshot keeps the link as a link; restoring it writes nothing through it.
            snap = ok(c, op="snapshot", session=sid)["snapshot"]
            ok(c, op="restore", session=sid, snapshot=snap)
            assert outside.read_text() == "host file" and not (outside.parent / "f").exists()
        finally:
            outside.unlink()
        ok(c, op="close", session=sid)


def test_quota_exceeded_is_a_clean_error(bwrap_ok, run_dir):
    with server(run_dir) as _, client(run_dir) as c:
        sid = ok(c, op="open", limits={"work_mb": 2, "file_size_mb": 8})["session"]
        assert "quota" in refused(c, op="write", session=sid, path="big", content="x" * (3 << 20))
        # The program meets the same cap as ENOSPC, and the session goes on.
        res = ok(c, op="run", session=sid, cmd=["sh", "-c", "head -c 3000000 /dev/zero > fill"])
        assert res["status"] == "nonzero_exit" and b"No space left" in res["stderr"], res
        ok(c, op="run", session=sid, cmd=["rm", "fill"])
        assert ok(c, op="write", session=sid, path="small", content="fits")["bytes"] == 4
        ok(c, op="close", session=sid)


def test_idle_sessions_expire_and_leave_nothing(bwrap_ok, run_dir):
    with server(run_dir, "sandbox.session_idle_s=3600") as srv, client(run_dir) as c:
        assert srv.sessions.idle_s == 3600
        sid = ok(c, op="open")["session"]
        ok(c, op="run", session=sid, cmd=["sh", "-c", "echo x > f"])
        snap = ok(c, op="snapshot", session=sid)["snapshot"]
        home = Path(srv.sessions.root, sid)
        assert (home / "work" / "f").exists() and (home / "snap" / snap / "f").exists()
        # Made tiny only now, so the operations above never race it on a slow machine.
        srv.sessions.idle_s = 0.05
        wait_for(lambda: len(srv.sessions) == 0, 60, 0.05, "the idle session to expire")
        assert not home.exists()
        assert "no open session" in refused(c, op="list", session=sid)
    assert host_residue(UIDS) == []


def test_unknown_sessions_bad_ops_and_max_sessions(bwrap_ok, run_dir):
    with server(run_dir, "sandbox.max_sessions=2") as srv, client(run_dir) as c:
        assert "no open session" in refused(c, op="read", session="0" * 32, path="x")
        assert "op must be one of" in refused(c, op="launch")
        assert "'session'" in refused(c, op="list")
        assert "unknown keys" in refused(c, op="open", colour="red")
        assert "cmd" in refused(c, op="run", session="x", cmd="ls -l")
        assert "ceiling" in refused(c, op="open", limits={"memory_mb": 1 << 30})
        a, b = ok(c, op="open")["session"], ok(c, op="open")["session"]
        assert a != b and len(a) == 32
        assert "max_sessions" in refused(c, op="open")
        ok(c, op="close", session=a)
        ok(c, op="close", session=ok(c, op="open")["session"])
        ok(c, op="close", session=b)
        # Raw malformed bodies are answered too, and the server keeps serving.
        raw = RequestClient(c.node, "sandbox-0", timeout_s=5, retries=0)
        assert raw.request("session", "not a mapping").body["ok"] is False
        assert srv.sessions.opened == 3


def test_session_commands_use_the_one_launch_path():
    # bwrap: the workspace replaces the run's tmpfs as /work; every other flag is the one-shot run's.
    base = bwrap_args(Limits(), exec_fd=4, status_fd=3, memory="cgroup", layout=[])
    sess = bwrap_args(Limits(), exec_fd=4, status_fd=3, memory="cgroup", layout=[], workspace="/w")
    i = base.index("/work") - 1
    assert base[i] == "/tmp/work" and sess[i] == "/w" and base[:i] + base[i + 1 :] == sess[:i] + sess[i + 1 :]
    # apptainer (cannot run here): the workspace is bound as /work, nothing is copied in.
    a = apptainer_args(("python3", "main.py"), Limits(), image="i.sif", src_dir="/s", workspace="/w")
    assert "/w:/work" in a and "--scratch" not in a and a[a.index("-c") + 1] == 'exec prlimit "$@"'
    assert a[-3:] == ["--", "python3", "main.py"] and "--containall" in a


def test_session_dir_under_tmp_or_someone_elses_is_refused():
    with pytest.raises(ValueError, match="under /tmp"):
        SessionManager("/tmp/hpcrl-sessions-test")
    theirs = Path(SESSION_DIR + f"-theirs-{os.getpid()}")
    theirs.mkdir(mode=0o755)
    try:
        os.chown(theirs, UID + 3, UID + 3)  # e.g. made first by another user in world-writable /var/tmp
        with pytest.raises(ValueError, match="must be a directory of uid"):
            SessionManager(str(theirs))
    finally:
        theirs.rmdir()


def test_a_session_moves_between_slots_with_its_files(bwrap_ok):
    # Slots run as different host uids: the workspace is handed to the uid of the slot that runs.
    a, b = BwrapBackend(uid=UID + 2), BwrapBackend(uid=UID + 3)
    mgr = SessionManager(SESSION_DIR)
    try:

        def do(backend, **op):
            res = mgr.execute(SessionOp.from_wire(op), backend)
            assert res["ok"], (op, res)
            return res

        sid = do(a, op="open")["session"]
        do(a, op="write", session=sid, path="d/f.txt", content="1")
        work = Path(mgr.root, sid, "work")
        assert (work / "d" / "f.txt").stat().st_uid == UID + 2
        for backend, uid in ((b, UID + 3), (a, UID + 2), (b, UID + 3)):
            res = do(backend, op="run", session=sid, cmd=["sh", "-c", "echo x >> d/f.txt; mkdir -p e; touch e/$$"])
            assert res["status"] == "ok", res
            assert {p.stat().st_uid for p in (work, *work.rglob("*"))} == {uid}
        assert do(a, op="read", session=sid, path="d/f.txt")["content"] == b"1x\nx\nx\n"
        do(b, op="close", session=sid)
        assert not work.exists()
    finally:
        mgr.close_all()
        a.close()
        b.close()
    assert host_residue(UIDS) == []


def hpcrl(*args, stdin: str, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", *args], input=stdin.encode(), capture_output=True, timeout=timeout
    )


def test_cli_session_json_runs_a_script_from_stdin(bwrap_ok, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"sandbox:\n  uid_base: {UID}\n")
    script = [
        {"op": "open"},
        {"op": "write", "path": "main.py", "content": "print(open('data.txt').read())"},
        {"op": "write", "path": "data.txt", "content": "héllo"},
        {"op": "run", "cmd": ["python3", "main.py"], "timeout_s": 60},
        {"op": "snapshot"},
        {"op": "write", "path": "data.txt", "content": "changed"},
        "not json",
        {"op": "restore", "snapshot": "0" * 16},
        {"op": "restore"},  # no id: the session's latest snapshot (a script cannot know the id ahead)
        {"op": "read", "path": "data.txt"},
        {"op": "read", "path": "../etc/passwd"},
        {"op": "list"},
        {"op": "write", "path": "blob", "content_b64": base64.b64encode(b"\xff\x00").decode()},
        {"op": "read", "path": "blob"},  # not UTF-8: comes back as content_b64
        {"op": "close"},
    ]
    lines = [op if isinstance(op, str) else json.dumps(op) for op in script]
    out = hpcrl("sandbox", "session", "--json", "--config", str(config), stdin="\n".join(lines) + "\n")
    results = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert len(results) == len(script) and out.returncode == 1, out  # one line per op; some failed
    assert [r["op"] for r in results[:6]] == ["open", "write", "write", "run", "snapshot", "write"]
    assert all(r["ok"] for r in results[:6]) and results[3]["stdout"] == "héllo\n" and results[3]["status"] == "ok"
    assert set(results[3]) >= {"exit_code", "stdout", "stderr", "status"}
    assert results[6]["ok"] is False and "not JSON" in results[6]["error"]
    assert results[7]["ok"] is False and "no snapshot" in results[7]["error"]
    assert results[8]["ok"] and results[9]["content"] == "héllo"
    assert results[10]["ok"] is False and "'..'" in results[10]["error"]
    assert {e["path"] for e in results[11]["entries"]} == {"main.py", "data.txt"}
    assert results[12]["bytes"] == 2 and base64.b64decode(results[13]["content_b64"]) == b"\xff\x00"
    assert results[14] == {"op": "close", "ok": True}
    assert hpcrl("sandbox", "session", stdin="").returncode == 2  # --json is the format


def test_cli_session_json_drives_a_server(bwrap_ok, run_dir):
    with server(run_dir) as srv:
        script = [{"op": "open"}, {"op": "write", "path": "a.txt", "content": "kept"}]
        out = hpcrl("sandbox", "session", "--json", "--run-dir", str(run_dir), stdin="\n".join(map(json.dumps, script)))
        opened = [json.loads(line) for line in out.stdout.decode().splitlines()]
        assert out.returncode == 0 and all(r["ok"] for r in opened), out
        sid = opened[0]["session"]
        # A second script names the session: it lives on the server between invocations.
        script = [{"op": "read", "session": sid, "path": "a.txt"}, {"op": "close", "session": sid}]
        out = hpcrl("sandbox", "session", "--json", "--run-dir", str(run_dir), stdin="\n".join(map(json.dumps, script)))
        results = [json.loads(line) for line in out.stdout.decode().splitlines()]
        assert out.returncode == 0 and results[0]["content"] == "kept" and results[1]["ok"], out
        assert len(srv.sessions) == 0


def test_a_killed_servers_workspaces_are_swept_by_the_next():
    if os.geteuid() != 0:
        pytest.skip("tmpfs workspaces need root")
    code = (
        "import sys, time\n"
        "from hpcrl.sandbox.session import SessionManager, SessionOp\n"
        f"m = SessionManager({SESSION_DIR!r})\n"
        "r = m.execute(SessionOp.from_wire({'op': 'open'}), None)\n"
        "print(m.root + '/' + r['session'] + '/work', r['quota'], flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        work, quota = proc.stdout.readline().split()
        assert quota == "tmpfs" and work in Path("/proc/self/mounts").read_text()
    finally:
        proc.kill()
        proc.wait()
    SessionManager(SESSION_DIR).close_all()  # starting sweeps what dead servers left
    assert work not in Path("/proc/self/mounts").read_text() and not Path(work).parent.parent.exists()


def test_hpcrl_sandbox_serve_serves_sessions_and_a_restart_sweeps_the_killed_ones(bwrap_ok, run_dir, tmp_path):
    adopt_orphans()  # the killed server's sandbox started ahead dies with it, an orphan: reap it here
    config = tmp_path / "config.yaml"
    config.write_text(f"sandbox:\n  uid_base: {UID}\n")
    serve = [sys.executable, "-m", "hpcrl.jobs.cli", "sandbox", "serve", "--slots", "1", "--run-dir", str(run_dir)]

    def start() -> subprocess.Popen:
        old = _instance(run_dir)
        proc = subprocess.Popen([*serve, "--config", str(config)], stderr=subprocess.DEVNULL)
        wait_for(lambda: _instance(run_dir) not in (None, old), 60, 0.05, "the server's endpoint")
        return proc

    proc = start()
    try:
        script = [{"op": "open"}, {"op": "run", "cmd": ["sh", "-c", "echo kept > a.txt"]}]
        out = hpcrl("sandbox", "session", "--json", "--run-dir", str(run_dir), stdin="\n".join(map(json.dumps, script)))
        results = [json.loads(line) for line in out.stdout.decode().splitlines()]
        assert out.returncode == 0 and results[1]["status"] == "ok", out
        sid = results[0]["session"]
        work = next(line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines() if sid in line)
        assert Path(work, "a.txt").read_text() == "kept\n"
        proc.kill()
        proc.wait()
        proc = start()  # its session manager sweeps what the killed one left
        assert sid not in Path("/proc/self/mounts").read_text() and not Path(work).exists()
        script = [{"op": "list", "session": sid}]
        out = hpcrl("sandbox", "session", "--json", "--run-dir", str(run_dir), stdin=json.dumps(script[0]))
        assert "no open session" in json.loads(out.stdout)["error"] and out.returncode == 1
    finally:
        proc.terminate()
        code = proc.wait(30)
        reap_orphans()
    assert code == 0 and host_residue(UIDS) == []


def _instance(run_dir: Path) -> str | None:
    try:
        return read_endpoint(run_dir, "sandbox-0", 0.01).instance
    except Exception:  # no endpoint yet
        return None
