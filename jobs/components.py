"""The run's job components: small picklable callables, the same on a laptop and on Slurm.

    ex = make_executor(cfg.executor, cfg.slurm, "learner", folder=run_dir / "submitit")   # jobs/launch.py
    job = ex.submit(LearnerComponent(run_dir, cfg.learner, cfg.policy, seed=cfg.experiment.seed))

`__init__` keeps only plain config (frozen dataclasses, paths, names), so submitit can pickle
the component into the job; `__call__` builds sockets, models and threads inside the job. Each
component writes `procs/<name>.json` (host, pid) into the run directory, and SIGTERM/SIGINT
(submitit's cancel) make it finish cleanly: the store flushes, the learner checkpoints,
generators wait for their trajectories to be acknowledged. SIGUSR2, which Slurm sends
`slurm.<role>.signal_delay_s` ahead of the time limit, does the same and then requeues the job
(`finish_job`): it runs again under the same job id and resumes from the run directory
(checkpoints, store cursor, coordinator state). They stay `submitit.helpers.Checkpointable`,
so a USR2 that arrives before the component installed its own handler still requeues the job.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import psutil
import submitit

from hpcrl.core.files import atomic_write_json
from hpcrl.core.liveness import install, read_heartbeats
from hpcrl.core.metrics import provide
from hpcrl.core.metrics import serve as serve_metrics
from hpcrl.jobs.boot import take_early
from hpcrl.jobs.rundir import private_umask
from hpcrl.rl.coordinator.coordinator import Coordinator
from hpcrl.slurm.command import run_slurm
from hpcrl.slurm.queries import gpu_share_of_job

# hpcrl imports inside functions here would load h5py, msgpack, numpy, torch, transformers, zmq for
# every importer of this module (start-up speed).

__all__ = [
    "StoreComponent",
    "SandboxComponent",
    "CoordinatorComponent",
    "LearnerComponent",
    "GeneratorComponent",
    "start_component",
    "finish_job",
]

log = logging.getLogger("hpcrl.components")


class _Stop(threading.Event):
    """Set by SIGTERM/SIGINT (cancel, requeue) and by SIGUSR2, which Slurm sends `signal_delay_s`
    ahead of the time limit; `requeue` tells the component to requeue its job once it has drained."""

    requeue = False
    signalled_at: float | None = None  # time.time() of the first SIGTERM/SIGINT
    _setting = False

    def set(self) -> None:
        # A signal handler calls this, and another signal (Ctrl-C reaches every process of the
        # terminal's group as the runner's SIGTERM arrives) may run a second handler inside the
        # first one's set(), which would wait forever for the lock the first one holds.
        if self._setting:
            return
        self._setting = True
        try:
            super().set()
        finally:
            self._setting = False


LAUNCHER_ENV = "HPCRL_LAUNCHER"  # "pid:create_time" of the `hpcrl run` that owns these local jobs


def _watch_launcher(stop: _Stop, name: str) -> None:
    """Local jobs only: when the `hpcrl run` that started them is gone (kill -9, a crash), drain
    and stop as on SIGTERM instead of training on as orphans. On Slurm the scheduler owns jobs."""
    spec = os.environ.get(LAUNCHER_ENV)
    if not spec or os.environ.get("SLURM_JOB_ID"):
        return
    pid, started = spec.split(":")

    def alive() -> bool:
        # A killed launcher stays a zombie until its parent reaps it (a script or test that
        # started `hpcrl run` and waits for something else first): gone all the same. Taken for
        # alive, it kept a store writer serving on, orphaned, past `hpcrl resume`'s wait.
        try:
            proc = psutil.Process(int(pid))
            return abs(proc.create_time() - float(started)) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while not stop.wait(1.0):
            if not alive():
                log.warning("%s: the hpcrl run that launched this job (pid %s) is gone; stopping", name, pid)
                stop.set()
                return

    threading.Thread(target=watch, name="hpcrl-launcher-watch", daemon=True).start()


def start_component(run_dir: Path, name: str, role: str, metrics_cfg=None) -> _Stop:
    """Logging, one torch thread per process unless told otherwise, signals -> stop event, procs
    file, heartbeat, and the Prometheus endpoint (`metrics_cfg`: the run's `metrics:` section)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s", force=True)
    private_umask(run_dir)  # what this job writes is the owner's alone (the group reads it if the run is shared)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # components never download
    stop = _Stop()
    if threading.current_thread() is threading.main_thread():

        def on_signal(*_):
            if stop.signalled_at is None:
                stop.signalled_at = time.time()  # for the hand-back's timing line; no logging in a handler
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

        def time_limit(*_):
            # Replaces submitit's USR2 handler, which requeues at once and exits from inside the
            # handler: here the component first drains (the learner checkpoints, the store flushes
            # and finalizes its shard, generators hand back their episodes), then `_finish` requeues.
            log.warning("%s: SIGUSR2 (time limit ahead): draining, then requeueing the job", name)
            stop.requeue = True
            stop.set()

        def window_job(*_):
            # A rollout job (jobs/rollout.py) ends itself by the EndTime it read at start. Slurm
            # sends this warning up to PERIODIC_TIMEOUT (30 s) earlier than signal_delay_s asks,
            # which in a one-minute backfill job is half its window: it is not a reason to stop.
            log.info("%s: SIGUSR2 ignored: the window's deadline ends this job", name)

        handler = window_job if role == "rollout" else time_limit
        signal.signal(signal.SIGUSR2, handler)
        if signal.SIGUSR2 in take_early():  # it came while the job was still importing and unpickling
            handler()
    _watch_launcher(stop, name)
    if role != "supervisor":
        _watch_supervisor(run_dir, stop, name)
    procs = run_dir / "procs"
    procs.mkdir(exist_ok=True)
    atomic_write_json(
        procs / f"{name}.json",
        {"name": name, "role": role, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()},
    )
    install(run_dir, name)  # heartbeats/<name>.json; the main loop's beat() keeps it fresh
    if metrics_cfg is not None:
        serve_metrics(run_dir, name, metrics_cfg)
    return stop


def finish_job(stop: _Stop, result):
    """Requeue the job after a SIGUSR2 drain (rank 0 only; the same job id runs again later)."""
    job = os.environ.get("SLURM_JOB_ID")
    if stop.requeue and job and os.environ.get("SLURM_PROCID", "0") == "0":
        if os.environ.get("SLURM_ARRAY_TASK_ID"):
            job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        out = run_slurm(["scontrol", "requeue", job], check=False)
        if out.returncode:
            log.error("could not requeue job %s (%s): the supervisor will resubmit it", job, out.stderr.strip())
        else:
            log.warning("drained; job %s requeued", job)
    return result


# A supervisor whose heartbeat is this old may just be gone (killed, its node failed): ask
# squeue through `hpcrl supervise`, which replaces it only if it left the queue (or is hung).
SUPERVISOR_QUIET_S = 60.0


def _watch_supervisor(run_dir: Path, stop: _Stop, name: str) -> None:
    """Slurm runs, every component: when the supervisor's heartbeat is older than
    SUPERVISOR_QUIET_S (or supervise.hang_s if shorter), run `hpcrl supervise RUN --stale-s
    hang_s` (jobs/resume.py): a new supervisor if the recorded one left the queue, or is RUNNING
    with a heartbeat older than hang_s. Every component watches, not the coordinator alone: with
    the supervisor and the coordinator both dead, nobody else would bring either back. The run
    lock makes the watchers' calls one at a time, and each finds the one before it done."""
    if not os.environ.get("SLURM_JOB_ID") or not (run_dir / "jobs.json").exists():
        return
    try:
        from hpcrl.core.config import RESOLVED_NAME, load_config

        hang_s = load_config(run_dir / RESOLVED_NAME).supervise.hang_s
    except Exception as exc:  # an unreadable config must not stop the component itself
        log.warning("%s: not watching the supervisor: %s", name, exc)
        return
    if not hang_s:
        return
    quiet_s = min(SUPERVISOR_QUIET_S, hang_s)
    started = time.time()

    def watch() -> None:
        import subprocess
        import sys

        while not stop.wait(min(15.0, quiet_s / 2)):
            last = max([b["time"] for b in read_heartbeats(run_dir, "supervisor")], default=started)
            if time.time() - max(last, started) < quiet_s:
                continue
            argv = [sys.executable, "-m", "hpcrl.jobs.cli", "supervise", str(run_dir), "--stale-s", str(hang_s)]
            try:
                out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as exc:  # squeue is busy: look again next time
                log.warning("%s: hpcrl supervise did not answer: %s", name, exc)
                continue
            said = (out.stdout + out.stderr).strip()
            (log.warning if out.returncode or said.startswith("submitted") else log.info)("%s: %s", name, said)

    threading.Thread(target=watch, name="hpcrl-supervisor-watch", daemon=True).start()


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("HPCRL_TORCH_THREADS", n)))


class StoreComponent(submitit.helpers.Checkpointable):
    """The trajectory store writer (hpcrl.rl.store.writer behind hpcrl.rl.store.stream)."""

    def __init__(self, run_dir, store_cfg, name: str = "store-0"):
        self.run_dir, self.cfg, self.name = Path(run_dir), store_cfg, name

    def __call__(self) -> str:
        from hpcrl.core.transport import Node
        from hpcrl.rl.store.stream import TrajectoryReceiver
        from hpcrl.rl.store.writer import ShardWriter

        stop = start_component(self.run_dir, self.name, "store", getattr(self, "metrics", None))
        writer = ShardWriter(self.run_dir / "trajectories", self.name, self.cfg)
        with Node(self.run_dir, self.name) as node:
            receiver = TrajectoryReceiver(node, "store", writer)
            provide(
                lambda: {
                    "store_rows_total": writer.total_rows,
                    "store_received_total": receiver.received,
                    "store_duplicates_total": receiver.duplicates + writer.duplicates,
                    "store_rejected_total": receiver.dropped,
                    "store_free_bytes": shutil.disk_usage(self.run_dir / "trajectories").free,
                }
            )
            receiver.serve(stop)  # flushes and finalizes the shard at the end
        return finish_job(stop, "stopped")


class SandboxComponent(submitit.helpers.Checkpointable):
    """A sandbox server (hpcrl.sandbox.server) with `slots` isolated executions at a time."""

    def __init__(self, run_dir, sandbox_cfg, name: str = "sandbox-0"):
        self.run_dir, self.cfg, self.name = Path(run_dir), sandbox_cfg, name

    def __call__(self) -> int:
        from hpcrl.sandbox.server import serve

        stop = start_component(self.run_dir, self.name, "sandbox", getattr(self, "metrics", None))
        return finish_job(
            stop, serve(self.cfg, run_dir=str(self.run_dir), slots=self.cfg.slots, name=self.name, stop=stop)
        )


class CoordinatorComponent(submitit.helpers.Checkpointable):
    """The coordinator (hpcrl.rl.coordinator.coordinator)."""

    def __init__(self, run_dir, coordinator_cfg, domains, learner_cfg, seed: int, sizes=None):
        self.run_dir, self.cfg, self.seed = Path(run_dir), coordinator_cfg, seed
        self.weights = {d.name: d.weight for d in domains}
        self.sizes = dict(sizes or {})  # {domain: number of tasks} of domains with a finite list
        self.group_size, self.batch_groups = learner_cfg.group_size, learner_cfg.batch_groups
        self.max_staleness, self.max_steps = learner_cfg.max_staleness, learner_cfg.max_steps

    def __call__(self) -> str:
        from hpcrl.core.transport import Node

        stop = start_component(self.run_dir, "coordinator", "coordinator", getattr(self, "metrics", None))
        coord = Coordinator(
            self.run_dir,
            self.weights,
            self.group_size,
            self.batch_groups,
            self.max_staleness,
            self.max_steps,
            self.seed,
            self.cfg,
            getattr(self, "sizes", None),  # a component pickled by an older hpcrl has none
        )
        provide(coord.metrics)
        with Node(self.run_dir, "coordinator") as node:
            coord.serve(node, stop)
        return finish_job(stop, "stopped")


class LearnerComponent(submitit.helpers.Checkpointable):
    """The DeepSpeed ZeRO-3 learner; one task per rank (slurm.learner.tasks_per_node x nodes)."""

    def __init__(self, run_dir, learner_cfg, policy_cfg, seed: int, torch_threads: int = 1):
        self.run_dir, self.cfg, self.policy, self.seed = Path(run_dir), learner_cfg, policy_cfg, seed
        self.torch_threads = torch_threads

    def __call__(self) -> int:
        from hpcrl.rl.learner.service import run_learner

        try:
            # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from submitit (local or Slurm).
            dist = submitit.helpers.TorchDistributedEnvironment()
            if dist.world_size == dist.local_world_size:
                # All ranks on this node: loopback always works, while Slurm's node name may not
                # resolve (the dev cluster's emulated nodes n1/n2 are no host names).
                dist.master_addr = "127.0.0.1"
            dist.export(set_cuda_visible_devices=False)
        except RuntimeError:
            pass  # not inside a submitit job (run by hand): rl/common/distenv.py finds the ranks itself
        rank = os.environ.get("RANK", "0")
        stop = start_component(self.run_dir, f"learner-{rank}", "learner", getattr(self, "metrics", None))
        _threads(self.torch_threads)
        step = run_learner(self.run_dir, self.cfg, self.policy, self.seed, stop)
        if step >= self.cfg.max_steps:
            stop.requeue = False  # done: a signal that came with the last step must not start it again
        return finish_job(stop, step)


def exit_now() -> None:
    """End the process at once, logs flushed: nothing is left to save (no interpreter teardown)."""
    logging.shutdown()
    os._exit(0)


def _leave_before_leasing(signum, frame) -> None:
    log.warning("SIGTERM while loading, before the first lease: nothing to hand back; exiting now")
    exit_now()


class GeneratorComponent(submitit.helpers.Checkpointable):
    # A subclass (jobs/rollout.py RolloutComponent) runs the same generator under its own role,
    # with a source that stops leasing, and a stop condition, of its own.
    role = "generator"

    def wrap_source(self, source):
        return source

    def should_end(self) -> bool:
        return False

    def __init__(
        self,
        run_dir,
        name: str,
        generator_cfg,
        policy_cfg,
        domains,
        sandbox_services,
        seed: int,
        search_path=(),
        sandbox_slots: int = 0,
        torch_threads: int = 1,
    ):
        self.run_dir, self.name, self.cfg, self.policy = Path(run_dir), name, generator_cfg, policy_cfg
        self.domains, self.sandbox_services, self.seed = tuple(domains), tuple(sandbox_services), seed
        self.search_path, self.sandbox_slots, self.torch_threads = tuple(search_path), sandbox_slots, torch_threads

    def __call__(self) -> dict:
        from hpcrl.rl.domains import load_domains
        from hpcrl.rl.model.policy import cap_gpu_memory
        from hpcrl.rl.rollout.service import serve_generator

        stop = start_component(self.run_dir, self.name, self.role, getattr(self, "metrics", None))
        # A rollout job preempted (or scancelled) while it is still loading holds no lease and has
        # stored nothing: it leaves at once rather than after loading (13-16 s measured at load
        # ~5), which the job that preempted it would wait for. Its loop takes SIGTERM over below.
        early = self.role == "rollout" and threading.current_thread() is threading.main_thread()
        on_term = signal.signal(signal.SIGTERM, _leave_before_leasing) if early else None
        _threads(self.torch_threads)
        domains = load_domains(self.domains, self.search_path)
        share = gpu_share_of_job()  # on GPU shards: this job's part of the GPU, before anything is allocated
        if share is not None and cap_gpu_memory(share):
            log.info("%s: GPU memory capped at %.0f%% (its GPU shards)", self.name, 100 * share)
        result = serve_generator(
            self.run_dir,
            self.name,
            self.cfg,
            self.policy,
            domains,
            self.sandbox_services,
            seed=self.seed,
            sandbox_slots=self.sandbox_slots,
            stop=stop,
            signalled_at=lambda: stop.signalled_at,
            wrap_source=self.wrap_source,
            should_end=self.should_end,
            on_ready=(lambda: signal.signal(signal.SIGTERM, on_term)) if early else None,
        )
        if self.role == "rollout":
            stop.requeue = False  # its window is over, whatever the signal: not a job to run again
        return finish_job(stop, result)
