"""What the cluster looks like now: partitions, nodes, pending jobs, job states, start estimates.

Each function runs one or two Slurm commands through `run_slurm` and hands the text to a pure
parser in `hpcrl.slurm.parse`; results are frozen dataclasses. The scheduler and `hpcrl
status` build on these.

    from hpcrl.slurm import queries
    for p in queries.partitions():
        print(p.name, p.idle_cpus, p.idle_gpus)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import os
from dataclasses import dataclass

from hpcrl.slurm import parse
from hpcrl.slurm.command import SlurmCommandError, run_slurm

# Node states in which Slurm will not start new work.
_UNUSABLE = (
    "DOWN",
    "DRAIN",
    "FAIL",
    "FUTURE",
    "MAINT",
    "NOT_RESPONDING",
    "POWER",
    "REBOOT",
    "RESERVED",
    "INVAL",
    "UNKNOWN",
)


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # e.g. IDLE, MIXED, ALLOCATED, DRAINED, IDLE+DRAIN
    partitions: tuple[str, ...]
    cpus_total: int
    cpus_alloc: int
    gpus_total: int
    gpus_alloc: int
    real_memory_mb: int
    alloc_memory_mb: int
    shards_total: int = 0  # GPU shards (GRES shard) over all its GPUs

    @functools.cached_property  # asked for every GPU and CPU count of every node in a decision
    def usable(self) -> bool:
        return not any(flag in self.state.upper() for flag in _UNUSABLE)

    @property
    def cpus_idle(self) -> int:
        return max(self.cpus_total - self.cpus_alloc, 0) if self.usable else 0

    @property
    def gpus_idle(self) -> int:
        return max(self.gpus_total - self.gpus_alloc, 0) if self.usable else 0


@dataclass(frozen=True)
class PartitionState:
    name: str
    up: bool
    nodes: tuple[str, ...]
    max_time_s: int | None  # None: unlimited
    cpus_total: int
    cpus_alloc: int
    cpus_idle: int  # on nodes that can take work
    gpus_total: int
    gpus_alloc: int
    gpus_idle: int
    priority_tier: int = 1  # a higher tier's jobs may preempt this one's (PreemptType=preempt/partition_prio)
    preempt_mode: str = "OFF"  # what preemption does to this partition's jobs: OFF, CANCEL, REQUEUE, SUSPEND,GANG
    grace_time_s: int = 0  # between a preempted job's SIGTERM and its SIGKILL


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    partition: str
    user: str
    name: str
    nodes: int
    cpus: int
    gpus: int
    time_limit_s: int | None
    expected_start: dt.datetime | None  # Slurm's backfill estimate; None when it has none yet
    reason: str
    priority: int
    # Nodes Slurm's backfill has planned it on (squeue %Y), empty when it has none yet: a job that
    # cannot start now holds these from expected_start, and backfill keeps lower ones off them.
    sched_nodes: tuple[str, ...] = ()
    mem_mb: int = 0  # memory it asks per node (squeue %m; 0: not given)


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    partition: str
    name: str
    nodes: tuple[str, ...]
    gpus: int  # over all its nodes
    end: dt.datetime | None  # when Slurm plans it to end (start + time limit); None: no limit
    cpus: int = 0  # over all its nodes
    mem_mb: int = 0  # per node (squeue %m)


@dataclass(frozen=True)
class JobRecord:
    """One finished-or-running job as accounting (sacct) knows it."""

    job_id: str
    name: str
    partition: str
    state: str
    cancelled_by: str | None
    exit_code: int
    signal: int
    elapsed_s: int | None
    nodes: tuple[str, ...]
    start: dt.datetime | None
    end: dt.datetime | None
    submit: dt.datetime | None = None  # a requeued life's Submit is when it was requeued
    cpus: int = 0  # AllocCPUS: over all its nodes; 0 until it starts
    gpus: int = 0  # gres/gpu of AllocTRES, over all its nodes
    mem_mb: int = 0  # mem of AllocTRES, over all its nodes; 0 until it starts


def nodes(name: str | None = None) -> list[NodeState]:
    """Every node of the cluster (or the one named)."""
    out = run_slurm(["scontrol", "-o", "show", "node", *([name] if name else [])])
    result = []
    for rec in parse.parse_scontrol_records(out.stdout):
        gpus_total = parse.gpus_in_tres(rec.get("CfgTRES", "")) or parse.gpus_in_gres(rec.get("Gres", ""))
        shards = parse.gpus_in_tres(rec.get("CfgTRES", ""), "shard") or parse.gpus_in_gres(rec.get("Gres", ""), "shard")
        result.append(
            NodeState(
                name=rec["NodeName"],
                state=rec.get("State", "UNKNOWN"),
                partitions=tuple(p for p in rec.get("Partitions", "").split(",") if p),
                cpus_total=int(rec.get("CPUTot", 0)),
                cpus_alloc=int(rec.get("CPUAlloc", 0)),
                gpus_total=gpus_total,
                gpus_alloc=parse.gpus_in_tres(rec.get("AllocTRES", "")),
                real_memory_mb=int(rec.get("RealMemory", 0)),
                alloc_memory_mb=int(rec.get("AllocMem", 0) or 0),
                shards_total=shards,
            )
        )
    return result


def gpu_share_of_job(environ=None) -> float | None:
    """Inside a job holding GPU shards (`--gres=shard:N`): the part of one GPU they are, from
    SLURM_SHARDS_ON_NODE and this node's GRES (parse.gpu_share); None in any other process."""
    env = os.environ if environ is None else environ
    shards, node = int(env.get("SLURM_SHARDS_ON_NODE") or 0), env.get("SLURMD_NODENAME")
    if shards <= 0 or not node:
        return None
    here = nodes(node)
    return parse.gpu_share(shards, here[0].gpus_total, here[0].shards_total) if here else None


def partitions(node_states: list[NodeState] | None = None) -> list[PartitionState]:
    """Every partition with total, allocated and idle CPUs and GPUs (GRES) on its nodes
    (`node_states`: the nodes when the caller has just read them)."""
    by_name = {n.name: n for n in (nodes() if node_states is None else node_states)}
    out = run_slurm(["scontrol", "-o", "show", "partition"])
    result = []
    for rec in parse.parse_scontrol_records(out.stdout):
        members = [by_name[h] for h in parse.expand_hostlist(rec.get("Nodes", "")) if h in by_name]
        result.append(
            PartitionState(
                name=rec["PartitionName"],
                up=rec.get("State", "") == "UP",
                nodes=tuple(n.name for n in members),
                max_time_s=parse.parse_duration_s(rec.get("MaxTime", "UNLIMITED")),
                cpus_total=sum(n.cpus_total for n in members),
                cpus_alloc=sum(n.cpus_alloc for n in members),
                cpus_idle=sum(n.cpus_idle for n in members),
                gpus_total=sum(n.gpus_total for n in members),
                gpus_alloc=sum(n.gpus_alloc for n in members),
                gpus_idle=sum(n.gpus_idle for n in members),
                priority_tier=int(rec.get("PriorityTier", 1) or 1),
                preempt_mode=rec.get("PreemptMode", "OFF").upper(),
                grace_time_s=int(rec.get("GraceTime", 0) or 0),
            )
        )
    return result


_PENDING_FIELDS = (
    "job_id",
    "partition",
    "user",
    "nodes",
    "cpus",
    "time_limit",
    "start",
    "priority",
    "tres",
    "reason",
    "sched_nodes",
    "name",
    "mem",
)


def pending_jobs(partition: str | None = None) -> list[PendingJob]:
    """Pending jobs with Slurm's expected start times (`squeue --start`), earliest first."""
    argv = ["squeue", "--start", "-h", "-t", "PENDING", "-o", "%i|%P|%u|%D|%C|%l|%S|%Q|%b|%r|%Y|%j|%m"]
    if partition:
        argv += ["-p", partition]
    rows = parse.parse_delimited(run_slurm(argv).stdout, _PENDING_FIELDS)
    jobs = [
        PendingJob(
            job_id=r["job_id"],
            partition=r["partition"],
            user=r["user"],
            name=r["name"],
            nodes=int(r["nodes"]),
            cpus=int(r["cpus"]),
            gpus=parse.gpus_in_gres(r["tres"]) * int(r["nodes"]),
            time_limit_s=parse.parse_duration_s(r["time_limit"]),
            expected_start=parse.parse_timestamp(r["start"]),
            reason=r["reason"],
            priority=int(r["priority"] or 0),
            sched_nodes=tuple(parse.expand_hostlist(r["sched_nodes"])),
            mem_mb=round(parse.parse_mem_mb(r["mem"]) or 0),
        )
        for r in rows
    ]
    far = dt.datetime.max
    return sorted(jobs, key=lambda j: (j.expected_start or far, j.job_id))


def running_jobs() -> list[RunningJob]:
    """Running jobs of every partition with their nodes and planned ends (`squeue -t RUNNING`)."""
    argv = ["squeue", "-h", "-t", "RUNNING", "-o", "%i|%P|%D|%b|%N|%e|%j|%C|%m"]
    fields = ("job_id", "partition", "nodes", "tres", "nodelist", "end", "name", "cpus", "mem")
    return [
        RunningJob(
            job_id=r["job_id"],
            partition=r["partition"],
            name=r["name"],
            nodes=tuple(parse.expand_hostlist(r["nodelist"])),
            gpus=parse.gpus_in_gres(r["tres"]) * int(r["nodes"]),
            end=None if r["end"] == "NONE" else parse.parse_timestamp(r["end"]),  # NONE: no time limit
            cpus=int(r["cpus"] or 0),
            mem_mb=round(parse.parse_mem_mb(r["mem"]) or 0),
        )
        for r in parse.parse_delimited(run_slurm(argv).stdout, fields)
    ]


def expected_start(sbatch_args: list[str], script: str | None = None) -> parse.TestOnlyEstimate:
    """When would a job with these sbatch options (and script) start? Nothing is queued.

    `sbatch --test-only` answers conservatively and spends a job id on each test.
    """
    argv = ["sbatch", "--test-only", *sbatch_args, script or "--wrap=true"]
    out = run_slurm(argv)
    return parse.parse_test_only(out.stderr + "\n" + out.stdout)


SACCT_FIELDS = (
    "job_id",
    "partition",
    "state",
    "exit_code",
    "elapsed",
    "submit",
    "start",
    "end",
    "alloc_cpus",
    "alloc_tres",
    "nodelist",
    "name",
)
_SACCT_FORMAT = "JobID,Partition,State,ExitCode,Elapsed,Submit,Start,End,AllocCPUS,AllocTRES,NodeList,JobName"


def record_from_row(row: dict[str, str]) -> JobRecord:
    """One row of `parse_delimited(sacct output, SACCT_FIELDS)` as a JobRecord (pure)."""
    state, by = parse.split_state(row["state"])
    code, sig = parse.parse_exit_code(row["exit_code"])
    return JobRecord(
        job_id=row["job_id"],
        name=row["name"],
        partition=row["partition"],
        state=state,
        cancelled_by=by,
        exit_code=code,
        signal=sig,
        elapsed_s=parse.parse_duration_s(row["elapsed"]),
        nodes=tuple(parse.expand_hostlist(row["nodelist"]) if row["nodelist"] != "None assigned" else ()),
        start=parse.parse_timestamp(row["start"]),
        end=parse.parse_timestamp(row["end"]),
        submit=parse.parse_timestamp(row["submit"]),
        cpus=int(row["alloc_cpus"] or 0),
        gpus=parse.gpus_in_tres(row["alloc_tres"]),
        mem_mb=parse.mem_mb_in_tres(row["alloc_tres"]),
    )


def _sacct(job_ids, *flags: str) -> list[JobRecord]:
    argv = ["sacct", "-X", *flags, "-n", "-P", "-j", ",".join(job_ids), "-o", _SACCT_FORMAT]
    # A user's SLURM_TIME_FORMAT (relative, or a strftime of their own) would change the
    # timestamps parse_timestamp reads; "standard" is ISO 8601 whatever their shell sets.
    out = run_slurm(argv, env={"SLURM_TIME_FORMAT": "standard"})
    return [record_from_row(r) for r in parse.parse_delimited(out.stdout, SACCT_FIELDS)]


def job_records(job_ids: list[str] | tuple[str, ...]) -> dict[str, JobRecord]:
    """Accounting records (`sacct -X`) by job id, a requeued job's latest life. Jobs accounting
    has not seen yet are absent."""
    if not job_ids:
        return {}
    return {r.job_id: r for r in _sacct(job_ids)}


def peak_rss_mb(job_ids: list[str] | tuple[str, ...]) -> dict[str, float]:
    """The largest resident memory any step of each job reached, MB, as accounting sampled it
    (every JobAcctGatherFrequency seconds: a shorter peak can be missed). Jobs without are absent."""
    if not job_ids:
        return {}
    out = run_slurm(["sacct", "-n", "-P", "-j", ",".join(job_ids), "-o", "JobID,MaxRSS"])
    return parse.peak_rss_by_job(out.stdout)


def job_history(job_ids: list[str] | tuple[str, ...]) -> list[JobRecord]:
    """Every life of these jobs (`sacct -X -D`: a requeued job's earlier lives too), in sacct's
    order, for the ids asked only. sacct lists a job array whose tasks have not started as one
    row `123_[0-3]`, which `-j 123_0` does not find: array tasks are asked by their array's id
    too, and such a row becomes one record per task."""
    if not job_ids:
        return []
    arrays = {j.split("_", 1)[0] for j in job_ids if "_" in j}
    return select_lives(_sacct(sorted(set(job_ids) | arrays), "-D"), job_ids)


def select_lives(records: list[JobRecord], job_ids: list[str] | tuple[str, ...]) -> list[JobRecord]:
    """The records of `job_ids` among those sacct gave (pure): a pending array's `123_[0-3]` row
    becomes one record per asked task, other tasks and jobs are left out."""
    wanted = set(job_ids)
    out = []
    for rec in records:
        for jid in parse.expand_array_ids(rec.job_id):
            if jid in wanted:
                out.append(rec if jid == rec.job_id else dataclasses.replace(rec, job_id=jid))
    return out


def show_job(job_id: str) -> dict[str, str] | None:
    """`scontrol show job` as a dict; None once the controller has forgotten the job."""
    out = run_slurm(["scontrol", "-o", "show", "job", str(job_id)], check=False)
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return None

        raise SlurmCommandError(list(out.argv), out.returncode, out.stderr)
    records = parse.parse_scontrol_records(out.stdout)
    return records[0] if records else None


def queue(user: str | None = None, job_ids: list[str] | tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Jobs the controller holds now (`squeue`), as parsed rows with state, node and times."""
    argv = ["squeue", "-h", "-o", "%i|%P|%T|%M|%L|%D|%R|%j"]
    if user:
        argv += ["-u", user]
    if job_ids:
        argv += ["-j", ",".join(job_ids)]
    out = run_slurm(argv, check=not job_ids)
    if out.returncode != 0:  # squeue -j of jobs that all left the queue exits 1
        return []
    return parse.parse_delimited(
        out.stdout, ("job_id", "partition", "state", "elapsed", "time_left", "nodes", "reason_or_nodelist", "name")
    )


def partition_jobs(partitions: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(job id, state) of every pending, running or completing job in these partitions, sorted:
    one cheap squeue whose change says that a job there started, ended or was queued."""
    argv = ["squeue", "-h", "-r", "-t", "PENDING,RUNNING,COMPLETING", "-o", "%i|%T", "-p", ",".join(partitions)]
    rows = parse.parse_delimited(run_slurm(argv).stdout, ("job_id", "state"))
    return tuple(sorted((r["job_id"], r["state"]) for r in rows))


def cancel(job_ids: list[str] | tuple[str, ...], signal: str | None = None) -> None:
    """`scancel` these jobs (all of an array's tasks when given the array id)."""
    if not job_ids:
        return
    argv = ["scancel"]
    if signal:
        argv += ["--signal", signal]
    run_slurm(argv + list(job_ids))


def scheduler_parameters() -> dict[str, str]:
    """The controller's SchedulerParameters (bf_interval, bf_resolution, ...); Slurm's defaults
    apply to those absent (bf_interval 30 s, bf_resolution 60 s)."""
    return parse.parse_scheduler_parameters(run_slurm(["scontrol", "show", "config"]).stdout)


def show_config() -> dict[str, str]:
    """The controller's configuration (`scontrol show config`), {key: value}: PreemptType, KillWait, ..."""
    return parse.parse_show_config(run_slurm(["scontrol", "show", "config"]).stdout)


def job_states(job_ids: list[str] | tuple[str, ...]) -> dict[str, str]:
    """{job id: squeue state} of these jobs still in the queue. Unlike `queue` it raises when squeue
    fails for another reason than "every id has left the queue": a controller hiccup must not
    look like every job ended."""
    if not job_ids:
        return {}
    out = run_slurm(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(job_ids)], check=False)
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return {}

        raise SlurmCommandError(list(out.argv), out.returncode, out.stderr)
    return {r["job_id"]: r["state"] for r in parse.parse_delimited(out.stdout, ("job_id", "state"))}
