"""The sandbox server and client over real ZeroMQ (CURVE) with real bwrap sandboxes: requests,
bad input, backpressure, idempotent retries, and a server killed 10 times in a row.

Needs bubblewrap and root; skips without, fails with HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from hpcrl.core.config import load_config
from hpcrl.core.rpc import RequestClient
from hpcrl.core.transport import Node, read_endpoint
from hpcrl.core.wire import encode
from hpcrl.sandbox.client import SandboxBusy, SandboxClient
from hpcrl.sandbox.judge import FunctionTask, IOCase
from hpcrl.sandbox.languages import get_language
from hpcrl.sandbox.pool import SlotPool
from hpcrl.sandbox.server import SandboxServer
from hpcrl.sandbox.spec import ExecSpec, Limits

from conftest import require_bwrap, server_thread, wait_for
from residue import adopt_orphans, host_residue, reap_orphans

UID = 61140
UIDS = range(UID, UID + 4)


@pytest.fixture(scope="module")
def bwrap_ok():
    require_bwrap(UID)


@contextlib.contextmanager
def server(run_dir: Path, slots: int = 2, queue: int = 8, *overrides: str, **server_kw):
    """A SandboxServer in a thread of this process, on 127.0.0.1, as `serve` configures it."""
    cfg = load_config(None, [f"sandbox.uid_base={UID}", f"sandbox.queue={queue}", *overrides]).sandbox
    pool = SlotPool.from_config(cfg, slots=slots)

    def close(srv):
        pool.close()  # the server closes after its pool has stopped
        srv.close()

    try:
        with server_thread(
            run_dir,
            "sandbox-0",
            lambda node: SandboxServer(node, "sandbox-0", pool, ceiling=cfg.ceiling, **server_kw),
            close=close,
        ) as srv:
            yield srv
    finally:
        pool.close()


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


def test_exec_judge_and_info_over_the_wire(bwrap_ok, run_dir):
    with server(run_dir), Node(run_dir, "gen-0") as node:
        c = SandboxClient(node)
        r = c.run(ExecSpec.single("python", "import sys; print(sys.stdin.read()[::-1])", stdin=b"\x00abc"))
        assert r.status == "ok" and r.stdout == b"cba\x00\n"
        if get_language("c").present():
            assert c.run(ExecSpec.single("c", "int main( {")).status == "compile_error"
        v = c.judge_io("python", "print(int(input()) * 2)", [IOCase(b"2", b"4"), IOCase(b"5", b"10")])
        assert v.passed and len(v.cases) == 2
        task = FunctionTask("def f(x):\n    return x + 1\n", "f", "def check(c):\n    assert c(1) == 2\n")
        assert c.judge_function(task).passed
        info = c.info()
        assert info["slots"] == 2 and "python" in info["languages"] and "memory limit" in info["backend"]
    assert host_residue(UIDS) == []


def test_malformed_requests_are_refused_and_the_server_keeps_serving(bwrap_ok, run_dir):
    with server(run_dir) as srv, Node(run_dir, "gen-0") as node:
        raw = RequestClient(node, "sandbox-0", timeout_s=5, retries=0)
        assert raw.request("exec", {"language": "cobol", "files": [["main.py", b"", False]]}).kind == "bad_request"
        assert raw.request("exec", {"language": "python", "files": [["../x", b"", False]]}).kind == "bad_request"
        assert raw.request("launch_missiles", {}).kind == "bad_request"
        sock, _ = node.connect(zmq.DEALER, "sandbox-0")
        sock.send_multipart([b"not msgpack at all"])
        sock.send_multipart(encode("exec", {"language": "python"}))  # no request id
        with pytest.raises(ValueError, match="refused the exec request"):
            SandboxClient(node)._call("exec", {"language": "python", "files": []}, 5, 5)
        assert SandboxClient(node).run(ExecSpec.single("python", "print('still here')")).stdout == b"still here\n"
        sock.close(0)
        assert srv.dropped == 2


def test_judge_io_cases_must_be_bytes_and_a_huge_integer_does_not_take_the_server_down(bwrap_ok, run_dir):
    # bytes(n) of an int n is n zero bytes: 2**64-1 raised OverflowError in the handler, and
    # 10**8 made the server allocate 100 MB for one case. Cases are bytes or str, nothing else.
    with server(run_dir) as srv, Node(run_dir, "gen-0") as node:
        raw = RequestClient(node, "sandbox-0", timeout_s=5, retries=0)
        good = {"language": "python", "files": [["main.py", b"print(input())", False]]}
        for cases in ([[2**64 - 1, b"x"]], [[10**8, b""]], [[b"1", -1]], [[b"1"]], "ab", [[b"1", b"1", b"1"]]):
            env = raw.request("judge_io", {**good, "cases": cases})
            assert env.kind == "bad_request", (cases, env.kind, env.body)
            assert "judge_io" in env.body["message"] and "case" in env.body["message"], env.body
        env = raw.request("judge_io", {**good, "cases": [["7", "7\n"], [b"8", b"8"]]})
        assert env.kind == "verdict" and env.body["passed"], env.body
        env = raw.request("exec", {**good, "stdin": 2**64 - 1})
        assert env.kind == "bad_request" and "stdin" in env.body["message"], env.body
        assert SandboxClient(node).run(ExecSpec.single("python", "print('still here')")).stdout == b"still here\n"
        assert srv.served >= 2


def test_large_outputs_cannot_grow_the_reply_cache_past_its_byte_bound(bwrap_ok, run_dir):
    bound = 2 << 20
    with server(run_dir, replay_cache_bytes=bound) as srv, Node(run_dir, "gen-0") as node:
        c = SandboxClient(node)
        flood = ExecSpec.single("python", "import sys; sys.stdout.write('y' * (900 << 10))")
        for _ in range(6):  # 6 x 900 KiB answers: more than twice the bound
            assert len(c.run(flood).stdout) == 900 << 10
            assert srv.server._replies_bytes <= bound
        assert 0 < len(srv.server._replies) < 6  # the oldest answers were let go
        huge = ExecSpec.single("python", "import sys; sys.stdout.write('z' * (3 << 20))", limits=Limits(output_kb=4096))
        assert len(c.run(huge).stdout) == 3 << 20  # answered, but too big to remember
        assert srv.server._replies_bytes <= bound


def test_requests_over_the_ceiling_are_refused_whoever_sends_them(bwrap_ok, run_dir):
    with (
        server(run_dir, 2, 8, "sandbox.ceiling.memory_mb=256", "sandbox.ceiling.wall_s=5") as srv,
        Node(run_dir, "gen-0") as node,
    ):
        c = SandboxClient(node)
        assert c.info()["ceiling"]["memory_mb"] == 256
        big = ExecSpec.single("python", "print(1)", limits=Limits(memory_mb=4096, wall_s=60))
        with pytest.raises(
            ValueError,
            match=r"refused the exec request: over this sandbox server's ceiling: "
            r"limits.wall_s=60 \(ceiling 5.0\), limits.memory_mb=4096 \(ceiling 256\); "
            r"ask for less, or raise sandbox.ceiling",
        ):
            c.run(big)
        # Defaults count too: the judge's harness asks for 512 MiB unless told otherwise.
        task = FunctionTask("def f(x):\n    return x\n", "f", "def check(c):\n    assert c(1) == 1\n")
        with pytest.raises(
            ValueError,
            match=r"judge_function request: over this sandbox server's ceiling: "
            r"limits.wall_s=10.0 \(ceiling 5.0\), limits.memory_mb=512",
        ):
            c.judge_function(task)
        assert c.judge_function(task, Limits(memory_mb=256, wall_s=5)).passed
        assert c.run(ExecSpec.single("python", "print(2)", limits=Limits(memory_mb=128, wall_s=5))).stdout == b"2\n"
        assert srv.served == 4
    assert host_residue(UIDS) == []


def test_a_full_queue_answers_busy_and_the_client_backs_off_until_served(bwrap_ok, run_dir):
    with server(run_dir, slots=1, queue=0) as srv, Node(run_dir, "gen-0") as node:
        slow = ExecSpec.single("python", "import time; time.sleep(2); print('slow')", limits=Limits(wall_s=5))
        holder = {}
        t = threading.Thread(target=lambda: holder.setdefault("r", SandboxClient(node).run(slow)))
        t.start()
        deadline = time.monotonic() + 5
        while srv.pool.busy == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the slow run holds the only slot
        quick = ExecSpec.single("python", "print('later')")
        with Node(run_dir, "gen-1") as node2:
            raw = RequestClient(node2, "sandbox-0", timeout_s=5, retries=0)
            assert raw.request("exec", quick.to_wire()).kind == "busy"
            with pytest.raises(SandboxBusy, match="queue full"):
                SandboxClient(node2).run(quick, timeout_s=0.5)
            r = SandboxClient(node2).run(quick)  # backs off until the slot is free
        t.join()
        assert holder["r"].stdout == b"slow\n" and r.stdout == b"later\n"
        assert srv.refused >= 2


def test_retries_of_one_request_run_it_once(bwrap_ok, run_dir):
    with server(run_dir) as srv, Node(run_dir, "gen-0") as node:
        spec = ExecSpec.single("python", "import time; time.sleep(1); print('once')", limits=Limits(wall_s=5))
        before = srv.served
        # Attempts time out every 0.15 s and are resent on fresh sockets under the same id.
        env = RequestClient(node, "sandbox-0", timeout_s=0.15, retries=40).request("exec", spec.to_wire())
        assert env.kind == "result" and env.body["stdout"] == b"once\n"
        assert srv.served - before == 1
        # The slot is free once the reply is sent (a moment after the client has it).
        wait_for(lambda: srv.pool.busy == 0 and srv.pool.queued == 0, 30, what="the slot to be free")


_DIES_AFTER_START = """
import os, signal, sys, time
from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.spec import ExecSpec, Limits
backend = BwrapBackend(uid={uid})
spec = ExecSpec.single("python", "import time; time.sleep(600)", limits=Limits(wall_s=600, cpu_s=600))
print("ready", flush=True)
sys.stdin.readline()
backend.start(spec)
time.sleep({delay})
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.01, 0.03])
def test_a_server_killed_while_it_starts_a_sandbox_leaves_none_running(bwrap_ok, delay):
    # bwrap sets its parent-death signal only after it has made its namespaces (milliseconds):
    # a server SIGKILLed before that left a sandbox running unsupervised, with no wall limit.
    adopt_orphans()
    uid = UID + 5
    proc = subprocess.Popen(
        [sys.executable, "-c", _DIES_AFTER_START.format(uid=uid, delay=delay)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.wait(30) == -signal.SIGKILL
        left = settled([uid], timeout_s=10, cgroups=False)
        assert left == [], f"the sandbox outlived its server: {left}"
        # SIGKILL skipped its atexit: its cgroup parents stay until the next process that probes
        # cgroups (a server starting) sweeps them. Be that process, so no later test finds them.
        probe = "from hpcrl.sandbox import cgroups; cgroups.probe()"
        subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
        left = settled([uid], timeout_s=10)  # what the sweep killed, reaped
        assert left == [], f"the next process to probe cgroups did not sweep the dead server's: {left}"
    finally:
        _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    """SIGKILL whatever still runs as `uid` (a failed test must not leave its sandboxes behind)."""
    for line in host_residue([uid], cgroups=False):
        if line.startswith("process "):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[1]), signal.SIGKILL)
    settled([uid], cgroups=False)


def _start_server(run_dir: Path, config: Path) -> subprocess.Popen:
    old = None
    try:
        old = read_endpoint(run_dir, "sandbox-0").instance
    except Exception:  # no endpoint yet
        pass
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpcrl.jobs.cli",
            "sandbox",
            "serve",
            "--slots",
            "2",
            "--run-dir",
            str(run_dir),
            "--config",
            str(config),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if read_endpoint(run_dir, "sandbox-0").instance != old:
                return proc
        except Exception:  # not published yet
            pass
        if proc.poll() is not None:
            raise AssertionError(f"sandbox server exited: {proc.stderr.read().decode()}")
        time.sleep(0.05)
    raise AssertionError("sandbox server did not publish its endpoint in 30 s")


@pytest.mark.slow
def test_killing_the_server_10_times_leaves_clients_working(bwrap_ok, run_dir, tmp_path):
    adopt_orphans()  # the killed servers' sandboxes end up here; reap them to check for residue
    config = tmp_path / "config.yaml"
    config.write_text(f"sandbox:\n  uid_base: {UID}\n")
    proc = _start_server(run_dir, config)
    try:
        with Node(run_dir, "gen-0") as node:
            client = SandboxClient(node, attempt_s=0.5)
            assert client.run(ExecSpec.single("python", "print('up')")).stdout == b"up\n"
            for i in range(10):
                # A request in flight when the server dies is answered by the next server.
                spec = ExecSpec.single("python", f"import time; time.sleep(0.3); print({i})", limits=Limits(wall_s=2))
                got = {}
                t = threading.Thread(
                    target=lambda got=got, spec=spec: got.setdefault("r", client.run(spec, timeout_s=60))
                )
                t.start()
                time.sleep(0.15)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                # The sandboxes die with their server (a few ms later; their zombies come to us, the
                # subreaper); its empty cgroups wait for the next server to sweep them.
                assert settled(UIDS, cgroups=False) == [], f"kill {i + 1}"
                proc = _start_server(run_dir, config)
                t.join(60)
                assert got["r"].status == "ok" and got["r"].stdout == f"{i}\n".encode(), f"kill {i + 1}"
                assert settled(UIDS, servers=[proc.pid]) == [], f"kill {i + 1}"  # bar its next sandbox
            assert client.run(ExecSpec.single("python", "print('still up')")).stdout == b"still up\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
        reap_orphans()
    assert code == 0
    assert settled(UIDS) == []


def settled(uids, timeout_s: float = 5.0, **kw) -> list[str]:
    """host_residue once the killed server's sandboxes have finished dying (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reap_orphans(timeout_s=0)
        left = host_residue(uids, **kw)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
