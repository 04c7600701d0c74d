"""Trajectories/s of the full local pipeline against the generator alone in a tight loop
(orchestration overhead), and each role's busy fraction.

    .venv/bin/python bench/pipeline.py [--seconds 30] [--warmup 10] [--unthrottled] [--pin]
        [--json out.json] [KEY=VALUE ...]

Both measurements use the same config.yaml (domains, policy, episodes in flight; overrides
apply to both):

1. baseline: the Generator in a tight loop in this process: tasks from an in-process sampler,
   fixed weights, trajectories dropped. Trajectories/s and CPU seconds per trajectory.
2. pipeline: the components of `hpcrl run` as submitit LocalExecutor jobs (store writer,
   coordinator, learner, generator) training for real. After `--warmup` seconds, over
   `--seconds`: episodes completed (acknowledged by the store) per second, the generator
   process's CPU seconds per trajectory (psutil), busy fractions from status.json.

Printed: pipeline/baseline trajectories/s (on a 2-core machine the learner takes its share
of the CPUs and flow control holds generators back to the learner's pace, so this ratio is
not the overhead); the orchestration overhead, i.e. the share of the generator's wall time
spent in coordination (its task source and sink: coordinator syncs, sending trajectories,
store acknowledgements; and weight loads), timed around those calls; target <= 10 %. Also
the generator process's CPU per trajectory against the baseline: on shared cores it also
grows with the sampling itself (cache and memory bandwidth shared with the learner; the
`sampling ms/trajectory` row shows by how much), so it bounds the overhead from above.
`--unthrottled` lets the generator run flat out inside the pipeline (no flow control);
`--pin` gives the generator a core of its own in both measurements (the others get the rest),
so that the throughput ratio measures orchestration and not the learner's share of the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def baseline(cfg, seconds: float) -> dict:
    import torch

    from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
    from hpcrl.rl.domains import load_domains
    from hpcrl.rl.model.alphabet import resolve_charset
    from hpcrl.rl.model.policy import Policy
    from hpcrl.rl.rollout.generator import Generator

    torch.set_num_threads(1)  # as each component does
    domains = load_domains(cfg.domains)
    cfg = resolve_charset(cfg, domains)  # the tokenizer the pipeline's components build
    if any(d.needs_executor for d in domains.values()):
        raise SystemExit("bench/pipeline.py: use domains without a sandbox (the baseline has no sandbox server)")
    gen = Generator(cfg.generators, Policy.load(cfg.policy, seed=0), domains, run="bench", name="gen-0", seed=0)
    sizes = {name: d.size for name, d in domains.items()}
    source = LocalTaskSource(TaskSampler({d.name: d.weight for d in cfg.domains}, cfg.learner.group_size, 0, sizes))
    count = [0]

    def sink(_traj):
        count[0] += 1

    gen.run(source, sink, stop=lambda: count[0] >= 2 * cfg.generators.episodes_in_flight)  # warm-up
    n0, c0, t0 = count[0], time.process_time(), time.perf_counter()
    gen.run(source, sink, stop=lambda: time.perf_counter() - t0 >= seconds)
    n, cpu, wall = count[0] - n0, time.process_time() - c0, time.perf_counter() - t0
    gen.close()
    s = gen.stats
    return {
        "traj_per_s": n / wall,
        "cpu_s_per_traj": cpu / n,
        "trajectories": n,
        "busy": s.busy_fraction,
        "batch": s.batch_rows / max(s.batches, 1),
        "orchestration": (s.source_s + s.weights_s) / s.wall_s,
        "sample_ms_per_traj": 1e3 * s.busy_s / max(s.trajectories, 1),
    }


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (affinity is per thread; new threads inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread ended meanwhile


def pin_pipeline(run_dir, gen_cpus: set[int], rest_cpus: set[int]) -> None:
    """The generator on its own core(s), every other component (and this process) on the rest."""
    from hpcrl.jobs.localrun import pids

    pin(os.getpid(), rest_cpus)
    for role in ("coordinator", "store", "learner", "gen"):
        for pid in pids(run_dir, role):
            pin(pid, gen_cpus if role == "gen" else rest_cpus)


def pipeline(cfg, seconds: float, warmup: float, pinned: tuple[set[int], set[int]] | None = None) -> dict:
    import psutil

    from hpcrl.jobs.launch import plan
    from hpcrl.jobs.localrun import LocalRun, pids
    from hpcrl.jobs.rundir import create_run_dir
    from hpcrl.rl.coordinator.report import read_status

    run_dir = create_run_dir(cfg)
    jobs = LocalRun(cfg, run_dir, plan(cfg, run_dir))
    try:
        jobs.start()
        deadline = time.monotonic() + 180
        while not ((read_status(run_dir) or {}).get("learner") or {}).get("step"):
            jobs._check()  # restart what dies while we wait
            if time.monotonic() > deadline:
                raise SystemExit(f"bench/pipeline.py: no learner step within 180 s; see {run_dir}/submitit")
            if pinned:
                pin_pipeline(run_dir, *pinned)
            time.sleep(0.5)
        time.sleep(warmup)
        if pinned:
            pin_pipeline(run_dir, *pinned)  # threads started since
        gen = psutil.Process(pids(run_dir, "gen-0")[0])
        # The learner's CPU seconds per step: on a shared machine its wall time per step moves
        # with everyone else's load, its CPU time much less, so trees compare on it too.
        learner = psutil.Process(pids(run_dir, "learner")[0])

        def sample():
            st = read_status(run_dir)
            cpu, lcpu = gen.cpu_times(), learner.cpu_times()
            return time.perf_counter(), st, cpu.user + cpu.system, lcpu.user + lcpu.system

        t0, st0, cpu0, lcpu0 = sample()
        load0 = os.getloadavg()[0]
        busy = []
        while time.perf_counter() - t0 < seconds:
            time.sleep(1.0)
            jobs._check()
            busy.append((read_status(run_dir) or {}).get("busy", {}))
        t1, st1, cpu1, lcpu1 = sample()
        done = st1["counts"]["completed"] - st0["counts"]["completed"]
        made = st1["generators"]["gen-0"]["stats"]["trajectories"] - st0["generators"]["gen-0"]["stats"]["trajectories"]
        steps = st1["learner"]["step"] - st0["learner"]["step"]
        g0, g1 = st0["generators"]["gen-0"]["stats"], st1["generators"]["gen-0"]["stats"]
        d = {k: g1[k] - g0[k] for k in ("busy_s", "wall_s", "source_s", "weights_s", "batches", "batch_rows")}
        roles = {k: sum(b.get(k, 0.0) for b in busy) / max(len(busy), 1) for k in ("generator", "learner", "sandbox")}
        return {
            "traj_per_s": done / (t1 - t0),
            "cpu_s_per_traj": (cpu1 - cpu0) / max(made, 1),
            "trajectories": done,
            "learner_steps_per_s": steps / (t1 - t0),
            "learner_cpu_ms_per_step": 1e3 * (lcpu1 - lcpu0) / max(steps, 1),
            "load_avg": [load0, os.getloadavg()[0]],  # 1-minute load average at the start and end
            "busy": roles,
            "reward_end": st1["learner"]["reward"],
            "batch": d["batch_rows"] / max(d["batches"], 1),
            "orchestration": (d["source_s"] + d["weights_s"]) / max(d["wall_s"], 1e-9),
            "sample_ms_per_traj": 1e3 * d["busy_s"] / max(made, 1),
            "run_dir": str(run_dir),
        }
    finally:
        jobs.shutdown(grace_s=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement window of each side")
    ap.add_argument(
        "--warmup", type=float, default=10.0, help="pipeline seconds after the first learner step, unmeasured"
    )
    ap.add_argument(
        "--unthrottled",
        action="store_true",
        help="no flow control (generators run ahead of the learner at full speed): the generator's capacity "
        "inside the pipeline, sharing the CPUs with learner, store and coordinator",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="give the generator a core of its own (CPU 0) in both measurements and everything else the "
        "other cores: the throughput ratio is then the orchestration overhead alone, not the "
        "learner's share of the CPUs",
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from hpcrl.core.config import load_config

    root = tempfile.mkdtemp(prefix="hpcrl-bench-")
    cfg = load_config(
        args.config,
        [
            f"experiment.run_root={root}",
            "experiment.name=bench",
            "learner.max_steps=100000",
            *(["coordinator.max_groups_ahead=1000000", "learner.max_staleness=1000000"] if args.unthrottled else []),
            *args.overrides,
        ],
    )
    print(f"baseline: generator alone, {args.seconds:.0f} s ...", flush=True)
    every = os.sched_getaffinity(0)
    pinned = ({min(every)}, every - {min(every)}) if args.pin and len(every) > 1 else None
    if pinned:
        pin(os.getpid(), pinned[0])
    base = baseline(cfg, args.seconds)
    if pinned:
        pin(os.getpid(), every)  # the components inherit this process's affinity: undo it first
    print(f"pipeline: hpcrl run's components, {args.warmup:.0f} s warm-up + {args.seconds:.0f} s ...", flush=True)
    pipe = pipeline(cfg, args.seconds, args.warmup, pinned)
    overhead = pipe["cpu_s_per_traj"] / base["cpu_s_per_traj"] - 1
    print()
    print(f"{'':28}{'baseline':>12}{'pipeline':>12}{'ratio':>9}")
    print(
        f"{'trajectories/s':28}{base['traj_per_s']:12.0f}{pipe['traj_per_s']:12.0f}"
        f"{pipe['traj_per_s'] / base['traj_per_s']:9.2f}"
    )
    print(
        f"{'generator CPU ms/trajectory':28}{1e3 * base['cpu_s_per_traj']:12.3f}{1e3 * pipe['cpu_s_per_traj']:12.3f}"
        f"{pipe['cpu_s_per_traj'] / base['cpu_s_per_traj']:9.2f}"
    )
    print(
        f"{'sampling ms/trajectory':28}{base['sample_ms_per_traj']:12.3f}{pipe['sample_ms_per_traj']:12.3f}"
        f"{pipe['sample_ms_per_traj'] / base['sample_ms_per_traj']:9.2f}"
    )
    print(f"{'mean sampling batch':28}{base['batch']:12.0f}{pipe['batch']:12.0f}")
    print(f"{'generator time coordinating':28}{100 * base['orchestration']:11.1f}%{100 * pipe['orchestration']:11.1f}%")
    print(
        f"orchestration overhead: {100 * pipe['orchestration']:.1f} % of the generator's time goes to coordination "
        f"(task source, store, weights; target <= 10 %); CPU per trajectory {100 * overhead:+.1f} % vs baseline"
    )
    print(
        "busy fraction per role (pipeline): "
        + "  ".join(f"{k} {100 * v:.0f}%" for k, v in pipe["busy"].items())
        + f"   baseline generator {100 * base['busy']:.0f}%"
    )
    print(
        f"learner {pipe['learner_steps_per_s']:.2f} steps/s, {pipe['learner_cpu_ms_per_step']:.0f} CPU ms/step; "
        f"reward at the end {pipe['reward_end']:.3f}; cores {os.cpu_count()}; "
        f"load average {pipe['load_avg'][0]:.1f}-{pipe['load_avg'][1]:.1f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": base, "pipeline": pipe, "overhead": overhead}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
