"""The one door to Slurm's command-line tools.

Every `sbatch`, `squeue`, `sinfo`, `scontrol`, `sacct`, `scancel`, `sacctmgr` call in hpcrl goes
through `run_slurm`, so a failure always reads the same way: the command line, the exit code
and Slurm's own stderr, plus a hint when the cause is a common one (no SLURM_CONF, controller
down). Parsing the output is the job of the pure functions in `hpcrl.slurm.parse`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SLURM_TOOLS = ("sbatch", "squeue", "sinfo", "scontrol", "sacct", "scancel", "sacctmgr", "srun", "sdiag", "sprio")


class SlurmCommandError(RuntimeError):
    """A Slurm command failed (or could not start, or timed out)."""

    def __init__(self, argv: list[str], returncode: int | None, stderr: str, hint: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.hint = hint
        code = "timed out" if returncode is None else f"exit code {returncode}"
        msg = f"`{shlex.join(argv)}` failed ({code}): {stderr.strip() or '(no stderr)'}"
        if hint:
            msg += f"\n  hint: {hint}"
        super().__init__(msg)

    def summary(self) -> str:
        """One line for a person: the command, how it failed, the stderr line that says why (the
        one a hint matches, else the last), and the hint."""
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in lines if _hint(ln)), lines[-1] if lines else "(no stderr)")
        code = "timed out" if self.returncode is None else f"exit code {self.returncode}"
        return f"`{shlex.join(self.argv)}` failed ({code}): {why}" + (f"; {self.hint}" if self.hint else "")


# Variables that say where Slurm is, not which job we are in: kept by outside_job().
_SITE_VARS = ("SLURM_CONF", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT")


@contextlib.contextmanager
def outside_job() -> Iterator[None]:
    """Submit as if from outside any job: drop the calling job's SLURM_*/SBATCH_*/SRUN_* variables
    for the block. A job submitted from inside another inherits its environment, and its srun then
    reads the caller's (a supervisor submitted from a GPU job asked for GRES its CPU job did not
    have: "Step requested GRES but job doesn't have GRES")."""
    saved = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k not in _SITE_VARS
    }
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


@dataclass(frozen=True)
class SlurmOutput:
    argv: tuple[str, ...]
    stdout: str
    stderr: str
    returncode: int


def _hint(stderr: str) -> str:
    if "Could not establish a configuration source" in stderr or ("slurm.conf" in stderr and "No such file" in stderr):
        return 'export SLURM_CONF (for the dev cluster: eval "$(make -s devcluster-env)")'
    if "Unable to contact slurm controller" in stderr or "Connection refused" in stderr:
        return "slurmctld is not answering: is the cluster up (`make devcluster` here), and SLURM_CONF right?"
    if "Munge encode failed" in stderr or "munge.socket" in stderr:
        return "munged is not running here (or its socket is elsewhere): start munge (`make devcluster` here)"
    if "Invalid account" in stderr or "Invalid qos" in stderr:
        return "check slurm.account / slurm.qos in the config against `sacctmgr show assoc user=$USER`"
    if "Requested node configuration is not available" in stderr:
        return (
            "no node can ever satisfy this request: check partition, gres and cpus/mem per node "
            "(`sinfo -o '%P %c %m %G'`)"
        )
    return ""


def run_slurm(
    argv: list[str],
    *,
    timeout_s: float = 30.0,
    check: bool = True,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> SlurmOutput:
    """Run one Slurm command; raise SlurmCommandError with command, exit code and stderr.

    With `check=False` a non-zero exit is returned instead of raised (e.g. `sbatch --test-only`
    prints its answer on stderr; `scontrol show job` of a purged job exits 1).
    """
    if not argv:
        raise ValueError("run_slurm: empty command")
    if argv[0] in SLURM_TOOLS and shutil.which(argv[0]) is None:
        raise SlurmCommandError(
            argv, 127, f"{argv[0]}: not found on PATH", hint="install Slurm's client tools (Debian: slurm-client)"
        )
    full_env = None
    if env:
        full_env = dict(os.environ)
        full_env.update(env)
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            env=full_env,
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise SlurmCommandError(argv, None, err or f"no answer within {timeout_s:g} s", hint=_hint(err)) from None
    except OSError as exc:
        raise SlurmCommandError(argv, 126, str(exc)) from None
    if check and proc.returncode != 0:
        raise SlurmCommandError(argv, proc.returncode, proc.stderr, hint=_hint(proc.stderr))
    return SlurmOutput(tuple(argv), proc.stdout, proc.stderr, proc.returncode)
