"""Who am I in the learner's process group: rank, world size, local rank, rendezvous address.

    env = resolve_dist_env(run_key="r1")     # then exported as RANK/WORLD_SIZE/... for DeepSpeed

Sources, first match wins: RANK/WORLD_SIZE (torchrun, the deepspeed launcher, or set by hand);
SLURM_PROCID/SLURM_NTASKS (srun; the rendezvous host is the first node of the job); an MPI
launcher (OMPI_COMM_WORLD_SIZE or PMI_SIZE in the environment, ranks from mpi4py); otherwise a
single process. The port is MASTER_PORT if set, else derived from the run key (and the Slurm
job id), so every rank of one learner picks the same port without talking first.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass

__all__ = ["DistEnv", "resolve_dist_env"]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # env | slurm | mpi | single

    def export(self) -> None:
        """Set the variables torch.distributed's env:// rendezvous and DeepSpeed read."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def _port(run_key: str) -> int:
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"])
    key = f"{run_key}:{os.environ.get('SLURM_JOB_ID', '')}"
    return 20000 + int(hashlib.sha1(key.encode()).hexdigest(), 16) % 20000


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_dist_env(run_key: str = "hpcrl") -> DistEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int_env("RANK"), _int_env("WORLD_SIZE")
        local = int(env.get("LOCAL_RANK", rank))
        return _checked(DistEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), _port(run_key), "env"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        from hpcrl.slurm.parse import expand_hostlist

        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or socket.gethostname()
        master = env.get("MASTER_ADDR") or expand_hostlist(nodes)[0]
        rank, world = _int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS")
        return _checked(DistEnv(rank, world, int(env.get("SLURM_LOCALID", 0)), master, _port(run_key), "slurm"))
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        master = comm.bcast(socket.gethostname() if comm.rank == 0 else None, root=0)
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("MPI_LOCALRANKID", 0)))
        return _checked(DistEnv(comm.rank, comm.size, local, env.get("MASTER_ADDR", master), _port(run_key), "mpi"))
    # One process rendezvouses with itself: any free port will do, and none can collide.
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else _free_port()
    return DistEnv(0, 1, 0, "127.0.0.1", port, "single")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checked(d: DistEnv) -> DistEnv:
    if not 0 <= d.rank < d.world_size:
        raise ValueError(f"rank {d.rank} is outside world size {d.world_size} (from {d.source} environment variables)")
    return d
