"""The Policy protocol on a Megatron-Core GPTModel: any TP x PP x DP, exact summed gradients.

Layout and parallelism:
  - ``parallel_state`` is initialised from the default process group (torchrun / srun started it; a single
    process without one gets a one-rank gloo group), TP x PP from ``policy.tensor_parallel_size`` /
    ``policy.pipeline_parallel_size``, DP = world / (TP x PP). Each rank holds its shard of the model.
  - The model is built by ``nemo_disco.policy.megatron_model`` (layer spec: Transformer Engine on a GPU in
    bf16 / fp16, else the local spec; fused kernels only where they import). With TE, sequences are packed
    (THD, no padding); otherwise the local layer spec runs on a padded batch with an explicit attention mask
    (mcore's own causal mask is built on CUDA). On CPU ``cpu_compat`` patches the CUDA assumptions.
  - Every sequence is laid out from position 0 (``nemo_disco.policy.megatron_layout``), so positions and RoPE
    angles match Hugging Face's forward exactly; rows are grouped into micro-batches by
    ``nemo_disco.batch.split_microbatches``.
  - Families: Qwen2 / Qwen2.5, Llama 3.x, Qwen3 (q / k norms, head_dim from the config) and Qwen3-MoE
    (``nemo_disco.weights``). MoE layers split their experts over ``policy.expert_parallel_size`` ranks of a
    pipeline stage (expert tensor parallelism 1; the all-to-all token dispatcher, which runs on CPU with gloo
    too) and run sequence parallel at TP > 1 (mcore requires it; the sequence is padded to a multiple of TP).
    The ranks of an expert-parallel group run as many micro-batches each (fillers are added, their output
    discarded). The router is frozen by default (``policy.freeze_router``, as NeMo-RL); its load-balancing
    loss is measured every update and added to the objective only with ``policy.router_aux_loss_coef`` > 0
    (``megatron_moe.RouterBalance``), so by default the gradient is exactly that of the surrogate below.

Gradient exactness (the surrogate carries global normalisation, see ``nemo_disco.policy.base``):
  - ``calculate_per_token_loss=True`` and a loss function returning ``(loss, num_tokens, ...)``: the pipeline
    schedules do NOT divide the loss by the number of micro-batches;
  - Megatron DDP with ``calculate_per_token_loss=True`` and ``average_in_collective=False``: gradients are
    SUMMED over data-parallel ranks (``gradient_scaling_factor=1``);
  - ``finalize_model_grads`` is called with ``num_tokens=None``, so gradients are not divided by a token count.
  So the gradient is exactly the sum over micro-batches and DP ranks of ``d surrogate / d theta``.

Optimiser: Megatron's (distributed, when ``policy.use_distributed_optimizer``) optimizer on GPU; on CPU a
plain ``torch.optim.AdamW`` over the DDP gradient buffers (mcore's clipping asserts CUDA tensors), with the
same weight-decay groups (none on biases and norms), each group's decay and learning rate written before every
update (:func:`set_group_hyperparameters`). The gradient norm is taken over the full model
(TP-replicated and tied copies counted once) before clipping; a non-finite surrogate or norm on any rank
skips the update on every rank.

What :meth:`MegatronPolicy.save` writes into ``policy/`` (``nemo_disco.convert.megatron_to_hf`` reads it):
  - ``megatron.json``: format marker, update counter, TP / PP / dtype it was saved with, padded vocabulary,
    the layer spec (``transformer_engine`` or ``local``; either loads into either, see
    ``megatron_model.load_model_checkpoint``);
  - ``config.json`` + tokenizer files + ``generation_config.json``: copied from the Hugging Face source;
  - ``model/``: a Megatron dist checkpoint (torch_dist) of the weights; tensors are stored globally, so it
    loads at any TP / PP (vocabulary padding must match: it does for any TP dividing ``vocab_multiple``);
  - ``optimizer/``: a dist checkpoint of the optimizer state (absent in weights-only checkpoints).

A forward-only policy (``trainable=False``, the reference policy of the GRPO family's KL term) has neither
gradient buffers, optimizer nor fp32 master weights; it is offloaded with the trained policy.

Colocated offload (:meth:`MegatronPolicy.offload`): gradients and optimizer state leave the GPU before the
refit, the weights after it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nemo_disco import distributed, weights
from nemo_disco.batch import RolloutBatch, split_microbatches
from nemo_disco.config import PolicyConfig, RunConfig
from nemo_disco.policy import cpu_compat
from nemo_disco.policy.base import RunValues, SurrogateFn
from nemo_disco.policy.logprobs import token_logprobs
from nemo_disco.policy.megatron_layout import MicroBatch, prepare_microbatch
from nemo_disco.policy.megatron_model import (
    LAYER_SPECS,
    build_gpt_model,
    init_parallel,
    is_checkpoint_dir,
    load_hf_weights,
    load_model_checkpoint,
    make_empty_dir,
    model_device,
    read_checkpoint_meta,
    save_model_checkpoint,
    transformer_config,
    use_transformer_engine,
    write_policy_files,
)
from nemo_disco.policy.megatron_moe import RouterBalance, is_router
from nemo_disco.policy.schedule import lr_at

# ----------------------------------------------------------------------------------------------------------------------
# Optimizer parameter groups (both optimizer paths).


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Mcore's default rule: no weight decay on biases and 1-D parameters (norms)."""
    return name.endswith(".bias") or param.dim() == 1


def set_group_hyperparameters(groups: list[dict[str, Any]], lr: float, weight_decay: float) -> None:
    """Each group's learning rate and weight decay for the next update: ``lr x lr_mult``, ``decay x wd_mult``.

    What mcore's ``OptimizerParamScheduler`` does every step. mcore's groups carry ``wd_mult`` (0 for biases
    and norms) but its inner Adam applies ``OptimizerConfig.weight_decay`` to every group unless the group's
    own ``weight_decay`` is written, so both optimizer paths call this before every step.
    """
    for group in groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


# How the distributed optimizer lays out its checkpoint: "fully_reshardable" restores at any DP / TP / PP, as the
# weights do (Megatron-LM passes this or "dp_reshardable"). Without it mcore picks the deprecated
# "fully_sharded_model_space", whose flattened tensors its own checkpoint code refuses (0.16.1 and 0.19.2:
# "ShardedTensor.flattened_range is not supported"), so a save with the distributed optimizer would fail.
OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The inner torch Adam / AdamW of each of mcore's optimizers (chained or not); none under TE or apex."""
    inner = [getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [opt for opt in inner if isinstance(opt, torch.optim.Adam | torch.optim.AdamW)]


def init_torch_adam_state(optimizer: Any) -> None:
    """Zero moments and step 0 for every parameter of mcore's inner torch Adam that has no state yet.

    Without Transformer Engine or apex, mcore's optimizers wrap ``torch.optim.AdamW``, which has no state before
    its first step; the distributed optimizer's ``state_dict()`` (called by ``sharded_state_dict``, also when
    loading) asserts that every parameter's state holds one common ``step`` (megatron-core 0.16.1 and 0.19.2
    ``distrib_optimizer.py``), so a freshly built policy could not load a checkpoint. The state made here is
    what AdamW's first step starts from (its next step is the same update, bitwise), and a load overwrites it.
    A no-op under TE's or apex's FusedAdam.
    """
    for opt in _torch_adams(optimizer):
        for group in opt.param_groups:
            on_device = group.get("capturable") or group.get("fused")
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else None),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }


def restore_adam_steps(optimizer: Any) -> None:
    """Each parameter of mcore's inner torch Adam gets a step tensor of its own, set to the loaded step.

    Without TE or apex, the distributed optimizer saves the common Adam step in its parameter groups
    (``state_dict``) and, on load, hands every parameter one shared step tensor; its "dp_reshardable" parameter
    state then copies into that tensor the step of the template built before the load (0 for a fresh
    optimizer), so the resumed optimizer would restart its bias corrections (measured on CPU with 0.16.1:
    weights off by 3e-4 after the next update). torch's Adam also increments each parameter's step in place, so a
    shared tensor would count one update once per parameter. The groups' loaded ``step`` is the truth.
    """
    for opt in _torch_adams(optimizer):
        for group in opt.param_groups:
            step = group.get("step")
            for p in group["params"]:
                state = opt.state.get(p)
                if state and isinstance(state.get("step"), torch.Tensor):
                    value = state["step"] if step is None else torch.tensor(float(step))
                    state["step"] = value.to(state["step"].device, torch.float32).clone()


# ----------------------------------------------------------------------------------------------------------------------


def _to_host(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Copies of ``tensors`` on the host: from a GPU into pinned memory without blocking, then one synchronize."""
    if not any(t is not None and t.is_cuda for t in tensors):
        return tuple(None if t is None else t.cpu() for t in tensors)
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
    torch.cuda.current_stream().synchronize()
    return tuple(out)


class MegatronPolicy:
    """pi_theta as a Megatron-Core GPTModel shard (see the module docstring)."""

    # Build Megatron's optimizer on the CPU too (tests of the GPU path's optimizer; they shim its CUDA checks).
    MCORE_OPTIMIZER_ON_CPU = False

    def __init__(
        self,
        pc: PolicyConfig,
        model_dir: str | Path,
        run: RunValues,
        *,
        vocab_multiple: int | None = None,
        trainable: bool = True,
    ) -> None:
        """Build the model from an HF folder or a Megatron policy directory.

        Args:
            pc: the ``policy`` section of the run config.
            model_dir: an HF folder (config.json + safetensors) or a directory written by :meth:`save` /
                ``nemo_disco.convert.hf_to_megatron`` (its weights only; the optimizer starts fresh).
            run: the run values the policy needs (seed, temperature, total updates, refit bucket size).
            vocab_multiple: pad the vocabulary to a multiple of lcm(this, TP) (Megatron's
                ``make_vocab_size_divisible_by``); default: the checkpoint's, else 128.
            trainable: False builds a forward-only model (a reference policy): no gradient buffers, no
                optimizer, no fp32 master weights; only :meth:`logprobs`, :meth:`offload` and :meth:`onload`.
        """
        cpu_compat.apply()
        from megatron.core import parallel_state as ps

        self.pc = pc
        self.run = run
        self.model_dir = Path(model_dir)
        self.on_gpu = torch.cuda.is_available()
        # Megatron's optimizer (distributed when asked) on a GPU, torch's AdamW on the CPU; tests of the GPU
        # path's optimizer set ``MCORE_OPTIMIZER_ON_CPU`` on a subclass.
        self.mcore_optimizer = self.on_gpu or self.MCORE_OPTIMIZER_ON_CPU
        self.dtype = weights.DTYPES[pc.dtype]
        self.tp, self.pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.spec = weights.ModelSpec.from_dir(self.model_dir)
        self.ep = pc.expert_parallel_size
        if self.spec.is_moe:
            weights.local_experts(self.spec, self.ep)
        elif self.ep > 1:
            raise ValueError(
                f"policy.expert_parallel_size={self.ep} needs a mixture-of-experts model; {self.model_dir} is "
                f"{self.spec.architecture} (dense)"
            )
        init_parallel(self.tp, self.pp, run.seed, ep=self.ep if self.spec.is_moe else None)
        # After init: under torchrun / srun it selects this process's GPU.
        self.device = model_device()
        from_checkpoint = is_checkpoint_dir(self.model_dir)
        meta = read_checkpoint_meta(self.model_dir) if from_checkpoint else {}
        self.vocab_multiple = vocab_multiple or meta.get("vocab_multiple") or weights.DEFAULT_VOCAB_MULTIPLE
        self.padded_vocab = weights.padded_vocab_size(self.spec.vocab_size, self.tp, self.vocab_multiple)
        self.use_te = use_transformer_engine(pc.transformer_engine, pc.dtype)
        self.layer_spec = LAYER_SPECS[0] if self.use_te else LAYER_SPECS[1]
        self.packed = self.use_te  # THD packing needs TE attention
        self.temperature = run.temperature
        self.tf_config = transformer_config(
            self.spec,
            tp=self.tp,
            pp=self.pp,
            dtype=self.dtype,
            use_te=self.use_te,
            recompute=pc.activation_checkpointing,
            ep=self.ep,
            router_dtype=pc.router_dtype,
            sequence_parallel=pc.sequence_parallel,
            moe_permute_fusion=pc.moe_permute_fusion,
        )
        self.gpt = build_gpt_model(self.spec, self.tf_config, self.padded_vocab, self.use_te)
        if from_checkpoint:
            self._check_meta(meta, self.model_dir)
            load_model_checkpoint(self.gpt, self.model_dir / "model")
        else:
            load_hf_weights(self.gpt, self.model_dir, self.spec, self.padded_vocab)
        self._source_dir = self.model_dir
        self.trainable = trainable
        if trainable and self.spec.is_moe and pc.freeze_router:
            # Frozen before DDP and the optimizer see them: no gradient buffer, no optimizer state (NeMo-RL's
            # freeze_moe_router); the gradient still flows through the routing weights to the layers below.
            for name, p in self.gpt.named_parameters():
                if is_router(name):
                    p.requires_grad_(False)
        self.ep_group = ps.get_expert_model_parallel_group() if self.spec.is_moe else None
        self.balance = None
        if self.spec.is_moe:
            sp_group = ps.get_tensor_model_parallel_group() if self.tf_config.sequence_parallel else None
            # Only full recomputation runs the routers twice (selective recomputes the core attention alone).
            full = pc.activation_checkpointing == "full"
            self.balance = RouterBalance(self.gpt, self.spec, pc.router_aux_loss_coef, full, sp_group)
        if trainable:
            self.model = self._wrap_ddp()
            self.optimizer = self._build_optimizer()
        else:
            for p in self.gpt.parameters():
                p.requires_grad_(False)
            self.model, self.optimizer = self.gpt, None
        self.updates = 0
        self.total_updates = run.total_updates
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self._last_stage_rank = ps.get_pipeline_model_parallel_last_rank()
        self._offloaded: set[str] = set()  # "optimizer" (gradients + optimizer state) and / or "weights"
        self.last_router_stats: dict[str, float] = {}

    @classmethod
    def from_run_config(
        cls, cfg: RunConfig, model_dir: str | Path, *, vocab_multiple: int | None = None, trainable: bool = True
    ) -> MegatronPolicy:
        """The policy of a run config (its ``policy`` section and :meth:`RunValues.of`)."""
        return cls(cfg.policy, model_dir, RunValues.of(cfg), vocab_multiple=vocab_multiple, trainable=trainable)

    # ------------------------------------------------------------------------------------------------------------------
    # Construction helpers.

    def _wrap_ddp(self) -> Any:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        pc = self.pc
        dist_opt = self.mcore_optimizer and pc.use_distributed_optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=pc.overlap_grad_reduce,
            overlap_param_gather=dist_opt and pc.overlap_param_gather,
            use_distributed_optimizer=dist_opt,
            # SUM over data-parallel ranks: the surrogate is already globally normalised.
            average_in_collective=False,
        )
        with cpu_compat.device_scope():
            ddp = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=self.gpt)
        if ddp_config.overlap_grad_reduce:
            # The schedules run every micro-batch but the last under no_sync (a bucket is reduced once, when the
            # last micro-batch's backward has filled it; Megatron-LM's training.py wires the same hooks).
            self.tf_config.no_sync_func = ddp.no_sync
            self.tf_config.grad_sync_func = ddp.start_grad_sync
        if ddp_config.overlap_param_gather:
            self.tf_config.param_sync_func = ddp.start_param_sync
        return ddp

    def _gather_params(self) -> None:
        """Complete the distributed optimizer's deferred parameter all-gather before reading the parameters.

        With ``policy.overlap_param_gather`` the gather of updated shards runs inside the next forward's
        pre-hooks; the refit, a checkpoint and an offload read parameters without a forward (Megatron-LM forces
        the gather the same way before it saves).
        """
        if self.trainable and self.model.ddp_config.overlap_param_gather:
            self.model.disable_forward_pre_hook(param_sync=True)
            self.model.enable_forward_pre_hook()

    def _build_optimizer(self) -> Any:
        return self._build_megatron_optimizer() if self.mcore_optimizer else self._build_torch_optimizer()

    def _build_megatron_optimizer(self) -> Any:
        """Mcore's optimizer (distributed when ``policy.use_distributed_optimizer``); the GPU path.

        Its parameter groups carry ``wd_mult`` / ``lr_mult``; :func:`set_group_hyperparameters` turns them
        into each group's decay and learning rate at every update.
        """
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        pc = self.pc
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=pc.lr,
            weight_decay=pc.weight_decay,
            adam_beta1=pc.adam_beta1,
            adam_beta2=pc.adam_beta2,
            adam_eps=pc.adam_eps,
            clip_grad=pc.grad_clip,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
            params_dtype=self.dtype,
            use_distributed_optimizer=pc.use_distributed_optimizer and self.mcore_optimizer,
        )
        with cpu_compat.device_scope():  # tests build it on CPU to compare its groups with the CPU path's
            optimizer = get_megatron_optimizer(opt_config, [self.model])
        if self.dtype == torch.float16:
            self.tf_config.grad_scale_func = optimizer.scale_loss
        set_group_hyperparameters(optimizer.param_groups, pc.lr, pc.weight_decay)
        return optimizer

    def _build_torch_optimizer(self) -> torch.optim.AdamW:
        """AdamW over the DDP gradient buffers with mcore's default decay groups; the CPU path."""
        pc = self.pc
        decay, no_decay = [], []
        for name, p in self.gpt.named_parameters():
            if p.requires_grad:  # a frozen router has neither gradient buffer nor optimizer state
                (no_decay if no_weight_decay(name, p) else decay).append(p)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        groups = [g for g in groups if g["params"]]
        set_group_hyperparameters(groups, pc.lr, pc.weight_decay)
        return torch.optim.AdamW(groups, lr=pc.lr, betas=(pc.adam_beta1, pc.adam_beta2), eps=pc.adam_eps)

    def _check_meta(self, meta: dict[str, Any], where: Path) -> None:
        if int(meta["padded_vocab_size"]) != self.padded_vocab:
            raise ValueError(
                f"{where}: the checkpoint pads the vocabulary to {meta['padded_vocab_size']} rows but TP="
                f"{self.tp} with vocab_multiple={self.vocab_multiple} pads to {self.padded_vocab}"
            )

    # ------------------------------------------------------------------------------------------------------------------
    # Forward / backward through the schedules.

    def microbatch_rows(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Row indices of the micro-batches :meth:`train_minibatch` runs ``batch`` in (see ``Policy``)."""
        return split_microbatches(batch, self.pc.microbatch_tokens, "packed" if self.packed else "trimmed")

    def _microbatches(self, batch: RolloutBatch) -> list[MicroBatch]:
        groups = self.microbatch_rows(batch)
        multiple = self.tp if self.tf_config.sequence_parallel else 1
        mbs = [prepare_microbatch(batch, rows, self.packed, self.device, multiple) for rows in groups]
        if self.ep > 1:
            # Every MoE layer exchanges tokens with the other ranks of its expert-parallel group: all of them must
            # run as many forward passes. Ranks with fewer micro-batches add copies of a one-row micro-batch whose
            # output is discarded (zero loss, no log-probs stored, not counted in the router statistics).
            target = distributed.max_int(len(mbs), group=self.ep_group)
            filler = prepare_microbatch(batch, groups[0][:1], self.packed, self.device, multiple)
            filler = dataclasses.replace(filler, filler=True)
            mbs += [filler] * (target - len(mbs))
        return mbs

    def _response_logprobs(
        self, logits: torch.Tensor, mb: MicroBatch, width: int, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, R] log-probs (and entropy) of the response tokens from this shard's logits [b, s, V / TP]."""
        shard = self.padded_vocab // self.tp
        lp, ent = token_logprobs(
            logits,
            mb.targets,
            temperature=self.temperature,
            group=self.tp_group if self.tp > 1 else None,
            vocab_start=self.tp_rank * shard,
            vocab_size=self.spec.vocab_size,
            chunk_size=self.pc.logprob_chunk_size,
            entropy=entropy,
        )  # [b, s] each

        def pick(x: torch.Tensor) -> torch.Tensor:
            out = x.reshape(-1)[mb.response_index]  # [n, r]
            out = torch.where(mb.response_mask, out, torch.zeros_like(out))
            return torch.nn.functional.pad(out, (0, width - out.shape[1]))  # [n, R]

        return pick(lp), (pick(ent) if entropy else None)

    def _run(
        self,
        mbs: list[MicroBatch],
        width: int,
        entropy: bool,
        on_output: Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], torch.Tensor],
        forward_only: bool,
    ) -> None:
        """One pass over the micro-batches through Megatron's schedule; ``on_output`` runs on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def loss_func(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            lp, ent = self._response_logprobs(logits, mb, width, entropy)
            value = lp.sum() * 0.0 if mb.filler else on_output(mb, lp, ent)
            # A 3-tuple with calculate_per_token_loss: the schedule neither divides by num_tokens nor by the
            # number of micro-batches, so the backward is exactly d value / d theta.
            return value, torch.ones((), dtype=torch.int, device=value.device), {}

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Callable]:
            mb = next(data_iterator)
            if self.balance is not None:
                self.balance.set_tokens(mb)
            out = model(mb.input_ids, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed)
            return out, functools.partial(loss_func, mb)

        with cpu_compat.device_scope():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(mbs),
                model=[self.model],
                num_microbatches=len(mbs),
                seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs),
                micro_batch_size=max(int(mb.input_ids.shape[0]) for mb in mbs),
                forward_only=forward_only,
            )

    def _broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.pp > 1:
            distributed.broadcast(t, src=self._last_stage_rank, group=self.pp_group)
        return t

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of ``batch.response_ids``, [N, R] float32 on CPU, on every rank."""
        self.model.eval()
        n, width = batch.response_ids.shape
        lp_all = torch.zeros((n, width), dtype=torch.float32, device=self.device)
        ent_all = torch.zeros((n, width), dtype=torch.float32, device=self.device) if entropy else None

        def store(mb: MicroBatch, lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
            rows = mb.rows.to(self.device)
            lp_all[rows] = lp
            if ent_all is not None:
                ent_all[rows] = ent
            return lp.new_zeros(())

        self._run(self._microbatches(batch), width, entropy, store, forward_only=True)
        self._broadcast_from_last_stage(lp_all)
        if ent_all is not None:
            self._broadcast_from_last_stage(ent_all)
        return _to_host(lp_all, ent_all)

    def accumulate_gradients(self, batch: RolloutBatch, surrogate_fn: SurrogateFn, *, entropy: bool = False) -> float:
        """Zero the gradients, then backward of the summed surrogate over micro-batches and DP ranks (no step).

        The first half of :meth:`train_minibatch`; with :meth:`export_gradients` it lets tests and tools read
        the exact gradient. Returns the summed surrogate of this DP rank's micro-batches (on every rank of the
        model-parallel group).
        """
        from megatron.core.distributed import finalize_model_grads

        self.model.train()
        self.model.zero_grad_buffer()
        values: list[torch.Tensor] = []

        def surrogate(mb: MicroBatch, lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
            value = surrogate_fn(mb.rows, lp, ent)
            values.append(value.detach().float())
            return value

        mbs = self._microbatches(batch)
        if self.balance is not None:
            self.balance.start(mbs, self.dp_group)
        self._run(mbs, batch.response_ids.shape[1], entropy, surrogate, forward_only=False)
        if self.balance is not None:
            self.last_router_stats = self.balance.finish(self.dp_group, self.pp_group if self.pp > 1 else None)
        with cpu_compat.device_scope():
            # DP all-reduce (SUM) and the tied-embedding sync; num_tokens=None: no division by a token count.
            finalize_model_grads([self.model], num_tokens=None)
        total = torch.stack(values).sum() if values else torch.zeros((), device=self.device)
        return float(self._broadcast_from_last_stage(total.reshape(1).to(self.device)))

    def train_minibatch(
        self,
        batch: RolloutBatch,
        surrogate_fn: SurrogateFn,
        *,
        entropy: bool = False,
        lr: float | None = None,
    ) -> dict[str, float]:
        """One optimizer update on the summed micro-batch surrogates (see ``Policy.train_minibatch``).

        Args:
            batch: this DP rank's rollouts.
            surrogate_fn: ``(rows, logprobs [n, R], entropy [n, R] | None) -> scalar``, called per micro-batch
                on the last pipeline stage.
            entropy: pass per-token entropy to ``surrogate_fn``.
            lr: learning rate of this update; None follows ``policy.schedule.lr_at``.
        """
        if not self.trainable:
            raise RuntimeError("train_minibatch on a forward-only (reference) policy")
        surrogate = self.accumulate_gradients(batch, surrogate_fn, entropy=entropy)
        step_lr = lr_at(self.updates, self.pc, self.total_updates) if lr is None else lr
        clip = self.pc.grad_clip
        if self.mcore_optimizer:
            grad_norm, skipped = self._step_megatron(step_lr, clip, surrogate)
        else:
            grad_norm, skipped = self._step_torch(step_lr, clip, surrogate)
        self.model.zero_grad_buffer()
        if not skipped:
            self.updates += 1
        out = {"grad_norm": grad_norm, "lr": step_lr, "skipped": float(skipped), "surrogate": surrogate}
        if self.balance is not None:
            out.update(self.last_router_stats)
        return out

    def _any_rank(self, flag: bool) -> bool:
        return distributed.any_rank(flag)

    def _step_torch(self, step_lr: float, clip: float, surrogate: float) -> tuple[float, bool]:
        grad_norm = self.grad_norm()
        if self._any_rank(not (math.isfinite(surrogate) and math.isfinite(grad_norm))):
            return grad_norm, True
        coeff = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        trained = [p for p in self.gpt.parameters() if p.requires_grad]
        for p in trained:
            g = p.main_grad if coeff == 1.0 else p.main_grad * coeff
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        set_group_hyperparameters(self.optimizer.param_groups, step_lr, self.pc.weight_decay)
        self.optimizer.step()
        for p in trained:
            p.grad = None
        return grad_norm, False

    def _step_megatron(self, step_lr: float, clip: float, surrogate: float) -> tuple[float, bool]:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if self._any_rank(found_inf or not (math.isfinite(surrogate) and math.isfinite(grad_norm))):
            self.optimizer.zero_grad()
            return grad_norm, True
        set_group_hyperparameters(self.optimizer.param_groups, step_lr, self.pc.weight_decay)
        if clip > 0:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, clip, grad_norm)
        self.optimizer.step_with_ready_grads()
        self.optimizer.zero_grad()
        return grad_norm, False

    def grad_norm(self) -> float:
        """L2 norm of the accumulated gradient of the whole model (TP / PP reduced; replicas counted once).

        Expert weights (mcore marks them ``allreduce=False``) are distinct on every rank of the expert-parallel
        group and never split over TP (expert TP 1): their squares are summed over that group and PP instead.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        expert_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.gpt.parameters():
            if not p.requires_grad or not param_is_not_shared(p):
                continue
            if not getattr(p, "allreduce", True):
                expert_sq += p.main_grad.float().pow(2).sum()
            elif param_is_not_tensor_parallel_duplicate(p):
                sq += p.main_grad.float().pow(2).sum()
        distributed.all_reduce(sq, group=ps.get_model_parallel_group())
        if self.spec.is_moe:
            distributed.all_reduce(expert_sq, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((sq + expert_sq).sqrt())

    # ------------------------------------------------------------------------------------------------------------------
    # Weights, checkpoints, offload.

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, TP-gathered and PP-broadcast in buckets of ``generation.refit_bucket_mb``."""
        self._gather_params()
        yield from weights.export_hf(
            dict(self.gpt.named_parameters()),
            self.spec,
            tp_group=self.tp_group if self.tp > 1 else None,
            pp_group=self.pp_group if self.pp > 1 else None,
            ep_group=self.ep_group if self.ep > 1 else None,
            bucket_bytes=self.run.refit_bucket_mb * 2**20,
        )

    def export_gradients(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The accumulated gradient (after :meth:`accumulate_gradients`) as full HF-named tensors.

        Raises:
            RuntimeError: with the distributed optimizer and DP > 1 the gradient buffers are reduce-scattered:
                each rank holds the summed gradient of its shard only, so the full gradient is not at hand.
        """
        if self.model.ddp_config.use_distributed_optimizer and self.dp_size > 1:
            raise RuntimeError(
                "export_gradients: with policy.use_distributed_optimizer=true and data-parallel size "
                f"{self.dp_size} each rank holds only its shard of the reduced gradient; use "
                "policy.use_distributed_optimizer=false (or DP 1) to read the full gradient"
            )
        # A frozen parameter (the MoE router by default) has no gradient buffer: its update is zero.
        grads = {n: p.main_grad if p.requires_grad else torch.zeros_like(p) for n, p in self.gpt.named_parameters()}
        yield from weights.export_hf(
            grads,
            self.spec,
            tp_group=self.tp_group if self.tp > 1 else None,
            pp_group=self.pp_group if self.pp > 1 else None,
            ep_group=self.ep_group if self.ep > 1 else None,
            bucket_bytes=self.run.refit_bucket_mb * 2**20,
        )

    def _optimizer_sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        model_sd = self.gpt.sharded_state_dict()
        if self.mcore_optimizer:
            init_torch_adam_state(self.optimizer)
            return self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_CKPT_METADATA)
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        self._init_adam_state()
        state = self.optimizer.state_dict()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        steps = {float(s["step"]) for s in state["state"].values()}
        if len(steps) > 1:
            raise ValueError(f"optimizer steps differ across parameters: {sorted(steps)}")
        common_step = steps.pop()
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        optim_state_to_sharding_state(state, id_map, exclude_keys="step")
        state["state"]["common_step"] = common_step
        return state

    def _init_adam_state(self) -> None:
        """Zero AdamW moments for parameters without state: identical to a fresh optimizer, but saveable."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if not self.optimizer.state[p]:
                    self.optimizer.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }

    def save(self, directory: Path) -> None:
        """Collective: weights and optimizer as dist checkpoints, plus ``megatron.json`` and the HF files."""
        from megatron.core import dist_checkpointing

        if not self.trainable:
            raise RuntimeError("a forward-only (reference) policy has no training state to save")
        directory = Path(directory)
        self._gather_params()
        if distributed.rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
        distributed.barrier()
        save_model_checkpoint(self.gpt, directory / "model")
        make_empty_dir(directory / "optimizer")
        with cpu_compat.device_scope():
            dist_checkpointing.save(self._optimizer_sharded_state_dict(is_loading=False), str(directory / "optimizer"))
        if distributed.rank() == 0:
            write_policy_files(directory, self._source_dir, self._meta())
        distributed.barrier()

    def _meta(self) -> dict[str, Any]:
        return {
            "updates": self.updates,
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "expert_parallel_size": self.ep,
            "dtype": self.pc.dtype,
            "vocab_size": self.spec.vocab_size,
            "padded_vocab_size": self.padded_vocab,
            "vocab_multiple": self.vocab_multiple,
            "layer_spec": self.layer_spec,
        }

    def load(self, directory: Path) -> None:
        """Collective: restore what :meth:`save` wrote, or the weights of a weights-only dir.

        Weights restore at any TP / PP. The optimizer state does too on the CPU path; Megatron's distributed
        optimizer saves it as "dp_reshardable" (:data:`OPTIMIZER_CKPT_METADATA`), restored at the same TP / PP and
        any data-parallel size.
        """
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        meta = read_checkpoint_meta(directory)
        self._check_meta(meta, directory)
        load_model_checkpoint(self.gpt, directory / "model")
        if self.mcore_optimizer:
            self.optimizer.reload_model_params()
        if (directory / "optimizer").is_dir():
            with cpu_compat.device_scope():
                template = self._optimizer_sharded_state_dict(is_loading=True)
                state = dist_checkpointing.load(template, str(directory / "optimizer"))
            if not self.mcore_optimizer:
                step = state["state"].pop("common_step")
                for s in state["state"].values():
                    s["step"] = torch.tensor(float(step), dtype=torch.float32)
            with torch.no_grad():  # the distributed optimizer copies into views of the fp32 parameters
                self.optimizer.load_state_dict(state)
            if self.mcore_optimizer:
                restore_adam_steps(self.optimizer)
        self.updates = int(meta.get("updates", 0))

    def offload(self, *, weights: bool = True) -> None:
        """Free the GPU for the generator: gradients and optimizer state, then (``weights``) the weights too.

        The colocated order (``nemo_disco.algorithm.generation_phase``) calls ``offload(weights=False)`` before
        the refit (the weights are read by it) and ``offload()`` after. A no-op on a CPU-only machine.
        """
        if not self.on_gpu:
            return
        self._gather_params()
        if "optimizer" not in self._offloaded and self.trainable:
            self.model.offload_grad_buffers(synchronize=True, empty_cache=False)
            self._move_optimizer(torch.device("cpu"))
            self._offloaded.add("optimizer")
        if weights and "weights" not in self._offloaded:
            self._move_weights(torch.device("cpu"))
            self._offloaded.add("weights")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Inverse of :meth:`offload` (whatever it moved)."""
        if not self.on_gpu or not self._offloaded:
            return
        if "weights" in self._offloaded:
            self._move_weights(self.device)
        if "optimizer" in self._offloaded:
            self.model.restore_grad_buffers(synchronize=False)
            self._move_optimizer(self.device)
        torch.cuda.synchronize()
        self._offloaded.clear()

    def _move_weights(self, device: torch.device) -> None:
        """The weights to ``device``: DDP's parameter buffers (distributed optimizer) or each parameter."""
        buffers = self._param_buffers()
        for buffer in buffers:
            if buffer.param_data is not None:
                move = buffer.offload_to_cpu if device.type == "cpu" else buffer.reload_from_cpu
                move(move_params=True, move_grads=False)
        in_buffers = any(buffer.param_data is not None for buffer in buffers)
        for p in self.gpt.parameters():
            if not in_buffers or not p.requires_grad:  # a frozen router is in no buffer
                p.data = p.data.to(device, non_blocking=True)

    def _param_buffers(self) -> list[Any]:
        """Megatron DDP's parameter / gradient buffers: the dense ones and, for MoE, the experts' own."""
        if not self.trainable:
            return []
        return list(self.model.buffers) + list(getattr(self.model, "expert_parallel_buffers", []))

    def _move_optimizer(self, device: torch.device) -> None:
        """Adam moments and, for bf16 / fp16 weights, the fp32 master copies (float32 masters ARE the weights)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:  # a stub optimizer of a rank without parameters of that kind
                continue
            for state in inner.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(device, non_blocking=True)
            if self.dtype != torch.float32:
                for group in inner.param_groups:
                    for p in group["params"]:
                        p.data = p.data.to(device, non_blocking=True)
