"""Memory bombs against the bwrap sandbox, with a memory cgroup (root) and without one (the
fallback: RLIMIT_AS, RLIMIT_DATA and a seccomp filter, `sandbox.memory_fallback`).

Each bomb tries to hold 1 GiB under a 256 MiB limit (this machine has no swap: sizes stay far
below its RAM) and prints BOMB once it has touched every page; contained means it never does.
Needs bubblewrap; skips without, fails with HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import pytest

from hpcrl.sandbox.bwrap import BwrapBackend
from hpcrl.sandbox.result import SandboxUnavailable
from hpcrl.sandbox.spec import ExecSpec, Limits

from conftest import require_bwrap
from residue import Snapshot, host_residue

UID = 61300
LIMITS = Limits(wall_s=20, cpu_s=20, memory_mb=256, pids=16, output_kb=64)
GIB = 1 << 30

_TOUCH = "def touch(m, n):\n    for i in range(0, n, 4096):\n        m[i] = 1\n"
BOMBS = {
    "private_mmap": (
        f"import mmap\n{_TOUCH}m = mmap.mmap(-1, {GIB}, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        f"touch(m, {GIB})\nprint('BOMB', flush=True)\n"
    ),
    "shared_mmap": (
        f"import mmap\n{_TOUCH}m = mmap.mmap(-1, {GIB}, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)\n"
        f"touch(m, {GIB})\nprint('BOMB', flush=True)\n"
    ),
    "memfd_mapped": (
        f"import mmap, os\n{_TOUCH}fd = os.memfd_create('x')\nos.ftruncate(fd, {GIB})\n"
        f"m = mmap.mmap(fd, {GIB})\ntouch(m, {GIB})\nprint('BOMB', flush=True)\n"
    ),
    # Written, never mapped, then unmapped memory kept: no rlimit on memory counts it.
    "memfd_written": (
        "import os\nfds = []\nchunk = b'm' * (1 << 20)\nfor _ in range(64):\n    fd = os.memfd_create('x')\n"
        "    for _ in range(16):\n        os.write(fd, chunk)\n    fds.append(fd)\nprint('BOMB', flush=True)\n"
    ),
    "sysv_shm_detached": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(16):\n    sid = libc.shmget(0, 64 << 20, 0o1600)\n    assert sid >= 0, ctypes.get_errno()\n"
        "    p = libc.shmat(sid, None, 0)\n    ctypes.memset(p, 1, 64 << 20)\n    libc.shmdt(ctypes.c_void_p(p))\n"
        "print('BOMB', flush=True)\n"
    ),
}


@pytest.fixture(scope="module", params=["cgroup", "fallback"])
def backend(request):
    require_bwrap(UID)
    b = BwrapBackend(uid=UID, use_cgroups=request.param == "cgroup")
    if request.param == "cgroup" and not b.cgroups.memory:
        pytest.skip("no memory cgroup on this machine")
    yield b
    b.close()


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_memory_bomb_is_contained(backend, bomb):
    before = Snapshot.take()
    r = backend.run(ExecSpec.single("python", BOMBS[bomb], limits=LIMITS))
    assert b"BOMB" not in r.stdout, f"{bomb} got its 1 GiB past a 256 MiB limit: {r}"
    assert r.status in ("memory_limit", "nonzero_exit", "killed_by_signal"), r
    assert host_residue([backend.uid], before, waiting=[backend]) == []


def test_programs_still_run_under_the_fallback():
    require_bwrap(UID)
    b = BwrapBackend(uid=UID + 1, use_cgroups=False)
    src = "x = bytearray(200 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nprint('ok')\n"
    assert b.run(ExecSpec.single("python", src, limits=LIMITS)).stdout == b"ok\n"
    r = b.run(ExecSpec.single("node", "const a = new Array(1e6).fill(1); console.log(a.length)", limits=LIMITS))
    assert r.status == "ok" and r.stdout == b"1000000\n", r  # V8 reserves ~700 MiB of address space
    b.close()


def test_without_a_memory_cgroup_the_sandbox_refuses_if_told_to():
    require_bwrap(UID)
    with pytest.raises(SandboxUnavailable, match=r"no memory cgroup.*sandbox.memory_fallback"):
        BwrapBackend(uid=UID + 2, use_cgroups=False, memory_fallback="refuse")


def test_the_seccomp_filter_refuses_its_calls_and_nothing_else():
    require_bwrap(UID)
    b = BwrapBackend(uid=UID + 3)
    src = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, call in [('memfd_create', lambda: libc.memfd_create(b'x', 0)),\n"
        "                   ('shmget', lambda: libc.shmget(0, 4096, 0o1600)),\n"
        "                   ('io_uring_setup', lambda: libc.syscall(425, 1, ctypes.create_string_buffer(128))),\n"
        "                   ('keyctl', lambda: libc.syscall(250, 0, 0)),\n"
        "                   ('setsid', lambda: libc.setsid()),\n"
        "                   ('getpid', lambda: libc.getpid())]:\n"
        "    ctypes.set_errno(0)\n    rc = call()\n    print(name, rc, ctypes.get_errno())\n"
        "import mmap, multiprocessing.shared_memory as sm\n"
        "s = sm.SharedMemory(create=True, size=1 << 20); s.buf[0] = 1; s.close(); s.unlink(); print('posix shm ok')\n"
    )
    r = b.run(ExecSpec.single("python", src, limits=LIMITS))
    lines = r.stdout.decode().splitlines()
    refused = ("memfd_create", "shmget", "io_uring_setup", "keyctl", "setsid")
    assert lines[:5] == [f"{n} -1 38" for n in refused], r  # ENOSYS
    assert lines[5].startswith("getpid ") and not lines[5].startswith("getpid -1") and lines[6] == "posix shm ok"
    b.close()


def test_the_seccomp_program_is_well_formed():
    from hpcrl.sandbox.seccomp import SECCOMP_SYSCALLS, filter_program

    for machine in ("x86_64", "aarch64"):
        prog = filter_program(machine)
        assert len(prog) % 8 == 0 and len(prog) // 8 == len(SECCOMP_SYSCALLS) + 5 + (machine == "x86_64")
    with pytest.raises(ValueError, match="no seccomp filter for 'sparc'"):
        filter_program("sparc")
