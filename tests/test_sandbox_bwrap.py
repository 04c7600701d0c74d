"""The bwrap backend for real: languages, statuses, limits, stdin/argv, sessions, uids.

Needs bubblewrap (apt `bubblewrap`) and root (per-slot uids). Skips without it, fails instead
when HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.languages import get_language
from hpcrl.sandbox.result import SandboxUnavailable
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile

from conftest import require_bwrap
from residue import host_residue

UID = 61040


def needs(*langs):
    missing = [lang for lang in langs if not get_language(lang).present()]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed on this host")


@pytest.fixture(scope="module")
def backend():
    require_bwrap(UID)
    b = BwrapBackend(uid=UID)
    yield b
    b.close()


def run(backend, lang, src, **kw):
    return backend.run(ExecSpec.single(lang, src, **kw))


HELLO = {
    "python": "import sys; print('hello', sys.argv[1:], sys.stdin.read())",
    "bash": 'echo hello "[$*]" "$(cat)"',
    "node": "const fs=require('fs'); console.log('hello', process.argv.slice(2), fs.readFileSync(0,'utf8'))",
    "c": "#include <stdio.h>\nint main(int c,char**v){char b[64]={0};fgets(b,64,stdin);"
    'printf("hello %s %s\\n",v[1],b);}',
    "cpp": "#include <iostream>\n#include <string>\nint main(int c,char**v){std::string s;std::cin>>s;"
    'std::cout<<"hello "<<v[1]<<" "<<s<<std::endl;}',
}


@pytest.mark.parametrize("lang", sorted(HELLO))
def test_each_present_language_runs_with_stdin_and_argv(backend, lang):
    if not get_language(lang).present():
        pytest.skip(f"{lang} is not installed on this host")
    r = backend.run(ExecSpec.single(lang, HELLO[lang], stdin=b"in", argv=("x",)))
    assert r.status == "ok", r
    assert r.stdout.startswith(b"hello") and b"x" in r.stdout and b"in" in r.stdout


@needs("c", "cpp")
@pytest.mark.parametrize("lang,src", [("c", "int main( {"), ("cpp", "int main() { undefined_fn(); }")])
def test_a_compile_error_is_a_result_with_the_diagnostics(backend, lang, src):
    r = run(backend, lang, src)
    assert r.status == "compile_error"
    assert b"error" in r.stderr


@needs("c")
def test_compilation_runs_under_its_own_limits(backend):
    # gcc needs far more than 24 MiB; the compiled program does not. The compile step has its own limits.
    src = '#include <stdio.h>\nint main(){puts("built");}'
    r = backend.run(ExecSpec.single("c", src, limits=Limits(memory_mb=24, wall_s=2)))
    assert r.status == "ok" and r.stdout == b"built\n"


@needs("c")
def test_a_compile_bomb_is_a_compile_error_within_the_compile_limits(backend):
    # Each macro level doubles the expansion: 2**32 tokens, far beyond any limit.
    levels = "".join(f"#define L{i + 1}(x) L{i}(x) L{i}(x)\n" for i in range(32))
    src = "#define L0(x) x\n" + levels + "int main(void){ L32(;) return 0; }\n"
    r = backend.run(ExecSpec.single("c", src, compile_limits=Limits(wall_s=2, cpu_s=2, memory_mb=256)))
    assert r.status == "compile_error"
    # Stopped by the 2-s limit (unlimited, the expansion runs for hours), with room for a loaded machine.
    assert r.wall_s < 60
    assert not host_residue([UID], waiting=[backend])


@needs("c")
def test_a_compiled_program_is_reused_across_runs(backend):
    spec = ExecSpec.single("c", '#include <stdio.h>\nint main(){int x; scanf("%d",&x); printf("%d\\n",x*2);}')
    built = backend.build(spec)
    assert built.path == "prog" and built.executable
    outs = [backend.run(ExecSpec(spec.language, spec.files, stdin=s), built).stdout for s in (b"2", b"21")]
    assert outs == [b"4\n", b"42\n"]


def test_exit_codes_and_signals(backend):
    assert (r := run(backend, "python", "import sys; sys.exit(3)")).status == "nonzero_exit" and r.exit_code == 3
    r = run(backend, "python", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (r.status, r.signal, r.exit_code) == ("killed_by_signal", 11, None)


def test_wall_timeout_kills(backend):
    r = run(backend, "python", "import time; time.sleep(60)", limits=Limits(wall_s=0.5))
    assert r.status == "timeout" and r.signal == 9
    assert r.wall_s < 30  # killed, not slept out (60 s), with room for a loaded machine


def test_cpu_limit_stops_a_busy_loop_before_the_wall_limit(backend):
    r = run(backend, "python", "while True: pass", limits=Limits(cpu_s=1, wall_s=20))
    assert r.status == "cpu_limit"  # not "timeout": stopped by the CPU limit before the wall limit


def test_memory_limit(backend):
    r = run(backend, "python", "x = bytearray(400 << 20)", limits=Limits(memory_mb=100))
    if backend.cgroups.memory:
        assert r.status == "memory_limit" and r.peak_memory_mb <= 110
    else:  # RLIMIT_DATA only: the allocation fails inside the program
        assert r.status == "nonzero_exit" and b"MemoryError" in r.stderr


def test_output_cap_truncates_and_kills(backend):
    r = run(backend, "python", "import sys\nwhile True: sys.stdout.write('x' * 4096)", limits=Limits(output_kb=64))
    assert r.status == "output_limit" and r.stdout_truncated and len(r.stdout) == 64 * 1024
    assert not r.stderr_truncated


def test_binary_output_and_stdin_are_bytes(backend):
    data = bytes(range(256)) * 4
    r = run(backend, "python", "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])", stdin=data)
    assert r.stdout == data[::-1]


def test_large_stdin_to_a_program_that_reads_none_of_it(backend):
    r = run(backend, "python", "print('ignored')", stdin=b"x" * (4 << 20))
    assert r.status == "ok" and r.stdout == b"ignored\n"


def test_multiple_files_and_nested_paths(backend):
    spec = ExecSpec(
        "python",
        (
            SourceFile("main.py", "from pkg.util import f; print(f())"),
            SourceFile("pkg/__init__.py", ""),
            SourceFile("pkg/util.py", "def f(): return 'nested'"),
        ),
    )
    assert backend.run(spec).stdout == b"nested\n"


def test_the_program_sees_a_minimal_environment_and_its_own_work_dir(backend):
    r = run(
        backend,
        "python",
        "import os, json; print(json.dumps([dict(os.environ), os.getcwd(), os.getuid(), sorted(os.listdir('/'))]))",
    )
    import json

    env, cwd, uid, top = json.loads(r.stdout)
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD"} | (
        {"MALLOC_ARENA_MAX"} if backend.memory != "cgroup" else set()
    )
    assert cwd == "/work" and uid == 65534
    assert "home" not in top and "root" not in top


def test_the_sandbox_runs_as_the_slot_uid_on_the_host(backend):
    seen = {}

    def watch():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "uids" not in seen:
            for pid in os.listdir("/proc"):
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                    status = open(f"/proc/{pid}/status").read()
                except OSError:
                    continue
                if b"marker-8fa1" in cmd and cmd.split(b"\0")[0] == b"python3":
                    seen["uids"] = {int(x) for x in status.split("Uid:")[1].split("\n")[0].split()}
                    break
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    run(backend, "python", "import time; time.sleep(1.5)", argv=("marker-8fa1",), limits=Limits(wall_s=5))
    t.join()
    if os.geteuid() == 0:
        assert seen.get("uids") == {UID}, seen
    else:
        assert seen.get("uids") == {os.geteuid()}


@pytest.fixture
def as_root():
    if os.geteuid() != 0:
        pytest.skip("slot uids exist only when the sandbox is started as root")


def test_a_slot_uid_that_is_a_real_account_or_group_is_refused(as_root):
    import grp
    import pwd

    account = next(p for p in pwd.getpwall() if p.pw_uid > 0)  # nobody (65534) at least
    with pytest.raises(SandboxUnavailable, match=rf"slot uid {account.pw_uid} is the account '{account.pw_name}'"):
        BwrapBackend(uid=account.pw_uid)
    users = {p.pw_uid for p in pwd.getpwall()}
    group = next((g for g in grp.getgrall() if g.gr_gid > 0 and g.gr_gid not in users), None)
    if group is not None:  # the slot also runs with gid = uid
        with pytest.raises(SandboxUnavailable, match=rf"slot uid {group.gr_gid} is the group '{group.gr_name}'"):
            BwrapBackend(uid=group.gr_gid)
    with pytest.raises(SandboxUnavailable, match=r"sandbox.uid_base"):
        BwrapBackend(uid=account.pw_uid)


def test_two_processes_cannot_share_a_slot_uid(as_root):
    uid = UID + 7
    src = (
        "import sys\nfrom hpcrl.sandbox.bwrap import BwrapBackend\n"
        f"b = BwrapBackend(uid={uid})\nprint('holding', flush=True)\nsys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", src], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"holding\n"
        with pytest.raises(
            SandboxUnavailable,
            match=rf"slot uid {uid} is in use by another sandbox process on this host \(pid {holder.pid}, .*"
            r"take free ones from the pool",
        ):
            BwrapBackend(uid=uid)
    finally:
        holder.stdin.close()
        holder.wait(30)
    # Free again once the holder is gone; one process may hold a uid twice (a check and its backend).
    a, b = BwrapBackend(uid=uid), BwrapBackend(uid=uid)
    a.close()
    b.close()


def test_a_session_talks_to_a_live_program(backend):
    spec = ExecSpec.single("python", "import sys\nfor line in sys.stdin:\n    print(int(line) * 2, flush=True)")
    with backend.session(spec) as s:
        answers = []
        for n in (1, 2, 3):
            s.send(f"{n}\n".encode())
            answers.append(s.read_line(timeout_s=5))
        assert s.read_line(timeout_s=0.2) is None  # nothing more until asked
        s.close_stdin()
        r = s.finish()
    assert answers == [b"2\n", b"4\n", b"6\n"] and r.status == "ok"


def test_leaving_a_session_without_finishing_kills_the_program(backend):
    with backend.session(ExecSpec.single("python", "import time; time.sleep(60)")):
        pass
    assert not host_residue([UID], waiting=[backend])


def test_a_session_killed_at_any_moment_of_its_start_leaves_no_zombie():
    # The earliest kills land before bwrap has reported its init's pid: that init still comes
    # to us (subreaper) and must be found and reaped, or it waits as a zombie for the host's
    # init, which in a container may never reap. Delays step through the whole start-up, of a
    # sandbox started on demand and of one started ahead that a closing backend ends.
    spec = ExecSpec.single("python", "import time; time.sleep(60)")
    cold = BwrapBackend(uid=UID + 8, start_ahead=False)
    for i in range(40):
        s = cold.start(spec)
        time.sleep(i * 0.0015)
        s.kill()
        assert s.finish().status != "ok"
        assert host_residue([UID + 8]) == [], f"after a kill {i * 1.5:.1f} ms into the start"
    cold.close()
    for i in range(20):
        ahead = BwrapBackend(uid=UID + 8)
        assert ahead.run(ExecSpec.single("bash", "true")).status == "ok" and len(ahead.waiting) == 1
        time.sleep(i * 0.003)
        ahead.close()
        assert ahead.waiting == () and host_residue([UID + 8]) == [], f"closed {i * 3} ms into the start"


def test_killing_the_launcher_alone_kills_every_process_of_the_sandbox():
    # No cgroup to fall back on: the launcher's pid namespace is what holds them. Its pid 1 dies
    # with the launcher (--kill-child), and with it the setsid daemon and the program.
    backend = BwrapBackend(uid=UID + 9, use_cgroups=False)
    src = (
        "import os, sys, time\nif os.fork() == 0:\n    try: os.setsid()\n    except OSError: pass\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n    os._exit(0)\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    s = backend.start(ExecSpec.single("python", src, limits=Limits(wall_s=60, cpu_s=60)))
    assert s.read_line(timeout_s=10) == b"up\n"
    os.kill(s._proc.pid, 9)  # the launcher only, as a kill of the whole server would
    assert s.finish().status != "ok"
    assert host_residue([UID + 9], cgroups=False, waiting=[backend]) == []
    backend.close()


def test_concurrent_runs_on_different_slots(backend):
    backends = [BwrapBackend(uid=UID + 1 + i) for i in range(3)]
    results = [None] * 3

    def go(i):
        results[i] = backends[i].run(ExecSpec.single("python", f"import time; time.sleep(0.3); print({i})"))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [b"0\n", b"1\n", b"2\n"]
    assert time.monotonic() - t0 < 0.3 * 3 + 2  # they overlapped rather than queued
    assert not host_residue(range(UID, UID + 4), waiting=[backend, *backends])
    for b in backends:
        b.close()


def test_describe_says_which_limits_are_enforced(backend):
    text = backend.describe()
    assert "memory limit" in text and "pids limit" in text
    if shutil.which("bwrap") and os.geteuid() == 0 and os.path.isdir("/sys/fs/cgroup"):
        assert f"uid {UID}" in text


def test_a_language_whose_interpreter_is_missing_is_an_infrastructure_error(backend, monkeypatch, tmp_path):
    from hpcrl.sandbox.result import SandboxUnavailable

    monkeypatch.setenv("PATH", str(tmp_path))  # a host without node (or anything else)
    with pytest.raises(SandboxUnavailable, match="language 'node' is not available here"):
        backend.run(ExecSpec.single("node", "console.log(1)"))


# -- the next sandbox, started ahead -----------------------------------------------------------


def test_a_run_takes_the_sandbox_started_for_its_limits_and_leaves_the_next_one():
    backend = BwrapBackend(uid=UID + 7)
    fast, big = Limits(wall_s=5), Limits(wall_s=5, memory_mb=300, pids=40)
    try:
        assert run(backend, "bash", "true", limits=fast).status == "ok"
        assert backend.settle(timeout_s=60) and len(backend.waiting) == 1
        taken = set(backend.waiting)
        # Other limits cannot use it (its cgroups, rlimits and mounts are the old ones'): a fresh
        # sandbox, and one started ahead for those limits too, the first kept.
        r = run(backend, "bash", "cat /proc/self/limits | grep -i 'max processes'", limits=big)
        assert r.status == "ok" and r.stdout.split()[2:4] == [b"40", b"40"], r.stdout
        assert backend.settle(timeout_s=60) and taken < set(backend.waiting) and len(backend.waiting) == 2
        # The same limits with another wall clock and output cap take the first, whose clock starts now.
        r = run(backend, "bash", "cat /proc/self/limits | grep -i 'max processes'", limits=fast.replace(wall_s=9))
        assert r.status == "ok" and r.stdout.split()[2:4] == [b"64", b"64"] and r.wall_s < 9
        assert backend.settle(timeout_s=60) and not taken & set(backend.waiting) and len(backend.waiting) == 2
        assert host_residue([UID + 7], waiting=[backend]) == []
    finally:
        backend.close()
    assert backend.waiting == () and host_residue([UID + 7]) == []


def test_the_helpers_markers_cannot_be_forged_by_the_program(backend):
    # Only what the helper writes before the program starts is taken off stdout: a program
    # printing the markers itself gets them back as its output, and its own exit status.
    fake = (
        "import os\nos.write(1, b'\\0hpcrl-ready\\n\\0hpcrl-fail\\n')\n"
        "os.write(2, b'hpcrl-launch: cannot join the cgroup')\n"
    )
    r = run(backend, "python", fake + "os._exit(125)")
    assert r.status == "nonzero_exit" and r.exit_code == 125
    assert r.stdout == b"\0hpcrl-ready\n\0hpcrl-fail\n"
    with backend.session(
        ExecSpec.single("python", fake + "print('next', flush=True)\nimport sys; sys.stdin.read()")
    ) as s:
        assert s.read_line(timeout_s=30) == b"\0hpcrl-ready\n" and s.read_line(timeout_s=30) == b"\0hpcrl-fail\n"
        assert s.read_line(timeout_s=30) == b"next\n"


def test_files_the_sandbox_cannot_hold_are_a_sandbox_error_not_the_programs(backend):
    files = tuple(SourceFile(f"f{i}.txt", b"x") for i in range(12)) + (SourceFile("main.py", b"print(1)"),)
    r = backend.run(ExecSpec(language="python", files=files, limits=Limits(inodes=8)))
    assert r.status == "sandbox_error" and b"hpcrl-launch: cannot create" in r.stderr, r
    # The next run with those limits is fine, in a sandbox of its own.
    assert run(backend, "python", "print(2)", limits=Limits(inodes=8)).stdout == b"2\n"


def test_a_backend_that_starts_nothing_ahead_leaves_nothing_waiting():
    cold = BwrapBackend(uid=UID + 8, start_ahead=False)
    try:
        assert run(cold, "bash", "echo on demand").stdout == b"on demand\n" and cold.waiting == ()
        assert "started on demand" in cold.describe()
        assert host_residue([UID + 8]) == []
    finally:
        cold.close()


def test_the_next_sandbox_outlives_the_thread_whose_run_started_it():
    # The parent-death signal fires when the forking *thread* ends: every child is forked by one
    # long-lived thread, so a short-lived thread's run leaves a next sandbox that another uses.
    backend = BwrapBackend(uid=UID + 7)
    try:
        t = threading.Thread(target=lambda: run(backend, "bash", "true"))
        t.start()
        t.join()
        assert backend.settle(timeout_s=60) and len(backend.waiting) == 1
        left = set(backend.waiting)
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r", run(backend, "bash", "sleep 0.2; echo taken")))
        t.start()
        t.join()
        assert done["r"].stdout == b"taken\n" and not left & set(backend.waiting)
    finally:
        backend.close()
