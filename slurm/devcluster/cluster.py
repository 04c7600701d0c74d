"""The dev cluster's verbs: `up` (prepare the state folder, start what is not running, wait until usable),
`down` (cancel jobs, stop every daemon), `status`, and the Slurm client calls they rely on."""

from __future__ import annotations

import os
import pwd
import secrets
import shlex
import shutil
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

from .host import port_in_use, secret_file, shquote, state_lock, write_file
from .layout import NODES, DaemonFailed, Failed, Layout, log
from .procs import DAEMON_PATH, Supervisor, tail_logs

TEMPLATES = Path(__file__).resolve().parent
BINARIES = (
    "munged",
    "munge",
    "unmunge",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "slurmdbd",
    "slurmctld",
    "slurmd",
    "sacctmgr",
    "sinfo",
    "scontrol",
    "squeue",
    "scancel",
)
HEALTHY = {"idle", "mixed", "allocated", "completing"}  # "idle*" (not responding) is not
MAX_SOCKET_PATH = 99  # sockaddr_un.sun_path is 108 bytes; munged and MariaDB want less
BAD = ("drain", "down", "fail", "maint", "reboot", "inval")


class Cluster:
    def __init__(self, layout: Layout):
        self.layout = layout
        self.sup = Supervisor(layout)
        env = dict(os.environ, SLURM_CONF=str(layout.slurm_conf))
        env["PATH"] = f"{env.get('PATH', '')}:{DAEMON_PATH}"
        # A caller's output-format or cluster settings must not change what we parse.
        for var in ("SINFO_FORMAT", "SQUEUE_FORMAT", "SQUEUE_FORMAT2", "SLURM_CLUSTERS", "SQUEUE_SORT"):
            env.pop(var, None)
        self.env = env

    # ---- one-shot commands ------------------------------------------------------------------------
    def q(self, *argv: str, input: str | None = None, timeout_s: float = 20) -> subprocess.CompletedProcess:
        """Run a client command; a timeout reads as exit 124, a missing program as 127 (like timeout(1))."""
        try:
            return subprocess.run(
                argv, input=input, capture_output=True, text=True, env=self.env, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(argv, 124, exc.stdout or "", exc.stderr or "")
        except OSError as exc:
            return subprocess.CompletedProcess(argv, 127, "", str(exc))

    def ok(self, *argv: str) -> bool:
        return self.q(*argv).returncode == 0

    def lines(self, *argv: str) -> list[str]:
        return self.q(*argv).stdout.splitlines()

    def sinfo_ok(self) -> bool:
        return self.ok("sinfo", "-h", "-o", "%P")

    def sacctmgr_ok(self) -> bool:
        return self.ok("sacctmgr", "-n", "-P", "list", "cluster", "format=cluster")

    def node_states(self) -> dict[str, str]:
        """node -> long state name (idle, mixed, drained, idle*, ...)."""
        pairs = (line.split(None, 1) for line in self.lines("sinfo", "-h", "-N", "-o", "%N %T"))
        return {p[0]: p[1].strip() for p in pairs if len(p) == 2}

    def unhealthy_nodes(self) -> list[str]:
        states = self.node_states()
        return [n for n in NODES if states.get(n) not in HEALTHY]

    def munge_ok(self) -> bool:
        sock = str(self.layout.munge_socket)
        cred = self.q("munge", "-S", sock, "-n", input="")
        return cred.returncode == 0 and self.q("unmunge", "-S", sock, input=cred.stdout).returncode == 0

    def db_sql(self, sql: str) -> bool:
        """SQL as the DB root, over the private socket."""
        sock = f"--socket={self.layout.db_socket}"
        return self.ok("mariadb", "--no-defaults", "--protocol=socket", sock, "-uroot", "-N", "-B", "-e", sql)

    # ---- preparation: folders, munge key, fake GPUs, configs --------------------------------------
    def prepare(self) -> None:
        lay = self.layout
        os.umask(0o022)  # the daemons inherit it
        for d in (
            lay.etc,
            lay.run,
            lay.log,
            lay.spool / "slurmctld",
            lay.devdir,
            lay.munge_dir,
            lay.db_dir / "tmp",
            *(lay.spool / f"slurmd.{n}" for n in NODES),
        ):
            d.mkdir(parents=True, exist_ok=True)
        # munged insists on safe permissions: key dir not writable by others; socket dir needs o+x.
        for d, mode in ((lay.state, 0o755), (lay.run, 0o755), (lay.log, 0o755), (lay.munge_dir, 0o700)):
            d.chmod(mode)
        lay.munge_socket.parent.mkdir(exist_ok=True)
        lay.munge_socket.parent.chmod(0o711)
        secret_file(lay.munge_dir / "munge.key", lambda: os.urandom(1024))
        secret_file(lay.db_dir / "slurm.pass", lambda: secrets.token_hex(16).encode())
        for i in range(4):  # fake GPU devices (gres.conf File= needs real paths)
            dev = lay.devdir / f"nvidia{i}"
            if not (dev.is_symlink() and os.readlink(dev) == "/dev/null"):
                dev.unlink(missing_ok=True)
                dev.symlink_to("/dev/null")
        self.render_configs()

    def template_values(self) -> dict[str, str]:
        lay = self.layout
        return {
            "state": str(lay.state),
            "cluster": lay.cluster,
            "host": socket.gethostname().split(".")[0],
            "ctld_port": str(lay.ctld_port),
            "n1_port": str(lay.node_ports["n1"]),
            "n2_port": str(lay.node_ports["n2"]),
            "dbd_port": str(lay.dbd_port),
            "db_port": str(lay.db_port),
            "munge_socket": str(lay.munge_socket),
            "db_pass": (lay.db_dir / "slurm.pass").read_text().strip(),
            "devdir": str(lay.devdir),
        }

    def render_configs(self) -> None:
        """etc/X from each X.in template. Daemons running with an older config keep it: warn instead."""
        values = self.template_values()
        any_running = any(self.sup.running(r.name) for r in self.layout.roles)
        changed = []
        for tmpl in sorted(TEMPLATES.glob("*.conf.in")):
            try:
                text = string.Template(tmpl.read_text()).substitute(values)
            except (KeyError, ValueError) as exc:
                raise Failed(f"cannot render {tmpl}: bad or unknown variable {exc}") from None
            out = self.layout.etc / tmpl.name.removesuffix(".in")
            mode = 0o600 if out.name == "slurmdbd.conf" else 0o644  # it holds the DB password
            old = out.read_text() if out.exists() else None
            if old is not None and old != text and any_running:
                changed.append(out.name)
            elif old != text:
                write_file(out, text.encode(), mode)
            out.chmod(mode)
        if changed:
            log(
                f"WARNING: templates changed ({' '.join(changed)}) but daemons are running with the old config; "
                "run 'down' then 'up' to apply"
            )

    # ---- daemons ----------------------------------------------------------------------------------
    def ensure(self, role: str, argv: list[str]) -> None:
        """Start ROLE unless it runs; its port must be free first."""
        if self.sup.running(role):
            return
        self.check_port_free(role)
        self.sup.start(role, argv)

    def check_port_free(self, role: str) -> None:
        port = self.layout.role(role).port
        if port is not None and port_in_use(port):
            raise Failed(
                f"port {port} (for {role}) is already in use by another process; "
                f"set HPCRL_DEVCLUSTER_PORT_BASE to another base (now {self.layout.port_base})"
            )

    def up_munged(self) -> None:
        lay = self.layout
        if self.sup.running("munged") and self.munge_ok():
            return
        self.sup.stop(["munged"], 15)  # a munged that does not answer is no use
        for stale in (lay.munge_socket, lay.munge_socket.with_name("munge.socket.lock")):
            stale.unlink(missing_ok=True)
        self.sup.start(
            "munged",
            [
                "munged",
                "-F",
                "-S",
                str(lay.munge_socket),
                f"--key-file={lay.munge_dir / 'munge.key'}",
                f"--pid-file={lay.pidfile('munged')}",
                f"--log-file={lay.logfile('munged')}",
                f"--seed-file={lay.munge_dir / 'munged.seed'}",
                "--num-threads=4",
            ],
        )
        self.sup.wait_until("munged", 15, f"munge socket {lay.munge_socket} to answer", self.munge_ok)

    def mariadb_opts(self) -> list[str]:
        db = self.layout.db_dir
        return [
            "--no-defaults",
            "--basedir=/usr",
            f"--datadir={db / 'data'}",
            f"--tmpdir={db / 'tmp'}",
            "--innodb-buffer-pool-size=512M",
            "--innodb-log-file-size=32M",
            "--innodb-lock-wait-timeout=900",
            "--innodb-flush-log-at-trx-commit=2",
            "--innodb-use-native-aio=0",
            "--max-allowed-packet=64M",
        ]

    def init_mariadb(self) -> None:
        """A fresh datadir, once: `.initialized` is only written when mariadb-install-db succeeded."""
        db = self.layout.db_dir
        log(f"initializing MariaDB datadir {db / 'data'}")
        shutil.rmtree(db / "data", ignore_errors=True)
        (db / "data").mkdir()
        with open(self.layout.outfile("mariadb-install-db"), "w") as out:
            rc = subprocess.run(
                [
                    "mariadb-install-db",
                    *self.mariadb_opts(),
                    "--user=root",
                    "--skip-test-db",
                    "--auth-root-authentication-method=socket",
                    "--skip-name-resolve",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self.env,
                check=False,
            ).returncode
        if rc != 0:
            raise DaemonFailed("mariadb-install-db", f"exit status {rc}")
        (db / ".initialized").touch()

    def up_mariadb(self) -> None:
        lay = self.layout
        if not self.sup.running("mariadb"):
            if not (lay.db_dir / ".initialized").exists():
                self.init_mariadb()
            self.check_port_free("mariadb")
            lay.db_socket.unlink(missing_ok=True)
            self.sup.start(
                "mariadb",
                [
                    "mariadbd",
                    *self.mariadb_opts(),
                    "--user=root",
                    f"--socket={lay.db_socket}",
                    f"--port={lay.db_port}",
                    "--bind-address=127.0.0.1",
                    "--skip-name-resolve",
                    f"--pid-file={lay.pidfile('mariadb')}",
                    f"--log-error={lay.logfile('mariadb')}",
                ],
            )
        self.sup.wait_until("mariadb", 60, f"MariaDB to answer on {lay.db_socket}", lambda: self.db_sql("SELECT 1"))
        pw = (lay.db_dir / "slurm.pass").read_text().strip()
        hosts = ("127.0.0.1", "localhost")
        sql = ["CREATE DATABASE IF NOT EXISTS slurm_acct_db;"]
        sql += [f"CREATE USER IF NOT EXISTS 'slurm'@'{h}' IDENTIFIED BY '{pw}';" for h in hosts]
        sql += [f"ALTER USER 'slurm'@'{h}' IDENTIFIED BY '{pw}';" for h in hosts]
        sql += [f"GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'{h}';" for h in hosts]
        if not self.db_sql("\n".join([*sql, "FLUSH PRIVILEGES;"])):
            raise DaemonFailed("mariadb", "could not create the slurm_acct_db database/user")

    def up_slurmdbd(self) -> None:
        self.ensure("slurmdbd", ["slurmdbd", "-D"])
        # The first start creates the tables; that can take a while on a slow machine.
        self.sup.wait_until(
            "slurmdbd", 60, f"slurmdbd to answer sacctmgr on port {self.layout.dbd_port}", self.sacctmgr_ok
        )

    def sacctmgr_has(self, value: str, *query: str) -> bool:
        return value in self.lines("sacctmgr", "-n", "-P", "list", *query)

    def sacctmgr_do(self, what: str, *args: str) -> None:
        if not self.ok("sacctmgr", "-i", *args):
            raise DaemonFailed("slurmdbd", f"sacctmgr {what} failed")

    def register_cluster(self) -> None:
        cluster = self.layout.cluster
        if not self.sacctmgr_has(cluster, "cluster", "format=cluster"):
            log(f"registering cluster {cluster} in accounting")
            self.sacctmgr_do(f"add cluster {cluster}", "add", "cluster", cluster)

    def register_account_user(self) -> None:
        """The calling user in the account, with it as default account."""
        cluster, account = self.layout.cluster, self.layout.account
        user = pwd.getpwuid(os.geteuid()).pw_name
        if not self.sacctmgr_has(account, "account", account, "format=account"):
            self.sacctmgr_do(
                f"add account {account}",
                "add",
                "account",
                account,
                f"cluster={cluster}",
                "description=hpcrl dev",
                "organization=hpcrl",
            )
        if not self.sacctmgr_has(
            user, "assoc", f"cluster={cluster}", f"account={account}", f"user={user}", "format=user"
        ):
            self.sacctmgr_do(f"add user {user}", "add", "user", user, f"account={account}", f"cluster={cluster}")
        if not self.sacctmgr_has(account, "user", user, "format=defaultaccount"):
            self.sacctmgr_do(
                f"modify user {user} defaultaccount",
                "modify",
                "user",
                "where",
                f"name={user}",
                "set",
                f"defaultaccount={account}",
            )

    def up_slurmctld(self) -> None:
        self.ensure("slurmctld", ["slurmctld", "-D", "-f", str(self.layout.slurm_conf)])
        self.sup.wait_until(
            "slurmctld", 30, f"slurmctld to answer sinfo on port {self.layout.ctld_port}", self.sinfo_ok
        )

    def resume_bad_nodes(self) -> None:
        """A node drained once stays drained across restarts (Slurm's state files): resume it."""
        for node, state in self.node_states().items():
            if node in NODES and "*" not in state and any(b in state for b in BAD):  # "*": not registered yet
                log(f"node {node} is '{state}': resuming")
                self.q("scontrol", "update", f"nodename={node}", "state=resume")

    def wait_nodes(self, timeout_s: float = 40) -> None:
        roles = [f"slurmd.{n}" for n in NODES]
        procs = {r: self.sup.find(r) for r in roles}
        for role, p in procs.items():
            if p is None:
                raise DaemonFailed(role, f"not running{self.sup.exit_note(role)}")
        deadline, last_resume = time.monotonic() + timeout_s, 0.0
        while self.unhealthy_nodes():
            for role in roles:
                procs[role] = self.sup.still_running(role, procs[role])
                if procs[role] is None:
                    raise DaemonFailed(
                        role,
                        f"process exited{self.sup.exit_note(role)} "
                        f"while waiting for node {role.split('.')[1]} to become idle",
                    )
            if time.monotonic() - last_resume >= 3:
                self.resume_bad_nodes()
                last_resume = time.monotonic()
            if time.monotonic() > deadline:
                self.report_stuck_nodes(timeout_s)
                raise Failed(f"nodes did not become idle in {timeout_s:g}s (see above)")
            time.sleep(0.3)

    def report_stuck_nodes(self, timeout_s: float) -> None:
        log(f"nodes did not become idle in {timeout_s:g}s:")
        for node, state in sorted(self.node_states().items()):
            print(f"{node} {state}", file=sys.stderr)
        for node in self.unhealthy_nodes():
            shown = self.lines("scontrol", "show", "node", node)
            print("\n".join(line for line in shown if "State=" in line or "Reason=" in line), file=sys.stderr)
            tail_logs(self.layout, f"slurmd.{node}")
        tail_logs(self.layout, "slurmctld")

    def fully_up(self) -> bool:
        return (
            all(self.sup.running(r.name) for r in self.layout.roles)
            and self.sinfo_ok()
            and not self.unhealthy_nodes()
            and self.sacctmgr_ok()
        )

    def cancel_all_jobs(self) -> None:
        """`scontrol shutdown` and stopping slurmd leave jobs running: cancel them first."""
        if not self.sinfo_ok():
            return
        ids = sorted(set(self.lines("squeue", "-h", "-o", "%A")), key=lambda j: (len(j), j))
        if not ids:
            return
        log(f"cancelling jobs: {' '.join(ids)}")
        self.q("scancel", *ids)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not self.lines("squeue", "-h", "-o", "%A"):
                return
            time.sleep(0.3)
        log("WARNING: jobs still listed after 15s:")
        print(self.q("squeue").stdout, end="", file=sys.stderr)

    # ---- verbs --------------------------------------------------------------------------------------
    def up(self) -> int:
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise Failed("must run as root (SlurmUser=root, mariadbd --user=root)")
        path = self.env["PATH"]
        missing = [b for b in BINARIES if shutil.which(b, path=path) is None]
        if missing:
            raise Failed(
                f"missing programs: {' '.join(missing)} (apt-get install slurm-wlm slurmdbd mariadb-server munge)"
            )
        for sock in (self.layout.munge_socket, self.layout.db_socket):
            if len(str(sock)) > MAX_SOCKET_PATH:
                raise Failed(
                    f"socket path too long ({len(str(sock))} chars, max {MAX_SOCKET_PATH}): {sock}; "
                    "set HPCRL_DEVCLUSTER_DIR to a shorter folder"
                )
        self.layout.state.mkdir(parents=True, exist_ok=True)
        with state_lock(self.layout):
            self.sup.locked = True
            self.prepare()
            if self.fully_up():
                self.register_account_user()
                log(
                    f"already up ({time.monotonic() - t0:.1f}s): cluster {self.layout.cluster}, "
                    f"SLURM_CONF={self.layout.slurm_conf}"
                )
                return 0
            for role in self.layout.roles:  # every daemon that is not running yet needs a free port
                if not self.sup.running(role.name):
                    self.check_port_free(role.name)
            self.up_munged()
            self.up_mariadb()
            self.up_slurmdbd()
            self.register_cluster()
            self.up_slurmctld()
            self.register_account_user()
            for node in NODES:
                self.ensure(f"slurmd.{node}", ["slurmd", "-D", "-N", node, "-f", str(self.layout.slurm_conf)])
            self.wait_nodes()
        log(f"up in {time.monotonic() - t0:.1f}s: cluster {self.layout.cluster}, SLURM_CONF={self.layout.slurm_conf}")
        hint = f"{shlex.quote(sys.executable)} -m hpcrl.slurm.devcluster env"
        if os.environ.get("HPCRL_DEVCLUSTER_DIR"):
            hint = f"HPCRL_DEVCLUSTER_DIR={shquote(str(self.layout.state))} {hint}"
        log(f'use: eval "$({hint})"')
        for node, state in sorted(self.node_states().items()):
            log(f"  {node} {state}")
        return 0

    def down(self) -> int:
        t0 = time.monotonic()
        lay = self.layout
        if not lay.state.is_dir():
            log(f"nothing to stop ({lay.state} does not exist)")
            return 0
        with state_lock(lay):
            self.sup.locked = True
            if self.sup.running("slurmctld"):
                self.cancel_all_jobs()
            self.sup.stop([f"slurmd.{n}" for n in NODES], 15)
            for role, timeout_s in (("slurmctld", 20), ("slurmdbd", 20), ("mariadb", 60), ("munged", 10)):
                self.sup.stop([role], timeout_s)
            left = self.sup.kill_tagged()  # leftovers, e.g. a stuck slurmstepd
            if left:
                log(f"killed leftover processes of this cluster: {' '.join(map(str, left))}")
            for sock in (lay.munge_socket, lay.db_socket):
                sock.unlink(missing_ok=True)
        log(f"down in {time.monotonic() - t0:.1f}s")
        return 0

    def status(self) -> int:
        lay, ok = self.layout, True
        print(f"state folder: {lay.state}")
        print(
            f"cluster: {lay.cluster}  ports: mariadb={lay.db_port} slurmctld={lay.ctld_port} "
            f"slurmdbd={lay.dbd_port} slurmd n1={lay.node_ports['n1']} n2={lay.node_ports['n2']}"
        )
        for role in lay.roles:
            p = self.sup.find(role.name)
            print(f"  {role.name:<10} running (pid {p.pid})" if p else f"  {role.name:<10} STOPPED")
            ok = ok and p is not None
        if lay.slurm_conf.is_file() and self.sup.running("slurmctld") and self.sinfo_ok():
            sinfo = self.q("sinfo")
            print(sinfo.stdout, end="")
            print(sinfo.stderr, end="", file=sys.stderr)
            if self.unhealthy_nodes():
                print("nodes not all usable:")
                print("".join(f"{n} {s}\n" for n, s in sorted(self.node_states().items())), end="")
                ok = False
            if self.sup.running("slurmdbd") and not self.sacctmgr_ok():
                print("sacctmgr does not answer")
                ok = False
        else:
            print("slurmctld does not answer")
            ok = False
        print("status: UP" if ok else "status: NOT UP")
        return 0 if ok else 1
