"""A session's workspace on the sandbox node: files the server handles for a client while the
session's sandboxed runs, between operations, may have put anything there.

    ws = Workspace.create(session_dir, limits, uid)       # a tmpfs capped in bytes and inodes (root)
    ws.write("src/main.c", b"...", uid=ws.uid); ws.read("out.txt", max_bytes=1 << 20)
    ws.copy_to(snapshot_dir); ws.restore_from(snapshot_dir); ws.remove()

Trust: a path from the client is checked (relative, no '..', no NUL) and then walked component
by component with O_NOFOLLOW from a descriptor of the workspace root, so a symlink the
sandboxed code made (to /etc, to another session) is refused, never followed; a file is read
only if it is a regular one (a FIFO would block the server) and written to a fresh name that
is then renamed over the target (a rename replaces a symlink or a hard link, it never writes
through one). Copies for snapshots walk with os.fwalk (directory descriptors, no following)
and keep directories, regular files and symlinks (as links, never resolved); devices, FIFOs
and sockets are left out. Between runs nothing sandboxed is alive (a run's processes die with
its pid namespace), so the tree cannot change under these walks.

Quota: as root the workspace is its own tmpfs, mounted with `size=` work_mb and `nr_inodes=`
inodes (the same caps as a one-shot run's /work, hpcrl.sandbox.launcher), nosuid and nodev:
the kernel refuses writes over it, the server's and the program's alike (ENOSPC). Where no
tmpfs can be mounted (not root; apptainer on a cluster; `sandbox.session_tmpfs: false`) it is
a plain directory and the quota is measured (`footprint()`): the server refuses writes that
would pass it, and the session's commands are held to it as hpcrl.sandbox.session says.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from hpcrl.sandbox.launcher import tmpfs_options
from hpcrl.sandbox.spec import Limits

__all__ = ["Workspace", "WorkspaceError", "check_path", "sweep", "tree_footprint"]

_MIB = 1024 * 1024
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger(__name__)
_warned = False


class WorkspaceError(ValueError):
    """An operation on the workspace was refused; the message names what and what to do."""


def check_path(path: object) -> tuple[str, ...]:
    """The components of a client's workspace path; WorkspaceError if it could leave the workspace."""
    if not isinstance(path, str) or not path:
        raise WorkspaceError(
            f"path must be a non-empty string relative to the workspace, e.g. 'main.py' (got {path!r})"
        )
    if "\0" in path or len(path) > 4096:
        raise WorkspaceError(f"path {path[:80]!r}: no NUL characters, at most 4096 characters")
    if path.startswith("/"):
        raise WorkspaceError(f"path {path!r} is absolute; give it relative to the workspace, e.g. 'src/main.c'")
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise WorkspaceError(f"path {path!r} contains '..'; paths stay inside the workspace")
    if not parts or any(len(p.encode()) > 255 for p in parts):
        raise WorkspaceError(f"path {path!r} names no file (or a component is over 255 bytes)")
    return parts


@dataclass
class Workspace:
    """`root`: the directory bound as /work; `mounted`: a tmpfs of its own (the kernel keeps the quota)."""

    root: str
    quota_bytes: int
    uid: int | None  # who owns the files (the slot uid running the session's commands); None: ourselves
    mounted: bool

    @classmethod
    def create(cls, root: str, limits: Limits, uid: int | None, tmpfs: bool = True) -> Workspace:
        """A new workspace at `root`: as root (and `tmpfs`) a tmpfs of its own, else a directory."""
        os.mkdir(root, 0o700)
        mounted = False
        if os.geteuid() == 0 and tmpfs:
            opts = tmpfs_options(limits.work_mb, limits.inodes, "0700").encode()
            mounted = _libc.mount(b"hpcrl-session", root.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) == 0
            global _warned
            if not mounted and not _warned:
                _warned = True
                log.warning(
                    "cannot mount a tmpfs for session workspaces (%s): their quota is measured, not enforced "
                    "by the kernel (a run can pass it until it ends)",
                    os.strerror(ctypes.get_errno()),
                )
        ws = cls(root, limits.work_mb * _MIB, None, mounted)
        ws.chown(uid)
        return ws

    def remove(self) -> None:
        if self.mounted:
            # Detached: gone from the tree now, freed once the last user (none: no run is live) lets go.
            _libc.umount2(self.root.encode(), _MNT_DETACH)
            self.mounted = False
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the client's operations -------------------------------------------------------------
    def write(self, path: str, data: bytes, *, executable: bool = False) -> int:
        parts = check_path(path)
        if not self.mounted and self.usage() + len(data) > self.quota_bytes:
            raise self._full(path, len(data))
        with self._dir(parts[:-1], path, create=True) as dfd:
            tmp = f".hpcrl-write-{secrets.token_hex(6)}"
            fd = os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=dfd)
            try:
                try:
                    _write_all(fd, data)
                    os.fchmod(fd, 0o755 if executable else 0o644)
                    if self.uid is not None:
                        os.fchown(fd, self.uid, self.uid)
                finally:
                    os.close(fd)
                os.rename(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._full(path, len(data)) from None
                if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise WorkspaceError(f"write {path!r}: it is a directory; write a file path") from None
                raise
        return len(data)

    def read(self, path: str, max_bytes: int) -> bytes:
        parts = check_path(path)
        with self._dir(parts[:-1], path, create=False) as dfd:
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                raise WorkspaceError(
                    f"read {path!r}: no such file in the workspace; `list` shows what is there"
                ) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise WorkspaceError(f"read {path!r}: it is a symlink; read the file by its own path") from None
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WorkspaceError(f"read {path!r}: not a regular file (a directory, FIFO or socket)")
            if st.st_size > max_bytes:
                raise WorkspaceError(
                    f"read {path!r}: {st.st_size} bytes, more than the {max_bytes} a read returns (limits.output_kb)"
                )
            chunks, left = [], max_bytes + 1
            while left > 0:
                b = os.read(fd, min(left, 1 << 20))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            return b"".join(chunks)[:max_bytes]
        finally:
            os.close(fd)

    def tree(self, max_entries: int, max_bytes: int = 512 << 10) -> tuple[list[dict], bool]:
        """Entries {path, type: file|dir|symlink|other, size} sorted by path, and whether some were
        left out: at most `max_entries`, and about `max_bytes` of paths (a reply header is capped)."""
        out: list[dict] = []
        size = 0
        for rel, name, st in self._walk(self.root):
            if len(out) >= max_entries or size >= max_bytes:
                return sorted(out, key=lambda e: e["path"]), True
            kind = (
                "dir"
                if stat.S_ISDIR(st.st_mode)
                else "file"
                if stat.S_ISREG(st.st_mode)
                else "symlink"
                if stat.S_ISLNK(st.st_mode)
                else "other"
            )
            path = os.path.join(rel, name) if rel else name
            out.append({"path": path, "type": kind, "size": st.st_size})
            size += len(path) + 32
        return sorted(out, key=lambda e: e["path"]), False

    def usage(self) -> int:
        """Bytes the workspace holds (allocated blocks, as a quota counts them)."""
        return self.footprint()[0]

    def footprint(self) -> tuple[int, int]:
        """(bytes held, entries: files, directories, links), as a quota counts them."""
        return tree_footprint(self.root)

    # -- snapshots ---------------------------------------------------------------------------
    def copy_to(self, dest: str) -> None:
        """The tree into a new directory `dest` (ours alone: 0700, files owned by us)."""
        os.mkdir(dest, 0o700)
        _copy_tree(self.root, dest, None)

    def restore_from(self, src: str) -> None:
        """Empty the workspace, then copy `src` (a snapshot) back, owned by the workspace's uid."""
        with os.scandir(self.root) as it:
            names = [e.name for e in it]
        for name in names:
            p = os.path.join(self.root, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)  # fd-based on Linux: does not follow symlinks inside
            else:
                os.unlink(p)
        _copy_tree(src, self.root, self.uid)

    def chown(self, uid: int | None) -> None:
        """Hand every entry to `uid` (a run on another slot runs as another uid), links themselves only."""
        if uid is None or uid == self.uid:
            self.uid = uid if uid is not None else self.uid
            return
        os.chown(self.root, uid, uid, follow_symlinks=False)
        for _, dirnames, filenames, dfd in os.fwalk(self.root, follow_symlinks=False):
            for name in dirnames + filenames:
                os.chown(name, uid, uid, dir_fd=dfd, follow_symlinks=False)
        self.uid = uid

    # -- machinery ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _dir(self, parts: tuple[str, ...], path: str, *, create: bool) -> Iterator[int]:
        """A descriptor of the directory `parts` inside the workspace, walked without following links."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts:
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise WorkspaceError(f"{path!r}: no directory {part!r} in the workspace") from None
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if self.uid is not None:
                            os.chown(part, self.uid, self.uid, dir_fd=fd, follow_symlinks=False)
                    except OSError as exc:
                        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                            raise self._full(path, 0) from None
                        raise
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise WorkspaceError(
                            f"{path!r}: {part!r} is a symlink or not a directory; paths may not pass through symlinks"
                        ) from None
                    raise
                os.close(fd)
                fd = nfd
            yield fd
        finally:
            os.close(fd)

    def _full(self, path: str, size: int) -> WorkspaceError:
        return WorkspaceError(
            f"write {path!r} ({size} bytes): the workspace is over its quota of {self.quota_bytes // _MIB} MiB "
            "(limits.work_mb, limits.inodes); remove files with a run, or open a session with more"
        )

    @staticmethod
    def _walk(root: str) -> Iterator[tuple[str, str, os.stat_result]]:
        for dirpath, dirnames, filenames, dfd in os.fwalk(root, follow_symlinks=False):
            rel = os.path.relpath(dirpath, root)
            rel = "" if rel == "." else rel
            for name in dirnames + filenames:
                with contextlib.suppress(FileNotFoundError):
                    yield rel, name, os.stat(name, dir_fd=dfd, follow_symlinks=False)


def tree_footprint(root: str) -> tuple[int, int]:
    """(allocated bytes, entries) of the tree under `root`, links not followed."""
    size = count = 0
    for _, _, st in Workspace._walk(root):
        size += st.st_blocks * 512
        count += 1
    return size, count


def _copy_tree(src: str, dest: str, uid: int | None) -> None:
    """Directories, regular files and symlinks (as links) of `src` into the existing `dest`."""
    for dirpath, dirnames, filenames, sfd in os.fwalk(src, follow_symlinks=False):
        rel = os.path.relpath(dirpath, src)
        dfd = os.open(dest if rel == "." else os.path.join(dest, rel), _DIR_FLAGS)
        try:
            for name in list(dirnames) + filenames:
                st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode) & 0o777  # never setuid/setgid bits
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(name, 0o700, dir_fd=dfd)
                    os.chmod(name, mode | 0o700, dir_fd=dfd, follow_symlinks=False)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
                elif stat.S_ISREG(st.st_mode):
                    _copy_file(sfd, dfd, name, mode)
                else:
                    continue  # FIFOs, sockets, devices: nothing a program's files need
                if uid is not None:
                    os.chown(name, uid, uid, dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)
        # Do not descend into directories that were symlinks (fwalk does not) or skipped.


def _copy_file(sfd: int, dfd: int, name: str, mode: int) -> None:
    rfd = os.open(name, _READ_FLAGS, dir_fd=sfd)
    try:
        if not stat.S_ISREG(os.fstat(rfd).st_mode):
            return
        wfd = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=dfd)
        try:
            while True:
                chunk = os.read(rfd, 1 << 20)
                if not chunk:
                    break
                _write_all(wfd, chunk)
            os.fchmod(wfd, mode)
        finally:
            os.close(wfd)
    finally:
        os.close(rfd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def sweep(root: str) -> None:
    """Remove what a dead server left in `root` (named `<pid>-...`): its tmpfs mounts, then its files."""
    for name in os.listdir(root):
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        path = os.path.join(root, name)
        for mnt in _mounts_under(path):
            _libc.umount2(mnt.encode(), _MNT_DETACH)
        shutil.rmtree(path, ignore_errors=True)


def _mounts_under(path: str) -> list[str]:
    try:
        with open("/proc/self/mounts") as fh:
            points = [line.split()[1] for line in fh]
    except OSError:
        return []
    return sorted((p for p in points if p.startswith(path + "/")), reverse=True)
