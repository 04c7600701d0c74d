"""Adversarial programs against the bwrap sandbox: one property per test, each bounded in time,
each also checking that nothing of the sandbox is left on the host (processes of the slot uid,
files it owns in /tmp, /var/tmp, /dev/shm, populated cgroups, new mounts).

Needs bubblewrap and root; skips without, fails with HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.spec import ExecSpec, Limits

from conftest import require_bwrap
from residue import Snapshot, host_residue

UID = 61060
QUICK = Limits(wall_s=3, cpu_s=3, memory_mb=256, pids=32, output_kb=256)


@pytest.fixture(scope="module")
def backend():
    require_bwrap(UID)
    b = BwrapBackend(uid=UID)
    yield b
    b.close()


def probe(backend, src, lang="python", **limits):
    """Run `src`; assert it ended within its wall limit and left nothing behind; return the result."""
    before = Snapshot.take()
    lim = QUICK.replace(**limits)
    t0 = time.monotonic()
    r = backend.run(ExecSpec.single(lang, src, limits=lim))
    assert time.monotonic() - t0 < lim.wall_s + 5, "the sandbox outlived its wall limit"
    assert host_residue([UID], before, waiting=[backend]) == []
    return r


def out(r) -> str:
    return (r.stdout + r.stderr).decode(errors="replace")


# -- processes ---------------------------------------------------------------------------------


def test_fork_bomb_is_contained(backend):
    r = probe(backend, ":(){ :|:& };:\nsleep 1; echo host-still-fine", lang="bash", wall_s=2)
    assert r.status in ("timeout", "ok", "nonzero_exit")
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_python_fork_bomb_never_exceeds_the_pids_limit(backend):
    src = (
        "import os, time\nn = 0\nfor _ in range(10000):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n        n += 1\n    except OSError:\n        break\n"
        "print(n, flush=True)\n"
    )
    r = probe(backend, src, pids=16, wall_s=2)
    assert r.stdout and int(r.stdout.split()[0]) < 16


def test_memory_bomb_in_one_process(backend):
    r = probe(backend, "x = []\nwhile True: x.append(bytearray(16 << 20))", memory_mb=128)
    if backend.cgroups.memory:
        assert r.status == "memory_limit" and r.peak_memory_mb <= 128 + 8
    else:
        assert r.status == "nonzero_exit" and "MemoryError" in out(r)


def test_memory_bomb_across_many_processes_is_capped_in_total(backend):
    if not backend.cgroups.memory:
        pytest.skip("no memory cgroup here: only per-process RLIMIT_AS, the total is not capped (documented)")
    src = (
        "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        x = bytearray(60 << 20)\n"
        "        for i in range(0, len(x), 4096): x[i] = 1\n        time.sleep(1); os._exit(0)\n"
        "for _ in range(8):\n    os.wait()\n"
    )
    r = probe(backend, src, memory_mb=160, wall_s=4)
    assert r.status == "memory_limit"
    assert r.peak_memory_mb <= 160 + 8


def _autogroups() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as fh:
            on = fh.read().strip() == "1"
        with open("/proc/self/cgroup") as fh:  # autogroups apply in the root cpu cgroup only
            return on and all(line.rstrip().endswith(":/") for line in fh if ":cpu" in line or line.startswith("0::"))
    except OSError:
        return False


@pytest.mark.parametrize("cgroups", [True, False], ids=["cpu-cgroup", "no-cgroups"])
def test_60_busy_loops_in_one_slot_do_not_starve_another(backend, cgroups):
    # Each loop tries a session of its own, so that the kernel's autogroups (one per session)
    # would give it 60 shares: a cpu cgroup per run (weight and quota) keeps the other slot fed,
    # and without one, the seccomp filter's refusal of setsid keeps the run one autogroup.
    if cgroups and not backend.cgroups.cpu_limit:
        pytest.skip("no cpu controller here (documented in sandbox/bwrap.py)")
    if not cgroups and not _autogroups():
        pytest.skip("no autogroups here: without cgroups CPU is not shared per run (documented)")
    if not cgroups:
        backend = BwrapBackend(uid=UID + 3, use_cgroups=False)
    hog = (
        "import os, time\nfor _ in range(60):\n    if os.fork() == 0:\n        try: os.setsid()\n"
        "        except OSError: pass\n        while True: pass\nprint('forked', flush=True)\ntime.sleep(100)\n"
    )
    work = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done')\n"
    other = BwrapBackend(uid=UID + 2, use_cgroups=cgroups)
    before = Snapshot.take()
    with backend.session(ExecSpec.single("python", hog, limits=QUICK.replace(wall_s=30, cpu_s=60, pids=72))) as s:
        assert s.read_line(timeout_s=20) == b"forked\n"
        r = other.run(ExecSpec.single("python", work, limits=QUICK.replace(wall_s=10)))
        s.kill()
        hogged = s.finish()
    assert r.status == "ok" and r.stdout == b"done\n", r
    if cgroups:  # the quota: one core (Limits.cpus) however many processes, with a margin
        assert hogged.cpu_s <= hogged.wall_s * Limits().cpus * 1.25 + 0.5, hogged
    assert host_residue([backend.uid, UID + 2], before, cgroups=cgroups, waiting=[backend, other]) == []
    other.close()


def test_infinite_loop_hits_the_cpu_limit(backend):
    r = probe(backend, "while True: pass", cpu_s=1, wall_s=3)
    assert r.status == "cpu_limit"


def test_sleep_forever_times_out(backend):
    r = probe(backend, "import time; time.sleep(10**6)", wall_s=1)
    assert r.status == "timeout"


def test_double_fork_setsid_daemon_dies_with_the_sandbox(backend):
    src = (
        "import os, time\nif os.fork() == 0:\n    try: os.setsid()\n    except OSError: pass\n    if os.fork() == 0:\n"
        "        time.sleep(30)\n    os._exit(0)\nos.wait()\nprint('parent done')\n"
    )
    # The daemon sleeps 30 s: a run that ends "ok" inside a 20-s wall limit did not wait for it
    # (no bound on the run's own time, which a loaded machine stretches).
    r = probe(backend, src, wall_s=20)
    assert r.status == "ok" and r.stdout == b"parent done\n"


def test_stdout_flood(backend):
    r = probe(backend, "import os\nwhile True: os.write(1, b'y' * 65536)", output_kb=128)
    assert r.status == "output_limit" and r.stdout_truncated and len(r.stdout) == 128 * 1024


def test_stderr_flood(backend):
    r = probe(backend, "import os\nwhile True: os.write(2, b'e' * 65536)", output_kb=128)
    assert r.status == "output_limit" and r.stderr_truncated and len(r.stderr) == 128 * 1024
    assert not r.stdout_truncated


# -- files -------------------------------------------------------------------------------------


def test_a_2_gib_file_is_stopped_at_the_file_size_limit(backend):
    src = (
        "import sys\nchunk = b'z' * (1 << 20)\nn = 0\ntry:\n    with open('big', 'wb') as f:\n"
        "        for _ in range(2048):\n            f.write(chunk); f.flush(); n += 1\n"
        "except OSError as e:\n    print('stopped', n, e.errno); sys.exit(1)\nprint('wrote', n)\n"
    )
    r = probe(backend, src, file_size_mb=16, work_mb=64, wall_s=5)
    assert r.stdout.startswith(b"stopped") and int(r.stdout.split()[1]) <= 16


def test_100000_small_files_run_out_of_work_dir_space(backend):
    src = (
        "import os\nn = 0\ntry:\n    for i in range(100000):\n        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'x')\n        n += 1\nexcept OSError as e:\n    print('stopped', n, e.errno)\n"
        "else:\n    print('created', n)\n"
    )
    r = probe(backend, src, work_mb=16, wall_s=10, cpu_s=10, memory_mb=512)
    assert r.stdout.startswith(b"stopped"), out(r)
    assert int(r.stdout.split()[1]) < 100000


@pytest.mark.parametrize("where", ["/work", "/tmp", "/dev/shm"])
def test_empty_files_cannot_exhaust_inodes(where):
    # Empty files take no tmpfs space, only inodes (and kernel memory): without an inode cap a
    # memory cgroup was all that bounded them. Here there is none, to check the cap itself.
    backend = BwrapBackend(uid=UID + 1, use_cgroups=False)
    src = (
        f"import os\nos.chdir({where!r})\nn = 0\ntry:\n    for i in range(200000):\n"
        "        os.close(os.open(f'e{i}', os.O_CREAT | os.O_WRONLY)); n += 1\n"
        "except OSError as e:\n    print('stopped', n, e.errno)\nelse:\n    print('created', n)\n"
    )
    before = Snapshot.take()
    r = backend.run(ExecSpec.single("python", src, limits=QUICK.replace(wall_s=20, cpu_s=20)))
    assert r.stdout.startswith(b"stopped"), out(r)
    assert int(r.stdout.split()[1]) <= Limits().inodes and int(r.stdout.split()[2]) == 28  # ENOSPC
    assert host_residue([UID + 1], before, cgroups=False, waiting=[backend]) == []
    backend.close()


def test_dev_shm_fill_is_capped_and_private(backend):
    host_free = shutil.disk_usage("/dev/shm").free
    src = (
        "n = 0\ntry:\n    with open('/dev/shm/fill', 'wb') as f:\n        while True:\n"
        "            f.write(b's' * (1 << 20)); f.flush(); n += 1\nexcept OSError as e:\n    print('stopped', n)\n"
    )
    r = probe(backend, src, shm_mb=8, file_size_mb=64)
    assert r.stdout.startswith(b"stopped") and int(r.stdout.split()[1]) <= 8
    assert shutil.disk_usage("/dev/shm").free >= host_free - (4 << 20)


@pytest.mark.parametrize("path", ["/etc/hpcrl-probe", "/usr/hpcrl-probe", "/usr/bin/hpcrl-probe", "/hpcrl-probe"])
def test_system_directories_are_read_only(backend, path):
    name = f"{path}-{secrets.token_hex(4)}"
    try:
        r = probe(backend, f"open({name!r}, 'w').write('x')")
        assert r.status == "nonzero_exit" and ("Read-only file system" in out(r) or "Permission denied" in out(r))
        assert not os.path.exists(name)
    finally:
        if os.path.exists(name):
            os.remove(name)


def test_root_home_is_not_visible(backend):
    r = probe(backend, "import os\nfor p in ('/root', '/home'):\n    print(p, os.path.exists(p))")
    assert r.stdout == b"/root False\n/home False\n"


def test_the_run_directory_is_not_visible(backend, tmp_path):
    run_dir = tmp_path / "runs" / "quickstart-1"
    run_dir.mkdir(parents=True)
    secret = secrets.token_hex(16)
    (run_dir / "server.key").write_text(secret)
    src = (
        f"import os\nfor p in ({str(run_dir)!r}, {str(run_dir / 'server.key')!r}, {str(tmp_path)!r}):\n"
        "    print(os.path.exists(p))\n"
    )
    r = probe(backend, src)
    assert r.stdout == b"False\nFalse\nFalse\n" and secret.encode() not in r.stdout


def test_a_secret_in_the_servers_environment_is_not_visible(backend, monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("HPCRL_TEST_SECRET", secret)
    src = (
        "import os\nprint(dict(os.environ))\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
        "        for f in ('environ', 'cmdline'):\n            try: print(open(f'/proc/{pid}/{f}', 'rb').read())\n"
        "            except OSError as e: print(pid, f, e)\n"
    )
    r = probe(backend, src)
    assert r.status == "ok" and b"/proc/1/environ" not in r.stderr
    assert secret.encode() not in r.stdout + r.stderr
    assert b"HPCRL_TEST_SECRET" not in r.stdout + r.stderr


# -- network -----------------------------------------------------------------------------------


class _Listener:
    """A host listener that records whether anything connected."""

    def __init__(self, family, address):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.connections = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._accept, daemon=True)
        self._t.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
                self.connections += 1
                c.close()
            except (TimeoutError, OSError):
                pass

    def close(self):
        self._stop.set()
        self._t.join()
        self.sock.close()


def _host_ip() -> str:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def test_host_tcp_ports_are_unreachable(backend):
    lis = _Listener(socket.AF_INET, ("0.0.0.0", 0))
    port = lis.sock.getsockname()[1]
    try:
        src = (
            f"import socket\nfor host in ('127.0.0.1', {_host_ip()!r}):\n    s = socket.socket()\n    s.settimeout(1)\n"
            f"    try:\n        s.connect((host, {port})); print('CONNECTED', host)\n"
            "    except OSError as e:\n        print('refused', host, e.errno)\n"
        )
        r = probe(backend, src)
    finally:
        lis.close()
    assert b"CONNECTED" not in r.stdout and r.stdout.count(b"refused") == 2
    assert lis.connections == 0


def test_host_unix_sockets_are_unreachable(backend, tmp_path):
    path = str(tmp_path / "host.sock")
    abstract = "\0hpcrl-test-" + secrets.token_hex(4)
    listeners = [_Listener(socket.AF_UNIX, path), _Listener(socket.AF_UNIX, abstract)]
    try:
        src = (
            f"import socket\nfor addr in ({path!r}, {abstract!r}):\n    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n        s.connect(addr); print('CONNECTED')\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
        )
        r = probe(backend, src)
    finally:
        for lis in listeners:
            lis.close()
    assert b"CONNECTED" not in r.stdout and r.stdout.count(b"refused") == 2
    assert sum(lis.connections for lis in listeners) == 0


def test_dns_does_not_resolve(backend):
    src = (
        "import socket\ntry:\n    print(socket.getaddrinfo('example.com', 80))\n"
        "except OSError as e:\n    print('no dns', e)\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n    s.sendto(b'x', ('8.8.8.8', 53)); print('SENT')\n"
        "except OSError as e:\n    print('no route', e.errno)\n"
    )
    r = probe(backend, src)
    assert r.stdout.startswith(b"no dns") and b"no route" in r.stdout and b"SENT" not in r.stdout


# -- signals, namespaces, threads, stdin -----------------------------------------------------------


def test_kill_minus_one_cannot_reach_host_processes_of_the_same_uid(backend):
    as_slot = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"] if os.geteuid() == 0 else []
    canary = subprocess.Popen([*as_slot, "sleep", "30"])  # not root: the sandbox runs as our uid
    try:
        # kill(-1) reaches every process the caller may signal: inside the sandbox, none (ESRCH).
        src = (
            "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
            "except OSError as e:\n    print('errno', e.errno)\n"
            "print('survived')\n"
        )
        before = Snapshot.take()
        r = backend.run(ExecSpec.single("python", src, limits=QUICK))
        assert r.stdout.endswith(b"survived\n")
        assert canary.poll() is None, "kill(-1) inside the sandbox killed a host process"
    finally:
        canary.kill()
        canary.wait()
    assert host_residue([UID], before, waiting=[backend]) == []


def test_nested_user_namespaces_are_refused(backend):
    src = (
        "import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('cli', subprocess.run(['unshare', '-U', '-r', 'true']).returncode)\n"
    )
    r = probe(backend, src)
    lines = r.stdout.decode().split("\n")
    assert lines[0].startswith("unshare -1") and lines[1] != "cli 0"


def test_endless_threads_are_capped_by_the_pids_limit(backend):
    src = (
        "import threading, time\nn = 0\ntry:\n    while True:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n += 1\n"
        "except RuntimeError:\n    print('capped', n, flush=True)\n"
    )
    r = probe(backend, src, pids=32, wall_s=3)
    assert r.stdout.startswith(b"capped") and int(r.stdout.split()[1]) < 32


def test_a_blocking_stdin_read_sees_end_of_file(backend):
    r = probe(backend, "import sys\ndata = sys.stdin.buffer.read()\nprint('eof after', len(data))", wall_s=3)
    assert r.status == "ok" and r.stdout == b"eof after 0\n"


def test_a_program_blocked_on_an_open_stdin_is_killed_at_its_deadline(backend):
    before = Snapshot.take()
    spec = ExecSpec.single("python", "import sys; sys.stdin.read()", limits=QUICK.replace(wall_s=1))
    t0 = time.monotonic()
    with backend.session(spec) as s:
        assert s.read_line(timeout_s=3) is None  # stdin stays open; the deadline passes meanwhile
        r = s.finish()
    assert r.status == "timeout" and time.monotonic() - t0 < 3.5
    assert host_residue([UID], before, waiting=[backend]) == []


def test_the_terminal_cannot_be_injected_into(backend):
    # TIOCSTI on fd 0 would push keystrokes into a controlling terminal; --new-session removes it.
    src = (
        "import fcntl, termios\ntry:\n    fcntl.ioctl(0, termios.TIOCSTI, b'x'); print('INJECTED')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    r = probe(backend, src)
    assert r.stdout.startswith(b"refused")


def test_proc_sys_is_read_only(backend):
    r = probe(backend, "open('/proc/sys/kernel/hostname', 'w').write('pwned')")
    assert r.status == "nonzero_exit" and socket.gethostname() != "pwned"


def test_signals_sent_from_outside_only_reach_the_sandbox(backend):
    # A program that ignores SIGTERM still ends at its deadline: the kill is SIGKILL, tree-wide.
    src = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(30)"
    r = probe(backend, src, wall_s=1)
    assert r.status == "timeout" and r.signal == signal.SIGKILL


def test_the_program_cannot_see_host_processes(backend):
    r = probe(backend, "import os\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    # bwrap is pid 1 of the launcher's pid namespace, the program the only other process there:
    # nothing of the host, not even the server.
    me, pids = r.stdout.decode().split(" ", 1)
    assert json.loads(pids) == [1, int(me)], r.stdout


def test_tmp_is_private_to_each_run(backend):
    probe(backend, "open('/tmp/left-behind', 'w').write('x')")
    r = probe(backend, "import os; print(os.listdir('/tmp'))")
    assert r.stdout == b"[]\n"
    assert not os.path.exists("/tmp/left-behind")


def test_setuid_binaries_do_not_elevate(backend):
    su = next((p for p in ("/usr/bin/su", "/usr/bin/passwd", "/usr/bin/mount") if os.path.exists(p)), None)
    if su is None:
        pytest.skip("no setuid binary to try")
    r = probe(
        backend,
        f"import subprocess\nsubprocess.run([{su!r}, '--help'], capture_output=True)\nimport os\nprint(os.geteuid())",
    )
    assert r.stdout.strip().endswith(b"65534")


def test_workdir_is_a_fresh_tmpfs(backend):
    r = probe(backend, "import os\nprint(sorted(os.listdir('.')))\nprint(open('/proc/self/mounts').read())")
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "['main.py']"
    assert any(" /work tmpfs " in ln for ln in lines)


def test_the_host_temp_dir_is_untouched(backend):
    marker = f"hpcrl-adv-{secrets.token_hex(4)}"
    probe(
        backend,
        "import os\nfor d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
        f"    try: open(os.path.join(d, {marker!r}), 'w').write('x')\n"
        "    except OSError: pass",
    )
    for d in (tempfile.gettempdir(), "/var/tmp", "/dev/shm"):
        assert not os.path.exists(os.path.join(d, marker))
