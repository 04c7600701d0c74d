"""`hpcrl report RUN` (accounting): GPU-/CPU-hours and queue wait per role from
sacct, split across domains by the trajectories' own costs.

The rules are checked on sacct rows captured from the dev cluster (requeued lives, a pending
array, a job cancelled while pending, a hetjob's shared groups) and on a store written by the
real writer; then end to end: a run submitted to the dev cluster (while it runs and once it
ended), a local `hpcrl run`, and the one-line errors.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.jobs.accounting import (
    DomainCosts,
    apportion,
    life_usage,
    local_roles,
    run_members,
    store_costs,
    summarize,
)
from hpcrl.slurm import parse, queries

from conftest import RUN_GUARD_S, wait_for

ROOT = Path(__file__).resolve().parents[1]

# `sacct -X -D -n -P -o JobID,Partition,State,ExitCode,Elapsed,Submit,Start,End,AllocCPUS,AllocTRES,
# NodeList,JobName` as the dev cluster prints it (ids renumbered): the learner's job 102 was
# requeued (two lives), then restarted as 105, still running; the supervisor's first job was
# cancelled while pending; the sandbox array's task 1 has not started (sacct shows `104_[1]`).
SACCT = """\
100|cpu|COMPLETED|0:0|00:20:00|2026-12-05T10:00:00|2026-12-05T10:00:05|2026-12-05T10:20:05|1|billing=1,cpu=1,mem=256M,node=1|n1|hpcrl-r-store
101|cpu|COMPLETED|0:0|00:20:00|2026-12-05T10:00:00|2026-12-05T10:00:10|2026-12-05T10:20:10|2|billing=2,cpu=2,mem=512M,node=1|n1|hpcrl-r-coordinator
102|gpu|REQUEUED|0:0|00:10:00|2026-12-05T10:00:00|2026-12-05T10:01:00|2026-12-05T10:11:00|2|billing=2,cpu=2,gres/gpu=1,mem=512M,node=1|n2|hpcrl-r-learner
102|gpu|FAILED|1:0|00:05:00|2026-12-05T10:11:00|2026-12-05T10:11:30|2026-12-05T10:16:30|2|billing=2,cpu=2,gres/gpu=1,mem=512M,node=1|n2|hpcrl-r-learner
105|gpu|RUNNING|0:0|00:02:00|2026-12-05T10:16:40|2026-12-05T10:17:00|Unknown|4|billing=4,cpu=4,gres/gpu=2,mem=1G,node=1|n1|hpcrl-r-learner
103|gpu|COMPLETED|0:0|00:18:00|2026-12-05T10:00:00|2026-12-05T10:02:00|2026-12-05T10:20:00|1|billing=1,cpu=1,gres/gpu=1,mem=256M,node=1|n2|hpcrl-r-gen-0
104_0|cpu|COMPLETED|0:0|00:06:00|2026-12-05T10:00:00|2026-12-05T10:00:20|2026-12-05T10:06:20|4|billing=4,cpu=4,mem=1G,node=1|n2|hpcrl-r-sandbox
104_[1]|cpu|PENDING|0:0|00:00:00|2026-12-05T10:00:00|Unknown|Unknown|0||None assigned|hpcrl-r-sandbox
106|cpu|CANCELLED by 0|0:0|00:00:00|2026-12-05T10:00:00|None|2026-12-05T10:00:40|1||None assigned|hpcrl-r-supervisor
107|cpu|RUNNING|0:0|00:19:00|2026-12-05T10:00:50|2026-12-05T10:01:00|Unknown|1|billing=1,cpu=1,mem=256M,node=1|n1|hpcrl-r-supervisor
"""
NOW = dt.datetime(2026, 12, 5, 10, 20, 0)  # sacct's clock when it printed the rows above

JOBS = {
    "state": "running",
    "components": {
        "store": {"role": "coordinator", "job_id": "100", "history": ["100"], "restarts": 0},
        "coordinator": {"role": "coordinator", "job_id": "101", "history": ["101"], "restarts": 0},
        "sandbox-0": {"role": "sandbox", "job_id": "104_0", "history": ["104_0"], "restarts": 0},
        "sandbox-1": {"role": "sandbox", "job_id": "104_1", "history": ["104_1"], "restarts": 0},
        "learner": {"role": "learner", "job_id": "105", "history": ["102", "105"], "restarts": 1},
        "gen-0": {"role": "generator", "job_id": "103", "history": ["103"], "restarts": 0},
    },
    "supervisor": {"job_id": "107", "history": ["106", "107"]},
}


def records(text: str = SACCT, ids=None) -> list[queries.JobRecord]:
    rows = [queries.record_from_row(r) for r in parse.parse_delimited(text, queries.SACCT_FIELDS)]
    return queries.select_lives(rows, ids if ids is not None else list(run_members(JOBS)))


def test_array_rows_expand_to_the_asked_tasks_and_other_jobs_are_left_out():
    assert parse.expand_array_ids("6_[0-2%2]") == ["6_0", "6_1", "6_2"]
    assert parse.expand_array_ids("6_[1,3-4]") == ["6_1", "6_3", "6_4"]
    assert parse.expand_array_ids("7+1") == ["7+1"] and parse.expand_array_ids("104_0") == ["104_0"]
    with pytest.raises(parse.SlurmParseError, match="not a job array id"):
        parse.expand_array_ids("6_[a-b]")
    ids = [r.job_id for r in records(ids=["104_1", "102"])]
    assert ids == ["102", "102", "104_1"]  # both lives of 102; the pending array row as task 1 only
    mem = {r.job_id: r.mem_mb for r in records(ids=["107", "104_1"])}
    assert mem == {"107": 256, "104_1": 0}  # AllocTRES memory; a pending task has none yet


def test_run_members_lists_every_life_of_every_component_and_the_supervisor():
    members = run_members(JOBS)
    assert members["102"] == members["105"] == [("learner", "learner")]
    assert members["106"] == members["107"] == [("supervisor", "coordinator")]
    assert set(members) == {"100", "101", "102", "103", "104_0", "104_1", "105", "106", "107"}


def test_life_usage_wall_cpu_gpu_and_queue_wait_of_each_kind_of_row():
    lives = {(life.job_id, life.state): life for life in (life_usage(r, NOW) for r in records())}
    done = lives["102", "REQUEUED"]
    assert (done.wall_s, done.cpus, done.gpus, done.wait_s, done.running) == (600, 2, 1, 60, False)
    again = lives["102", "FAILED"]  # its Submit is the requeue: it waited 30 s
    assert (again.wall_s, again.wait_s) == (300, 30)
    running = lives["105", "RUNNING"]  # counts up to now, not sacct's Elapsed of when it printed
    assert (running.wall_s, running.gpus, running.wait_s, running.running) == (180, 2, 20, True)
    pending = lives["104_1", "PENDING"]
    assert (pending.wall_s, pending.wait_s, pending.pending) == (0, 1200, True)
    never = lives["106", "CANCELLED"]  # left the queue without starting: waited until it was cancelled
    assert (never.wall_s, never.wait_s, never.pending, never.running) == (0, 40, False, False)


def test_summarize_per_role_and_total():
    s = summarize(records(), run_members(JOBS), {}, NOW)
    r = s["roles"]
    assert list(r) == ["store", "coordinator", "sandbox", "learner", "generator", "supervisor"]
    learner = r["learner"]
    assert (learner["jobs"], learner["running"], learner["pending"]) == (3, 1, 0)
    assert learner["wall_h"] == pytest.approx((600 + 300 + 180) / 3600)
    assert learner["gpu_h"] == pytest.approx((600 + 300 + 2 * 180) / 3600)
    assert learner["cpu_h"] == pytest.approx((2 * 600 + 2 * 300 + 4 * 180) / 3600)
    assert (learner["wait_mean_s"], learner["wait_max_s"]) == (pytest.approx(110 / 3), 60)
    sandbox = r["sandbox"]
    assert (sandbox["components"], sandbox["jobs"], sandbox["pending"]) == (["sandbox-0", "sandbox-1"], 2, 1)
    assert sandbox["cpu_h"] == pytest.approx(4 * 360 / 3600) and sandbox["gpu_h"] == 0
    assert sandbox["wait_max_s"] == 1200  # the pending task, still waiting
    assert r["supervisor"]["jobs"] == 2 and r["supervisor"]["wait_max_s"] == 40
    assert r["store"]["gpu_h"] == 0 and r["generator"]["gpu_h"] == pytest.approx(0.3)
    total = s["total"]
    assert total["jobs"] == 10 and total["running"] == 2 and total["pending"] == 1
    for k in ("cpu_h", "gpu_h", "wall_h"):
        assert total[k] == pytest.approx(sum(row[k] for row in r.values()))
    assert s["missing_job_ids"] == []
    assert len(s["jobs"]) == 10 and s["jobs"][0]["components"] == ["store"]
    gone = summarize(records()[:3], run_members(JOBS), {}, NOW)
    assert gone["missing_job_ids"] == ["104_0", "104_1", "105", "103", "106", "107"]


def test_a_hetjob_group_counts_once_and_its_hours_split_by_what_each_component_asks():
    het = """\
200+0|cpu|COMPLETED|0:0|01:00:00|2026-12-05T09:00:00|2026-12-05T09:00:10|2026-12-05T10:00:10|4|billing=4,cpu=4,mem=1G,node=1|n1|hpcrl-h
200+1|gpu|COMPLETED|0:0|01:00:00|2026-12-05T09:00:00|2026-12-05T09:00:10|2026-12-05T10:00:10|3|billing=3,cpu=3,gres/gpu=3,mem=1G,node=1|n2|hpcrl-h
"""
    jobs = {
        "components": {
            n: {"role": role, "job_id": f"200+{g}", "history": [f"200+{g}"]}
            for n, role, g in [
                ("store", "coordinator", 0),
                ("coordinator", "coordinator", 0),
                ("sandbox-0", "sandbox", 0),
                ("learner", "learner", 1),
                ("gen-0", "generator", 1),
            ]
        }
    }
    members = run_members(jobs)
    requests = {"coordinator": (1.0, 0.0), "sandbox": (2.0, 0.0), "learner": (2.0, 2.0), "generator": (1.0, 1.0)}
    s = summarize(records(het, list(members)), members, requests, NOW)
    r = s["roles"]
    assert (r["store"]["cpu_h"], r["coordinator"]["cpu_h"], r["sandbox"]["cpu_h"]) == pytest.approx((1, 1, 2))
    assert (r["learner"]["gpu_h"], r["generator"]["gpu_h"]) == pytest.approx((2, 1))
    assert (r["learner"]["cpu_h"], r["generator"]["cpu_h"]) == pytest.approx((2, 1))
    assert all(row["jobs"] == 1 and row["wall_h"] == pytest.approx(1) for row in r.values())
    assert s["total"]["jobs"] == 2 and s["total"]["wall_h"] == pytest.approx(2)
    assert (s["total"]["cpu_h"], s["total"]["gpu_h"]) == pytest.approx((7, 3))
    equal = summarize(records(het, list(members)), members, {}, NOW)["roles"]  # no config: equal shares
    assert equal["learner"]["gpu_h"] == equal["generator"]["gpu_h"] == pytest.approx(1.5)


def test_apportion_splits_each_role_by_its_own_cost_and_keeps_the_rest_unattributed():
    costs = {
        "a": DomainCosts(trajectories=30, generate_s=10.0, sandbox_s=0.0, trained_tokens=100),
        "b": DomainCosts(trajectories=10, generate_s=30.0, sandbox_s=0.0, trained_tokens=300),
    }
    hours = {
        "generator": {"gpu_h": 4.0, "cpu_h": 8.0},
        "learner": {"gpu_h": 8.0, "cpu_h": 4.0},
        "store": {"gpu_h": 0.0, "cpu_h": 2.0},
        "sandbox": {"gpu_h": 0.0, "cpu_h": 5.0},  # no domain ran in a sandbox: not split
        "supervisor": {"gpu_h": 0.0, "cpu_h": 1.0},
    }
    domains, rest = apportion(hours, costs, ("cpu_h", "gpu_h"))
    assert domains["a"]["gpu_h"] == pytest.approx(4 * 0.25 + 8 * 0.25)
    assert domains["b"]["gpu_h"] == pytest.approx(4 * 0.75 + 8 * 0.75)
    assert domains["a"]["cpu_h"] == pytest.approx(8 * 0.25 + 4 * 0.25 + 2 * 0.75)
    assert domains["a"]["by_role"]["store"] == {"cpu_h": pytest.approx(1.5), "gpu_h": 0.0}
    assert rest == {"cpu_h": pytest.approx(6.0), "gpu_h": 0.0}
    for m in ("cpu_h", "gpu_h"):
        assert domains["a"][m] + domains["b"][m] + rest[m] == pytest.approx(sum(h[m] for h in hours.values()))


def test_local_roles_take_wall_time_from_heartbeats_up_to_now_for_live_processes():
    beats = [
        {"name": "learner-0", "started": 100.0, "time": 160.0},
        {"name": "learner-1", "started": 100.0, "time": 150.0},
        {"name": "gen-0", "started": 110.0, "time": 130.0},
        {"name": "broken"},
    ]
    roles = local_roles(beats, alive={"gen-0"}, now=200.0)
    assert list(roles) == ["learner", "generator"]
    assert roles["learner"] == {"components": ["learner-0", "learner-1"], "wall_h": pytest.approx(110 / 3600)}
    assert roles["generator"]["wall_h"] == pytest.approx(90 / 3600)


def _traj(domain: str, episode: int, gen_s: list[float], sandbox_s: float = 0.0):
    from hpcrl.rl.record.trajectory import SandboxOutcome, Step, Trajectory

    steps = [
        Step(
            policy_version=0,
            prompt_tokens=[1, 2, 3],
            action_tokens=[4, 5],
            action_logprobs=[-0.1, -0.2],
            loss_mask=[1, 1],
            observation_tokens=[6] * (k + 1),
            sandbox=SandboxOutcome("ok", duration_s=sandbox_s) if sandbox_s else SandboxOutcome(),
            generate_s=g,
            env_s=0.5,
        )
        for k, g in enumerate(gen_s)
    ]
    return Trajectory(
        run="r", domain=domain, task="t", episode=episode, generator="gen-0", steps=steps, final_reward=0.0
    )


def test_store_costs_sum_each_domains_steps_and_the_trained_trajectories(tmp_path):
    from hpcrl.core.config import StoreConfig
    from hpcrl.rl.store.writer import ShardWriter

    trajs = [
        _traj("arith/a", 0, [1.0]),
        _traj("code", 1, [2.0, 3.0], sandbox_s=0.25),
        _traj("arith/a", 2, [4.0]),
        _traj("code", 3, [1.0], sandbox_s=1.0),
    ]
    cfg = StoreConfig(flush_every=3, compression="none")
    with ShardWriter(tmp_path / "trajectories", "store-0", cfg) as w:
        for t in trajs:
            w.append(t)
    (tmp_path / "learner").mkdir()
    audit = [
        {"step": 1, "trained": [trajs[0].id, trajs[1].id], "dropped": []},
        {"resumed_step": 0},  # a restart redid step 1: the lineage counts each trajectory once
        {"step": 1, "trained": [trajs[0].id, trajs[1].id], "dropped": [trajs[2].id]},
    ]
    (tmp_path / "learner" / "trained.jsonl").write_text("".join(json.dumps(r) + "\n" for r in audit))
    costs, notes = store_costs(tmp_path)
    assert notes == []
    a, code = costs["arith/a"], costs["code"]
    assert (a.trajectories, a.steps, a.generate_s, a.env_s, a.sandbox_s) == (2, 2, 5.0, 1.0, 0.0)
    assert (code.trajectories, code.steps, code.generate_s, code.sandbox_s) == (2, 3, 6.0, 1.5)
    assert (a.trained, a.trained_tokens) == (1, trajs[0].n_tokens)
    assert (code.trained, code.trained_tokens) == (1, trajs[1].n_tokens)
    assert trajs[1].n_tokens == 13  # (3 prompt + 2 action + 1 observation) + (3 + 2 + 2)
    # The same sums read from the segments, where a shard has no index (finalized before them).
    for index in (tmp_path / "trajectories").glob("*/IDS.bin"):
        index.unlink()
    assert store_costs(tmp_path) == (costs, [])


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", "report", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})),
        timeout=120,
    )


def test_report_errors_are_one_line_and_exit_non_zero(tmp_path):
    out = cli(str(tmp_path / "nope"))
    assert out.returncode == 2 and "is not a run directory" in out.stderr and len(out.stderr.splitlines()) == 1
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.resolved.yaml").write_text("executor: slurm\n")
    (run / "jobs.json").write_text(json.dumps(JOBS))
    # An empty slurm.conf: sacct stops at once (a missing one makes it retry for a minute).
    (tmp_path / "slurm.conf").write_text("")
    out = cli(str(run), env={"SLURM_CONF": str(tmp_path / "slurm.conf")})
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("hpcrl report: error: sacct failed for run r: ") and len(out.stderr.splitlines()) == 1


def check_split(acct: dict, metrics: tuple[str, ...]) -> None:
    """Domains plus unattributed add up to the roles' hours."""
    for m in metrics:
        roles = sum(r[m] for r in acct["roles"].values())
        assert sum(d[m] for d in acct["domains"].values()) + acct["unattributed"][m] == pytest.approx(roles), m


@pytest.mark.slow
def test_report_of_a_local_run_says_sacct_is_not_available_and_splits_wall_time(tmp_path):
    from test_run import finish, hpcrl

    proc = hpcrl("run", "config.yaml", f"experiment.run_root={tmp_path}", "learner.max_steps=5", "--run-id", "loc")
    out = finish(proc, RUN_GUARD_S)
    assert proc.returncode == 0, out[-3000:]
    run_dir = tmp_path / "loc"
    rep = cli(str(run_dir), "--json")
    assert rep.returncode == 0, rep.stderr
    acct = json.loads(rep.stdout)
    assert (acct["executor"], acct["sacct"], acct["total"], acct["jobs"]) == ("local", False, None, [])
    assert "sacct figures are not available for a local run" in acct["notes"][0]
    assert {"store", "coordinator", "learner", "generator"} <= set(acct["roles"])
    assert all(r["wall_h"] > 0 and "gpu_h" not in r for r in acct["roles"].values())
    assert acct["domains"] and all(d["trajectories"] > 0 and d["generate_s"] > 0 for d in acct["domains"].values())
    assert sum(d["trained"] for d in acct["domains"].values()) > 0
    check_split(acct, ("wall_h",))
    text = cli(str(run_dir))
    assert text.returncode == 0 and "sacct figures are not available" in text.stdout
    heads = [line.split() for line in text.stdout.splitlines() if line.startswith(("role ", "domain "))]
    assert [h[-1] for h in heads] == ["wall-h", "wall-h"]  # no CPU-h or GPU-h column to fill with guesses


@pytest.mark.slurm
def test_report_of_a_dev_cluster_run_shows_its_jobs_hours_and_queue_waits(slurm_cluster, tmp_path):
    from hpcrl.jobs.supervise import queue_states

    from test_submit import SMALL, all_ids, hpcrl, status_json

    out = hpcrl(
        "submit", "config.yaml", *SMALL, f"experiment.run_root={tmp_path}", "learner.max_steps=30", "--run-id", "acct"
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "acct"

    def report() -> dict:
        rep = cli(str(run_dir), "--json")
        assert rep.returncode == 0, rep.stderr
        return json.loads(rep.stdout)

    try:
        wait_for(lambda: (status_json(run_dir)["step"] or 0) >= 1, 180, what="learner step 1")

        # Running jobs count up to now (asked while the run lives: 30 steps, not the moment after step 1).
        def counted() -> bool:
            running = [j for j in report()["jobs"] if j["running"]]
            return bool(running) and all(j["wall_s"] > 0 for j in running)

        wait_for(counted, 60, 0.2, "the report to show running jobs with their wall time so far")
        wait_for(lambda: not queue_states(all_ids(run_dir)), 240, what="the run's jobs to end by themselves")
    except BaseException:
        hpcrl("cancel", str(run_dir))  # leave no job behind
        raise
    # slurmdbd gets each end record a moment after the job ends: wait for every life to show ended.
    acct = wait_for(
        lambda: (a := report())["jobs"] and not any(j["running"] or j["pending"] for j in a["jobs"]) and a,
        60,
        what="sacct to show every job of the run ended",
    )
    assert acct["executor"] == "slurm" and acct["sacct"] and acct["missing_job_ids"] == []
    roles = acct["roles"]
    assert {"store", "coordinator", "learner", "generator", "supervisor"} <= set(roles)
    for name, r in roles.items():
        assert r["jobs"] >= 1 and r["wall_h"] > 0 and r["cpu_h"] > 0, (name, r)
        assert r["wait_max_s"] is not None and r["wait_max_s"] >= 0 and r["wait_mean_s"] >= 0, (name, r)
    assert roles["learner"]["gpu_h"] > 0 and roles["generator"]["gpu_h"] > 0
    assert roles["store"]["gpu_h"] == roles["coordinator"]["gpu_h"] == roles["supervisor"]["gpu_h"] == 0
    assert acct["total"]["jobs"] == len(acct["jobs"]) >= 5
    assert acct["domains"] and sum(d["gpu_h"] for d in acct["domains"].values()) > 0
    check_split(acct, ("cpu_h", "gpu_h"))
    text = cli(str(run_dir), "--jobs")
    assert text.returncode == 0, text.stderr
    assert "GPU-h" in text.stdout and "learner" in text.stdout and "unattributed" in text.stdout
    print(text.stdout)  # the example output the README shows
