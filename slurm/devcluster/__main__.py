"""`python -m hpcrl.slurm.devcluster up|down|status|env`: what `make devcluster*` runs."""

from __future__ import annotations

import sys

from .cluster import Cluster
from .host import shquote
from .layout import DaemonFailed, Failed, Layout, log
from .procs import tail_logs

USAGE = """\
usage: python -m hpcrl.slurm.devcluster {up|down|status|env}
  up      start munged, MariaDB, slurmdbd, slurmctld, slurmd n1+n2 (idempotent)
  down    cancel all jobs and stop every daemon
  status  show daemons and sinfo; exit 1 unless fully up
  env     print 'export SLURM_CONF=...' for: eval "$(python -m hpcrl.slurm.devcluster env)"
state folder: """


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    layout = None
    try:
        layout = Layout.from_env()
        if verb == "env":
            print(f"export SLURM_CONF={shquote(str(layout.slurm_conf))}")
            print(f"export HPCRL_DEVCLUSTER_DIR={shquote(str(layout.state))}")
            return 0
        cluster = Cluster(layout)
        verbs = {"up": cluster.up, "down": cluster.down, "status": cluster.status}
        if verb not in verbs:
            print(USAGE + str(layout.state), file=sys.stderr)
            return 2
        return verbs[verb]()
    except DaemonFailed as exc:
        log(f"ERROR: {exc.role} failed: {exc}")
        if layout is not None:
            tail_logs(layout, exc.role)
        return 1
    except Failed as exc:
        log(f"ERROR: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
