"""The learner: a DeepSpeed ZeRO-3 engine over the policy, trained on groups of trajectories.

    learner = Learner(cfg.learner, cfg.policy, run_dir, seed=cfg.experiment.seed)
    extra = learner.setup()          # join the process group, build, resume if a checkpoint exists
    stats = learner.train_step(groups)   # every rank passes the same groups; each trains its share
    learner.publish()                # gather the ZeRO-3 shards, write weights v<version> for generators
    learner.checkpoint({"store_cursor": ...})   # model + optimizer + your state, every rank
    learner.close()

Run it as one process per rank: torchrun/deepspeed launchers, srun (SLURM_PROCID...), mpirun,
or plain RANK/WORLD_SIZE/MASTER_ADDR; see rl/common/distenv.py (the ranks meet at a store of the run
that only holders of its keys reach). On CPU the backend is gloo
(DS_ACCELERATOR=cpu), on GPUs NCCL (`learner.dist_backend: auto`).

Versions: `step` counts optimizer steps (restored from the checkpoint); `version` numbers the
published policies and only ever grows, also across a restart: a learner resumed from step 40
whose predecessor had already published version 43 publishes its weights as 44, so generators
(which only take newer versions) switch to the resumed policy at once.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hpcrl.core.config import LearnerConfig, PolicyConfig
from hpcrl.rl.common.distenv import DistEnv, init_process_group, resolve_dist_env
from hpcrl.rl.learner.algorithms import make_algorithm
from hpcrl.rl.learner.batch import collate, collate_rows, layout, trained_tokens
from hpcrl.rl.learner.checkpoints import CheckpointError, mark_complete, prune_checkpoints, resume_tag
from hpcrl.rl.learner.collectives import Collectives, backend_device, resolve_backend
from hpcrl.rl.learner.diagnostics import batch_diagnostics
from hpcrl.rl.learner.dsconfig import check_deepspeed_section, deepspeed_config, import_deepspeed, layer_leaf_modules
from hpcrl.rl.learner.packing import MASKED_ATTENTION, Unit, attention_mask, pack, plan_units
from hpcrl.rl.learner.reference import ReferencePolicy, kl_penalty
from hpcrl.rl.learner.schedule import entropy_coef_at, lr_at, set_lr
from hpcrl.rl.model.logprobs import PolicyHead
from hpcrl.rl.model.policy import build_policy_model, load_tokenizer, model_eos_ids, resolve_device
from hpcrl.rl.record.trajectory import Trajectory
from hpcrl.rl.weights.direct import DirectSender
from hpcrl.rl.weights.shards import Bucket, ShardPublisher, WeightStore, owned_names

__all__ = ["Learner"]

_GATHER_NUMEL = 1 << 26  # gather at most ~64M parameters at once when publishing


class Learner:
    def __init__(
        self,
        cfg: LearnerConfig,
        policy: PolicyConfig,
        run_dir: str | os.PathLike,
        seed: int,
        dist: DistEnv | None = None,
    ):
        self.cfg, self.policy_cfg = cfg, policy
        self.run_dir = Path(run_dir)
        self.seed = seed
        self.dist = dist
        self.algorithm = make_algorithm(cfg.algorithm)
        self.weights = WeightStore(self.run_dir, keep=cfg.keep_weights)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.engine = None
        self.reference = None
        self.publisher: ShardPublisher | None = None
        self.direct = None  # DirectSender on rank 0 with policy.weight_sync: direct
        self.comm: Collectives | None = None
        self.step = 0
        self.version = 0

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> dict[str, Any]:
        """Join the process group, build the engine, resume from the newest checkpoint if any.
        Returns the `extra` state saved with that checkpoint ({} on a fresh start)."""
        self.device = resolve_device(self.policy_cfg.device)
        ds = self.ds = import_deepspeed(self.device)
        self.dist = self.dist or resolve_dist_env(str(self.run_dir.resolve()))
        self.dist.export()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.dist.local_rank)
            self.device = torch.device("cuda", self.dist.local_rank)
        backend = resolve_backend(self.cfg.dist_backend, self.device)
        init_process_group(self.dist, backend, self.run_dir)  # on the run's authenticated store, not env://
        ds.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        self.rank, self.world = self.dist.rank, self.dist.world_size
        # Our own collectives on the backend's device (NCCL: CUDA tensors only).
        self.comm = self.comm or Collectives(backend_device(backend, self.dist.local_rank))

        batch = self.cfg.batch_groups * self.cfg.group_size
        per_rank = math.ceil(batch / self.world)
        self.micro_steps = math.ceil(per_rank / self.cfg.micro_batch)
        check_deepspeed_section(self.cfg.deepspeed)
        config = self.ds_config = deepspeed_config(self.cfg, self.policy_cfg, self.micro_steps)
        self.tokenizer = load_tokenizer(self.policy_cfg)
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )
        # What ends an action, for the diagnostics' eos_fraction (the model folder may declare several).
        self.eos_ids = frozenset({self.tokenizer.eos_token_id, *model_eos_ids(self.policy_cfg)} - {None})
        self.engine = self._build_engine(config)
        if self.cfg.algorithm.beta > 0:
            self.reference = ReferencePolicy(ds, self._initial_model, config, self.cfg.logit_chunk_tokens)
        self.publisher = ShardPublisher(self.weights, self.rank, self.world)
        if self.policy_cfg.weight_sync == "direct" and self.rank == 0:
            self.direct = DirectSender(self.run_dir, backend)

        extra: dict[str, Any] = {}
        # Rank 0 chooses (rl/learner/checkpoints.py): every rank loads the same tag even if one rank's
        # view of the shared filesystem lags.
        choice: tuple[str, str | None] = ("tag", None)
        if self.rank == 0:
            try:
                choice = ("tag", resume_tag(self.ckpt_dir))
            except Exception as exc:  # every rank waits in the broadcast below: tell them, then raise
                choice = ("error", str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
        kind, tag = self.comm.broadcast_object(choice, src=0)
        if kind == "error":
            raise CheckpointError(tag)
        if tag is not None:
            _, client = self.engine.load_checkpoint(str(self.ckpt_dir), tag=tag)
            self.step = int(client["step"])
            extra = dict(client.get("extra") or {})
            announced = self.weights.latest()
            self.version = max(int(client["version"]), announced[0] if announced else 0) + 1
            if self.rank == 0:
                self.weights.discard_above(self.version - 1)
            self.comm.barrier()  # no rank writes a shard of the new version before that
        self.publish()
        return extra

    def _initial_model(self):
        # Same seed on every rank: ZeRO-3 partitions one identical model.
        if self.policy_cfg.path is None:
            model = build_policy_model(self.policy_cfg, self.tokenizer, self.seed)
        else:
            # transformers' ZeRO-3 integration, on while this model loads: from_pretrained creates
            # it inside zero.Init and loads the weights straight into the shards. Off again after,
            # so a generator built in this process (hpcrl.rl.learner.inprocess) gets a whole model.
            from transformers.integrations import HfDeepSpeedConfig
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            keep = HfDeepSpeedConfig(self.ds_config)
            try:
                model = build_policy_model(self.policy_cfg, self.tokenizer, self.seed)
            finally:
                unset_hf_deepspeed_config()
                del keep
        model.config.use_cache = False
        return model

    def _build_engine(self, config: dict):
        """The policy as a DeepSpeed engine around a `PolicyHead` (chunked log-probabilities)."""
        model = self._initial_model()
        if self.cfg.gather_per_layer:
            config = self.ds_config = layer_leaf_modules(config, model)  # the reference model's too
        if self.cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        head = PolicyHead(model, self.cfg.logit_chunk_tokens, zero3=True)
        # A DeepSpeed optimizer from the config (offload: its CPU Adam) or torch's AdamW.
        opt = None
        if "optimizer" not in config:
            opt = torch.optim.AdamW(
                head.parameters(),
                lr=self.cfg.lr,
                weight_decay=self.cfg.weight_decay,
                betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
                eps=self.cfg.adam_eps,
            )
        engine, *_ = self.ds.initialize(model=head, optimizer=opt, config=config)
        self.attn_impl = getattr(model.config, "_attn_implementation", None) or "eager"
        self.dtype = next(model.parameters()).dtype  # an eager attention mask's dtype
        self.share_prompt = self.cfg.share_prompt and self.attn_impl in MASKED_ATTENTION
        if self.cfg.share_prompt and not self.share_prompt:
            warnings.warn(
                f"learner.share_prompt: the model's {self.attn_impl!r} attention takes no 4-D mask "
                f"(one of {MASKED_ATTENTION} does); training one row per trajectory",
                stacklevel=2,
            )
        return engine

    # -- training ------------------------------------------------------------------------

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, Any]:
        """One optimizer step on `groups` (batch_groups groups of group_size). Every rank must
        call it with the same groups; rank r trains rows r, r + world, ... (with share_prompt:
        groups r, r + world, ..., whole)."""
        t0 = time.perf_counter()
        trajs = [t for g in groups for t in g]
        expected = self.cfg.batch_groups * self.cfg.group_size
        if len(trajs) != expected:
            raise ValueError(
                f"train_step: got {len(trajs)} trajectories, the configured batch is "
                f"batch_groups x group_size = {expected}"
            )
        rewards = torch.tensor([t.final_reward for t in trajs])
        gidx = torch.tensor([i for i, g in enumerate(groups) for _ in g])
        adv = self.algorithm.advantages(rewards, gidx)
        ent_coef = entropy_coef_at(self.cfg.algorithm, self.step)
        # Every advantage 0 (no group with reward variance): no policy gradient, yet an Adam step
        # would still move every weight on momentum (and on the entropy bonus alone). Skip it:
        # the step counts, the weights, the optimizer state and the version stay.
        skip = self.cfg.skip_empty_steps and bool((adv.abs() < 1e-12).all())

        if self.share_prompt:
            # Whole groups per rank, each group's common prompt once (rl/learner/packing.py).
            starts = [0]
            for g in groups:
                starts.append(starts[-1] + len(g))
            mine_groups = [list(range(starts[k], starts[k + 1])) for k in range(self.rank, len(groups), self.world)]
            mine = [i for g in mine_groups for i in g]
            rows = {i: layout(trajs[i]) for i in mine}
            units = plan_units(rows, mine_groups, self.cfg.micro_batch_tokens, self.cfg.micro_batch)
            chunks = self._chunks(units, [u.length for u in units], [len(u.members) for u in units])
        else:
            mine = list(range(self.rank, len(trajs), self.world))
            # Rows of similar length together (contiguous runs of the sorted rows) keep padding
            # low; the chunk count is the same on every rank (possibly an empty chunk), because
            # each forward pass gathers ZeRO-3 shards collectively.
            mine.sort(key=lambda i: -trajs[i].n_tokens)
            chunks = self._chunks(mine, [trajs[i].n_tokens for i in mine], [1] * len(mine))
        if self.world > 1:
            chunks += [[]] * (int(self.comm.max([float(len(chunks))])[0]) - len(chunks))
        local_den = self.algorithm.denominator([trained_tokens(trajs[i]) for i in mine])
        total_den = max(self.comm.sum([float(local_den)])[0], 1.0)
        lr = lr_at(self.cfg, self.step)
        set_lr(self.engine.optimizer, lr)

        stats: dict[str, float] = defaultdict(float)
        ratio_lo, ratio_hi = float("inf"), float("-inf")
        self.engine.train()
        for k, chunk in enumerate([] if skip else chunks):
            # The number of micro-batches follows the batch's lengths, not DeepSpeed's configured
            # gradient_accumulation_steps: the last one is the boundary that reduces and steps.
            self.engine.set_gradient_accumulation_boundary(k == len(chunks) - 1)
            if self.share_prompt:
                loss_sum, st = self._micro_step_packed(chunk, rows, trajs, adv, ent_coef)
            else:
                loss_sum, st = self._micro_step(chunk, trajs, adv, ent_coef)
            # DeepSpeed averages gradients over ranks: scale so the result is the batch's loss
            # (loss_agg's weighted sum over the whole batch / its denominator), whatever each
            # rank and micro-batch holds.
            loss = loss_sum * (self.world / total_den)
            self.engine.backward(loss, scale_wrt_gas=False)
            self.engine.step()
            ratio_lo, ratio_hi = min(ratio_lo, st.pop("ratio_min")), max(ratio_hi, st.pop("ratio_max"))
            for k, v in st.items():
                stats[k] += v
            stats["loss_sum"] += float(loss_sum.detach())
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        diag = batch_diagnostics(groups, adv, self.version, self.eos_ids, decode)
        self.step += 1
        self.version += 0 if skip else 1
        keys = (
            "loss_sum", "ratio_sum", "clipped_sum", "kl_sum", "tokens", "rows", "entropy_sum", "entropy_first_sum",
            "ref_kl_sum",
        )  # fmt: skip
        loss_s, ratio_s, clip_s, kl_s, tok, rows, ent_s, ent1_s, ref_kl_s = self.comm.sum([stats[k] for k in keys])
        neg_lo, ratio_hi = self.comm.max([-ratio_lo, ratio_hi])
        nan = float("nan")
        by_domain: dict[str, list[float]] = defaultdict(list)
        for t in trajs:
            by_domain[t.domain].append(t.final_reward)
        grad_norm = self.engine.get_global_grad_norm()
        out = {
            "step": self.step,
            "version": self.version,
            "loss": loss_s / total_den,
            "reward": float(rewards.mean()),
            "reward_by_domain": {d: sum(v) / len(v) for d, v in by_domain.items()},
            "ratio_mean": ratio_s / tok if tok else nan,
            "ratio_min": -neg_lo if tok else nan,
            "ratio_max": ratio_hi if tok else nan,
            "clip_fraction": clip_s / tok if tok else nan,
            "kl": kl_s / tok if tok else nan,
            "entropy": ent_s / tok if tok else nan,
            "entropy_first": ent1_s / rows if rows else nan,
            **({"ref_kl": ref_kl_s / tok if tok else nan} if self.reference is not None else {}),
            "grad_norm": float(grad_norm) if grad_norm is not None and not skip else nan,
            "action_tokens": int(tok),
            "lr": lr,
            "entropy_coef": ent_coef,
            "skipped": skip,
            "micro_batches": 0 if skip else len(chunks),
            **diag,
            "step_s": time.perf_counter() - t0,
        }
        out["publish_s"] = 0.0  # gathering the shards for the generators (the write is a thread's)
        if not skip and self.step % self.cfg.publish_every == 0:
            t1 = time.perf_counter()
            self.publish()
            out["publish_s"] = time.perf_counter() - t1
        return out

    def _chunks(self, items: list, lengths: list[int], counts: list[int]) -> list[list]:
        """`items` (rows or packed units, longest first; each `lengths` tokens holding `counts`
        trajectories) cut into micro-batches of at most micro_batch trajectories and
        micro_batch_tokens padded tokens (items x the longest); one over the budget goes alone.
        Short rows thus share one pass (fewer, larger kernels), long ones are bounded in memory."""
        cap_rows, cap_tokens = self.cfg.micro_batch, self.cfg.micro_batch_tokens
        out: list[list] = []
        cur: list = []
        longest = held = 0
        for item, n, k in zip(items, lengths, counts):
            over_rows = held + k > cap_rows
            if cur and (over_rows or (cap_tokens and (len(cur) + 1) * max(longest, n) > cap_tokens)):
                out.append(cur)
                cur, longest, held = [], 0, 0
            cur.append(item)
            longest, held = max(longest, n), held + k
        return [*out, cur]

    def _micro_step(self, chunk: list[int], trajs: Sequence[Trajectory], adv: torch.Tensor, ent_coef: float):
        if not chunk:
            # This rank has fewer rows than another: run a masked dummy row anyway, so the
            # collective parameter gathers inside forward stay in step across ranks.
            ids = torch.tensor([[self.pad_id, self.pad_id]], device=self.device)
            lp, _ = self.engine(ids, torch.ones_like(ids))
            if self.reference is not None:
                self.reference.logprobs(ids, torch.ones_like(ids))
            return (lp * 0.0).sum(), {"ratio_min": float("inf"), "ratio_max": float("-inf")}
        tb = collate([trajs[i] for i in chunk], adv[chunk], self.pad_id).to(self.device)
        return self._loss(self.engine(tb.input_ids, tb.attention_mask, shaping=tb.shaping), tb, ent_coef)

    def _loss(self, out: torch.Tensor, tb, ent_coef: float):
        """`out`: the head's (log q, entropy[, the model's own log p]); see PolicyHead.forward.
        log q is of the sampling distribution each token was drawn from, recomputed from the
        current logits; without shaping it is the model's own log p."""
        lp, entropy = out[0], out[1]
        own_lp = out[2] if len(out) > 2 else lp
        if not ent_coef:
            entropy = entropy.detach()  # measured for the diagnostics only
        loss_sum, stats = self.algorithm.token_loss(lp, tb, entropy, ent_coef)
        if self.reference is not None:
            loss_sum, stats = self._add_reference_kl(loss_sum, stats, own_lp, tb)
        return loss_sum, stats

    def _micro_step_packed(self, units: list, rows: dict, trajs: Sequence[Trajectory], adv: torch.Tensor, ent_coef):
        if not units:
            # This rank has fewer micro-batches than another: a masked dummy row through the same
            # packed pass (ZeRO-3 checks that every rank's forward visits the same modules).
            dummy = {0: ([self.pad_id, self.pad_id], [1.0], [0.0], None)}
            pb = pack([Unit((0,), 0, 2)], dummy, self.pad_id).to(self.device)
            lp, _ = self.engine(pb.input_ids, self._packed_mask([], pb), packed=pb)
            if self.reference is not None:
                self.reference.logprobs(pb.input_ids, torch.ones_like(pb.input_ids))
            return (lp * 0.0).sum(), {"ratio_min": float("inf"), "ratio_max": float("-inf")}
        members = [i for u in units for i in u.members]  # the grid's rows, in pack()'s order
        tb = collate_rows([rows[i] for i in members], adv[members], self.pad_id).to(self.device)
        pb = pack(units, rows, self.pad_id).to(self.device)
        out = self.engine(pb.input_ids, self._packed_mask(units, pb), packed=pb, shaping=pb.shaping)
        return self._loss(out, tb, ent_coef)

    def _packed_mask(self, units: list, pb) -> torch.Tensor:
        """The 4-D mask when some unit shares a prefix; else plain rows, and the 2-D padding
        mask (the model's own causal mask: no [L, L] tensor for a long row of its own)."""
        if any(u.prefix for u in units):
            return attention_mask(pb.segment, self.attn_impl, self.dtype)
        return (pb.segment >= 0).long()

    def _add_reference_kl(self, loss_sum: torch.Tensor, stats: dict, own_lp: torch.Tensor, tb):
        """loss + beta x KL(pi || reference) over the micro-batch's action tokens (rl/learner/reference.py:
        k2, each token weighted by pi / mu, capped as the policy loss caps its weight)."""

        ref_lp = self.reference.logprobs(tb.input_ids, tb.attention_mask)
        mask = tb.action_mask
        is_weight = torch.exp((own_lp.detach() - tb.behaviour_logprobs) * mask).clamp(max=self.cfg.algorithm.max_ratio)
        kl_sum, kl_stats = kl_penalty(own_lp, ref_lp, mask, self.algorithm.token_weights(mask), is_weight)
        return loss_sum + self.cfg.algorithm.beta * kl_sum, {**stats, **kl_stats}

    # -- weights and checkpoints ----------------------------------------------------------

    def gather_plan(self) -> tuple[list[list[tuple[str, torch.nn.Parameter]]], dict[str, torch.Tensor]]:
        """What publishing gathers: the parameters in chunks of at most _GATHER_NUMEL elements
        (each gathered at once, into one bucket), and on rank 0 the persistent buffers that are
        no parameter (one more bucket)."""
        module = self.engine.module.lm
        chunks, numel = [], 0
        for name, p in module.named_parameters():
            if not chunks or numel + _numel(p) > _GATHER_NUMEL:
                chunks.append([])
                numel = 0
            chunks[-1].append((name, p))
            numel += _numel(p)
        names = {n for chunk in chunks for n, _ in chunk}
        persistent = set(module.state_dict().keys()) if self.rank == 0 else set()
        return chunks, {n: b.detach() for n, b in module.named_buffers() if n in persistent and n not in names}

    def gathered_state_dict(self, plan, everything_on_rank0: bool = True, on_bucket=None) -> dict[str, torch.Tensor]:
        """Full weights from the ZeRO-3 shards, on the host in the policy dtype. Every rank must
        call it (gathering is collective); parameters are gathered in bounded chunks (`plan`, from
        `gather_plan`), each copied once into a flat host buffer (a `Bucket`; pinned on GPUs)
        whose views are returned, and handed to `on_bucket` as soon as it is filled. Each rank
        keeps the tensors `owned_names` gives it; rank 0 all of them if `everything_on_rank0`."""
        chunks, extra = plan
        named = [(n, p) for chunk in chunks for n, p in chunk]
        owners = owned_names([n for n, _ in named], [_numel(p) for _, p in named], self.world)
        mine = set(owners[self.rank]) if not (everything_on_rank0 and self.rank == 0) else {n for n, _ in named}
        dtype = self._publish_dtype()
        pin = self.device.type == "cuda"
        out: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            with self.ds.zero.GatheredParameters([p for _, p in chunk], modifier_rank=None):
                kept = [(name, p) for name, p in chunk if name in mine]
                bucket = Bucket([(name, dtype, p.shape) for name, p in kept], pin=pin)
                for name, p in kept:
                    bucket.tensors[name].copy_(p.detach())
            out.update(bucket.tensors)
            if on_bucket is not None and kept:
                on_bucket(bucket)
        if extra:
            bucket = Bucket.of(extra, pin=pin)
            out.update(bucket.tensors)
            if on_bucket is not None:
                on_bucket(bucket)
        return out

    def _publish_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.policy_cfg.dtype == "bfloat16" else torch.float32

    def publish(self) -> None:
        """Policy version `self.version`: every rank gathers and keeps its share on the host, a
        thread writes its shard (rank 0 then announces); training goes on meanwhile. With the
        direct path, rank 0's gathered buckets stream to the generators as they fill (their
        layout, known before gathering, announced first)."""
        plan, feed, dtype = self.gather_plan(), None, self._publish_dtype()
        if self.direct is not None:
            layout = [[(n, dtype, getattr(p, "ds_shape", p.shape)) for n, p in chunk] for chunk in plan[0]]
            extra = [[(n, b.dtype, b.shape) for n, b in plan[1].items()]] if plan[1] else []
            feed = self.direct.stream(self.version, layout + extra)
        try:
            state = self.gathered_state_dict(plan, everything_on_rank0=feed is not None, on_bucket=feed and feed.put)
        except BaseException:
            if feed is not None:
                feed.abort()
            raise
        if feed is not None:
            feed.close()
            named = [n for n, _ in self.engine.module.lm.named_parameters()]
            mine = set(owned_names(named, [state[n].numel() for n in named], self.world)[0])
            state = {k: v for k, v in state.items() if k in mine or k not in named}
        self.publisher.submit(self.version, state)

    def checkpoint(self, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, step, version and `extra` (e.g. the store cursor). Every rank calls it."""
        tag = f"step{self.step:08d}"
        client = {"step": self.step, "version": self.version, "extra": extra or {}}
        if self.rank == 0 and (self.ckpt_dir / tag).exists():
            # The same step saved again (after a resume from an older checkpoint): old files and
            # an old completion mark must not pass for the new save if this one dies halfway.
            shutil.rmtree(self.ckpt_dir / tag)
        self.comm.barrier()
        # No DeepSpeed `latest`: rank 0 would write it before every rank has saved, and a resume
        # goes by completion marks (rl/learner/checkpoints.py).
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
        self.comm.barrier()
        if self.rank == 0:
            mark_complete(self.ckpt_dir / tag, self.step, self.version)  # every rank's files are written
            prune_checkpoints(self.ckpt_dir, keep=self.cfg.keep_checkpoints, saved=tag)

    def close(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # All ranks leave together: a rank tearing gloo down while a peer still talks to it
            # can abort the peer at exit ("terminate called without an active exception").
            self.comm.barrier()
            # Release the engine (ZeRO-3 hooks, optimizer, its references to process groups)
            # while the interpreter is whole: groups that survive until interpreter teardown
            # join their gloo threads in arbitrary destructor order, which aborted a rank at
            # exit once in a loaded test run.
            if self.publisher is not None:
                self.publisher.flush()  # the last version is written and announced before we go
            if self.direct is not None:
                self.direct.close()  # sends what is queued, says goodbye to each generator
                self.direct = None
            if self.reference is not None:
                self.reference.close()
                self.reference = None
            if self.engine is not None:
                self.engine.destroy()
                self.engine = None
                gc.collect()
            torch.distributed.destroy_process_group()


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))
