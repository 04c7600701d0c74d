"""`hpcrl sandbox exec|info|build-image` as a user runs them (subprocess), exit codes included.

exec/info need bubblewrap and root; they skip without, and fail with HPCRL_REQUIRE_SANDBOX=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcrl.sandbox.languages import get_language
from hpcrl.sandbox.result import STATUSES

from conftest import require_bwrap

UID = 61100


def hpcrl(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "hpcrl.jobs.cli", *args], capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def bwrap_ok():
    require_bwrap(UID)


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(f"sandbox:\n  uid_base: {UID}\n")
    return str(p)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def exec_json(tmp_path, config, src, *extra, lang="python"):
    r = hpcrl("sandbox", "exec", "--config", config, "--lang", lang, write(tmp_path, "prog", src), "--json", *extra)
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 1, r  # one JSON object, nothing else on stdout
    return r.returncode, json.loads(lines[0])


def test_exec_json_prints_one_result_object(bwrap_ok, tmp_path, config):
    code, res = exec_json(tmp_path, config, "print('hi')")
    assert code == 0 and res["status"] == "ok" and res["stdout"] == "hi\n" and res["exit_code"] == 0
    assert set(res) >= {"status", "signal", "stderr", "stdout_truncated", "wall_s", "cpu_s", "peak_memory_mb"}


@pytest.mark.parametrize(
    "src,extra,status",
    [
        ("import sys; sys.exit(3)", (), "nonzero_exit"),
        ("import time; time.sleep(30)", ("--timeout-s", "0.5"), "timeout"),
        ("x = bytearray(300 << 20)", ("--memory-mb", "64"), None),
        ("int(", (), "nonzero_exit"),
    ],
)
def test_exec_exits_0_whatever_the_program_did(bwrap_ok, tmp_path, config, src, extra, status):
    code, res = exec_json(tmp_path, config, src, *extra)
    assert code == 0 and res["status"] in STATUSES
    if status:
        assert res["status"] == status


BOMBS = {
    "shared mmap": "import mmap\nm = mmap.mmap(-1, 1 << 30, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)\n"
    "for i in range(0, 1 << 30, 4096): m[i] = 1\nprint('BOMB')\n",
    "memfd": "import os\nfds = [os.memfd_create('x') for _ in range(64)]\n"
    "for fd in fds:\n    for _ in range(16): os.write(fd, b'm' * (1 << 20))\nprint('BOMB')\n",
    "inodes": "import os\nfor i in range(200000):\n    os.close(os.open(f'e{i}', os.O_CREAT | os.O_WRONLY))\n"
    "print('BOMB')\n",
}


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_exec_contains_memory_and_inode_bombs(bwrap_ok, tmp_path, config, bomb):
    code, res = exec_json(tmp_path, config, BOMBS[bomb], "--memory-mb", "256")
    assert code == 0 and "BOMB" not in res["stdout"], res
    assert res["status"] in ("memory_limit", "nonzero_exit"), res


@pytest.mark.skipif(not get_language("c").present(), reason="gcc not installed on this host")
def test_exec_reports_a_compile_error_as_a_result(bwrap_ok, tmp_path, config):
    code, res = exec_json(tmp_path, config, "int main( {", lang="c")
    assert code == 0 and res["status"] == "compile_error" and "error" in res["stderr"]


def test_exec_feeds_stdin_from_a_file(bwrap_ok, tmp_path, config):
    _code, res = exec_json(tmp_path, config, "print(input()[::-1])", "--stdin", write(tmp_path, "in.txt", "abc\n"))
    assert res["stdout"] == "cba\n"


def test_exec_without_json_passes_the_program_output_through(bwrap_ok, tmp_path, config):
    r = hpcrl(
        "sandbox",
        "exec",
        "--config",
        config,
        "--lang",
        "bash",
        write(tmp_path, "p.sh", "echo out; echo err >&2; exit 5"),
    )
    assert r.returncode == 0 and r.stdout == b"out\n"
    assert r.stderr.startswith(b"err\n") and b"nonzero_exit (exit 5)" in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (("--lang", "cobol", "{prog}"), "unknown language 'cobol'; registered: bash, c, cpp, node, python"),
        (("--lang", "python", "/nonexistent/prog.py"), "no such file"),
        (("--lang", "python", "{prog}", "--memory-mb", "1"), "--memory-mb: must be >= 16"),
        (("--lang", "python", "{prog}", "--timeout-s", "0"), "--timeout-s: must be > 0"),
        (("--lang", "python", "{prog}", "--stdin", "/nonexistent/in"), "--stdin: no such file"),
    ],
)
def test_bad_input_exits_2_with_what_to_fix(tmp_path, config, args, message):
    prog = write(tmp_path, "p.py", "pass")
    r = hpcrl("sandbox", "exec", "--config", config, *[a.format(prog=prog) for a in args])
    assert r.returncode == 2 and message in r.stderr.decode(), r.stderr


def test_an_unavailable_sandbox_exits_1(tmp_path):
    cfg = write(tmp_path, "c.yaml", "sandbox:\n  backend: apptainer\n  apptainer: apptainer-does-not-exist\n")
    r = hpcrl("sandbox", "exec", "--config", cfg, "--lang", "python", write(tmp_path, "p.py", "pass"), "--json")
    assert r.returncode == 1 and b"not found on PATH" in r.stderr and r.stdout == b""


def test_a_bad_config_exits_2(tmp_path):
    cfg = write(tmp_path, "c.yaml", "sandbox:\n  backend: docker\n")
    r = hpcrl("sandbox", "exec", "--config", cfg, "--lang", "python", write(tmp_path, "p.py", "pass"))
    assert r.returncode == 2 and b"sandbox.backend: must be one of bwrap, apptainer" in r.stderr


def test_info_says_which_limits_are_enforced(bwrap_ok, config):
    r = hpcrl("sandbox", "info", "--config", config)
    out = r.stdout.decode()
    assert r.returncode == 0 and "memory limit" in out and "pids limit" in out and "python" in out


def test_build_image_needs_apptainer(tmp_path):
    if any(os.access(os.path.join(d, "apptainer"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("apptainer is installed: building an image here would take minutes")
    r = hpcrl("sandbox", "build-image", "--out", str(tmp_path / "x.sif"))
    assert r.returncode == 1 and b"not found on PATH" in r.stderr


def test_sandbox_without_a_verb_prints_help_and_exits_2():
    r = hpcrl("sandbox")
    assert r.returncode == 2 and b"exec" in r.stdout
