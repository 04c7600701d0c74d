"""Unit tests of the sandbox's data types, language registry, status rules and command lines (no sandbox needed)."""

from __future__ import annotations

import json
import math
import signal
import struct

import pytest

from hpcrl.sandbox.backend import Exit, classify, rlimit_args
from hpcrl.sandbox.harness_wire import CodecError, decode, loads, request
from hpcrl.sandbox.languages import Language, get_language, languages, register
from hpcrl.sandbox.launcher import EXEC_PATH, bwrap_args, exec_header, fstab, launcher_args
from hpcrl.sandbox.pyharness import dumps, encode
from hpcrl.sandbox.result import STATUSES, ExecResult
from hpcrl.sandbox.spec import ExecSpec, Limits, SourceFile

# -- spec --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["wall_s", "cpu_s", "memory_mb", "pids", "output_kb", "work_mb"])
def test_limits_reject_non_positive_values_naming_the_field(field):
    with pytest.raises(ValueError, match=f"Limits.{field}"):
        Limits(**{field: 0})


@pytest.mark.parametrize("path", ["../x.py", "/etc/passwd", "a//b.py", "./a.py", "a/../b.py", "", ".hidden", "a b.py"])
def test_source_file_refuses_paths_that_could_leave_the_work_dir(path):
    with pytest.raises(ValueError, match="relative path"):
        SourceFile(path, b"")


def test_source_file_accepts_nested_relative_paths_and_str_data():
    f = SourceFile("pkg/util.py", "x = 1")
    assert f.data == b"x = 1"


def test_exec_spec_refuses_duplicate_files_and_empty_file_lists():
    with pytest.raises(ValueError, match="listed twice"):
        ExecSpec("python", (SourceFile("main.py", b""), SourceFile("main.py", b"")))
    with pytest.raises(ValueError, match="at least one"):
        ExecSpec("python", ())


def test_exec_spec_refuses_files_larger_than_the_work_dir():
    with pytest.raises(ValueError, match="work dir"):
        ExecSpec("python", (SourceFile("main.py", b"x" * (2 * 1024 * 1024)),), limits=Limits(work_mb=1))


def test_exec_spec_wire_form_round_trips():
    spec = ExecSpec(
        "cpp",
        (SourceFile("main.cpp", b"int main(){}"), SourceFile("run.sh", b"", True)),
        stdin=b"\x00\xff",
        argv=("a", "b"),
        limits=Limits(wall_s=3, memory_mb=100),
        compile_limits=Limits(wall_s=20),
    )
    assert ExecSpec.from_wire(spec.to_wire()) == spec


def test_exec_spec_from_wire_names_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys.*'bogus'"):
        ExecSpec.from_wire({"language": "python", "files": [["main.py", b"", False]], "limits": {"bogus": 1}})


# -- result ------------------------------------------------------------------------------------


def test_result_json_has_exactly_the_documented_names():
    r = ExecResult(status="ok", exit_code=0, stdout=b"hi\xff", wall_s=0.0123456)
    d = json.loads(r.to_json())
    assert set(d) == {
        "status",
        "exit_code",
        "signal",
        "stdout",
        "stderr",
        "stdout_truncated",
        "stderr_truncated",
        "wall_s",
        "cpu_s",
        "peak_memory_mb",
    }
    assert d["stdout"] == "hi\ufffd" and d["wall_s"] == 0.0123


def test_result_refuses_unknown_status_and_round_trips_on_the_wire():
    with pytest.raises(ValueError, match="one of ok"):
        ExecResult(status="passed")
    r = ExecResult(status="timeout", signal=9, stderr=b"x", cpu_s=None)
    assert ExecResult.from_wire(r.to_wire()) == r


# -- languages ---------------------------------------------------------------------------------


def test_language_registry_refuses_duplicates_and_lists_names_for_unknown_ones():
    with pytest.raises(ValueError, match="already registered"):
        register(Language(name="python", main_file="x.py", run=("python3",), tools=("python3",)))
    with pytest.raises(ValueError, match="registered: bash, c, cpp, node, python"):
        get_language("cobol")
    assert set(languages()) >= {"python", "c", "cpp", "bash", "node"}


def test_language_compile_and_artifact_go_together():
    with pytest.raises(ValueError, match="compile and artifact"):
        Language(name="x", main_file="x", run=("x",), tools=(), compile=("cc",))


def test_language_presence_follows_the_lookup():
    assert get_language("node").present(lambda t: "/usr/bin/" + t)
    assert not get_language("node").present(lambda t: None)


# -- status rules ------------------------------------------------------------------------------


def _exit(**kw):
    base = dict(
        exit_code=0,
        signal=None,
        started=True,
        timed_out=False,
        output_limited=False,
        oom_killed=False,
        cpu_s=0.1,
        peak_memory_mb=1.0,
        wall_s=0.1,
    )
    base.update(kw)
    return Exit(**base)


@pytest.mark.parametrize(
    "kw,status,code,sig",
    [
        ({}, "ok", 0, None),
        ({"exit_code": 3}, "nonzero_exit", 3, None),
        ({"exit_code": 128 + 11}, "killed_by_signal", None, 11),
        ({"exit_code": 128 + signal.SIGXCPU}, "cpu_limit", None, signal.SIGXCPU),
        ({"exit_code": 137, "cpu_s": 2.0}, "cpu_limit", None, 9),
        ({"exit_code": 137, "oom_killed": True}, "memory_limit", None, 9),
        ({"exit_code": 0, "oom_killed": True}, "memory_limit", 0, None),
        ({"exit_code": None, "signal": 9, "oom_killed": True, "timed_out": True}, "memory_limit", None, 9),
        ({"exit_code": None, "signal": 9, "timed_out": True}, "timeout", None, 9),
        ({"exit_code": None, "signal": 9, "output_limited": True, "timed_out": True}, "output_limit", None, 9),
        ({"exit_code": 1, "started": False}, "sandbox_error", 1, None),
    ],
)
def test_classify(kw, status, code, sig):
    r = classify(_exit(**kw), Limits(cpu_s=2), b"", b"", False, False)
    assert (r.status, r.exit_code, r.signal) == (status, code, sig)
    assert r.status in STATUSES


def test_rlimits_cap_processes_files_and_cpu_and_memory_only_without_a_cgroup():
    args = rlimit_args(Limits(cpu_s=2.5, pids=16, file_size_mb=1, open_files=32, memory_mb=64), memory="cgroup")
    assert args == ["--cpu=3:4", f"--fsize={1 << 20}", "--nproc=16", "--nofile=32", "--core=0"]
    # Without a memory cgroup: the address space (shared mappings count) plus what the runtime reserves.
    fallback = rlimit_args(Limits(memory_mb=64), memory="address_space", reserve_mb=1024)
    assert f"--data={64 << 20}" in fallback and f"--as={(64 + 1024) << 20}" in fallback
    legacy = rlimit_args(Limits(memory_mb=64), memory="data")
    assert f"--data={64 << 20}" in legacy and not any(a.startswith("--as=") for a in legacy)
    with pytest.raises(ValueError, match="memory must be one of"):
        rlimit_args(Limits(), memory="none")


# -- the bwrap command line --------------------------------------------------------------------


def test_bwrap_command_isolates_and_runs_the_helper_first():
    args = bwrap_args(
        Limits(work_mb=8, tmp_mb=4, shm_mb=2, cpu_s=2.5),
        exec_fd=5,
        status_fd=9,
        memory="cgroup",
        seccomp_fd=11,
        layout=["--ro-bind", "/usr", "/usr"],
    )
    line = " ".join(args)
    for flag in (
        "--unshare-user --unshare-ipc --unshare-net --unshare-uts",
        "--die-with-parent",
        "--new-session",
        "--cap-drop ALL",
        "--disable-userns",
        "--clearenv",
        "--remount-ro /",
        "--json-status-fd 9",
        "--seccomp 11",
        "--bind /tmp/shm /dev/shm --remount-ro /dev",
        "--bind /tmp/tmp /tmp",
        "--bind /tmp/work /work",
        "--uid 65534 --gid 65534",
    ):
        assert flag in line, flag
    # The binds are the launcher's tmpfs, capped in bytes and inodes, in its own namespaces.
    assert "--unshare-pid" not in line and "--unshare-all" not in line  # the launcher's pid namespace
    lim = Limits(work_mb=8, tmp_mb=4, shm_mb=2, inodes=100)
    launch = launcher_args(lim, uid=61000, server_pid=4242, cgroups=["/cg/a/cgroup.procs"], launch="/x/hpcrl-launch")
    assert launch[:3] == ["/x/hpcrl-launch", "--cgroup", "/cg/a/cgroup.procs"] and launch[-1] == "--"
    assert " ".join(launch[3:7]) == "--uid 61000 --server 4242"
    assert [launch[i + 1] for i, a in enumerate(launch) if a == "--mount"] == fstab(lim)
    assert fstab(lim)[0].startswith("hpcrl-proc /proc proc ")
    assert fstab(lim)[1] == f"hpcrl-work /tmp/work tmpfs size={8 << 20},nr_inodes=100,mode=0755,X-mount.mkdir 0 0"
    assert fstab(lim)[3] == f"hpcrl-shm /tmp/shm tmpfs size={2 << 20},nr_inodes=100,mode=0755,X-mount.mkdir 0 0"
    # The helper, copied in read-only, runs first and sets the rlimits for the program only; the
    # program and its files come on stdin (exec_header).
    assert f"--perms 0555 --file 5 {EXEC_PATH}" in line
    tail = args[args.index("--") + 1 :]
    assert tail == [EXEC_PATH, "--exec", *rlimit_args(Limits(cpu_s=2.5), memory="cgroup"), "--"]
    assert "--share-net" not in line
    assert {a for i, a in enumerate(args) if i and args[i - 1] == "--bind"} == {"/tmp/shm", "/tmp/tmp", "/tmp/work"}


def test_exec_header_is_what_the_helper_reads():
    files = [SourceFile("main.py", b"print(1)"), SourceFile("pkg/run", b"\x7fELF", executable=True)]
    h = exec_header(files, ["python3", "main.py"])
    # launch.c's format: magic, file count, per file (mode, path, size, bytes), argc, arguments.
    expect = b"HPX1" + struct.pack("<I", 2)
    expect += struct.pack("<II", 0o644, 7) + b"main.py" + struct.pack("<Q", 8) + b"print(1)"
    expect += struct.pack("<II", 0o755, 7) + b"pkg/run" + struct.pack("<Q", 4) + b"\x7fELF"
    expect += struct.pack("<I", 2) + struct.pack("<I", 7) + b"python3" + struct.pack("<I", 7) + b"main.py"
    assert h == expect


# -- the function-harness codec ----------------------------------------------------------------

VALUES = [
    None,
    True,
    0,
    -5,
    2**80,
    1.5,
    -0.0,
    "",
    'tab\tquote"back\\slash\n\x00\x1f é ☃ \U0001f600',
    [1, [2, [3]]],
    (1, "a", (None,)),
    {1: "a", "b": [1], (1, 2): {3}},
    {1, 2},
    frozenset({"x"}),
    b"\x00\xff",
    1 + 2j,
    [],
]


@pytest.mark.parametrize("value", VALUES, ids=[repr(v)[:20] for v in VALUES])
def test_codec_round_trips_plain_values_with_their_types(value):
    back = decode(loads(dumps(encode(value))))
    assert back == value and type(back) is type(value)


def test_codec_carries_nan_and_infinities():
    back = decode(loads(dumps(encode([float("nan"), float("inf"), float("-inf")]))))
    assert math.isnan(back[0]) and back[1:] == [float("inf"), float("-inf")]


def test_codec_carries_lone_surrogates_in_strings():
    assert decode(loads(dumps(encode("\udc80x")))) == "\udc80x"


def test_encode_refuses_subclasses_that_could_lie_about_equality():
    class AlwaysEqual(int):
        def __eq__(self, other):
            return True

    for v in (AlwaysEqual(1), object(), [AlwaysEqual(2)], {"k": object()}):
        with pytest.raises(CodecError):
            encode(v)


@pytest.mark.parametrize(
    "line",
    [
        b"{",
        b'{"value": NaN}',
        b'{"a": 1, "b": 2}',
        b'{"t": 5}',
        b'{"zz": []}',
        b'{"s": [[1]]}',
        b'{"d": [[[1], 2]]}',
        b"[" * 200 + b"]" * 200,
    ],
)
def test_decode_refuses_malformed_or_unknown_encodings(line):
    with pytest.raises(CodecError):
        decode(loads(line))


def test_requests_name_a_function_and_carry_only_plain_arguments():
    assert request(3, "f", [1, "x"]).startswith(b"3 f ")
    with pytest.raises(CodecError):
        request(1, "f; import os", [])
    with pytest.raises(CodecError):
        request(1, "f", [object()])
