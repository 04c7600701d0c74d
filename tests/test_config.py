"""The strict config loader, config.yaml's documentation, and `hpcrl validate`'s errors."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hpcrl.core.config import RESOLVED_NAME, Config, load_config
from hpcrl.core.schema import ConfigError, leaf_paths
from hpcrl.jobs.rundir import RunDirError, create_run_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def error_of(tmp_path: Path, text: str, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), list(overrides))
    return info.value


def test_default_config_loads_and_equals_schema_defaults():
    cfg = load_config(CONFIG)
    defaults = load_config(None)
    # config.yaml spells out the schema's defaults; only the anchored run_root may differ.
    assert dataclasses.replace(cfg, experiment=defaults.experiment) == defaults
    assert Path(cfg.experiment.run_root) == ROOT / "runs"


def documented_paths(text: str) -> dict[str, bool]:
    """Dotted path of every key in a YAML file (list items without index) -> has a comment."""
    out: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = re.match(r"^(\s*)(- )?([A-Za-z_][\w]*):(.*)$", line)
        if not m:
            continue
        indent = len(m.group(1)) + (2 if m.group(2) else 0)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [m.group(3)])
        out[path] = bool(re.search(r"#\s*\S", m.group(4)))
        stack.append((indent, m.group(3)))
    return out


def test_config_yaml_documents_every_field_with_a_comment():
    documented = documented_paths(CONFIG.read_text())
    for path, help_text in leaf_paths(Config):
        assert help_text, f"schema field {path} has no help text"
        assert path in documented, f"config.yaml does not show {path}"
        assert documented[path], f"config.yaml has no comment on {path}"
    # ...and nothing in config.yaml is unknown to the schema (strict load proves it).
    load_config(CONFIG)


@pytest.mark.parametrize(
    "text, path, fragment",
    [
        ("learner:\n  lr: -1\n", "learner.lr", "must be > 0 (got -1)"),
        ("learner:\n  lr: abc\n", "learner.lr", "expected float (got str 'abc')"),
        ("learner:\n  lrr: 0.1\n", "learner.lrr", "unknown key (did you mean 'lr'?); valid keys: lr, max_staleness"),
        ("bogus: 1\n", "bogus", "unknown key; valid keys: experiment, executor, slurm"),
        ("slurm:\n  learner:\n    gpus_per_nod: 2\n", "slurm.learner.gpus_per_nod", "did you mean 'gpus_per_node'?"),
        ("executor: slurmm\n", "executor", "must be one of local, slurm (got 'slurmm')"),
        ("sandbox:\n  backend: docker\n", "sandbox.backend", "must be one of bwrap, apptainer"),
        ("experiment:\n  seed: 1.5\n", "experiment.seed", "expected int (got float 1.5)"),
        ("experiment:\n  seed: true\n", "experiment.seed", "expected int (got bool True)"),
        ("experiment:\n  seed: -3\n", "experiment.seed", "must be >= 0"),
        ("experiment:\n  name: 'a b'\n", "experiment.name", "must match"),
        ("learner: 5\n", "learner", "expected a mapping"),
        ("domains: []\n", "domains", "at least 1"),
        ("domains:\n  - weight: 2\n", "domains.0.name", "required key is missing"),
        ("domains:\n  - name: a\n  - name: a\n", "domains.1.name", "duplicate domain 'a'"),
        ("domains:\n  - name: a\n    weight: 0\n", "domains.0.weight", "must be > 0"),
        ("domains:\n  - name: a\n    module: notamodule\n", "domains.0.module", "must match"),
        ("slurm:\n  setup: echo hi\n", "slurm.setup", "expected list of str"),
        ("slurm:\n  extra_directives: {constraint: 5}\n", "slurm.extra_directives.constraint", "expected str"),
        ("slurm:\n  account: 12\n", "slurm.account", "expected str"),
        (
            "slurm:\n  learner:\n    time_min: 1\n    signal_delay_s: 90\n",
            "slurm.learner.signal_delay_s",
            "shorter than the time limit",
        ),
        ("store:\n  compression: zstd\n", "store.compression", "must be one of none, gzip, lzf"),
        ("generators:\n  count: 0\n", "generators.count", "must be >= 1"),
    ],
)
def test_malformed_config_names_dotted_path(tmp_path, text, path, fragment):
    err = error_of(tmp_path, text)
    assert err.path == path
    assert fragment in str(err), str(err)


def test_yaml_syntax_and_shape_errors(tmp_path):
    err = error_of(tmp_path, "learner:\n  lr: [1, 2\n")
    assert "invalid YAML" in str(err) and "exp.yaml:" in str(err)
    err = error_of(tmp_path, "learner:\n  lr: 1\n  lr: 2\n")
    assert "duplicate key 'lr'" in str(err)
    err = error_of(tmp_path, "- a\n- b\n")
    assert "top level must be a mapping" in str(err)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_exponent_floats_without_dot_are_floats(tmp_path):
    cfg = load_config(write(tmp_path, "learner:\n  lr: 3e-4\n"))
    assert cfg.learner.lr == pytest.approx(3e-4)
    assert load_config(None, ["learner.lr=5E-5"]).learner.lr == pytest.approx(5e-5)


def test_ints_widen_to_float_but_not_the_reverse(tmp_path):
    assert load_config(write(tmp_path, "learner:\n  lr: 1\n")).learner.lr == 1.0
    assert isinstance(load_config(write(tmp_path, "learner:\n  lr: 1\n")).learner.lr, float)


def test_overrides_go_through_the_schema():
    cfg = load_config(
        CONFIG,
        [
            "learner.lr=3e-4",
            "executor=slurm",
            "slurm.learner.gpus_per_node=2",
            "slurm.learner.tasks_per_node=2",
            "slurm.account=proj42",
            "domains.0.weight=2.5",
            "slurm.setup=[module load cuda]",
        ],
    )
    assert cfg.learner.lr == pytest.approx(3e-4)
    assert cfg.executor == "slurm"
    assert cfg.slurm.learner.gpus_per_node == 2
    assert cfg.slurm.account == "proj42"
    assert cfg.domains[0].weight == 2.5
    assert cfg.slurm.setup == ("module load cuda",)


@pytest.mark.parametrize(
    "override, path, fragment",
    [
        ("learner.lr=-1", "learner.lr", "must be > 0 (got -1) [from override learner.lr=-1]"),
        ("learner.lr=fast", "learner.lr", "expected float"),
        ("learner.nope=1", "learner.nope", "unknown key"),
        ("nosuch.section.key=1", "nosuch", "unknown key"),
        ("executor=k8s", "executor", "must be one of local, slurm"),
        ("generators.count=0", "generators.count", "must be >= 1"),
        ("learner.lr.x=1", "learner.lr", "cannot set a sub-key"),
        ("domains.7.weight=1", "domains.7", "list index must be 0..2"),
    ],
)
def test_bad_overrides_name_path_and_origin(override, path, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [override])
    assert info.value.path == path
    assert fragment in str(info.value)


@pytest.mark.parametrize("override", ["learner.lr", "=3", "learner..lr=1", ".lr=1"])
def test_malformed_override_syntax(override):
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(CONFIG, [override])


def test_loaded_tree_is_frozen():
    cfg = load_config(CONFIG)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.learner.lr = 1.0  # type: ignore[misc]
    assert isinstance(cfg.domains, tuple) and isinstance(cfg.slurm.setup, tuple)


def test_resolved_config_is_written_and_round_trips(tmp_path):
    cfg = load_config(CONFIG, [f"experiment.run_root={tmp_path}", "learner.lr=2e-3", "slurm.setup=[echo a]"])
    run_dir = create_run_dir(cfg)
    assert run_dir.parent == tmp_path
    resolved = run_dir / RESOLVED_NAME
    assert yaml.safe_load(resolved.read_text())["learner"]["lr"] == pytest.approx(2e-3)
    assert load_config(resolved) == cfg
    with pytest.raises(RunDirError, match="already exists"):
        create_run_dir(cfg, run_id=run_dir.name)


def hpcrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.jobs.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_validate_ok_and_print():
    ok = hpcrl("validate", "config.yaml")
    assert ok.returncode == 0, ok.stderr
    assert "config OK" in ok.stdout
    printed = hpcrl("validate", "config.yaml", "learner.lr=3e-4", "--print")
    assert printed.returncode == 0
    assert yaml.safe_load(printed.stdout)["learner"]["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["learner.lr=-1"], "config error: learner.lr: must be > 0 (got -1) [from override learner.lr=-1]"),
        (
            ["executor=slurmm"],
            "config error: executor: must be one of local, slurm (got 'slurmm') [from override executor=slurmm]",
        ),
        (
            ["learner.lrr=1"],
            "config error: learner.lrr: unknown key (did you mean 'lr'?); valid keys: lr, max_staleness, "
            "algorithm, group_size, batch_groups, micro_batch, micro_batch_tokens, share_prompt, weight_decay, "
            "adam_beta1, adam_beta2, "
            "adam_eps, "
            "lr_schedule, lr_decay_steps, lr_warmup_steps, lr_min_ratio, skip_empty_steps, filter_groups, "
            "store_refresh_s, "
            "grad_clip, max_steps, publish_every, keep_weights, checkpoint_every, keep_checkpoints, dist_backend, "
            "logit_chunk_tokens, activation_checkpointing, gather_per_layer, offload_optimizer, offload_params, "
            "deepspeed, eval "
            "[from override learner.lrr=1]",
        ),
        (["oops"], "config error: override 'oops': expected KEY=VALUE with a dotted key, e.g. learner.lr=3e-4"),
    ],
)
def test_cli_validate_errors_are_one_line_exit_2(args, expected):
    proc = hpcrl("validate", "config.yaml", *args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == expected
    assert proc.stdout == ""


def test_cli_validate_bad_file(tmp_path):
    bad = write(tmp_path, "learner:\n  lr: 0\n")
    proc = hpcrl("validate", str(bad))
    assert proc.returncode == 2 and proc.stderr.strip() == "config error: learner.lr: must be > 0 (got 0)"
    proc = hpcrl("validate", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "no such config file" in proc.stderr


def test_cli_help_for_every_verb():
    from hpcrl.jobs.cli import VERBS

    top = hpcrl("--help")
    assert top.returncode == 0
    for verb in VERBS:
        assert verb in top.stdout
        sub = hpcrl(verb, "--help")
        assert sub.returncode == 0 and "usage: hpcrl " + verb in sub.stdout
    assert hpcrl().returncode == 2
    assert hpcrl("nosuchverb").returncode == 2


def test_console_script_installed():
    exe = Path(sys.executable).parent / "hpcrl"
    assert exe.exists(), "pip install -e . should install the `hpcrl` console script"
    proc = subprocess.run([str(exe), "validate", str(CONFIG)], capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr


def test_partial_section_keeps_the_fields_own_defaults(tmp_path):
    # SlurmRoleConfig's class default is the cpu partition; the learner field's default is gpu.
    cfg = load_config(write(tmp_path, "slurm:\n  learner:\n    time_min: 5\n    signal_delay_s: 30\n"))
    assert (cfg.slurm.learner.partition, cfg.slurm.learner.gpus_per_node, cfg.slurm.learner.time_min) == ("gpu", 1, 5)
    assert load_config(None, ["slurm.generator.mem_gb=8"]).slurm.generator.partition == "gpu"


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"learner:\n  lr: " + b"1" * 5000 + b"\n", "a value is out of range"),
        (b"learner: " + b"[" * 5000 + b"\n", "nested too deeply"),
        (b"experiment:\n  name: \xff\xfe\n", "is not UTF-8 text"),
        (b"learner:\n  lr: .inf\n", "learner.lr: must be a finite number"),
        (b"learner:\n  max_steps: " + b"9" * 30 + b"\n", "learner.max_steps: must fit in 64 bits"),
        (b"learner:\n  lr: " + b"9" * 400 + b"\n", "learner.lr: must be a finite number"),
        (b"experiment:\n  name: " + b"x" * 5000 + b"\n", "characters)"),
        # Each level repeats the one before nine times: 9^8 strings from a few hundred bytes.
        (
            b"learner:\n  deepspeed:\n    a0: &a0 [x, x, x, x, x, x, x, x, x]\n"
            + b"".join(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n".encode() for i in range(1, 9)),
            "exp.yaml:4:14: invalid YAML: alias *a0 is not accepted",
        ),
    ],
    ids=["5000-digit int", "5000 nested [", "not UTF-8", "inf", "huge int", "huge float", "long string", "alias bomb"],
)
def test_hostile_config_files_fail_with_one_short_line_exit_2(tmp_path, content, fragment):
    path = tmp_path / "exp.yaml"
    path.write_bytes(content)
    r = hpcrl("validate", str(path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and len(r.stderr) < 400 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert fragment in r.stderr


def test_hostile_overrides_fail_with_one_short_line_exit_2():
    r = hpcrl("validate", "config.yaml", "learner.lr=" + "1" * 5000)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and len(r.stderr) < 400, r.stderr[-2000:]
    r = hpcrl("validate", "config.yaml", "learner.lr=.nan")
    assert r.returncode == 2 and "must be a finite number" in r.stderr


def test_limits_built_in_code_refuse_infinite_values():
    from hpcrl.core.config import Limits

    with pytest.raises(ConfigError, match="Limits.wall_s: must be a finite number"):
        Limits(wall_s=float("inf"))


def test_sandbox_exec_refuses_an_infinite_timeout_with_one_line(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("pass\n")
    r = hpcrl("sandbox", "exec", "--lang", "python", str(prog), "--timeout-s", "inf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "must be a finite number" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "run_id", ["../../../../tmp/escaped", "a/b", ".hidden", "line\nbreak", "x" * 200, ""], ids=repr
)
@pytest.mark.parametrize("verb", ["run", "submit", "sbatch"])
def test_bad_run_ids_are_refused_before_anything_is_created(tmp_path, verb, run_id):
    root = tmp_path / "runs"
    extra = ["executor=slurm"] if verb != "run" else []
    out = ["-o", str(tmp_path / "scripts")] if verb == "sbatch" else []
    r = hpcrl(verb, "config.yaml", f"experiment.run_root={root}", *extra, "--run-id", run_id, *out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--run-id" in r.stderr, r.stderr[-2000:]
    assert not root.exists() or not any(root.iterdir())
    assert not (tmp_path.parent / "escaped").exists() and not Path("/tmp/escaped").exists()


def test_a_reused_run_id_is_one_line_exit_2(tmp_path):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    r = hpcrl("run", "config.yaml", f"experiment.run_root={tmp_path / 'runs'}", "--run-id", "taken")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "already exists" in r.stderr, r.stderr[-2000:]


def test_one_learner_rank_per_gpu_is_checked_at_load(tmp_path):
    err = error_of(tmp_path, "slurm:\n  learner: {gpus_per_node: 8, tasks_per_node: 1}\n")
    assert err.path == "slurm.learner.tasks_per_node"
    assert "set slurm.learner.tasks_per_node: 8" in str(err) and "7 GPU(s) per node would idle" in str(err)
    cfg = load_config(write(tmp_path, "slurm:\n  learner: {gpus_per_node: 8, tasks_per_node: 8, nodes: 2}\n"))
    assert cfg.slurm.learner.tasks_per_node == 8
    assert load_config(None, ["slurm.learner.gpus_per_node=0", "slurm.learner.tasks_per_node=2"])  # CPU ranks
    err = error_of(tmp_path, "slurm:\n  generator: {gpus_per_node: 4}\n")
    assert err.path == "slurm.generator.gpus_per_node" and "generators.count" in str(err)
    r = hpcrl("validate", "config.yaml", "slurm.learner.gpus_per_node=8")
    assert r.returncode == 2 and "tasks_per_node: 8" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "override, path, fragment",
    [
        ("learner.deepspeed={zero_optimisation: {stage: 3}}", "learner.deepspeed.zero_optimisation",
         "zero_optimization"),
        ("learner.deepspeed={train_micro_batch_size_per_gpu: 4}", "learner.deepspeed.train_micro_batch_size_per_gpu",
         "learner.micro_batch"),
        ("learner.deepspeed={zero_optimization: {offload_optimizer: {devic: cpu}}}",
         "learner.deepspeed.zero_optimization.offload_optimizer.devic", "unknown key"),
        ("learner.deepspeed={bf16: {enabled: maybe}}", "learner.deepspeed.bf16.enabled", "bool"),
        ("learner.deepspeed={scheduler: {type: WarmupLR}}", "learner.deepspeed.scheduler", "learner.lr_schedule"),
    ],
)  # fmt: skip
def test_deepspeed_passthrough_is_checked_with_dotted_paths(override, path, fragment):
    r = hpcrl("validate", "config.yaml", override)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"config error: {path}:" in r.stderr and fragment in r.stderr, r.stderr


def test_deepspeed_passthrough_merges_over_the_defaults():
    from hpcrl.rl.learner.dsconfig import deepspeed_config

    over = {"zero_optimization": {"stage3_prefetch_bucket_size": 5e8}, "comms_logger": {"enabled": True}}
    cfg = load_config(None, [f"learner.deepspeed={over}", "learner.offload_optimizer=cpu", "policy.dtype=bfloat16"])
    ds = deepspeed_config(cfg.learner, cfg.policy, micro_steps=2)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == 0  # defaults kept
    assert zero["stage3_prefetch_bucket_size"] == 5e8 and ds["comms_logger"] == {"enabled": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["optimizer"]["type"] == "AdamW" and ds["bf16"] == {"enabled": True}
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_micro_batch_size_per_gpu"] == cfg.learner.micro_batch
    # The offloaded (DeepSpeed) AdamW takes the learner's Adam options; learner.lr wins over one set here.
    opt = ["learner.offload_optimizer=cpu", "learner.adam_beta2=0.95", "learner.adam_eps=1e-6", "learner.lr=3e-4",
           "learner.deepspeed={optimizer: {type: AdamW, params: {lr: 0.1}}}"]  # fmt: skip
    cfg = load_config(None, opt)
    params = deepspeed_config(cfg.learner, cfg.policy, micro_steps=1)["optimizer"]["params"]
    assert params["betas"] == [0.9, 0.95] and params["eps"] == 1e-6 and params["lr"] == 3e-4


def test_gather_per_layer_makes_the_models_decoder_layers_zero3_leaf_modules():
    """learner.gather_per_layer: the model's _no_split_modules join DeepSpeed's leaf classes; a
    leaf_module the site configured, or a model that names no layer, leaves the config as it is."""
    from hpcrl.rl.learner.dsconfig import deepspeed_config, layer_leaf_modules

    cfg = load_config(None, [])
    ds = deepspeed_config(cfg.learner, cfg.policy, micro_steps=1)

    class Model:
        _no_split_modules = ["LlamaDecoderLayer"]

    leaf = layer_leaf_modules(ds, Model())["zero_optimization"]["leaf_module"]["classes"]
    assert leaf[-1] == "LlamaDecoderLayer" and len(leaf) == len(set(leaf)) > 1  # DeepSpeed's MoE defaults kept
    assert "leaf_module" not in ds["zero_optimization"]  # the input is not modified
    assert layer_leaf_modules(ds, object()) == ds
    own = {"zero_optimization": {"leaf_module": {"classes": ["MyBlock"]}}}
    cfg = load_config(None, [f"learner.deepspeed={own}"])
    ds = deepspeed_config(cfg.learner, cfg.policy, micro_steps=1)
    assert layer_leaf_modules(ds, Model())["zero_optimization"]["leaf_module"] == {"classes": ["MyBlock"]}
