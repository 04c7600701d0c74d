"""The experiment config: one typed tree of frozen dataclasses, loaded strictly from YAML.

    cfg = load_config("config.yaml", ["learner.lr=3e-4", "executor=slurm"])

Every field carries a one-line help text (`spec(help=...)`); `config.yaml` documents each
one, and a test keeps the two in step. Each component receives only its own section
(`cfg.learner`, `cfg.sandbox`, ...), never the whole tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from hpcrl.core.files import atomic_write_text
from hpcrl.core.limits import Limits as Limits  # re-exported: the one limits type lives in the config tree
from hpcrl.core.limits import SandboxConfig
from hpcrl.core.schema import ConfigError, apply_overrides, from_dict, load_yaml_text, spec, to_dict
from hpcrl.core.slurmconfig import (
    LocalWindowConfig as LocalWindowConfig,
)
from hpcrl.core.slurmconfig import (
    SchedulerConfig,
    SlurmConfig,
    SuperviseConfig,
)
from hpcrl.core.slurmconfig import (
    SlurmRoleConfig as SlurmRoleConfig,
)

RESOLVED_NAME = "config.resolved.yaml"

_NAME_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = spec("quickstart", help="run name prefix; letters, digits, '_', '.', '-'", pattern=_NAME_RE)
    run_root: str = spec(
        "runs", help="folder that holds one sub-folder per run (relative to the config file's folder)", min_len=1
    )
    seed: int = spec(0, help="seed for task sampling, model init and everything random", ge=0)
    share_with_group: bool = spec(
        False, help="the run directory readable by your group (0750, files 0640); false: by you alone (0700, 0600)"
    )


@dataclass(frozen=True)
class TinyModelConfig:
    """The small Llama built from code when `policy.path` is null (CPU runs, CI)."""

    hidden_size: int = spec(64, help="width of the tiny model", ge=8)
    num_layers: int = spec(2, help="transformer layers", ge=1)
    num_heads: int = spec(4, help="attention heads; must divide hidden_size", ge=1)
    intermediate_size: int = spec(256, help="MLP width", ge=8)
    max_context: int = spec(1024, help="longest sequence (prompt + every turn) in tokens", ge=16)
    charset: str = spec(
        "auto",
        help="characters of the character tokenizer (one token each, plus pad, bos, eos, unk); auto: the "
        "configured domains' alphabet (printable ASCII if a domain declares none); printable: printable ASCII",
        min_len=1,
    )
    tie_embeddings: bool = spec(True, help="share the input embedding and the output projection")

    def validate(self):
        if self.hidden_size % self.num_heads:
            yield "num_heads", f"must divide hidden_size ({self.hidden_size}) (got {self.num_heads})"
        if self.charset not in ("auto", "printable") and len(set(self.charset)) != len(self.charset):
            yield "charset", f"each character may appear once (got {self.charset!r})"


@dataclass(frozen=True)
class PolicyConfig:
    path: str | None = spec(
        None,
        help="local Hugging Face model folder (config.json, weights, tokenizer); null builds the tiny model",
        min_len=1,
    )
    tiny: TinyModelConfig = spec(factory=TinyModelConfig, help="the model built when path is null")
    dtype: Literal["float32", "bfloat16"] = spec("float32", help="parameter dtype of learner and generators")
    device: Literal["auto", "cpu", "cuda"] = spec("auto", help="auto: cuda when a GPU is visible, else cpu")
    weight_sync: Literal["file", "direct"] = spec(
        "file", help="file: sharded safetensors per version; direct: also sent over torch.distributed (NCCL/gloo)"
    )
    chat_template: bool = spec(
        False, help="wrap text prompts and feedback as chat turns with the tokenizer's template (messages always are)"
    )


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = spec(
        "grpo",
        help="policy-gradient loss from the algorithm registry: grpo | decoupled_ppo (clip around the proximal "
        "policy, capped behaviour weight: stale tokens keep their gradient) | reinforce",
        min_len=1,
    )
    clip_low: float = spec(0.2, help="grpo: lower clip of the importance ratio, 1 - clip_low", ge=0, lt=1)
    clip_high: float = spec(0.2, help="grpo: upper clip of the importance ratio, 1 + clip_high", ge=0)
    max_ratio: float = spec(
        4.0, help="cap on the importance ratio of stale tokens (dual clip; reinforce: truncation)", gt=1
    )
    normalize_std: bool = spec(True, help="divide group-relative advantages by the group's standard deviation")
    loss_agg: Literal["token", "seq", "constant"] = spec(
        "token",
        help="token: mean over the batch's action tokens (DAPO); seq: mean per sequence, then over sequences "
        "(GRPO); constant: sum / (sequences x loss_len) (Dr. GRPO, no length bias)",
    )
    loss_len: int = spec(256, help="loss_agg constant: the fixed length L dividing each sequence's summed loss", ge=1)
    entropy_coef: float = spec(
        0.01, help="entropy bonus: the loss subtracts this x the policy's entropy at each action token", ge=0
    )
    entropy_decay_steps: int = spec(
        0,
        help="entropy_coef decays linearly to 0 over this many optimizer steps (explore, then sharpen); 0: constant",
        ge=0,
    )
    beta: float = spec(
        0.0,
        help="KL(policy || initial policy) penalty (a ZeRO-3 reference model; k2 per action token, its gradient "
        "that KL's); 0: none",
        ge=0,
    )


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = spec(0, help="evaluate pass@k on held-out tasks every this many learner steps; 0: never", ge=0)
    domains: tuple[str, ...] = spec(factory=tuple, help="registered domains to evaluate, e.g. [humaneval]")
    k: tuple[int, ...] = spec(factory=lambda: (1,), help="the k of each pass@k reported", min_len=1)
    tasks: int = spec(16, help="held-out tasks per evaluation (fewer if the domain holds out fewer)", ge=1)
    samples: int = spec(0, help="samples per task; 0: the largest k", ge=0)

    def validate(self):
        if any(k < 1 for k in self.k):
            yield "k", f"every k must be >= 1 (got {list(self.k)})"
        if self.samples and max(self.k) > self.samples:
            yield "samples", f"must be >= the largest k ({max(self.k)}), or 0"
        if self.every_steps and not self.domains:
            yield "domains", "name the domains to evaluate (e.g. [humaneval]) when every_steps > 0"


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = spec(5e-4, help="AdamW learning rate", gt=0)
    max_staleness: int = spec(
        2,
        help="drop a group whose newest action is more than this many policy versions behind the learner "
        "(older turns are trained, corrected by importance weights)",
        ge=0,
    )
    algorithm: AlgorithmConfig = spec(factory=AlgorithmConfig, help="the loss and its importance-ratio clipping")
    group_size: int = spec(8, help="episodes per task instance; advantages are relative within a group", ge=2)
    batch_groups: int = spec(
        32, help="groups per optimizer step (batch = batch_groups x group_size trajectories)", ge=1
    )
    micro_batch: int = spec(256, help="at most this many trajectories per forward/backward pass on one rank", ge=1)
    micro_batch_tokens: int = spec(
        8192, help="... and at most this many padded tokens (rows x the longest); 0: rows only", ge=0
    )
    share_prompt: bool = spec(
        True,
        help="the learner runs a group's common prompt once, not once per member (needs sdpa or eager attention)",
    )
    weight_decay: float = spec(0.0, help="AdamW weight decay", ge=0)
    adam_beta1: float = spec(0.9, help="AdamW beta1 (first-moment decay)", ge=0, lt=1)
    adam_beta2: float = spec(0.999, help="AdamW beta2 (second-moment decay)", ge=0, lt=1)
    adam_eps: float = spec(1e-8, help="AdamW epsilon", gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = spec(
        "cosine", help="learning rate after warm-up: constant, or a decay to lr x lr_min_ratio (see lr_decay_steps)"
    )
    lr_decay_steps: int = spec(
        2400, help="lr_schedule linear/cosine: steps after warm-up over which the rate decays; 0: until max_steps", ge=0
    )
    lr_warmup_steps: int = spec(0, help="linear learning-rate warm-up from 0 over this many optimizer steps", ge=0)
    lr_min_ratio: float = spec(
        0.2, help="lr_schedule linear/cosine: the final learning rate as a fraction of lr", ge=0, le=1
    )
    skip_empty_steps: bool = spec(
        True, help="no optimizer update for a batch whose advantages are all 0 (Adam would move on momentum)"
    )
    filter_groups: bool = spec(
        False, help="dynamic sampling: drop groups whose rewards are all equal; new ones are issued in their place"
    )
    store_refresh_s: float = spec(
        0.01,
        help="while waiting, how often the learner lists each open shard for new segments, seconds",
        gt=0,
    )
    grad_clip: float = spec(1.0, help="clip the global gradient norm to this; 0 disables", ge=0)
    max_steps: int = spec(300, help="optimizer steps of the run; the run ends when the learner reaches it", ge=1)
    publish_every: int = spec(1, help="publish weights to the generators every this many optimizer steps", ge=1)
    keep_weights: int = spec(3, help="published weight versions (folders) kept in the run directory", ge=1)
    checkpoint_every: int = spec(
        50, help="save a DeepSpeed checkpoint (model, optimizer, store cursor) every this many steps", ge=1
    )
    keep_checkpoints: int = spec(2, help="checkpoints kept; older ones are deleted", ge=1)
    dist_backend: Literal["auto", "gloo", "nccl"] = spec(
        "auto", help="torch.distributed backend; auto: nccl on GPUs, gloo on CPU"
    )
    logit_chunk_tokens: int = spec(
        1024, help="tokens per chunk of log-probabilities and entropy (peak ~4 x chunk x vocab bytes)", ge=1
    )
    activation_checkpointing: bool = spec(
        False, help="recompute each layer's activations in the backward pass instead of keeping them"
    )
    gather_per_layer: bool = spec(
        True,
        help="ZeRO-3 gathers each decoder layer's parameters at once (the model's _no_split_modules as "
        "DeepSpeed leaf modules: one fetch/release hook per layer, not per linear); false: per submodule",
    )
    offload_optimizer: Literal["none", "cpu"] = spec(
        "none", help="ZeRO-3 optimizer state (fp32 master weights, Adam moments) on the host: cpu"
    )
    offload_params: Literal["none", "cpu"] = spec("none", help="ZeRO-3 parameters on the host between uses: cpu")
    deepspeed: dict[str, Any] = spec(
        factory=dict, help="DeepSpeed config merged over hpcrl's (checked: unknown keys are refused)"
    )
    eval: EvalConfig = spec(
        factory=EvalConfig, help="periodic held-out evaluation (pass@k into metrics.jsonl), off by default"
    )


@dataclass(frozen=True)
class GeneratorConfig:
    count: int = spec(1, help="number of rollout generator processes", ge=1)
    episodes_in_flight: int = spec(
        256, help="episodes each generator keeps open at once (rows of its continuous batch)", ge=1
    )
    lend_episodes: int = spec(
        0,
        help="episodes taken beyond episodes_in_flight while some wait on environment steps (sandboxes), "
        "so the batch keeps its rows; still at most episodes_in_flight decode at once; 0: off",
        ge=0,
    )
    max_new_tokens: int = spec(256, help="cap on one action's tokens (a domain may ask for fewer)", ge=1)
    max_turns: int = spec(8, help="cap on steps per episode; longer episodes end truncated (max_steps)", ge=1)
    env_threads: int = spec(8, help="threads stepping environments, so sandbox waits overlap sampling", ge=1)
    max_context: int | None = spec(
        None, help="longest context (prompt + every turn), tokens; null: the model's max_position_embeddings", ge=16
    )
    kv_cache_gb: float = spec(
        2.0, help="KV cache kept for episodes between turns, GB per generator; 0: re-prefill every turn", ge=0
    )
    weight_swap: Literal["continue", "restart"] = spec(
        "continue", help="new weights: actions in flight continue under them, or restart (exactly on-policy)"
    )
    explore_temperature: float = spec(
        2.0,
        help="sampling temperature for a task whose last group here had equal rewards below the domain's mean "
        "(wrong every time: no gradient), while under a fifth of the domain's groups are; recorded and trained "
        "at that temperature; 1: off (rl/rollout/explore.py)",
        ge=1.0,
    )
    session_fault: Literal["resume", "reissue"] = spec(
        "resume",
        help="a sandbox session's server fails mid-episode: resume on another server from the last good step, "
        "or reissue the episode",
    )


@dataclass(frozen=True)
class CoordinatorConfig:
    lease_s: float = spec(60.0, help="an episode whose generator has not synced for this long is issued again", gt=0)
    max_attempts: int = spec(3, help="issue a failing episode at most this many times, then give it up", ge=1)
    max_groups_ahead: int | None = spec(
        None,
        help="groups handed out beyond what the learner consumed; null: max(1, max_staleness) x batch_groups",
        ge=1,
    )
    sync_wait_s: float = spec(
        0.25,
        help="a sync finding no work waits this long for some (the learner's next report); 0: answer at once",
        ge=0,
        le=2.0,
    )
    status_every_s: float = spec(1.0, help="how often status.json is rewritten, seconds", gt=0)
    status_window_s: float = spec(10.0, help="trajectories/s is measured over this many recent seconds", gt=0)
    timeline_every_s: float = spec(
        10.0, help="how often coordinator/timeline.jsonl samples each generator's busy seconds (hpcrl plot)", gt=0
    )


@dataclass(frozen=True)
class DomainConfig:
    name: str = spec(help="registered domain name, or a label for a `module` domain", min_len=1)
    weight: float = spec(1.0, help="relative sampling weight", gt=0)
    module: str | None = spec(
        None, help="site domain as 'python.module:attribute'; null for a built-in", pattern=r"[\w.]+:[\w.]+"
    )


@dataclass(frozen=True)
class StoreConfig:
    flush_every: int = spec(256, help="flush a shard after this many trajectories", ge=1)
    flush_interval_s: float = spec(5.0, help="... or after this many seconds, whichever comes first", gt=0)
    flush_idle_s: float = spec(
        0.02, help="... or once no trajectory arrived for this many seconds (a batch's tail waits for no company)", gt=0
    )
    compression: Literal["none", "gzip", "lzf"] = spec("none", help="HDF5 filter for token datasets")
    shard_max_rows: int = spec(
        65536, help="finalize a shard (write its manifest) and start a new one after this many trajectories", ge=1
    )
    lease_s: float = spec(
        30.0, help="a writer whose shard heartbeat is older than this is presumed dead: a new one fences it", gt=0
    )


@dataclass(frozen=True)
class WandbConfig:
    mode: Literal["disabled", "offline", "online"] = spec(
        "disabled",
        help="Weights & Biases: online; offline writes RUN/wandb for `wandb sync` later (no network); disabled",
    )
    project: str = spec("hpcrl", help="W&B project the run is logged to", min_len=1)
    entity: str | None = spec(None, help="W&B team or user; null: the account's default")


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = spec(
        True, help="components keep Prometheus metrics: a textfile each (see textfile_dir), an endpoint with bind_host"
    )
    bind_host: str | None = spec(
        None,
        help="also serve them over unauthenticated HTTP here (counts, rates, names; 127.0.0.1: the node's users); "
        "null: no listener",
        min_len=1,
    )
    textfile_dir: str | None = spec(
        None,
        help="write hpcrl_<run>_<component>.prom here (node_exporter's textfile collector); null: the run's metrics/",
    )
    textfile_every_s: float = spec(15.0, help="how often the textfiles are rewritten, seconds", gt=0)
    tensorboard: bool = spec(
        False, help="also write each learner step's metrics as TensorBoard event files in RUN/tensorboard"
    )
    wandb: WandbConfig = spec(factory=WandbConfig, help="also log each learner step's metrics to Weights & Biases")


@dataclass(frozen=True)
class Config:
    experiment: ExperimentConfig = spec(
        factory=ExperimentConfig, help="what the run is called, where it lives, its seed"
    )
    executor: Literal["local", "slurm"] = spec(
        "local", help="local: submitit's local executor on this machine; slurm: jobs on a cluster"
    )
    slurm: SlurmConfig = spec(factory=SlurmConfig, help="Slurm account, QoS and per-role resources (executor: slurm)")
    policy: PolicyConfig = spec(factory=PolicyConfig, help="the model learner and generators share")
    learner: LearnerConfig = spec(factory=LearnerConfig, help="the DeepSpeed ZeRO-3 learner")
    generators: GeneratorConfig = spec(factory=GeneratorConfig, help="rollout generators")
    coordinator: CoordinatorConfig = spec(factory=CoordinatorConfig, help="episode leases, flow control, status files")
    sandbox: SandboxConfig = spec(factory=SandboxConfig, help="code-execution sandboxes")
    domains: tuple[DomainConfig, ...] = spec(
        factory=lambda: (
            DomainConfig(name="arith/copy"),
            DomainConfig(name="arith/add1-mod10"),
            DomainConfig(name="arith/max2"),
        ),
        help="task domains and their sampling weights",
        min_len=1,
    )
    store: StoreConfig = spec(factory=StoreConfig, help="HDF5 trajectory shards")
    scheduler: SchedulerConfig = spec(factory=SchedulerConfig, help="rollout placement policy")
    supervise: SuperviseConfig = spec(
        factory=SuperviseConfig, help="restart budgets and backoff, and hang detection from heartbeats"
    )
    metrics: MetricsConfig = spec(
        factory=MetricsConfig,
        help="Prometheus metrics of the components (textfiles, an endpoint only if asked); TensorBoard and W&B",
    )

    def validate(self):
        seen = set()
        for i, d in enumerate(self.domains):
            if d.name in seen:
                yield f"domains.{i}.name", f"duplicate domain {d.name!r}; each domain may be listed once"
            seen.add(d.name)


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load `path` (None: built-in defaults) with `key=value` overrides; raise ConfigError."""
    if path is None:
        raw, source_dir = {}, Path.cwd()
    else:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError("", f"{p}: no such config file") from None
        except UnicodeDecodeError as exc:
            raise ConfigError("", f"{p}: byte {exc.start} is not UTF-8 text; save the file as UTF-8") from None
        except OSError as exc:
            raise ConfigError("", f"{p}: cannot read: {exc.strerror}") from None
        raw = load_yaml_text(text, source=str(p))
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError("", f"{p}: the top level must be a mapping of sections (got {type(raw).__name__})")
        source_dir = p.resolve().parent
    raw, origins = apply_overrides(raw, overrides)
    try:
        cfg = from_dict(Config, raw)
    except ConfigError as exc:
        origin = next((o for key, o in origins.items() if exc.path == key or exc.path.startswith(key + ".")), None)
        if origin is not None:
            raise ConfigError(exc.path, exc.message, origin=f"from override {origin}") from None
        raise
    return _anchor_run_root(cfg, source_dir)


def _anchor_run_root(cfg: Config, source_dir: Path) -> Config:
    """A relative run_root is relative to the config file, so a job on another node finds it."""
    from dataclasses import replace

    root = Path(os.path.expanduser(cfg.experiment.run_root))
    if not root.is_absolute():
        root = source_dir / root
    return replace(cfg, experiment=replace(cfg.experiment, run_root=str(root)))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def write_resolved(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the fully resolved config into a run directory (atomically)."""
    out = Path(run_dir) / RESOLVED_NAME
    atomic_write_text(out, "# Resolved by hpcrl: every field, defaults and overrides applied.\n" + dump_config(cfg))
    return out
