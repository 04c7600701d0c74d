"""Start, watch, heal and finish one run's jobs through submitit (`hpcrl run` is a thin shell over this).

    run = RunJobs(cfg, run_dir, search_path=[config_folder])
    run.start()                                   # store, coordinator, sandboxes?, learner, generators
    ok = run.wait(on_status=print_progress)       # until the learner reached max_steps
    run.shutdown()                                # generators stop, services flush and exit

Every role is submitted with `make_executor` (local: submitit's LocalExecutor, the same
component classes as on Slurm). A job that ends before the run is over is submitted again, up
to `max_restarts` times per role: components resume from the run directory (the learner from
its checkpoint, the store writer by recovering its shard, the coordinator from its state file).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from hpcrl.jobs.config import Config
from hpcrl.jobs.launch import make_executor

__all__ = ["RunJobs", "RunFailed", "pids"]

log = logging.getLogger("hpcrl.run")


class RunFailed(RuntimeError):
    """A role kept failing; the message names it and points at its log."""


@dataclass
class _Role:
    name: str  # store, coordinator, sandbox-0, learner, gen-0, ...
    slurm_role: str
    component: Any
    job: Any = None
    restarts: int = 0
    history: list = field(default_factory=list)


class RunJobs:
    def __init__(self, cfg: Config, run_dir: str | Path, search_path: Sequence[str] = (), max_restarts: int = 3):
        from hpcrl.jobs.components import (
            CoordinatorComponent,
            GeneratorComponent,
            LearnerComponent,
            SandboxComponent,
            StoreComponent,
        )
        from hpcrl.rl.domains import load_domains

        self.cfg, self.run_dir, self.max_restarts = cfg, Path(run_dir), max_restarts
        domains = load_domains(cfg.domains, search_path)  # fail here, before any job starts
        needs_sandbox = any(d.needs_executor for d in domains.values())
        seed = cfg.experiment.seed
        sandboxes = [f"sandbox-{i}" for i in range(cfg.sandbox.servers)] if needs_sandbox else []
        self.roles: list[_Role] = [
            _Role("store", "coordinator", StoreComponent(self.run_dir, cfg.store)),
            _Role("coordinator", "coordinator",
                  CoordinatorComponent(self.run_dir, cfg.coordinator, cfg.domains, cfg.learner, seed)),
            *[_Role(s, "sandbox", SandboxComponent(self.run_dir, cfg.sandbox, s)) for s in sandboxes],
            _Role("learner", "learner", LearnerComponent(self.run_dir, cfg.learner, cfg.policy, seed)),
            *[_Role(f"gen-{i}", "generator",
                    GeneratorComponent(self.run_dir, f"gen-{i}", cfg.generators, cfg.policy, cfg.domains, sandboxes,
                                       seed + 1000 * (i + 1), search_path, cfg.sandbox.slots * len(sandboxes)))
              for i in range(cfg.generators.count)],
        ]
        self.finished = False
        self._ended: set[str] = set()

    def role(self, name: str) -> _Role:
        return next(r for r in self.roles if r.name == name)

    def _submit(self, role: _Role) -> None:
        ex = make_executor(self.cfg.executor, self.cfg.slurm, role.slurm_role, self.run_dir / "submitit",
                           job_name=f"hpcrl-{role.name}")
        role.job = ex.submit(role.component)
        role.history.append(role.job.job_id)
        log.info("submitted %s as job %s", role.name, role.job.job_id)

    def start(self) -> None:
        for role in self.roles:
            self._submit(role)

    def _check(self) -> None:
        """Resubmit roles whose job ended while the run goes on; raise when one keeps failing."""
        for role in self.roles:
            if not role.job.done():
                continue
            if role.name == "learner":
                try:
                    step = role.job.result()
                except Exception as exc:  # noqa: BLE001 - the job's failure, reported below
                    step, err = None, exc
                if step is not None and step >= self.cfg.learner.max_steps:
                    self.finished = True
                    continue
                if step is not None:
                    err = RuntimeError(f"learner stopped at step {step} of {self.cfg.learner.max_steps}")
            elif self.finished or role.name in self._ended:
                continue
            else:
                try:
                    result = role.job.result()
                    if isinstance(result, dict) and result.get("stopped_by") == "coordinator":
                        self._ended.add(role.name)  # told the run is over; the learner is finishing up
                        continue
                    err = RuntimeError("exited before the run was over")
                except Exception as exc:  # noqa: BLE001
                    err = exc
            if role.restarts >= self.max_restarts:
                raise RunFailed(f"{role.name} failed {role.restarts + 1} times; last: {str(err)[-800:]} "
                                f"(logs: {self.run_dir / 'submitit'}/{role.job.job_id}_*)")
            if role.name == "learner" and self._ended:
                # Generators that were told the run is over are needed again by a resumed learner.
                for name in sorted(self._ended):
                    self._submit(self.role(name))
                self._ended.clear()
            role.restarts += 1
            log.warning("%s ended (%s); restarting it (%d/%d)", role.name, str(err).strip().splitlines()[-1][:200],
                        role.restarts, self.max_restarts)
            self._submit(role)

    def wait(self, on_status: Callable[[dict | None], None] = lambda s: None, poll_s: float = 1.0,
             timeout_s: float | None = None) -> bool:
        """Until the learner finished (True) or `timeout_s` passed (False); calls on_status each poll."""
        from hpcrl.rl.coordinator import read_status

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.finished:
            self._check()
            on_status(read_status(self.run_dir))
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        on_status(read_status(self.run_dir))
        return True

    def shutdown(self, grace_s: float = 60.0) -> None:
        """Stop generators (the coordinator tells them; cancel if they linger), then the services."""
        from hpcrl.jobs.transport import Node
        from hpcrl.jobs.transport_rpc import RequestClient

        coord = self.role("coordinator").job
        if coord is not None and not coord.done():
            try:
                with Node(self.run_dir, "hpcrl-run") as node:
                    RequestClient(node, "coordinator", timeout_s=2.0, retries=1, discover_timeout_s=1.0).request("stop")
            except Exception as exc:  # noqa: BLE001 - cancelling below still ends everything
                log.warning("could not ask the coordinator to stop: %s", exc)
        order = [[r for r in self.roles if r.slurm_role in ("generator", "learner")],
                 [r for r in self.roles if r.slurm_role == "sandbox"],
                 [self.role("coordinator"), self.role("store")]]
        for group in order:
            for r in group:
                self.stop_role(r)  # generators also hear it from the coordinator; the learner checkpoints
            deadline = time.monotonic() + grace_s
            while any(not r.job.done() for r in group) and time.monotonic() < deadline:
                time.sleep(0.2)
            for r in group:
                if not r.job.done():
                    log.warning("%s did not stop within %.0f s; cancelling it", r.name, grace_s)
                    r.job.cancel()

    def stop_role(self, role: _Role) -> None:
        """Ask a role to finish cleanly: SIGTERM to its processes (local), scancel on Slurm
        (which sends SIGTERM and waits KillWait). submitit's local cancel would SIGKILL after ~1 s."""
        if role.job is None or role.job.done():
            return
        if self.cfg.executor != "local":
            role.job.cancel()
            return
        for proc in pids(self.run_dir, role.name):
            try:
                os.kill(proc, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def cancel_all(self) -> None:
        for r in self.roles:
            if r.job is not None and not r.job.done():
                r.job.cancel()


def pids(run_dir: str | Path, role: str) -> list[int]:
    """Process ids of a role's tasks on this host, from the procs/<name>.json files components write."""
    import socket

    import psutil

    out = []
    for f in sorted((Path(run_dir) / "procs").glob("*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        name = rec.get("name", "")
        if not (name == role or name.startswith(role + "-")) or rec.get("host") != socket.gethostname():
            continue
        try:
            # A pid file outlives its process; never signal a recycled pid.
            if psutil.Process(int(rec["pid"])).create_time() <= float(rec["started"]) + 1.0:
                out.append(int(rec["pid"]))
        except psutil.NoSuchProcess:
            continue
    return out
