"""Where a dev cluster lives: its state folder, ports and daemon roles, read from the environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TAG_VAR = "HPCRL_DEVCLUSTER_TAG"  # put into every daemon's environment: "<state dir>#<role>"
NODES = ("n1", "n2")


class Failed(Exception):
    """`up`/`down` cannot go on; main() prints the message and exits 1."""


class DaemonFailed(Failed):
    """A daemon failed; main() also prints the tail of its logs."""

    def __init__(self, role: str, message: str):
        super().__init__(message)
        self.role = role


def log(message: str) -> None:
    print(f"devcluster: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Role:
    name: str  # munged, mariadb, slurmdbd, slurmctld, slurmd.n1, slurmd.n2
    exe: str  # the executable's name; Debian may add a suffix (/usr/sbin/slurmd -> slurmd-wlm)
    port: int | None


class Layout:
    """Paths, ports and roles of one dev cluster (all of it under `state`)."""

    def __init__(self, state: Path, cluster: str, account: str, port_base: int):
        self.state, self.cluster, self.account, self.port_base = state, cluster, account, port_base
        # Ports: mariadb +0, slurmctld +7, slurmd n1 +8, slurmdbd +9, slurmd n2 +10.
        self.db_port, self.ctld_port, self.dbd_port = port_base, port_base + 7, port_base + 9
        self.node_ports = {"n1": port_base + 8, "n2": port_base + 10}
        self.etc, self.run, self.log, self.spool = (state / d for d in ("etc", "run", "log", "spool"))
        self.devdir, self.munge_dir, self.db_dir = state / "dev", state / "munge", state / "mariadb"
        self.munge_socket = self.run / "munge" / "munge.socket"
        self.db_socket = self.run / "mariadb.sock"
        self.slurm_conf = self.etc / "slurm.conf"
        self.roles = (  # in start order; stopping goes the other way
            Role("munged", "munged", None),
            Role("mariadb", "mariadbd", self.db_port),
            Role("slurmdbd", "slurmdbd", self.dbd_port),
            Role("slurmctld", "slurmctld", self.ctld_port),
            *(Role(f"slurmd.{n}", "slurmd", self.node_ports[n]) for n in NODES),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Layout:
        base = environ.get("HPCRL_DEVCLUSTER_PORT_BASE") or "16810"
        if not base.isdigit():
            raise Failed(f"HPCRL_DEVCLUSTER_PORT_BASE must be a port number, not {base!r}")
        # realpath: the tag (and so the identity of our daemons) must not depend on how the folder is spelled.
        state = Path(os.path.realpath(environ.get("HPCRL_DEVCLUSTER_DIR") or REPO_ROOT / ".devcluster"))
        cluster = environ.get("HPCRL_DEVCLUSTER_CLUSTER") or "hpcrldev"
        return cls(state, cluster, environ.get("HPCRL_DEVCLUSTER_ACCOUNT") or "hpcrl", int(base))

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def tag(self, role: str) -> str:
        return f"{self.state}#{role}"

    def pidfile(self, role: str) -> Path:
        """Written, and removed at exit, by the daemon itself."""
        return self.run / f"{role}.pid"

    def idfile(self, role: str) -> Path:
        """Our own record of the daemon: "PID CREATE_TIME"."""
        return self.run / f"{role}.id"

    def logfile(self, role: str) -> Path:
        return self.log / f"{role}.log"

    def outfile(self, role: str) -> Path:
        """The daemon's stdout/stderr, all starts appended (fatal errors before its log opens land here)."""
        return self.log / f"{role}.out"
