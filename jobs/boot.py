"""The first code a job process runs: it catches Slurm's time-limit signal before anything is imported.

    python -u -m hpcrl.jobs.boot -u -m submitit.core._submit FOLDER   # what submitit runs (launch.py)
    python -u -m hpcrl.jobs.boot -m hpcrl.jobs.scripts RUN_DIR NAME    # what an `hpcrl sbatch` script runs

Slurm sends SIGUSR2 `signal_delay_s` ahead of the time limit, at its next periodic check, which
can land in the first second of a job. Until a handler is installed SIGUSR2 kills the process,
and a learner spends seconds to minutes importing torch and DeepSpeed and unpickling its job
before `components.start_component` installs the handler that drains and requeues. Killed there,
the job ends FAILED instead of requeued, and the supervisor's restart budget pays for it. This
module installs a handler that only remembers the signal, then runs the real entry point;
`start_component` replays what was remembered (`take_early`), so a signal that came early still
drains and requeues the job. Nothing heavy is imported here: the whole point is to be first.
"""

from __future__ import annotations

import runpy
import signal
import sys

__all__ = ["EARLY_SIGNALS", "take_early", "main"]

EARLY_SIGNALS = (signal.SIGUSR2,)  # SIGTERM keeps its default: a job cancelled while starting just ends
_early: list[int] = []


def _remember(signum: int, _frame) -> None:
    _early.append(signum)


def take_early() -> list[int]:
    """The signals that arrived before the component's own handlers (each reported once)."""
    out = list(_early)
    _early.clear()
    return out


def main(argv: list[str]) -> None:
    for sig in EARLY_SIGNALS:
        signal.signal(sig, _remember)
    args = [a for a in argv if a != "-u"]  # output is unbuffered already: boot itself runs with -u
    if len(args) < 2 or args[0] != "-m":
        raise SystemExit(f"hpcrl.jobs.boot: expected '-m MODULE [ARGS...]', got {argv!r}")
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Run as `-m`, this file is `__main__`; components import `hpcrl.jobs.boot`. Import it under
    # that name so both see one `_early` list.
    from hpcrl.jobs import boot as _boot

    _boot.main(sys.argv[1:])
