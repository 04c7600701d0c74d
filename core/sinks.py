"""Each learner step's metrics also where users already look: TensorBoard and Weights & Biases.

    sinks = MetricSinks(run_dir, cfg.metrics, run_dir / "metrics.jsonl", config=to_dict(cfg))
    sinks.pump()          # the rows appended to metrics.jsonl since the last pump, to every sink
    sinks.close()         # the last rows, files flushed, the W&B run finished

The run's driver pumps (`hpcrl run`'s loop, the Slurm supervisor's poll), so components keep no
sink of their own and one writer feeds each. Both packages are optional and imported only when
enabled (`metrics.tensorboard: true`; `metrics.wandb.mode: online | offline`; `hpcrl validate`
says when one is missing). TensorBoard event files go to RUN/tensorboard (`tensorboard --logdir
RUN/tensorboard`); W&B's files to RUN/wandb: offline, for a cluster without network, sync them
later with `wandb sync RUN/wandb/offline-run-*`. A resumed run goes on with the same W&B run
(its id is the run id) and never logs a row twice (the position read is kept in RUN/sinks.json).

Names are the Prometheus series' (core/metrics.py): `hpcrl_reward`, `hpcrl_policy_version`,
`hpcrl_trajectories_per_s`, and `hpcrl_learner_<key>` for the learner's other numbers (loss,
entropy, grad_norm, wait_s, ...); a label becomes a path part, so the series
`hpcrl_reward{domain="arith/copy"}` is `hpcrl_reward/domain=arith/copy` (TensorBoard and W&B
group a section by the part before the first '/'). The x axis is the learner step
(`hpcrl_learner_step`). A sink that fails (a full disk, no network) is dropped with a warning:
metrics are never worth a run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hpcrl.core.files import atomic_write_json
from hpcrl.core.metrics import PREFIX

__all__ = ["MetricSinks", "series", "STATE_NAME"]

log = logging.getLogger("hpcrl.sinks")
STATE_NAME = "sinks.json"  # {"offset": bytes of metrics.jsonl already passed to the sinks}

# Row keys with a Prometheus series of another name (rl/coordinator/coordinator.py metrics()).
_NAMES = {"step": "learner_step", "version": "policy_version", "reward": "reward", "traj_per_s": "trajectories_per_s"}
# Row keys holding {label value: number}, and the label (the Prometheus series' where one exists).
_LABELLED = {"reward_by_domain": ("reward", "domain"), "busy": ("busy_fraction", "role")}
_SKIP = {"time", "elapsed_s", "reported_at", "reward_by_prompt", "staleness_hist"}


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
        return float(v)
    return None


def series(row: dict) -> dict[str, float]:
    """{name: value} of one metrics.jsonl row, named as the Prometheus series (see the module doc)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in _SKIP:
            continue
        if key in _LABELLED and isinstance(value, dict):
            name, label = _LABELLED[key]
            for sub, v in value.items():
                if (x := _number(v)) is not None:
                    out[f"{PREFIX}{name}/{label}={sub}"] = x
            continue
        x = _number(value)
        if x is None:
            continue
        if key.startswith("eval/"):  # eval/<domain>/pass@<k>, eval/<domain>/version, eval/step
            domain, _, what = key[len("eval/") :].rpartition("/")
            if what.startswith("pass@"):
                out[f"{PREFIX}eval_pass_at_k/domain={domain},k={what[len('pass@') :]}"] = x
            elif domain:
                out[f"{PREFIX}eval_{what}/domain={domain}"] = x
            else:
                out[f"{PREFIX}eval_{what}"] = x
            continue
        out[PREFIX + _NAMES.get(key, "learner_" + key)] = x
    return out


class _TensorBoard:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, step: int, values: dict[str, float], walltime: float | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=walltime)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, cfg, config: dict | None):
        import wandb

        # The run id is the W&B id: a resumed run (or a requeued supervisor) continues the same one.
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(run_dir),
            id=run_dir.name,
            name=run_dir.name,
            resume="allow",
            config=config,
        )
        # Charts against the learner step, which a restarted learner repeats: W&B's own step must grow.
        self.run.define_metric(PREFIX + "learner_step")
        self.run.define_metric("*", step_metric=PREFIX + "learner_step")

    def write(self, step: int, values: dict[str, float], walltime: float | None) -> None:
        self.run.log(values)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MetricSinks:
    """The enabled sinks of one run, fed from metrics.jsonl (`pump`)."""

    def __init__(self, run_dir: str | os.PathLike, cfg, source: str | os.PathLike, config: dict | None = None):
        self.run_dir, self.source = Path(run_dir), Path(source)
        self.sinks: dict[str, Any] = {}
        self.offset = 0
        if not cfg.tensorboard and cfg.wandb.mode == "disabled":
            return
        try:
            self.offset = int(json.loads((self.run_dir / STATE_NAME).read_text())["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            self.offset = 0
        makers = {
            "tensorboard": (cfg.tensorboard, lambda: _TensorBoard(self.run_dir / "tensorboard")),
            "wandb": (cfg.wandb.mode != "disabled", lambda: _Wandb(self.run_dir, cfg.wandb, config)),
        }
        for name, (on, make) in makers.items():
            if on:
                try:
                    self.sinks[name] = make()
                except Exception as exc:  # not installed, no network: the run goes on without it
                    log.warning("metrics.%s: not writing there: %s: %s", name, type(exc).__name__, exc)

    def pump(self) -> int:
        """Pass the whole rows appended since the last pump to every sink; how many."""
        if not self.sinks:
            return 0
        rows, cut = step_rows_since(self.source, self.offset)
        for name, sink in list(self.sinks.items()):
            try:
                for row in rows:
                    sink.write(row["step"], series(row), row.get("time"))
                sink.flush()
            except Exception as exc:
                log.warning("metrics.%s: stopped writing there: %s: %s", name, type(exc).__name__, exc)
                self.sinks.pop(name)
        if cut != self.offset:
            self.offset = cut
            try:
                atomic_write_json(self.run_dir / STATE_NAME, {"offset": self.offset})
            except OSError as exc:
                log.warning("cannot record the metrics sinks' position: %s", exc)
        return len(rows)

    def close(self) -> None:
        self.pump()
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as exc:
                log.warning("metrics.%s: closing: %s: %s", name, type(exc).__name__, exc)
        self.sinks = {}


def step_rows_since(path: str | os.PathLike, offset: int) -> tuple[list[dict], int]:
    """The step rows (JSON objects with an integer `step`) of the whole lines metrics.jsonl got
    after byte `offset`, and the offset after them: a line still being written waits for the
    next read, an unparsable one is passed over."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    cut = data.rfind(b"\n") + 1
    rows = []
    for line in data[:cut].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows, offset + cut
