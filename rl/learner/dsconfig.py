"""The learner's DeepSpeed config: hpcrl's defaults, the learner options, and `learner.deepspeed`
merged over them and checked.

    config = deepspeed_config(cfg.learner, cfg.policy, micro_steps)   # the dict deepspeed.initialize gets
    check_deepspeed_section(cfg.learner.deepspeed)                    # ConfigError naming the dotted key
    deepspeed = import_deepspeed(device)                              # with the CPU settings it needs

Defaults: ZeRO-3 with every parameter partitioned, bf16 (DeepSpeed keeps float32 master weights
and optimizer state; the module computes in bf16) when `policy.dtype: bfloat16`, with gradients
accumulated across micro-batches and reduced across ranks in float32 (`data_types.
grad_accum_dtype`, `communication_data_type`: DeepSpeed's recommendation for bf16, whose 8-bit
mantissa loses a micro-batch's small contributions when summed into a large total; by default
DeepSpeed would accumulate and reduce in the model's bf16), gradient clipping from
`learner.grad_clip`, optimizer and parameter offload from `learner.offload_*`.
`learner.deepspeed` is merged over that (mappings key by key, anything else replaced), so a
site sets e.g. `{zero_optimization: {stage3_prefetch_bucket_size: 5e8}, comms_logger: {enabled:
true}}` without restating the rest. Batch sizes are hpcrl's (`learner.micro_batch`, the batch
shape), so those keys are refused, as are keys DeepSpeed does not know: DeepSpeed silently
ignores an unknown top-level key, and a typo in a 70B run's offload setting must not be ignored.
Sections DeepSpeed describes with its own schema (zero_optimization, bf16, fp16, comms_logger,
compile, the monitors) are checked by that schema, so their errors name the nested key too.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpcrl.core.config import LearnerConfig, PolicyConfig
from hpcrl.core.schema import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "deepspeed_config",
    "merge",
    "check_deepspeed_section",
    "import_deepspeed",
    "layer_leaf_modules",
    "OWNED_KEYS",
]

# Set from hpcrl's own options; the message says which.
OWNED_KEYS = {
    "train_batch_size": "learner.batch_groups x learner.group_size",
    "train_micro_batch_size_per_gpu": "learner.micro_batch",
    "gradient_accumulation_steps": "learner.micro_batch (micro-steps follow from the batch)",
    "gradient_clipping": "learner.grad_clip",
    # The learner sets the learning rate of every param group at each step (learner.lr_schedule).
    "scheduler": "learner.lr_schedule, lr_decay_steps, lr_warmup_steps and lr_min_ratio",
}


def deepspeed_config(cfg: LearnerConfig, policy: PolicyConfig, micro_steps: int) -> dict:
    zero: dict[str, Any] = {
        "stage": 3,
        # Tiny models would otherwise stay unpartitioned without a word.
        "stage3_param_persistence_threshold": 0,
        "contiguous_gradients": True,
        "overlap_comm": False,
    }
    if cfg.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": cfg.offload_optimizer, "pin_memory": cfg.offload_optimizer == "cpu"}
    if cfg.offload_params != "none":
        zero["offload_param"] = {"device": cfg.offload_params, "pin_memory": cfg.offload_params == "cpu"}
    base = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": micro_steps,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": policy.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if policy.dtype == "bfloat16":
        # ZeRO-3 keeps each rank's gradient partition in grad_accum_dtype and sums every
        # micro-batch's gradient into it; the reduce-scatter runs in communication_data_type.
        base["data_types"] = {"grad_accum_dtype": "fp32"}
        base["communication_data_type"] = "fp32"
    if cfg.offload_optimizer != "none":
        # Offloaded optimizer state is stepped on the host: DeepSpeed's CPU Adam (compiled once
        # per site into TORCH_EXTENSIONS_DIR) is the one built for that.
        base["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "weight_decay": cfg.weight_decay,
                "betas": [cfg.adam_beta1, cfg.adam_beta2],
                "eps": cfg.adam_eps,
            },
        }
    out = merge(base, dict(cfg.deepspeed))
    if "optimizer" in out:
        # learner.lr wins: the learner sets every param group's rate at each step (lr_schedule).
        out["optimizer"].setdefault("params", {})["lr"] = cfg.lr
    return out


def layer_leaf_modules(config: dict, model) -> dict:
    """`config` with the model's decoder-layer classes as ZeRO-3 leaf modules (learner.gather_per_layer).

    ZeRO-3 hooks every submodule that holds parameters: before and after its forward and its
    backward it fetches and releases that module's own parameters, some ten Python hooks per
    decoder layer and micro-step. At a small width that Python is most of a step (a 64-wide
    Llama: ~15-20 % of the learner's CPU per step on 2 cores). A leaf module is fetched whole
    and its children get no hooks; a Hugging Face model names its decoder layer in
    `_no_split_modules` (what FSDP wraps, too: the unit it gathers). The math is unchanged;
    at most one layer's parameters (plus prefetch) are whole at a time. A `leaf_module` the
    site set in learner.deepspeed is kept as it is."""
    layers = [c for c in (getattr(model, "_no_split_modules", None) or []) if isinstance(c, str)]
    zero = config.get("zero_optimization") or {}
    if not layers or "leaf_module" in zero:
        return config
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    # DeepSpeed's defaults (MoE blocks) stay: a leaf inside a leaf changes nothing.
    classes = list(dict.fromkeys([*DEFAULT_LEAF_MODULE_CLASSES, *layers]))
    return merge(config, {"zero_optimization": {"leaf_module": {"classes": classes}}})


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict:
    """`over` merged into a copy of `base`: mappings key by key, anything else replaced."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# DeepSpeed's top-level keys (its config documentation, 0.15-0.19), other than the owned ones.
KNOWN_TOP = {
    "optimizer", "fp16", "bf16", "amp", "torch_autocast", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "activation_checkpointing", "flops_profiler", "wall_clock_breakdown",
    "memory_breakdown", "steps_per_print", "dump_state", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "autotuning", "elasticity", "data_efficiency", "curriculum_learning",
    "communication_data_type", "seq_parallel_communication_data_type", "aio", "checkpoint", "data_types",
    "compile", "timers", "hybrid_engine", "load_universal_checkpoint", "use_node_local_storage",
    "graph_harvesting", "nebula", "tensor_parallel", "dataloader_drop_last", "disable_allgather",
    "sparse_attention", "compression_training", "eigenvalue", "progressive_layer_drop", "weight_quantization",
    "quantize_training", "pipeline", "zenflow", "use_data_before_expert_parallelism",
}  # fmt: skip


def _schemas() -> dict[str, Any]:
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    out = {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "comms_logger": CommsLoggerConfig,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
        "comet": CometConfig,
    }
    try:
        from deepspeed.compile.config import CompileConfig

        out["compile"] = CompileConfig
    except ImportError:  # older DeepSpeed
        pass
    return out


def check_deepspeed_section(section: Mapping[str, Any], path: str = "learner.deepspeed", deep: bool = True) -> None:
    """ConfigError naming the dotted key of the first problem in `learner.deepspeed`: an owned
    key, a key DeepSpeed does not know, or (`deep`) a value its schema for that section refuses."""
    import difflib

    for key in section:
        where = f"{path}.{key}"
        if key in OWNED_KEYS:
            raise ConfigError(where, f"set by hpcrl; use {OWNED_KEYS[key]} instead")
        if key not in KNOWN_TOP:
            close = difflib.get_close_matches(key, sorted(KNOWN_TOP), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(where, f"not a DeepSpeed config key{hint}")
    if not deep:
        return
    for key, schema in _schemas().items():
        if key not in section:
            continue
        value = section[key]
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}.{key}", f"expected a mapping (got {type(value).__name__})")
        try:
            schema(**dict(value))
        except Exception as exc:  # pydantic.ValidationError: report its first error by path
            errors = getattr(exc, "errors", None)
            if not callable(errors):
                raise ConfigError(f"{path}.{key}", str(exc).splitlines()[0]) from None
            first = errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            msg = first.get("msg", "invalid")
            if first.get("type") == "extra_forbidden":
                msg = "unknown key"
            raise ConfigError(f"{path}.{key}" + (f".{loc}" if loc else ""), msg) from None


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for `device`, with the CPU settings that avoid minute-long JIT builds."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # heavy (torch, its ops): only where a learner is built

    # Its shared-memory collective op compiles ~50 s on first use and gloo does not need it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if device.type == "cpu" and "LOCAL_SIZE" not in os.environ:
        # The CPU accelerator's device_count() runs `numactl --hardware` in a subprocess on every
        # call unless LOCAL_SIZE is set (DeepSpeed's own launcher sets it), and ZeRO-3 asks for
        # it in every gradient reduce-scatter: a fork per micro-step. Its answer, once.
        from deepspeed.accelerator import get_accelerator

        os.environ["LOCAL_SIZE"] = str(get_accelerator().device_count())
    # DeepSpeed calls collectives torch has renamed; one warning per call drowns the logs.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    return deepspeed
