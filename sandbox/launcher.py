"""What runs between the server and bwrap: one exec chain, one pid, then a pid namespace of our own.

    [root, cgroups] sh JOIN          write this pid into the run's cgroups (as root)
    setpriv [drop to slot uid] --pdeathsig KILL
    unshare --user --map-root-user --mount --propagation private --pid --fork --kill-child
      `-> pid 1 of a new pid namespace: sh STAGE <server pid> <fstab lines>
            the launcher (unshare's parent) is alive and still the server's child, or stop;
            a procfs of this namespace on /proc; tmpfs /tmp/{work,tmp,shm} with size= and
            nr_inodes= (bwrap's --size has no inode cap)
            exec bwrap ...           pid 1 here; the program is the only other process

Why each step:

* A server that is SIGKILLed must take its sandboxes with it. bwrap's --die-with-parent arms
  PR_SET_PDEATHSIG in the outer bwrap only after it has made its namespaces, and in its init
  only after the whole mount setup: a kill in between (milliseconds; 18 of 30 kills of a busy
  server in a test) left a sandbox running with nobody to enforce its wall limit. Here setpriv
  arms the launcher (after the uid change, which would clear it), unshare's --kill-child arms
  the namespace's pid 1 right after the fork, and STAGE, which runs after both, checks that
  neither came too late: the launcher must be alive (else it died before --kill-child was
  armed) and its parent must still be the server (else the server died before setpriv armed
  it, and the signal will never come). Every other process of the sandbox lives in that pid
  namespace; when its pid 1 dies the kernel kills all of it. So nothing of a sandbox outlives
  its launcher, and nothing but pid 1 can be orphaned (the backend, a subreaper, reaps it).
  bwrap makes no pid namespace of its own: it is pid 1 of ours, its init is not needed.
* In the user namespace the slot uid is root, and nothing outside it. STAGE mounts the run's
  tmpfs there with `nr_inodes=` as well as `size=`, so empty files (which take no space) cannot
  exhaust inodes and kernel memory; the mounts vanish with the namespace, and bwrap binds them
  to /work, /tmp and /dev/shm. bwrap runs in it as that root with the namespace's
  capabilities, drops them (--cap-drop ALL) and nests its own user namespace, in which the
  program is uid 65534: it holds no capability in either, and from there cannot ptrace or
  read the environment of bwrap (a parent user namespace's process); SIGKILL from inside the
  pid namespace does not reach its pid 1.

Exit status 125 from the chain means a step refused (JOIN's message on stderr starts with
`sh:`, STAGE's mount failure with `hpcrl-launch:`; an orphaned STAGE stops silently, for
nobody is listening any more).
"""

from __future__ import annotations

import os

from hpcrl.sandbox.spec import Limits

__all__ = ["launcher_args", "join_cgroups_args", "fstab", "TMPFS_DIR", "tmpfs_options"]

_MIB = 1024 * 1024
# Where STAGE mounts the sandbox's tmpfs, in the launcher's own mount namespace (it hides the
# host's /tmp from bwrap, which needs nothing there; bwrap resolves --bind sources in the old
# root, so its own tmpfs on /tmp does not hide these).
TMPFS_DIR = "/tmp"

_JOIN_SH = 'for f; do shift; [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; done; exec "$@"'
_STAGE_SH = (
    # Our own /proc/self/stat in the host's /proc (still mounted here) names our parent, the
    # launcher, by its host pid (getppid() is 0 across a pid namespace); the launcher's names its.
    "read -r s < /proc/self/stat; s=${s##*) }; s=${s#* }; p=${s%% *}; "
    'read -r t < "/proc/$p/stat" || exit 125; t=${t##*) }; '
    'case "$t" in [ZX]*) exit 125 ;; esac; t=${t#* }; [ "${t%% *}" = "$1" ] || exit 125; shift; '
    # The fstab comes as arguments and goes to a file in the first mount: an inherited
    # descriptor would reach the program (bwrap closes none), and dash closes only fds 0-9.
    f"mount -t tmpfs -o size=65536,nr_inodes=16,mode=0700 hpcrl {TMPFS_DIR} && "
    f'printf "%s\\n" "$1" "$2" "$3" "$4" > {TMPFS_DIR}/fstab && mount -a -T {TMPFS_DIR}/fstab || '
    '{ echo "hpcrl-launch: cannot mount the sandbox tmpfs (see above)" >&2; exit 125; }; '
    'shift 4; exec "$@"'
)


def tmpfs_options(size_mb: int, inodes: int, mode: str = "0755") -> str:
    return f"size={size_mb * _MIB},nr_inodes={inodes},mode={mode}"


def join_cgroups_args(procs_files: list[str]) -> list[str]:
    """`sh JOIN`: this pid into each cgroup.procs file (as root, before anything else), then exec the rest."""
    return ["/bin/sh", "-c", _JOIN_SH, "sh", *procs_files, "--"]


def fstab(limits: Limits) -> list[str]:
    """STAGE's `mount -a` lines: a procfs of the new pid namespace over /proc (bwrap, which makes
    no pid namespace, binds the /proc it finds; the host's would show every host process), and
    the run's three tmpfs, capped in bytes and inodes (under a small tmpfs STAGE mounts over
    /tmp first). Pure."""
    return ["hpcrl-proc /proc proc nosuid,nodev,noexec 0 0"] + [
        f"hpcrl-{name} {TMPFS_DIR}/{name} tmpfs {tmpfs_options(mb, limits.inodes)},X-mount.mkdir 0 0"
        for name, mb in (("work", limits.work_mb), ("tmp", limits.tmp_mb), ("shm", limits.shm_mb))
    ]


def launcher_args(limits: Limits, uid: int | None, server_pid: int | None = None) -> list[str]:
    """Everything before `bwrap` in the chain above (after JOIN); `uid` None: not root, no drop.
    Pure but for getpid()."""
    drop = (
        [
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
        ]
        if uid is not None
        else []
    )
    return [
        "setpriv",
        *drop,
        "--pdeathsig",
        "KILL",
        "--",
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "--propagation",
        "private",
        "--pid",
        "--fork",
        "--kill-child",
        "--",
        "/bin/sh",
        "-c",
        _STAGE_SH,
        "sh",
        str(os.getpid() if server_pid is None else server_pid),
        *fstab(limits),
    ]
