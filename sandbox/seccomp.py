"""A small seccomp filter for the sandboxed program: a few system calls answer ENOSYS.

    prog = filter_program()          # classic BPF, as bwrap's --seccomp FD reads it
    profile = apptainer_profile()    # the same as an OCI/Docker JSON profile (apptainer --security seccomp:FILE)
    SECCOMP_SYSCALLS                 # which, and why

Two groups, refused everywhere so a program behaves the same with and without cgroups:

* memory no rlimit sees: `memfd_create`, `memfd_secret` and SysV `shmget` make memory that is
  no mapping while it is not mapped, so neither RLIMIT_AS nor RLIMIT_DATA counts it, and a
  process can keep such memory after unmapping it (a SysV segment even with no process
  attached). With a memory cgroup it is charged anyway; without one, these were how a program
  held gigabytes past its limit. POSIX shared memory still works: it lives in /dev/shm, a tmpfs
  capped in bytes and inodes.
* kernel attack surface no judged program needs: io_uring, userfaultfd (an exploit
  primitive), perf_event_open, bpf, and the keyring calls.
* `setsid`: without a cpu cgroup the kernel's autogroups share the CPU per session, and a
  program that put each of its busy processes in a session of its own took that many shares
  (60 loops starved another slot's program into a timeout). bwrap's own setsid
  (--new-session) comes before the filter.

Anything but the native architecture's calling convention (i386 or x32 on x86_64) is refused
outright, so that no call slips through under another number. The filter is pure data: this
module builds it, bwrap installs it (after no_new_privs, just before exec).

The Apptainer profile adds what bwrap's --disable-userns does there: unshare and clone with
CLONE_NEWUSER fail with EPERM, and clone3 (whose flags a filter cannot see) with ENOSYS, so
glibc falls back to clone; libseccomp, which Apptainer uses, handles the architectures.
"""

from __future__ import annotations

import errno
import json
import platform
import struct

__all__ = ["SECCOMP_SYSCALLS", "apptainer_profile", "filter_program", "supported"]

SECCOMP_SYSCALLS = (
    "memfd_create",
    "memfd_secret",
    "shmget",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "perf_event_open",
    "bpf",
    "add_key",
    "request_key",
    "keyctl",
    "setsid",
)

# AUDIT_ARCH_* and syscall numbers (asm/unistd_64.h on x86_64, asm-generic/unistd.h on aarch64).
_ARCHES = {
    "x86_64": (
        0xC000003E,
        {
            "memfd_create": 319,
            "memfd_secret": 447,
            "shmget": 29,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "userfaultfd": 323,
            "perf_event_open": 298,
            "bpf": 321,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "setsid": 112,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "memfd_create": 279,
            "memfd_secret": 447,
            "shmget": 194,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "userfaultfd": 282,
            "perf_event_open": 241,
            "bpf": 280,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "setsid": 157,
        },
    ),
}
_X32_BIT = 0x40000000

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_ENOSYS = 0x00050000 | errno.ENOSYS  # SECCOMP_RET_ERRNO
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in _ARCHES


def filter_program(machine: str | None = None) -> bytes:
    """The filter for `machine` (default: this one) as struct sock_filter[]; ValueError if unknown."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise ValueError(f"no seccomp filter for {machine!r} (known: {', '.join(_ARCHES)})")
    arch, numbers = _ARCHES[machine]
    nrs = [numbers[name] for name in SECCOMP_SYSCALLS]
    # Layout: [0] load arch, [1] foreign -> deny, [2] load nr, [3] x32 -> deny (x86_64),
    # one jeq per call -> deny, allow, deny. Jump offsets count from the next instruction.
    body: list[tuple[int, int, int, int]] = [(_LD_W_ABS, 0, 0, _NR)]
    if machine == "x86_64":
        body.append((_JGE_K, 0, 0, _X32_BIT))  # jt patched below
    body += [(_JEQ_K, 0, 0, nr) for nr in nrs]
    prog: list[tuple[int, int, int, int]] = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 0, 0, arch)]
    prog += body
    allow_at = len(prog)
    prog += [(_RET_K, 0, 0, _ALLOW), (_RET_K, 0, 0, _ENOSYS)]
    deny_at = allow_at + 1
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        if i == 1:  # arch check: equal -> go on, else deny
            jt, jf = 0, deny_at - (i + 1)
        elif code in (_JEQ_K, _JGE_K):  # a call to refuse (or x32): match -> deny
            jt, jf = deny_at - (i + 1), 0
        out.append(struct.pack("=HBBI", code, jt, jf, k))
    return b"".join(out)


_CLONE_NEWUSER = 0x10000000


def apptainer_profile() -> str:
    """SECCOMP_SYSCALLS and no new user namespace, as a Docker/OCI seccomp profile (JSON). Pure."""
    newuser = [{"index": 0, "value": _CLONE_NEWUSER, "valueTwo": _CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]
    return json.dumps(
        {
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [
                {"names": list(SECCOMP_SYSCALLS) + ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
                {"names": ["unshare", "clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM, "args": newuser},
            ],
        },
        indent=1,
    )
