"""Rollout jobs' decisions without a cluster: the scheduler parameters read from `scontrol show
config`, when a rollout job gives way to a pending job (only to one it keeps from starting, never
to one a higher-priority plan holds back), and Slurm's early time-limit warning ignored."""

from __future__ import annotations

import datetime as dt
import os

from hpcrl.slurm import parse, queries
from hpcrl.slurm.backfill.give_way import rollout_jobs_to_yield


def test_scheduler_parameters_are_parsed_from_scontrol_show_config():
    text = "ClusterName             = hpcrldev\nSchedulerParameters     = bf_interval=1,bf_continue,sched_interval=2\n"
    assert parse.parse_scheduler_parameters(text) == {"bf_interval": "1", "bf_continue": "", "sched_interval": "2"}
    assert parse.parse_scheduler_parameters("SchedulerParameters     = (null)\n") == {}
    assert parse.parse_scheduler_parameters("ClusterName = x\n") == {}


def _pending(job_id: str, gpus: int, nodes: int = 1, reason: str = "Resources", partition: str = "gpu", **kw):
    kw = {"time_limit_s": 600, "expected_start": None, "priority": 1, **kw}
    return queries.PendingJob(job_id, partition, "other", "x", nodes, 1, gpus, reason=reason, **kw)


def test_rollout_jobs_give_way_only_to_a_pending_job_they_keep_from_starting():
    members = {"gpu": ("n1", "n2"), "cpu": ("n1", "n2")}
    ours = {"n2": [("r0", 1), ("r1", 1), ("r2", 1)]}
    # 4 GPUs on one node: n1 has 1 idle, n2 1 idle + 3 of ours -> the fewest of ours on n2 go.
    assert rollout_jobs_to_yield([_pending("b", 4)], {"n1": 1, "n2": 1}, ours, members) == {
        "r2": "b",
        "r1": "b",
        "r0": "b",
    }
    assert rollout_jobs_to_yield([_pending("b", 2)], {"n1": 1, "n2": 1}, ours, members) == {"r2": "b"}
    # It can start without us (n1 has the GPUs), or it could not even with ours: nothing is given.
    assert rollout_jobs_to_yield([_pending("b", 2)], {"n1": 2, "n2": 0}, ours, members) == {}
    assert rollout_jobs_to_yield([_pending("b", 4, nodes=2)], {"n1": 0, "n2": 1}, ours, members) == {}
    # Held or waiting on a dependency: Slurm would not start it now either.
    for why in ("JobHeldUser", "Dependency", "BeginTime"):
        assert rollout_jobs_to_yield([_pending("b", 2, reason=why)], {"n1": 1, "n2": 1}, ours, members) == {}
    # Two nodes of 4: n1 is idle, n2 needs ours; a later job does not count GPUs the first one takes.
    two = [_pending("b", 8, nodes=2), _pending("c", 1)]
    got = rollout_jobs_to_yield(two, {"n1": 4, "n2": 1}, ours, members)
    assert got == {"r2": "b", "r1": "b", "r0": "b"}
    # A job of another partition whose nodes we are not on.
    elsewhere = {**members, "other": ("n9",)}
    assert rollout_jobs_to_yield([_pending("b", 1, partition="other")], {"n2": 0}, ours, elsewhere) == {}


def test_rollout_jobs_do_not_give_way_to_a_job_a_higher_priority_plan_holds_back():
    """Seen in a live backfill run on the dev cluster: ours were cancelled for jobs squeue showed
    with reason Priority, behind a higher-priority job planned on the same GPUs, which Slurm
    then did not start either: the GPUs stood idle."""
    now = dt.datetime(2026, 12, 5, 12, 0, 0)
    members = {"gpu": ("n1", "n2")}
    ours = {"n2": [("r0", 1)]}
    idle = {"n1": 0, "n2": 1}
    # 4 GPUs on one node: not even n2 with ours (2) holds it; Slurm plans it on n2 in 5 minutes.
    top = _pending("a", 4, priority=10, expected_start=now + dt.timedelta(seconds=300), sched_nodes=("n2",))
    # 10 minutes on n2 would still run at a's start: Slurm keeps it off n2, ours stays.
    long = _pending("b", 2, reason="Priority", time_limit_s=600)
    assert rollout_jobs_to_yield([long, top], idle, ours, members, now) == {}
    # The same jobs in Slurm's expected-start order are taken by priority: a first.
    assert rollout_jobs_to_yield([top, long], idle, ours, members, now) == {}
    # 2 minutes end before a's start: backfill would start it in our GPU, so ours gives way.
    short = _pending("b", 2, reason="Priority", time_limit_s=120)
    assert rollout_jobs_to_yield([top, short], idle, ours, members, now) == {"r0": "b"}
    # A job without a time limit never ends in time.
    assert rollout_jobs_to_yield([top, _pending("b", 2, time_limit_s=None)], idle, ours, members, now) == {}
    # a planned on n1 holds nothing on n2; a plan without nodes or start holds nothing (as before).
    on_n1 = _pending("a", 4, priority=10, expected_start=now + dt.timedelta(seconds=300), sched_nodes=("n1",))
    assert rollout_jobs_to_yield([on_n1, long], idle, ours, members, now) == {"r0": "b"}
    unplanned = _pending("a", 4, priority=10, expected_start=now + dt.timedelta(seconds=300))
    assert rollout_jobs_to_yield([unplanned, long], idle, ours, members, now) == {"r0": "b"}
    assert rollout_jobs_to_yield([top, long], idle, ours, members) == {"r0": "b"}  # no clock: as before
    # A lower-priority job does not hold anything for a higher one: b is taken first and gets ours.
    low = _pending("a", 4, priority=0, expected_start=now + dt.timedelta(seconds=300), sched_nodes=("n2",))
    assert rollout_jobs_to_yield([low, _pending("b", 2, priority=5)], idle, ours, members, now) == {"r0": "b"}


ROLLOUT_PROBE = """
import os, pathlib, signal, sys
os.kill(os.getpid(), signal.SIGUSR2)  # before the component's handlers: boot remembers it
from hpcrl.jobs.components import start_component
stop = start_component(pathlib.Path(sys.argv[1]), "rollout-0", "rollout")
os.kill(os.getpid(), signal.SIGUSR2)  # and once it runs
print(f"set={stop.is_set()} requeue={stop.requeue}", flush=True)
"""


def test_a_rollout_job_ignores_slurms_early_time_limit_warning(tmp_path):
    """Slurm sends SIGUSR2 up to 30 s before signal_delay_s asks (measured: 26 s before the end of a
    1-minute rollout job); its own deadline (EndTime) ends a rollout job, so the warning must not."""
    import subprocess
    import sys

    (tmp_path / "rollout_probe.py").write_text(ROLLOUT_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("SLURM_JOB_ID", None)
    out = subprocess.run(
        [sys.executable, "-u", "-m", "hpcrl.jobs.boot", "-u", "-m", "rollout_probe", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "set=False requeue=False", (out.stdout, out.stderr[-2000:])
    assert out.stderr.count("SIGUSR2 ignored") == 2, out.stderr[-2000:]
