"""A single-machine Slurm 22.05 dev cluster: munged, MariaDB, slurmdbd, slurmctld and two slurmd (n1, n2)
as plain root processes with private ports, sockets and state (see README.md next to this file).

    python -m hpcrl.slurm.devcluster up       # start (idempotent), wait until usable   = make devcluster
    python -m hpcrl.slurm.devcluster down     # cancel jobs, stop every daemon           = make devcluster-down
    python -m hpcrl.slurm.devcluster status   # exit 1 unless fully up; "status: UP"     = make devcluster-status
    eval "$(python -m hpcrl.slurm.devcluster env)"   # export SLURM_CONF, HPCRL_DEVCLUSTER_DIR
                                                     # = eval "$(make -s devcluster-env)"

Knobs: HPCRL_DEVCLUSTER_DIR (state folder, default <repo>/.devcluster), HPCRL_DEVCLUSTER_PORT_BASE
(default 16810), HPCRL_DEVCLUSTER_CLUSTER, HPCRL_DEVCLUSTER_ACCOUNT.

Map:
    layout.py    where things are: state folder layout, ports, daemon roles, from the environment
    procs.py     Supervisor: find a role's process (our run/<role>.id record, its pid file, a scan for the
                 HPCRL_DEVCLUSTER_TAG in its environment), start it detached, wait for it, stop it
    cluster.py   the verbs: prepare the state folder (munge key, DB password, fake GPUs, configs from
                 the *.conf.in string.Template files), bring each daemon up, down, status
    __main__.py  the command line

Needs only the standard library and psutil: no other hpcrl module is imported.
"""
