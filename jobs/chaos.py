"""A chaos drill: faults injected into a live run, then the invariants the run must have kept.

    drill = Drill(run_dir, cfg, duration_s=1800, every_s=60, seed=0)   # `hpcrl chaos RUN ...`
    report = drill.run(print_line=print)                               # faults, restarts, invariants, ok

Every `every_s` the drill picks a live component at random and kills it (SIGKILL) or stalls it
(SIGSTOP for `stall_s`, by default longer than the episode and store leases, then SIGCONT to
that same process or job, whatever took over its name meanwhile).
Locally it signals the component's process (procs/<name>.json, the pid checked against its
start time, so a recycled pid is never hit); on Slurm it signals the job (`scancel
--signal=KILL --full`, `scancel --signal=STOP|CONT` to its steps: a STOP sent to srun never
reaches the component under it). The supervisor is a target too: locally that is the `hpcrl
run` launcher that holds run.lock, after which the drill runs `hpcrl resume RUN` as an
operator would (its output in chaos/resume-<n>.log); on Slurm the supervisor job, which any
component replaces once its heartbeat goes stale (docs/benchmarks.md has both drills;
tests/test_chaos.py drills the local executor only).

After `duration_s` it stops injecting and waits for the run to end, then checks (rl/audit/audit.py):
  reached_max_steps                      the lineage holds steps 1..max_steps, the cursor max_steps
  step_never_went_back                   each learner life resumed from no earlier than the newest
                                         whole checkpoint at the fault that ended the life before
  published_version_only_grew            weights/latest.json, sampled twice a second, never went back
  no_trajectory_trained_twice
  every_acknowledged_trajectory_accounted  every stored trajectory trained, dropped with a recorded
                                         reason, buffered in the last checkpoint, or unread: 0 lost
  reward_did_not_collapse                the mean reward of the last fifth of the steps is no more than
                                         `collapse_tolerance` below that of the steps trained before the
                                         first fault (or, with `baseline`, of a fault-free run's last fifth)
Each fault's `recovered_s` is the time until the target ran again (a new incarnation's heartbeat,
or for a stall its first heartbeat after SIGCONT; for the local launcher, a learner that the
resumed launcher started) and the learner trained a step past the one it was at: the time the
fault cost.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from hpcrl.core.config import Config
from hpcrl.core.liveness import read_heartbeats
from hpcrl.jobs.launch import read_jobs
from hpcrl.jobs.localrun import live_procs
from hpcrl.rl.audit.audit import account, step_rewards
from hpcrl.rl.learner.checkpoints import COMPLETE_NAME, resume_tag
from hpcrl.slurm.command import run_slurm

__all__ = ["Fault", "Drill", "parse_duration", "KINDS", "TARGETS"]

log = logging.getLogger("hpcrl.chaos")
KINDS = ("kill", "stall")
TARGETS = ("coordinator", "store", "learner", "gen", "sandbox", "supervisor")
POLL_S = 0.5


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h' -> seconds (ValueError naming the text otherwise)."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration: write e.g. 90s, 30m or 2h") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{text!r} is not a duration: it must be positive and finite")
    return value


@dataclass
class Fault:
    kind: str  # kill | stall
    target: str  # component name (learner-0, gen-1, supervisor, ...)
    time: float  # when it was injected (epoch seconds)
    step: int  # the learner's step then (status.json)
    checkpoint_step: int | None = None  # learner faults: the newest whole checkpoint's step then
    recovered_s: float | None = None  # see the module doc; None: not within the drill
    note: str = ""


@dataclass
class _Proc:
    name: str
    pid: int
    started: float


@dataclass
class Drill:
    run_dir: Path
    cfg: Config
    duration_s: float
    every_s: float
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    targets: tuple[str, ...] = TARGETS
    stall_s: float | None = None  # None: 5 s longer than the longest lease
    baseline: Path | None = None  # a fault-free run of the same config, for the reward comparison
    collapse_tolerance: float = 0.1  # absolute reward
    wait_end_s: float = 3600.0  # after the drill, how long to wait for the run to end
    faults: list[Fault] = field(default_factory=list)
    _versions: list[int] = field(default_factory=list)  # weights/latest.json versions, as they changed
    _resumers: list[subprocess.Popen] = field(default_factory=list)  # `hpcrl resume` the drill started

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.rng = random.Random(self.seed)
        self.slurm = self.cfg.executor == "slurm"
        if self.stall_s is None:
            self.stall_s = max(self.cfg.coordinator.lease_s, self.cfg.store.lease_s) + 5.0
        self.incarnations: dict[str, set[tuple[int, float]]] = {}

    # -- observing the run ------------------------------------------------------------------

    def _step(self) -> int:
        """The learner's last reported step: the last line of metrics.jsonl (status.json forgets it
        while a restarted coordinator waits for the learner's first report)."""
        try:
            with open(self.run_dir / "metrics.jsonl", "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 65536))
                lines = fh.read().splitlines()
        except OSError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue  # torn, or cut by the seek
        return 0

    def _sample(self) -> None:
        try:
            v = int(json.loads((self.run_dir / "weights" / "latest.json").read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError):
            v = None  # not published yet, or being replaced
        if v is not None and (not self._versions or v != self._versions[-1]):
            self._versions.append(v)
        for p in self._procs():
            self.incarnations.setdefault(p.name, set()).add((p.pid, p.started))

    def _procs(self) -> list[_Proc]:
        """Live component processes on this host (local runs)."""
        return [_Proc(r["name"], int(r["pid"]), float(r["started"])) for r in live_procs(self.run_dir)]

    def _launcher(self) -> psutil.Process | None:
        """The local `hpcrl run`/`hpcrl resume` holding run.lock, if it is alive."""
        try:
            words = (self.run_dir / "run.lock").read_text().split()
            proc = psutil.Process(int(words[1]))
            if proc.status() != psutil.STATUS_ZOMBIE and any("hpcrl" in w for w in proc.cmdline()):
                return proc
        except (OSError, ValueError, IndexError, psutil.Error):
            pass
        return None

    def _jobs(self) -> dict:

        return read_jobs(self.run_dir) or {}

    def _slurm_targets(self) -> dict[str, str]:
        jobs = self._jobs()
        out = {n: c["job_id"] for n, c in jobs.get("components", {}).items()}
        if jobs.get("supervisor"):
            out["supervisor"] = jobs["supervisor"]["job_id"]
        return out

    def _candidates(self, pending: list[Fault]) -> list[str]:
        """Live components of the chosen roles, less those not yet recovered from their last fault
        (a second kill of a launcher still waiting for its predecessor's jobs tests nothing)."""
        names = list(self._slurm_targets()) if self.slurm else [p.name for p in self._procs()]
        if not self.slurm and self._launcher() is not None:
            names.append("supervisor")
        busy = {f.target for f in pending}
        return sorted(n for n in names if n.split("-")[0] in self.targets and n not in busy)

    def _ended(self) -> bool:
        if self.slurm:
            return self._jobs().get("state") in ("finished", "failed", "cancelled")
        # A killed launcher's components stop by themselves before the resumed one takes over.
        resuming = any(p.poll() is None for p in self._resumers)
        return self._launcher() is None and not self._procs() and not resuming

    # -- faults ----------------------------------------------------------------------------

    def _signal(self, target: str, sig: signal.Signals) -> bool:
        return self._sender(target)(sig)

    def _sender(self, target: str) -> Callable[[signal.Signals], bool]:
        """Signals to the process (locally) or job (Slurm) that is `target` now, and stays that one."""
        if self.slurm:
            job = self._slurm_targets().get(target)
            return lambda sig: job is not None and self._scancel(job, sig)
        proc = self._process(target)
        return lambda sig: self._send(proc, sig)

    @staticmethod
    def _scancel(job: str, sig: signal.Signals) -> bool:

        # KILL goes to the batch script too (--full), so the job ends. STOP and CONT go to the
        # job's steps only: with --full they reach srun, which cannot pass a STOP on, and the
        # component under it ran on (seen on the dev cluster).
        full = ["--full"] if sig == signal.SIGKILL else []
        out = run_slurm(["scancel", f"--signal={sig.name[3:]}", *full, job], check=False)
        return out.returncode == 0

    def _process(self, target: str) -> psutil.Process | None:
        """The local process that is `target` now (the launcher for "supervisor")."""
        if target == "supervisor":
            return self._launcher()
        pid = next((p.pid for p in self._procs() if p.name == target), None)
        try:
            return None if pid is None else psutil.Process(pid)
        except psutil.Error:
            return None

    @staticmethod
    def _send(proc: psutil.Process | None, sig: signal.Signals) -> bool:
        try:
            proc.send_signal(sig)  # psutil refuses a pid recycled since `proc` was taken
        except (AttributeError, psutil.Error):
            return False
        return True

    def _inject(self, kind: str, target: str) -> Fault:
        fault = Fault(kind, target, time.time(), self._step())
        if target.startswith("learner"):
            try:
                tag = resume_tag(self.run_dir / "checkpoints")
                if tag is not None:
                    done = json.loads((self.run_dir / "checkpoints" / tag / COMPLETE_NAME).read_text())
                    fault.checkpoint_step = int(done["step"])
            except (OSError, ValueError, KeyError):
                fault.note = "no readable checkpoint at the fault"
        if kind == "kill":
            if not self._signal(target, signal.SIGKILL):
                fault.note = "gone before the signal"
            elif target == "supervisor" and not self.slurm:
                self._resume()
        else:
            # SIGCONT goes to the very process (or job) stopped, not to whatever bears the name at
            # the end: a stopped job of a killed launcher loses procs/<name>.json to its resumed
            # successor meanwhile, and if the CONT went there it would stay stopped for good,
            # and every later `hpcrl resume` would wait for it in vain.
            send = self._sender(target)
            if send(signal.SIGSTOP):
                try:
                    deadline = time.monotonic() + float(self.stall_s)
                    while time.monotonic() < deadline:
                        self._sample()
                        time.sleep(POLL_S)
                finally:  # a drill stopped by Ctrl-C meanwhile still lets its target go
                    send(signal.SIGCONT)
            else:
                fault.note = "gone before the signal"
        return fault

    def _resume(self) -> None:
        """Locally, a killed launcher leaves its components to stop by themselves; continue the run."""
        logs = self.run_dir / "chaos"
        logs.mkdir(exist_ok=True)
        with open(logs / f"resume-{len(self._resumers) + 1}.log", "wb") as out:
            proc = subprocess.Popen(
                # -u: the log is a file, and a launcher the drill kills later keeps no buffer.
                [sys.executable, "-u", "-m", "hpcrl.jobs.cli", "resume", str(self.run_dir), "--quiet"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._resumers.append(proc)

    def _recovered(self, fault: Fault) -> bool:
        after = fault.time + (float(self.stall_s) if fault.kind == "stall" else 0.0)
        if fault.target == "supervisor" and not self.slurm:
            # The local launcher keeps no heartbeat, and the resumed one holds run.lock from its
            # first second while it waits for the old jobs to end: it is up once a learner it
            # started runs.
            launcher = self._launcher()
            started = launcher.create_time() if launcher is not None else float("inf")
            up = any(p.name.startswith("learner") and p.started > started for p in self._procs())
        else:
            beats = read_heartbeats(self.run_dir, fault.target)
            up = any(b.get("phase") == "running" and b["time"] > after for b in beats)
        return up and self._step() > fault.step

    # -- the drill -------------------------------------------------------------------------

    def run(self, print_line: Callable[[str], None] = lambda _: None) -> dict:
        start = time.monotonic()
        before = self._restarts()
        pending: list[Fault] = []
        next_at = start + self.every_s
        while time.monotonic() - start < self.duration_s and not self._ended():
            self._sample()
            self._check_recovery(pending)
            if time.monotonic() >= next_at:
                names = self._candidates(pending)
                if names:
                    kind, target = self.rng.choice(self.kinds), self.rng.choice(names)
                    fault = self._inject(kind, target)
                    self.faults.append(fault)
                    pending.append(fault)
                    print_line(f"chaos: {kind} {target} at step {fault.step} {fault.note}".rstrip())
                next_at = time.monotonic() + self.every_s
            time.sleep(POLL_S)
        print_line(f"chaos: {len(self.faults)} faults injected; waiting for the run to end")
        deadline = time.monotonic() + self.wait_end_s
        while not self._ended():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run_dir}: the run did not end within {self.wait_end_s:.0f} s of the drill")
            self._sample()
            self._check_recovery(pending)
            time.sleep(POLL_S)
        return self.report(before)

    def _check_recovery(self, pending: list[Fault]) -> None:
        for f in list(pending):
            if self._recovered(f):
                f.recovered_s = round(time.time() - f.time, 2)
                pending.remove(f)

    def _restarts(self) -> dict[str, int]:
        if self.slurm:
            return {n: int(c.get("restarts", 0)) for n, c in self._jobs().get("components", {}).items()}
        return {n: max(0, len(s) - 1) for n, s in self.incarnations.items()}

    def report(self, before: dict[str, int] | None = None) -> dict:
        acct = account(self.run_dir)
        max_steps = self.cfg.learner.max_steps
        after = self._restarts()
        restarts = {n: after[n] - (before or {}).get(n, 0) for n in after if after[n] - (before or {}).get(n, 0)}
        # Each learner fault's checkpoint bounds the resume of the life after it; no life starts
        # further back than the one before it.
        went_back = any(b[0] < a[0] for a, b in zip(acct.resumes, acct.resumes[1:]))
        for f in self.faults:
            if f.target.startswith("learner") and f.kind == "kill" and f.checkpoint_step is not None:
                later = [step for step, t in acct.resumes if t > f.time]
                went_back |= bool(later) and later[0] < f.checkpoint_step
        reward = self._reward_check()
        invariants = {
            "reached_max_steps": acct.steps == list(range(1, max_steps + 1)) and acct.cursor_step == max_steps,
            "step_never_went_back": not went_back,
            "published_version_only_grew": all(b > a for a, b in zip(self._versions, self._versions[1:])),
            "no_trajectory_trained_twice": acct.trained_twice == 0,
            "every_acknowledged_trajectory_accounted": acct.lost == 0 and "unknown" not in acct.dropped_by_reason,
            "reward_did_not_collapse": reward["ok"],
        }
        lost = [f.recovered_s for f in self.faults if f.recovered_s is not None]
        return {
            "run": str(self.run_dir),
            "executor": self.cfg.executor,
            "faults": [asdict(f) for f in self.faults],
            "restarts": restarts,
            "recovered_s": {"mean": round(sum(lost) / len(lost), 2) if lost else None, "max": max(lost, default=None)},
            "accounting": acct.as_dict(),
            "reward": reward,
            "invariants": invariants,
            "ok": all(invariants.values()),
        }

    def _reward_check(self) -> dict:
        rewards = step_rewards(self.run_dir)
        steps = sorted(rewards)
        if not steps:
            return {"ok": False, "why": "no rewards in metrics.jsonl"}
        last = steps[-max(1, len(steps) // 5) :]
        final = sum(rewards[s][0] for s in last) / len(last)
        if self.baseline is not None:
            base = step_rewards(self.baseline)
            bsteps = sorted(base)
            if not bsteps:
                return {"ok": False, "why": f"no rewards in {self.baseline}/metrics.jsonl"}
            blast = bsteps[-max(1, len(bsteps) // 5) :]
            ref, against = sum(base[s][0] for s in blast) / len(blast), "baseline_final"
        else:
            first = min((f.time for f in self.faults), default=float("inf"))
            early = [s for s in steps if rewards[s][1] < first] or steps[: max(1, len(steps) // 10)]
            ref, against = sum(rewards[s][0] for s in early) / len(early), "before_first_fault"
        return {
            "ok": final >= ref - self.collapse_tolerance,
            "final": round(final, 4),
            against: round(ref, 4),
            "tolerance": self.collapse_tolerance,
        }
