"""Slot uids (bwrap as root): each slot runs as its own host uid, which must be nobody's.

    claim = claim_free_uid(61000, 1024)   # a uid of the host's pool that nobody uses now, or SandboxUnavailable
    claim.uid; ...; claim.release()       # or let the process end
    claim_slot_uid(claim.uid)             # the same uid again in this process (a backend and its check)

The pool is `sandbox.uid_base` .. `uid_base + uid_pool - 1`, one for every sandbox on the host,
whatever run or user started it: a sandbox server takes a free uid per slot when it starts (and
records them in its run directory), a one-shot `hpcrl sandbox exec` takes one, and each gives
them back when it ends. A uid is free when

* it is in neither the passwd nor the group database (setpriv gives the slot the gid of the same
  number): files of a real account would be the sandbox's to read and write; such uids of the
  pool are skipped (and logged: the pool overlaps accounts);
* no other process holds its lock: an exclusive `flock` on /run/lock/hpcrl-sandbox/uid-<N>.lock,
  held until released or until the holder ends. The kernel drops it when the holder dies, even
  after SIGKILL, so a dead holder's uids come back by themselves; nothing is decided by pid
  (a pid can be reused by an unrelated process: the pid written in the file is for people);
* no process on the host runs as it (real, effective, saved or filesystem uid or gid): a
  holder that died may leave sandboxed processes behind for a moment (they die with their
  launcher, armed with a parent-death signal, or are being reaped), and a uid they still use is
  not handed to anyone until they are gone. Checked after the lock is taken, so nothing can
  start as that uid in between (only the lock's holder starts processes as it).

Within one process a uid already claimed is skipped by `claim_free_uid` (two slots never share
one) but may be claimed again by number with `claim_slot_uid` (a check() and the backend it
vouches for share one); the lock goes when the last claim is released.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import pwd
import threading

from hpcrl.sandbox.result import SandboxUnavailable

__all__ = ["UidClaim", "claim_free_uid", "claim_slot_uid", "check_unowned", "lock_dir", "uids_in_use"]

log = logging.getLogger(__name__)
_LOCK_DIRS = ("/run/lock", "/var/lock", "/tmp")
_held: dict[int, list[int]] = {}  # uid -> [fd, claims]
_held_lock = threading.Lock()
_warned_owned: set[int] = set()
_FIX = "pick sandbox.uid_base and sandbox.uid_pool so the pool holds uids no account or group uses"


def lock_dir() -> str:
    base = next((d for d in _LOCK_DIRS if os.path.isdir(d) and not os.path.islink(d)), "/tmp")
    return os.path.join(base, "hpcrl-sandbox")


def _owner(uid: int) -> tuple[str, str] | None:
    """('account'|'group', name) if `uid` is an account's uid or a group's gid on this host."""
    for what, lookup in (("account", lambda: pwd.getpwuid(uid).pw_name), ("group", lambda: grp.getgrgid(uid).gr_name)):
        try:
            return what, lookup()
        except KeyError:
            continue
    return None


def check_unowned(uid: int) -> None:
    """SandboxUnavailable if `uid` is an account's uid or a group's gid on this host."""
    owner = _owner(uid)
    if owner is not None:
        what, name = owner
        raise SandboxUnavailable(
            f"bwrap backend: slot uid {uid} is the {what} {name!r} on this host (the {what} database says so): "
            f"a sandbox must never run as a real {what}; {_FIX}"
        )


def uids_in_use() -> set[int]:
    """Every uid and gid some live process on this host (as far as our /proc shows) runs with.
    A zombie runs nothing (a killed server's sandboxes wait as zombies until init reaps them)."""
    out: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as fh:
                lines = [line for line in fh if line.startswith(("State:", "Uid:", "Gid:"))]
        except OSError:
            continue  # gone meanwhile
        if any(line.startswith("State:") and line.split()[1] == "Z" for line in lines):
            continue
        for line in lines:
            if line.startswith(("Uid:", "Gid:")):
                out.update(int(x) for x in line.split()[1:] if x.isdigit())
    return out


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


def _lock_folder() -> str:
    d = lock_dir()
    os.makedirs(d, mode=0o755, exist_ok=True)
    st = os.lstat(d)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not os.path.isdir(d) or os.path.islink(d):
        # /run/lock is world-writable on some systems: a directory someone else made could hold our locks.
        raise SandboxUnavailable(f"bwrap backend: {d} must be a directory of uid {os.geteuid()}, writable by it only")
    return d


def _try_lock(uid: int) -> tuple[int | None, str]:
    """(fd holding the uid's lock, "") or (None, the holder's pid as its file says). Call under _held_lock."""
    path = os.path.join(_lock_folder(), f"uid-{uid}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read_holder(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SandboxUnavailable(f"bwrap backend: cannot lock {path}: {exc}") from None
        return None, holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, ""


def claim_slot_uid(uid: int) -> UidClaim:
    """Claim `uid` itself for this process (SandboxUnavailable if it is an account's or another
    process holds it); a uid this process holds already is claimed once more."""
    check_unowned(uid)
    with _held_lock:
        entry = _held.get(uid)
        if entry is not None:
            entry[1] += 1
            return UidClaim(uid)
        fd, holder = _try_lock(uid)
        if fd is None:
            raise SandboxUnavailable(
                f"bwrap backend: slot uid {uid} is in use by another sandbox process on this host "
                f"({f'pid {holder}, ' if holder else ''}lock {lock_dir()}/uid-{uid}.lock); take free ones from "
                "the pool (sandbox.auto.make_backend) instead of naming one"
            )
        _held[uid] = [fd, 1]
        return UidClaim(uid)


def claim_free_uid(base: int, count: int) -> UidClaim:
    """A uid of the pool `base` .. `base + count - 1` that is free (see the module docstring),
    claimed for this process; SandboxUnavailable saying why none is."""
    held = owned = busy = 0
    running = uids_in_use()
    for uid in range(base, base + count):
        with _held_lock:
            if uid in _held:
                held += 1
                continue
        owner = _owner(uid)
        if owner is not None:
            owned += 1
            if uid not in _warned_owned:
                _warned_owned.add(uid)
                log.info("slot uid pool: skipping uid %d, the %s %r on this host; %s", uid, *owner, _FIX)
            continue
        if uid in running:
            busy += 1
            continue
        with _held_lock:
            if uid in _held:  # another thread of ours took it meanwhile
                held += 1
                continue
            fd, _ = _try_lock(uid)
            if fd is None:
                held += 1
                continue
            if uid in uids_in_use():  # a dead holder's process, still there
                os.close(fd)
                busy += 1
                continue
            _held[uid] = [fd, 1]
            return UidClaim(uid)
    raise SandboxUnavailable(
        f"bwrap backend: no free slot uid in the pool {base}..{base + count - 1} on this host ({held} held by "
        f"sandboxes, {busy} still used by processes, {owned} accounts' or groups'); raise sandbox.uid_pool, "
        "or stop sandboxes on this host"
    )


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
