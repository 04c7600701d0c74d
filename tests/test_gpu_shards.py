"""Generators of several experiments on one GPU through Slurm's GPU shards (GRES shard).

`slurm.generator.gpu_shards: N` asks for N shards of one GPU (`--gres=shard:N`, no whole GPU)
and the generator caps its CUDA memory to that part of the GPU. The dev cluster has 4 shards on
each of its fake GPUs: two runs submitted there get generators on the same GPU and both train.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpcrl.jobs.launch import read_jobs
from hpcrl.jobs.supervise import queue_states
from hpcrl.rl.model.policy import cap_gpu_memory
from hpcrl.slurm import parse, queries
from hpcrl.slurm.command import run_slurm

from conftest import wait_for
from test_submit import hpcrl

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "executor=slurm",
    "slurm.coordinator.time_min=10",
    "slurm.learner.time_min=10",
    "slurm.generator.time_min=10",
    "slurm.coordinator.signal_delay_s=30",
    "slurm.learner.signal_delay_s=30",
    "slurm.generator.signal_delay_s=30",
    # The learner and the coordinator role's jobs ask for memory as they use it, so two runs fit.
    "slurm.learner.mem_gb=2",
    "slurm.generator.mem_gb=1",
    "slurm.coordinator.mem_gb=0.5",
]


def test_a_share_is_its_shards_over_the_shards_of_one_gpu():
    assert parse.gpus_in_gres("gpu:4,shard:16", "shard") == 16 and parse.gpus_in_gres("gpu:4,shard:16") == 4
    assert parse.gpus_in_tres("cpu=8,gres/gpu=4,gres/shard=16", "shard") == 16
    assert parse.gpu_share(2, 4, 16) == 0.5 and parse.gpu_share(8, 4, 16) == 1.0
    assert parse.gpu_share(2, 4, 0) is None and parse.gpu_share(0, 4, 16) is None
    assert queries.gpu_share_of_job({}) is None  # not in a shard job: nothing to cap
    if not __import__("torch").cuda.is_available():
        assert cap_gpu_memory(0.5) is False  # no GPU here: nothing capped (bench/gpu_check.py checks a GPU)


def test_sbatch_asks_for_shards_and_no_whole_gpu(tmp_path):
    out = hpcrl(
        "sbatch", "config.yaml", *SMALL, f"experiment.run_root={tmp_path}", "slurm.generator.gpu_shards=2",
        "-o", str(tmp_path / "s"), "--run-id", "sh",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    gen = (tmp_path / "s" / "gen-0.sbatch").read_text()
    assert "#SBATCH --gres=shard:2" in gen and "--gpus" not in gen, gen
    assert "#SBATCH --gpus-per-node=1" in (tmp_path / "s" / "learner.sbatch").read_text()
    het = hpcrl(
        "sbatch", "config.yaml", *SMALL, f"experiment.run_root={tmp_path}", "slurm.generator.gpu_shards=2",
        "-o", str(tmp_path / "h"), "--run-id", "shh", "--hetjob",
    )  # fmt: skip
    assert het.returncode == 0, het.stderr
    text = (tmp_path / "h" / "run.hetjob.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=1" in text and "#SBATCH --gres=shard:2" in text
    assert " --gres=shard:2 " in text and " --gres=gpu:1 " in text  # each step its own


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("slurm.learner.gpu_shards=2", "only generators share a GPU by shards"),
        ("slurm.generator.gpus_per_node=2", "set gpus_per_node: 1"),
    ],
)
def test_shards_only_for_a_generator_on_one_gpu(tmp_path, override, message):
    out = hpcrl("validate", "config.yaml", "slurm.generator.gpu_shards=2", override)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slurm
def test_a_shard_job_knows_its_share_and_validate_knows_the_partitions_shards(slurm_cluster, tmp_path):
    node = next(n for n in queries.nodes() if n.shards_total)
    assert node.shards_total == 16 and node.gpus_total == 4
    script = tmp_path / "share.py"
    script.write_text("from hpcrl.slurm.queries import gpu_share_of_job\nprint('share', gpu_share_of_job())\n")
    out = tmp_path / "share.out"
    job = run_slurm(
        ["sbatch", "--parsable", "-p", "gpu", "--gres=shard:2", "-o", str(out), "--wrap", f"{sys.executable} {script}"]
    ).stdout.strip()
    wait_for(lambda: not queue_states([job]) and out.exists() and "share" in out.read_text(), 120, what="the job")
    assert "share 0.5" in out.read_text(), out.read_text()
    bad = hpcrl("validate", "config.yaml", "executor=slurm", "slurm.generator.gpu_shards=32")
    assert bad.returncode == 2 and "at most 16 GPU shards a node" in bad.stderr, bad.stderr


@pytest.mark.slurm
def test_two_experiments_share_a_gpu_and_both_train(slurm_cluster, tmp_path):
    runs = ("a", "b")
    common = [
        *SMALL,
        f"experiment.run_root={tmp_path}",
        "slurm.generator.gpu_shards=2",
        # Both generators on n1, where another job holds three of the four GPUs: Slurm spreads
        # shards over free GPUs, so on a busy node (as on a shared cluster) they share the last one.
        # The learners and the small jobs go to n2, so both runs fit the 8 CPUs of a node at once.
        "slurm.generator.extra_directives={nodelist: n1}",
        "slurm.learner.extra_directives={nodelist: n2}",
        "slurm.learner.cpus_per_task=1",
        "slurm.coordinator.extra_directives={nodelist: n2}",
        "learner.max_steps=100",
    ]
    busy = run_slurm(
        ["sbatch", "--parsable", "-p", "gpu", "-w", "n1", "--gres=gpu:3", "-J", "other-user", "-o", "/dev/null",
         "--wrap", "sleep 1200"]
    ).stdout.strip()  # fmt: skip
    try:
        for r in runs:
            out = hpcrl("submit", "config.yaml", *common, "--run-id", r)
            assert out.returncode == 0, out.stderr
        gens = {r: read_jobs(tmp_path / r)["components"]["gen-0"]["job_id"] for r in runs}

        def gres_of(job: str) -> str | None:
            shown = run_slurm(["scontrol", "show", "job", "-d", job], check=False).stdout
            return next((w for w in shown.split() if w.startswith("GRES=shard")), None)

        placed = wait_for(lambda: all(gres_of(j) for j in gens.values()) and {r: gres_of(j) for r, j in gens.items()},
                          120, interval_s=0.2, what="both generators running on shards")  # fmt: skip
        # GRES=shard:2(IDX:k): the same GPU index on the same node for both runs' generators.
        assert len(set(placed.values())) == 1 and "(IDX:" in placed["a"], placed
        for r in runs:
            wait_for(lambda r=r: read_jobs(tmp_path / r)["state"] in ("finished", "failed"), 600, what=f"run {r}")
    except BaseException:
        for r in runs:
            if (tmp_path / r / "jobs.json").exists():
                hpcrl("cancel", str(tmp_path / r))
        raise
    finally:
        run_slurm(["scancel", busy])
    for r in runs:
        assert read_jobs(tmp_path / r)["state"] == "finished"
        rows = [json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 100
        # Learning, not just running: an untrained policy scores ~0.04 on these arith domains.
        first, last = (sum(x["reward"] for x in part) / len(part) for part in (rows[:5], rows[-10:]))
        assert last > first + 0.1, (r, first, last)
