"""Shared fixtures. `slurm_cluster` brings up the dev Slurm cluster (python -m hpcrl.slurm.devcluster)
and exports SLURM_CONF; with HPCRL_REQUIRE_SLURM=1 (set by `make test`) a cluster that cannot
be started fails the suite instead of skipping it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVCLUSTER = "hpcrl.slurm.devcluster"  # run as `python -m`, with the interpreter running the tests


def devcluster_cmd(*args: str) -> list[str]:
    """The dev cluster's command line for `args` (up, down, status, env)."""
    return [sys.executable, "-m", DEVCLUSTER, *args]


def _unavailable(reason: str) -> None:
    if os.environ.get("HPCRL_REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm dev cluster required (HPCRL_REQUIRE_SLURM=1) but unavailable: {reason}", pytrace=False)
    pytest.skip(f"Slurm dev cluster unavailable: {reason} (run `make devcluster`)")


def _env_exports(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export ") :].split("=", 1)
            env[key] = value.strip().strip("'\"")
    return env


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """The dev cluster's client environment (SLURM_CONF, ...), also exported into os.environ."""
    for tool in ("slurmctld", "slurmd", "slurmdbd", "munged", "sbatch", "sacct"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} not on PATH (install with `make sysdeps`)")
    t0 = time.monotonic()
    up = subprocess.run(devcluster_cmd("up"), capture_output=True, text=True, timeout=180)
    if up.returncode != 0:
        _unavailable(f"`{DEVCLUSTER} up` exited {up.returncode}:\n{up.stdout[-2000:]}\n{up.stderr[-2000:]}")
    env = _env_exports(subprocess.run(devcluster_cmd("env"), capture_output=True, text=True, check=True).stdout)
    if "SLURM_CONF" not in env:
        _unavailable(f"`{DEVCLUSTER} env` printed no SLURM_CONF")
    os.environ.update(env)
    print(f"dev cluster ready in {time.monotonic() - t0:.1f} s")
    return env


# How long a whole `hpcrl run` (or in-process training run) may take before a test calls it hung.
# A hang guard, not a speed check: ~90 s on an idle 2-core machine, several times that beside
# CPU hogs and a parallel suite, so it is far above either.
RUN_GUARD_S = 1500.0


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    """Poll until predicate() is truthy; return its value or fail naming what was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def require_bwrap(uid: int) -> None:
    """Skip (or, with HPCRL_REQUIRE_SANDBOX=1 as in `make test`, fail) when bwrap can't run as `uid`."""
    from hpcrl.sandbox.bwrap import unavailable_reason

    reason = unavailable_reason(uid)
    if reason:
        if os.environ.get("HPCRL_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"HPCRL_REQUIRE_SANDBOX=1 but the bwrap sandbox cannot run: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def judge():
    """A SandboxJudge on the configured local backend (bwrap), for the code domains."""
    from hpcrl.core.config import SandboxConfig
    from hpcrl.rl.domains.code import SandboxJudge
    from hpcrl.sandbox.auto import make_backend
    from hpcrl.sandbox.result import SandboxError

    try:
        backend = make_backend(SandboxConfig())
        backend.check()
    except SandboxError as exc:
        if os.environ.get("HPCRL_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox required (HPCRL_REQUIRE_SANDBOX=1) but unavailable: {exc}", pytrace=False)
        pytest.skip(f"sandbox unavailable: {exc}")
    return SandboxJudge(backend)


@contextlib.contextmanager
def server_thread(run_dir: Path, name: str, make, limits=None, *, close=None):
    """Run `make(node)` (a server with poll_once) in its own thread and Node until the block ends;
    `close(server)` then runs in that thread, before its Node closes."""
    from hpcrl.core.transport import Node
    from hpcrl.core.wire import WireLimits

    ready, stop = threading.Event(), threading.Event()
    holder = {}

    def body():
        with Node(run_dir, name, limits or WireLimits(), bind_host="127.0.0.1") as node:
            holder["server"] = server = make(node)
            ready.set()
            while not stop.is_set():
                server.poll_once(0.02)
            if close is not None:
                close(server)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield holder["server"]
    finally:
        stop.set()
        t.join(10)


@contextlib.contextmanager
def session_server(run_dir: Path, uid_base: int, *overrides: str, slots: int = 2):
    """A SandboxServer with sessions, in a thread of this process, as `hpcrl sandbox serve` builds it."""
    from hpcrl.core.config import load_config
    from hpcrl.sandbox.pool import SlotPool
    from hpcrl.sandbox.server import SandboxServer
    from hpcrl.sandbox.session import SessionManager

    cfg = load_config(None, [f"sandbox.uid_base={uid_base}", *overrides]).sandbox
    pool = SlotPool.from_config(cfg, slots=slots)
    sessions = SessionManager.from_config(cfg)

    def close(srv):
        pool.close()
        srv.close()

    try:
        with server_thread(
            run_dir,
            "sandbox-0",
            lambda node: SandboxServer(node, "sandbox-0", pool, ceiling=cfg.ceiling, sessions=sessions),
            close=close,
        ) as srv:
            yield srv
    finally:
        pool.close()
        sessions.close_all()


@contextlib.contextmanager
def sandbox_client(run_dir: Path):
    """A sandbox client of the run, as a generator holds one (named gen-0)."""
    from hpcrl.core.transport import Node
    from hpcrl.sandbox.client import SandboxClient

    with Node(run_dir, "gen-0") as node:
        c = SandboxClient(node)
        try:
            yield c
        finally:
            c.close()
