"""The Apptainer backend: its command construction (always), its supervised session on real
processes (always), and real containers where `apptainer` is on PATH with an image
(HPCRL_SANDBOX_IMAGE, default sandbox.sif; `hpcrl sandbox build-image` makes one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import psutil
import pytest

from hpcrl.core.config import load_config
from hpcrl.sandbox.apptainer import ApptainerBackend, ProcessSession, apptainer_args, build_args, default_def_file
from hpcrl.sandbox.auto import make_backend
from hpcrl.sandbox.result import SandboxUnavailable
from hpcrl.sandbox.seccomp import apptainer_profile
from hpcrl.sandbox.spec import ExecSpec, Limits

from conftest import wait_for

ENV = {"PATH": "/usr/bin:/bin"}


# -- command construction ----------------------------------------------------------------------


def test_the_spec_becomes_a_contained_networkless_apptainer_exec():
    args = apptainer_args(
        ("python3", "-B", "main.py", "x"),
        Limits(cpu_s=2, pids=16, memory_mb=64),
        image="/img/sandbox.sif",
        src_dir="/tmp/src1",
    )
    line = " ".join(args)
    assert args[0] == "exec"
    assert "--containall --cleanenv --no-home --no-mount bind-paths,hostfs,home,cwd,sys,devpts" in line
    assert "--net --network none --no-privs" in line and "--security" not in line
    assert "--bind /tmp/src1:/src:ro" in line and "--scratch /work --pwd /work" in line
    image_at = args.index("/img/sandbox.sif")
    assert all(a.startswith("-") or args[i - 1].startswith("-") for i, a in enumerate(args[:image_at]) if i)
    inner = args[image_at + 1 :]
    assert inner[:2] == ["/bin/sh", "-c"] and "cp -R /src/. /work/" in inner[2]
    assert "--nproc=16" in inner and f"--data={64 << 20}" in inner  # no cgroups: memory by rlimit
    assert f"--as={64 << 20}" in inner and "MALLOC_ARENA_MAX=2" in line
    assert inner[-5:] == ["--", "python3", "-B", "main.py", "x"]
    assert "--memory" not in line


def test_cgroup_limits_are_passed_only_when_asked_for():
    args = apptainer_args(("true",), Limits(memory_mb=64, pids=16, cpus=1.5), image="i.sif", src_dir="/s", cgroups=True)
    assert args[args.index("--memory") + 1] == "64M" and args[args.index("--pids-limit") + 1] == "20"
    assert args[args.index("--cpus") + 1] == "1.5"
    assert not any(a.startswith(("--data=", "--as=")) for a in args)


def test_the_seccomp_profile_refuses_memfd_shm_and_new_user_namespaces():
    args = apptainer_args(("true",), Limits(), image="i.sif", src_dir="/s", seccomp_profile="/p/seccomp.json")
    assert args[args.index("--security") + 1] == "seccomp:/p/seccomp.json"
    assert args.index("--security") < args.index("i.sif")
    profile = json.loads(apptainer_profile())
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    enosys, newuser = profile["syscalls"]
    assert {"memfd_create", "shmget", "io_uring_setup", "clone3"} <= set(enosys["names"])
    assert enosys["errnoRet"] == 38 and newuser["names"] == ["unshare", "clone"] and newuser["errnoRet"] == 1
    assert newuser["args"] == [{"index": 0, "value": 0x10000000, "valueTwo": 0x10000000, "op": "SCMP_CMP_MASKED_EQ"}]


_FAKE_APPTAINER = """#!/bin/sh
# Stands in for apptainer: says its version, and for exec records its arguments and the
# permissions of the program copy it was given, then prints what the program would.
log=$(dirname "$0")/../log  # (the backend passes no FAKE_* variable on)
[ "$1" = --version ] && { echo "apptainer version $(cat "$log.version")"; exit 0; }
printf '%s\\n' "$@" > "$log"
while [ $# -gt 0 ]; do
  case "$1" in --bind) src=${2%%:*}; shift ;; esac
  shift
done
stat -c '%a %n' "$src" "$src"/* >> "$log.perms"
echo fake-ran
"""


@pytest.fixture
def fake_apptainer(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "apptainer"
    exe.parent.mkdir()
    exe.write_text(_FAKE_APPTAINER)
    exe.chmod(0o755)
    (tmp_path / "sandbox.sif").write_bytes(b"")
    (tmp_path / "log.version").write_text("1.3.4")
    monkeypatch.setenv("PATH", f"{exe.parent}:{os.environ['PATH']}")
    return tmp_path


def test_a_run_gets_a_private_program_copy_no_site_binds_and_the_profile(fake_apptainer):
    backend = ApptainerBackend(image=str(fake_apptainer / "sandbox.sif"))
    r = backend.run(ExecSpec.single("python", "print(1)"))
    assert r.status == "ok" and r.stdout == b"fake-ran\n", r
    args = (fake_apptainer / "log").read_text().splitlines()
    assert "--no-mount" in args and args[args.index("--no-mount") + 1].startswith("bind-paths,hostfs")
    profile = args[args.index("--security") + 1].removeprefix("seccomp:")
    perms = (fake_apptainer / "log.perms").read_text().split()
    assert perms[0] == "700" and perms[2] == "600" and perms[3].endswith("/main.py"), perms
    assert oct(os.stat(profile).st_mode & 0o777) == "0o600" and "memfd_create" in open(profile).read()
    assert not os.path.exists(perms[1])  # the copy is gone after the run
    backend.close()
    assert not os.path.exists(profile)


@pytest.mark.parametrize("version", ["1.1.9", "1.0.0"])
def test_an_apptainer_that_cannot_drop_the_site_binds_is_refused(fake_apptainer, version):
    (fake_apptainer / "log.version").write_text(version)
    with pytest.raises(SandboxUnavailable, match=rf"not Apptainer 1.2 or later \({version[:3]}\).*bind paths"):
        ApptainerBackend(image=str(fake_apptainer / "sandbox.sif"))


def test_build_image_command_and_definition_file():
    assert build_args("d.def", "o.sif") == ["build", "o.sif", "d.def"]
    assert build_args("d.def", "o.sif", fakeroot=True, force=True) == [
        "build",
        "--fakeroot",
        "--force",
        "o.sif",
        "d.def",
    ]
    text = default_def_file().read_text()
    for tool in ("python3", "gcc", "g++", "bash", "nodejs", "util-linux"):
        assert tool in text
    assert "mkdir -p /work /src" in text


def test_missing_apptainer_or_image_is_reported_with_what_to_do(tmp_path):
    with pytest.raises(SandboxUnavailable, match="not found on PATH"):
        ApptainerBackend(image=str(tmp_path / "x.sif"), apptainer="apptainer-does-not-exist")
    if shutil.which("apptainer"):
        with pytest.raises(SandboxUnavailable, match="build-image"):
            ApptainerBackend(image=str(tmp_path / "missing.sif"))


def test_config_selects_the_backend(tmp_path):
    cfg = load_config(None, ["sandbox.backend=apptainer", "sandbox.apptainer=apptainer-does-not-exist"]).sandbox
    with pytest.raises(SandboxUnavailable):
        make_backend(cfg)


# -- the supervised session, on real processes --------------------------------------------------


def sh_run(script: str, limits: Limits = Limits(), stdin: bytes = b""):
    s = ProcessSession(["bash", "-c", script], limits, env=ENV)
    if stdin:
        s.send(stdin)
    return s.finish()


def test_process_session_reports_exit_codes_and_bytes():
    r = sh_run("printf 'a\\xffb'; echo err >&2; exit 4")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("nonzero_exit", 4, b"a\xffb", b"err\n")


def test_process_session_feeds_stdin_and_has_no_tty():
    r = sh_run("test -t 0 && echo tty-in; test -t 1 && echo tty-out; tr a-z A-Z", stdin=b"hello\x00")
    assert r.status == "ok" and r.stdout == b"HELLO\x00"


def test_process_session_output_cap_kills_the_process_group():
    s = ProcessSession(["bash", "-c", "(yes &); yes"], Limits(output_kb=64), env=ENV)
    group = s._proc.pid
    r = s.finish()
    assert r.status == "output_limit" and r.stdout_truncated and len(r.stdout) == 64 * 1024

    def alive_in_group() -> list[int]:
        out = []
        for proc in psutil.process_iter(["status"]):
            try:
                if os.getpgid(proc.pid) == group and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(proc.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        return out

    wait_for(lambda: not alive_in_group(), 30, what="the background yes to die with its group")


def test_process_session_wall_limit_kills():
    r = sh_run("sleep 30", Limits(wall_s=0.5))
    assert r.status == "timeout" and r.signal == 9 and r.wall_s < 30  # killed, not left to finish


def test_process_session_signals():
    assert sh_run("kill -SEGV $$").status == "killed_by_signal"


def test_process_session_is_interactive():
    s = ProcessSession(["bash", "-c", "while read x; do echo $((x * 3)); done"], Limits(), env=ENV)
    replies = []
    for n in (1, 2):
        s.send(f"{n}\n".encode())
        replies.append(s.read_line(timeout_s=5))
    r = s.finish()
    assert replies == [b"3\n", b"6\n"] and r.status == "ok"


_DIES_AFTER_START = """
import os, signal, sys, time
from hpcrl.sandbox.apptainer import ProcessSession
from hpcrl.sandbox.spec import Limits
s = ProcessSession(["sleep", "{marker}"], Limits(wall_s=600), env={{"PATH": "/usr/bin:/bin"}})
time.sleep({delay})
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_process_session_dies_with_the_process_that_started_it(delay):
    # A server SIGKILLed must not leave apptainer (here: sleep) running with no wall limit.
    marker = f"{600 + int(delay * 1000)}.{os.getpid()}"
    proc = subprocess.run([sys.executable, "-c", _DIES_AFTER_START.format(marker=marker, delay=delay)], timeout=60)
    assert proc.returncode == -9

    def sleepers() -> list[int]:
        out = []
        for p in psutil.process_iter(["cmdline", "status"]):
            if p.info["cmdline"] == ["sleep", marker] and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        return out

    try:
        wait_for(lambda: not sleepers(), 10, 0.05, what="the session's process to die with its starter")
    finally:
        for pid in sleepers():
            os.kill(pid, 9)


# -- real Apptainer ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def apptainer():
    image = os.environ.get("HPCRL_SANDBOX_IMAGE", "sandbox.sif")
    if not shutil.which("apptainer"):
        pytest.skip("apptainer is not on PATH (clusters only)")
    if not os.path.exists(image):
        pytest.skip(f"no image {image}; build it with `hpcrl sandbox build-image --out {image}`")
    return ApptainerBackend(image=image)


@pytest.mark.parametrize(
    "lang,src",
    [
        ("python", "print(6 * 7)"),
        ("bash", "echo $((6 * 7))"),
        ("c", '#include <stdio.h>\nint main(){printf("42\\n");}'),
        ("cpp", "#include <iostream>\nint main(){std::cout<<42<<std::endl;}"),
        ("node", "console.log(6 * 7)"),
    ],
)
def test_apptainer_runs_each_language(apptainer, lang, src):
    r = apptainer.run(ExecSpec.single(lang, src))
    assert r.status == "ok" and r.stdout == b"42\n"


def test_apptainer_has_no_network_and_no_home(apptainer):
    src = (
        "import os, socket\nprint(os.path.exists(os.path.expanduser('~root')), os.environ.get('HOME'))\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1); print('NET')\n"
        "except OSError:\n    print('no net')\n"
    )
    r = apptainer.run(ExecSpec.single("python", src))
    assert b"NET" not in r.stdout and b"no net" in r.stdout


def test_apptainer_limits(apptainer):
    assert (
        apptainer.run(ExecSpec.single("python", "import time; time.sleep(30)", limits=Limits(wall_s=1))).status
        == "timeout"
    )
    r = apptainer.run(
        ExecSpec.single("python", "import sys\nwhile True: sys.stdout.write('x' * 4096)", limits=Limits(output_kb=64))
    )
    assert r.status == "output_limit"
