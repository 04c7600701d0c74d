"""Slot uids (bwrap as root): each slot runs as its own host uid, which must be nobody's.

    claim = claim_slot_uid(61000)    # SandboxUnavailable if an account owns it or another process uses it
    ...
    claim.release()                  # or let the process end

Two checks, both made when a root bwrap backend is built:

* the uid (and the gid of the same number, which setpriv gives the slot) must not be in the
  passwd or group database: files of a real account would be the sandbox's to read and write;
* no other process on this host may use it at the same time: two servers with the same
  `sandbox.uid_base` would run their slots as one host uid. A claim is an exclusive `flock` on
  /run/lock/hpcrl-sandbox/uid-<N>.lock, held until released or until the process ends (the
  kernel drops it even after SIGKILL). Within one process a uid may be claimed again (slots of
  a pool are distinct; a check() and the backend it vouches for share one).
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import threading

from hpcrl.sandbox.result import SandboxUnavailable

__all__ = ["UidClaim", "claim_slot_uid", "check_unowned", "lock_dir"]

_LOCK_DIRS = ("/run/lock", "/var/lock", "/tmp")
_held: dict[int, list[int]] = {}  # uid -> [fd, claims]
_held_lock = threading.Lock()
_FIX = "give each run its own range with sandbox.uid_base (server i's slot k runs as host uid uid_base + i x slots + k)"


def lock_dir() -> str:
    base = next((d for d in _LOCK_DIRS if os.path.isdir(d) and not os.path.islink(d)), "/tmp")
    return os.path.join(base, "hpcrl-sandbox")


def check_unowned(uid: int) -> None:
    """SandboxUnavailable if `uid` is an account's uid or a group's gid on this host."""
    for what, lookup in (("account", lambda: pwd.getpwuid(uid).pw_name), ("group", lambda: grp.getgrgid(uid).gr_name)):
        try:
            name = lookup()
        except KeyError:
            continue
        raise SandboxUnavailable(
            f"bwrap backend: slot uid {uid} is the {what} {name!r} on this host (the {what} database says so): "
            f"a sandbox must never run as a real {what}; {_FIX}, in a range no account or group uses"
        )


class UidClaim:
    """This process's use of one slot uid; `release()` once (idempotent)."""

    def __init__(self, uid: int):
        self.uid = uid
        self._released = False

    def release(self) -> None:
        with _held_lock:
            if self._released:
                return
            self._released = True
            entry = _held.get(self.uid)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[self.uid]
                os.close(entry[0])  # drops the flock


def claim_slot_uid(uid: int) -> UidClaim:
    """Check `uid` is nobody's and claim it for this process (see the module docstring)."""
    check_unowned(uid)
    with _held_lock:
        entry = _held.get(uid)
        if entry is not None:
            entry[1] += 1
            return UidClaim(uid)
        d = lock_dir()
        os.makedirs(d, mode=0o755, exist_ok=True)
        st = os.lstat(d)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not os.path.isdir(d) or os.path.islink(d):
            # /run/lock is world-writable on some systems: a directory someone else made could hold our locks.
            raise SandboxUnavailable(
                f"bwrap backend: {d} must be a directory of uid {os.geteuid()}, writable by it only"
            )
        path = os.path.join(d, f"uid-{uid}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SandboxUnavailable(f"bwrap backend: cannot lock {path}: {exc}") from None
            raise SandboxUnavailable(
                f"bwrap backend: slot uid {uid} is in use by another sandbox process on this host "
                f"({f'pid {holder}, ' if holder else ''}lock {path}); two servers must not share slot uids: {_FIX}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[uid] = [fd, 1]
        return UidClaim(uid)


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
