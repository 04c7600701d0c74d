"""What a run would hit later, checked before anything starts: `hpcrl validate`, and the first
thing `hpcrl run`, `submit` and `resume` do.

    check_run(cfg, domains, cluster=True)      # RunCheckError: one line naming what to change

Domain names and variants are checked where the domains are loaded (rl/domains: an unknown
family or variant, an unbuilt task list such as stdlib-repair's); this module checks the rest
a component would otherwise find minutes later, in its own log, after its restarts:

- `policy.path`: a folder with config.json that transformers reads as a causal language model,
  weights, and a tokenizer that loads (the weights themselves are not loaded);
- the sandbox backend, when a domain runs code: bwrap's tools and each domain's languages on
  this machine (executor local), the Apptainer executable (local) and image;
- experiment.run_root: a folder this user can create run directories in;
- `metrics.tensorboard` / `metrics.wandb`: the optional package is installed;
- on Slurm (`cluster=True`): every role's partition exists and one of its nodes has the GPUs
  (GRES), CPUs and memory the role asks for per node, as many nodes as it asks for, and a
  MaxTime no shorter than its time_min (one `scontrol show partition`, one `show node`).

What only the compute nodes can tell (bwrap there, a node-local cache) is left to the
components, whose failure at start stops the run at once (jobs/restarts.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcrl.core.config import Config, MetricsConfig, PolicyConfig

__all__ = [
    "RunCheckError",
    "check_run",
    "check_policy",
    "check_run_root",
    "check_sandbox",
    "check_sinks",
    "check_cluster",
]


class RunCheckError(ValueError):
    """Something the run would fail on later; the message is one line that names the fix."""


def check_run(cfg: Config, domains: Mapping[str, Any], *, cluster: bool = False, run_root: bool = True) -> None:
    """Every check below that applies to `cfg` (Slurm only with `cluster`), cheapest first; raise
    the first failure."""
    checks = [
        lambda: check_run_root(cfg) if run_root else None,
        lambda: check_sinks(cfg.metrics),
        lambda: check_sandbox(cfg, domains),
        lambda: check_policy(cfg.policy),
        lambda: check_cluster(cfg, domains) if cluster and cfg.executor == "slurm" else None,
    ]
    for check in checks:
        why = check()
        if why:
            raise RunCheckError(why)


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def check_policy(policy: PolicyConfig) -> str | None:
    """Why the learner and generators could not load `policy.path`, or None."""
    if policy.path is None:
        return None
    where = f"policy.path {policy.path!r}"
    hint = "point it at a local Hugging Face model folder, or set policy.path: null for the tiny built-in model"
    p = Path(os.path.expanduser(policy.path))
    if not p.is_dir():
        return f"{where}: no such folder; {hint}"
    if not (p / "config.json").is_file():
        return f"{where}: no config.json there; {hint}"
    weights = [*p.glob("*.safetensors"), *p.glob("pytorch_model*.bin"), *p.glob("*.safetensors.index.json")]
    if not weights:
        return f"{where}: no weights there (*.safetensors, pytorch_model*.bin); save the model there (save_pretrained)"
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # transformers says why in its own words: pass its last line on
        return f"{where}: its config.json does not load ({_last_line(exc)}); {hint}"
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"{where}: model_type {config.model_type!r} is not a causal language model this transformers "
            f"knows (AutoModelForCausalLM); {hint}"
        )
    try:
        AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:
        return (
            f"{where}: its tokenizer does not load ({_last_line(exc)}); save the tokenizer into the folder "
            "with tokenizer.save_pretrained"
        )
    return None


def check_run_root(cfg: Config) -> str | None:
    """Why no run directory can be created under experiment.run_root, or None. Tried, not asked
    of os.access (root passes that anywhere, a read-only filesystem or /proc does not): a folder
    is made in run_root (or the nearest existing folder above it, when run_root is to be made)
    and removed."""
    import tempfile

    root = Path(cfg.experiment.run_root)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    fix = "set experiment.run_root to a folder you can write (on a cluster: on the shared filesystem)"
    if not probe.is_dir():
        return f"experiment.run_root {root}: {probe} is not a folder; {fix}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hpcrl-write-check-", dir=probe))
    except OSError as exc:
        return f"experiment.run_root {root}: cannot create a folder in {probe} ({exc.strerror}); {fix}"
    return None


def check_sinks(metrics: MetricsConfig) -> str | None:
    """Why an enabled TensorBoard or W&B sink cannot write, or None."""
    if metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return (
            "metrics.tensorboard is true but the tensorboard package is not installed: "
            "pip install tensorboard, or set metrics.tensorboard: false"
        )
    if metrics.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        return (
            f"metrics.wandb.mode is {metrics.wandb.mode} but the wandb package is not installed: "
            "pip install wandb, or set metrics.wandb.mode: disabled"
        )
    return None


def check_sandbox(cfg: Config, domains: Mapping[str, Any]) -> str | None:
    """Why the sandbox servers could not run the configured code domains, or None."""
    code = sorted(name for name, d in domains.items() if d.needs_executor)
    if not code:
        return None
    sb = cfg.sandbox
    which = f"domain {code[0]} runs code in a sandbox"
    local = cfg.executor == "local"
    if sb.backend == "apptainer":
        if local and shutil.which(sb.apptainer) is None:
            return f"{which}, but {sb.apptainer!r} is not on PATH: `module load apptainer`, or sandbox.backend: bwrap"
        if not os.path.exists(sb.image):
            build = f"hpcrl sandbox build-image --out {sb.image}"
            return f"{which}, but sandbox.image {sb.image} does not exist: build it with `{build}`"
        return None
    if not local:
        return None  # bwrap runs on the compute nodes: nothing to see from here
    from hpcrl.sandbox.languages import available_languages
    from hpcrl.sandbox.process import setpriv_pdeathsig

    missing = [t for t in ("bwrap", "prlimit", "sh", "setpriv") if shutil.which(t) is None]
    if not missing and not setpriv_pdeathsig():
        missing.append("setpriv --pdeathsig (util-linux 2.33 or later)")
    if missing:
        return (
            f"{which}, but {', '.join(missing)} not found on PATH: install bubblewrap and util-linux "
            "(apt-get install bubblewrap util-linux) or set sandbox.backend: apptainer"
        )
    have = set(available_languages())
    for name in code:
        lacking = [lang for lang in getattr(domains[name], "languages", ()) if lang not in have]
        if lacking:
            return (
                f"domain {name} runs {', '.join(lacking)} code, which this machine cannot run (its tools are not "
                f"on PATH; available: {', '.join(sorted(have)) or 'none'}): install them or remove the domain"
            )
    return None


def check_cluster(cfg: Config, domains: Mapping[str, Any] | None = None) -> str | None:
    """Why a role's jobs could never start on this cluster (partition, GRES, CPUs, memory, nodes,
    MaxTime), or None. Asks Slurm twice (SlurmCommandError when it does not answer)."""
    from hpcrl.slurm import queries

    parts = {p.name: p for p in queries.partitions()}
    nodes = {n.name: n for n in queries.nodes()}
    roles = ["coordinator", "learner", "generator"]
    if domains is None or any(d.needs_executor for d in domains.values()):
        roles.append("sandbox")
    for role in roles:
        r = cfg.slurm.role(role)
        key = f"slurm.{role}"
        p = parts.get(r.partition)
        if p is None:
            return (
                f"{key}.partition {r.partition!r}: no such partition on this cluster; "
                f"partitions: {', '.join(sorted(parts)) or 'none'}"
            )
        members = [nodes[n] for n in p.nodes if n in nodes]
        if r.nodes > len(members):
            return (
                f"{key}.nodes {r.nodes}: partition {p.name} has {len(members)} node(s); ask for at most {len(members)}"
            )
        if p.max_time_s is not None and r.time_min * 60 > p.max_time_s:
            return (
                f"{key}.time_min {r.time_min}: partition {p.name} allows at most {p.max_time_s // 60} min (MaxTime); "
                f"set {key}.time_min: {p.max_time_s // 60} or less"
            )
        if r.gpu_shards and not any(n.shards_total >= r.gpu_shards for n in members):
            most = max((n.shards_total for n in members), default=0)
            has = f"at most {most} GPU shards a node" if most else "no GPU shards (GRES shard)"
            return (
                f"{key}.gpu_shards {r.gpu_shards}: partition {p.name} has {has}; ask the site for a partition "
                f"with shards (gres.conf Name=shard) or set {key}.gpu_shards: 0 for whole GPUs"
            )
        gpus_needed = 1 if r.gpu_shards else r.gpus_per_node
        cpus = r.tasks_per_node * r.cpus_per_task
        mem_mb = r.mem_gb * 1024
        fit = [
            n
            for n in members
            if n.gpus_total >= gpus_needed
            and n.shards_total >= r.gpu_shards
            and n.cpus_total >= cpus
            and (not n.real_memory_mb or n.real_memory_mb >= mem_mb)
        ]
        if len(fit) >= r.nodes:
            continue
        gpus = max((n.gpus_total for n in members), default=0)
        if r.gpus_per_node > gpus:
            has = f"has nodes with at most {gpus} GPUs (GRES gpu)" if gpus else "has no GPUs (GRES gpu)"
            return f"{key}.gpus_per_node {r.gpus_per_node}: partition {p.name} {has}; use a GPU partition or fewer GPUs"
        most = max((n.cpus_total for n in members), default=0)
        if cpus > most:
            return (
                f"{key}: tasks_per_node x cpus_per_task = {cpus} CPUs per node, but partition {p.name}'s nodes "
                f"have at most {most}"
            )
        mem = max((n.real_memory_mb for n in members), default=0)
        if mem_mb > mem:
            return f"{key}.mem_gb {r.mem_gb:g}: partition {p.name}'s nodes have at most {mem / 1024:g} GB (RealMemory)"
        return (
            f"{key}: only {len(fit)} node(s) of partition {p.name} have {r.gpus_per_node} GPUs, {cpus} CPUs and "
            f"{r.mem_gb:g} GB together; the role asks for {r.nodes}"
        )
    return None
