"""What runs between the server and bwrap: one exec chain, one pid, then a pid namespace of our own.

    [root, cgroups] sh JOIN          write this pid into the run's cgroups (as root)
    setpriv [drop to slot uid] --pdeathsig KILL
    sh GUARD <server pid>            the server is still our parent, or stop
    unshare --user --map-root-user --mount --propagation private --pid --fork --kill-child
      `-> pid 1 of a new pid namespace: sh STAGE
            the launcher (unshare's parent) is still alive, or stop;
            exec bwrap ...           bwrap's own namespaces nest inside

Why each step:

* A server that is SIGKILLed must take its sandboxes with it. bwrap's --die-with-parent arms
  PR_SET_PDEATHSIG in the outer bwrap only after it has made its namespaces, and in its init
  only after the whole mount setup: a kill in between (milliseconds; 18 of 30 kills of a busy
  server in a test) left a sandbox running with nobody to enforce its wall limit. Here every
  link is armed before its parent can go unnoticed: setpriv arms the launcher (after the uid
  change, which would clear the signal) and GUARD then checks that the parent is still the
  server (if it died first, the signal will never come); unshare's --kill-child arms the
  namespace's pid 1 and STAGE checks the launcher is still alive. Everything else lives in
  that pid namespace, and when its pid 1 dies the kernel kills all of it: no process of a
  sandbox ever outlives the launcher, and none is orphaned to the host's init.
* In the user namespace the slot uid is root, and nothing outside it. bwrap runs in it as
  that root with the namespace's capabilities, drops them (--cap-drop ALL) and nests its own
  user namespace, in which the program is uid 65534: it holds no capability in either.

Exit status 125 from the chain means a step refused (JOIN's message on stderr starts with
`sh:`; GUARD and STAGE stop silently, for nobody is listening any more).
"""

from __future__ import annotations

import os

from hpcrl.sandbox.spec import Limits

__all__ = ["launcher_args", "join_cgroups_args"]

_JOIN_SH = 'for f; do shift; [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; done; exec "$@"'
_GUARD_SH = (
    '[ "$PPID" = "$1" ] || exit 125; shift; '  # orphaned before the parent-death signal was armed
    'HPCRL_LAUNCHER=$$ exec "$@"'
)
_STAGE_SH = (
    "p=$HPCRL_LAUNCHER; unset HPCRL_LAUNCHER; "
    # pid 1 here has no parent it can name (getppid() is 0 across a pid namespace): look the
    # launcher up in the host's /proc, still mounted here. Gone or a zombie: it died before
    # unshare armed --kill-child in us, so stop.
    'read -r s < "/proc/$p/stat" || exit 125; case "${s##*) }" in [ZX]*) exit 125 ;; esac; '
    'exec "$@"'
)


def join_cgroups_args(procs_files: list[str]) -> list[str]:
    """`sh JOIN`: this pid into each cgroup.procs file (as root, before anything else), then exec the rest."""
    return ["/bin/sh", "-c", _JOIN_SH, "sh", *procs_files, "--"]


def launcher_args(limits: Limits, uid: int | None, server_pid: int | None = None) -> list[str]:
    """Everything before `bwrap` in the chain above (after JOIN); `uid` None: not root, no drop. Pure."""
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
        "/bin/sh",
        "-c",
        _GUARD_SH,
        "sh",
        str(os.getpid() if server_pid is None else server_pid),
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
    ]
