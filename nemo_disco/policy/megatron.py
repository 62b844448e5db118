"""The Policy protocol on a Megatron-Core GPTModel: any TP x PP x DP, exact summed gradients.

Layout and parallelism:
  - ``parallel_state`` is initialised from the default process group (torchrun / srun started it; a single
    process without one gets a one-rank gloo group), TP x PP from ``policy.tensor_parallel_size`` /
    ``policy.pipeline_parallel_size``, DP = world / (TP x PP). Each rank holds its shard of the model.
  - ``policy.transformer_engine``: ``auto`` takes the Transformer Engine layer spec on a GPU in bf16 / fp16
    and the local spec on the CPU or in float32 (TE has no fp32 packed attention and runs fp32 GEMMs in TF32);
    a GPU run in 16-bit whose TE does not import stops with the import error and the remedy
    (:func:`decide_transformer_engine`); ``true`` requires TE; ``false`` is the local spec. With TE,
    sequences are packed (THD, no padding). Otherwise the local layer spec on a padded batch with an explicit
    attention mask (mcore's own causal mask is built on CUDA). On CPU ``cpu_compat`` patches the CUDA
    assumptions.
  - Fused kernels from apex (masked softmax, gradient-accumulation fusion) are switched on only when their
    extension modules import (:func:`fusion_flags`); TE does not provide them, and mcore would raise.
  - Every sequence is laid out from position 0 (prompt then response, padding after it), as the generator
    sees it, so positions and RoPE angles match Hugging Face's forward exactly.
  - Families: Qwen2 / Qwen2.5, Llama 3.x, Qwen3 (q / k norms, head_dim from the config) and Qwen3-MoE
    (``nemo_disco.weights``). MoE layers split their experts over ``policy.expert_parallel_size`` ranks of a
    pipeline stage (expert tensor parallelism 1; the all-to-all token dispatcher, which runs on CPU with gloo
    too) and run sequence parallel at TP > 1 (mcore requires it; the sequence is padded to a multiple of TP).
    The ranks of an expert-parallel group run as many micro-batches each (fillers are added, their output
    discarded). The router is frozen by default (``policy.freeze_router``, as NeMo-RL); its load-balancing
    loss is measured every update and added to the objective only with ``policy.router_aux_loss_coef`` > 0
    (:class:`RouterBalance`), so by default the gradient is exactly that of the surrogate below.

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
    :func:`load_model_checkpoint`);
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
import importlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from nemo_disco import distributed, files, weights
from nemo_disco.batch import RolloutBatch, pack_questions
from nemo_disco.config import RunConfig
from nemo_disco.policy import cpu_compat
from nemo_disco.policy.base import SurrogateFn
from nemo_disco.policy.logprobs import token_logprobs
from nemo_disco.policy.schedule import lr_at

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT_META = "megatron.json"
CHECKPOINT_FORMAT = "nemo_disco.megatron/1"
TOKENIZER_FILES = files.TOKENIZER_FILES  # copied next to the weights, so a checkpoint is a complete model


log = logging.getLogger(__name__)

#: Layer specs a checkpoint records in ``megatron.json`` (``layer_spec``).
LAYER_SPECS = ("transformer_engine", "local")


def te_import_error() -> str | None:
    """None when ``transformer_engine.pytorch`` imports, else the reason.

    A broken install raises more than ImportError (e.g. cudnn not found): every exception is caught and reported.
    """
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return None


#: What to do when a GPU run cannot use Transformer Engine (the local spec's attention is quadratic in memory).
TE_REMEDY = (
    "install transformer-engine (the NGC PyTorch container ships it), or set policy.transformer_engine=false "
    "with policy.activation_checkpointing=true for short sequences only: the local layer spec materialises "
    "[heads, S, S] attention scores in every layer and runs out of memory at 8k-16k tokens"
)


def decide_transformer_engine(
    setting: bool | Literal["auto"], cuda: bool, import_error: str | None, dtype: str = "bfloat16"
) -> tuple[bool, str]:
    """Whether to build the Transformer Engine layer spec, and why (pure; :func:`use_transformer_engine` logs it).

    TE runs in bf16 / fp16 only here: with TE every micro-batch is packed (THD), and TE's
    ``get_attention_backend`` has no backend for fp32 THD (FlashAttention and fused attention are off for fp32,
    unfused attention is off for ``thd``: "No dot product attention backend"); TE also computes pure fp32 GEMMs
    in TF32 (``CUBLAS_COMPUTE_32F_FAST_TF32``) whatever torch's flags say. float32 therefore takes the local
    spec on a padded batch. On a GPU in 16-bit, ``auto`` requires TE: the local spec's attention materialises
    ``[b * heads, S, S]`` scores in every layer, which does not fit at RL lengths, so a missing TE is an error
    naming the remedy rather than an out-of-memory hours later.

    Args:
        setting: ``policy.transformer_engine``: "auto", True (required) or False (local spec).
        cuda: whether CUDA is available.
        import_error: :func:`te_import_error`'s answer (ignored without CUDA: TE is never installed on CPU).
        dtype: ``policy.dtype``.

    Raises:
        RuntimeError: TE is required (``true``, or ``auto`` on a GPU in 16-bit) and cannot run here: no CUDA, the
            import failed (its error and the remedy), or float32.
    """
    if setting is False:
        return False, "local layer spec: policy.transformer_engine=false"
    if dtype == "float32":
        if setting is True:
            raise RuntimeError(
                "policy.transformer_engine=true needs policy.dtype bfloat16 or float16: Transformer Engine has no "
                "attention backend for packed float32 sequences and runs float32 GEMMs in TF32"
            )
        return False, "local layer spec: policy.dtype=float32 (Transformer Engine runs packed 16-bit only)"
    if not cuda:
        if setting is True:
            raise RuntimeError("policy.transformer_engine=true needs a CUDA device; none is available")
        return False, "local layer spec: no CUDA device (Transformer Engine is GPU only)"
    if import_error is not None:
        raise RuntimeError(
            f"policy.transformer_engine={str(setting).lower()} on a GPU but transformer_engine failed to import: "
            f"{import_error}. Fix: {TE_REMEDY}"
        )
    return True, "Transformer Engine layer spec (packed sequences)"


def use_transformer_engine(setting: bool | Literal["auto"], dtype: str = "bfloat16") -> bool:
    """:func:`decide_transformer_engine` on this machine; logs the choice."""
    cuda = torch.cuda.is_available()
    use, why = decide_transformer_engine(setting, cuda, te_import_error() if cuda else None, dtype)
    log.info("Megatron policy: %s", why)
    return use


def te_available() -> bool:
    """Transformer Engine imports AND CUDA is present (TE is never installed on CPU machines)."""
    return torch.cuda.is_available() and te_import_error() is None


# Optional fused kernels: mcore enables them by config flag, then imports their extension inside the kernel
# (apex builds them; Transformer Engine does not provide them). A flag may only be on when its modules import.
_FUSION_MODULES = {
    # mcore's FusedScaleMaskSoftmax (local layer spec, 16-bit inputs) imports these in its forward.
    "masked_softmax_fusion": (
        "scaled_masked_softmax_cuda",
        "scaled_upper_triang_masked_softmax_cuda",
        "scaled_softmax_cuda",
    ),
    # mcore's ColumnParallelLinear (the output layer even under the TE spec) raises in its constructor without it.
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
}


def module_imports(name: str) -> bool:
    """Whether ``import name`` succeeds (a failure is logged with its error, never silent)."""
    try:
        importlib.import_module(name)
    except Exception as err:  # noqa: BLE001  (a broken extension raises more than ImportError)
        log.info("optional fused kernel module %s unavailable (%s: %s)", name, type(err).__name__, err)
        return False
    return True


def fusion_flags(on_gpu: bool, use_te: bool, imports: Callable[[str], bool] = module_imports) -> dict[str, bool]:
    """Mcore ``TransformerConfig`` fusion flags: a fused kernel only where it runs.

    Args:
        on_gpu: CUDA is available (every fusion here is a CUDA kernel).
        use_te: the Transformer Engine layer spec is used (RoPE fusion comes from TE).
        imports: whether a module imports (:func:`module_imports`; tests pass their own).
    """
    flags = {
        # torch.jit / compiled fusions that ship with mcore itself.
        "bias_activation_fusion": on_gpu,
        "bias_dropout_fusion": on_gpu,
        "apply_rope_fusion": use_te,
    }
    for flag, modules in _FUSION_MODULES.items():
        flags[flag] = on_gpu and all(imports(m) for m in modules)
    if on_gpu:
        off = sorted(f for f in _FUSION_MODULES if not flags[f])
        if off:
            log.info("Megatron policy: %s off (their apex extensions do not import)", ", ".join(off))
    return flags


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` is a policy directory written by :meth:`MegatronPolicy.save` or ``hf_to_megatron``."""
    return (Path(path) / CHECKPOINT_META).is_file()


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """``megatron.json`` of a policy directory.

    Raises:
        ValueError: not such a directory, or an unknown format.
    """
    meta_path = Path(path) / CHECKPOINT_META
    if not meta_path.is_file():
        raise ValueError(f"{path}: no {CHECKPOINT_META} (not a Megatron policy checkpoint)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
    return meta


# ----------------------------------------------------------------------------------------------------------------------
# Process groups and model construction (shared with nemo_disco.convert).


def init_parallel(tp: int, pp: int, seed: int = 1, ep: int | None = None) -> None:
    """Initialise torch.distributed (if needed) and Megatron's ``parallel_state`` for TP x PP x DP.

    One parallel layout per process at a time: asking for another TP / PP / EP re-initialises ``parallel_state``
    (models built under the previous layout must not be used afterwards).

    Args:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        seed: the model-parallel RNG seed.
        ep: expert-parallel size of a mixture-of-experts model (expert tensor parallelism 1); None for a dense
            model (mcore's default expert groups).

    Raises:
        ValueError: TP x PP does not divide the world size, or EP the ranks of a pipeline stage.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        torch.cuda.set_device(distributed.cuda_device_index())
    if not distributed.is_initialized():
        if distributed.read_env().world_size > 1:
            distributed.init()
        else:
            distributed.init_single_process()
    world = distributed.world_size()
    if world % (tp * pp):
        raise ValueError(
            f"policy.tensor_parallel_size x policy.pipeline_parallel_size = {tp} x {pp} does not divide "
            f"the world size {world}"
        )
    if ep is not None and (world // pp) % ep:
        raise ValueError(
            f"policy.expert_parallel_size={ep} does not divide the {world // pp} ranks of a pipeline stage "
            f"(world {world} / policy.pipeline_parallel_size {pp})"
        )
    global _EXPERT_LAYOUT
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (tp, pp)
        if same and _EXPERT_LAYOUT == ep:
            return
        ps.destroy_model_parallel()
    experts = {} if ep is None else {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": 1}
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **experts)
    _EXPERT_LAYOUT = ep
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


#: The expert-parallel size ``parallel_state`` was last initialised with (None: a dense model's defaults).
_EXPERT_LAYOUT: int | None = None


def transformer_config(
    spec: weights.ModelSpec,
    *,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    use_te: bool,
    recompute: bool,
    ep: int = 1,
    router_dtype: str = "float64",
    sequence_parallel: bool = False,
    moe_permute_fusion: bool = True,
) -> Any:
    """The mcore ``TransformerConfig`` of a model of ``spec`` (no dropout, per-token loss, variable shapes).

    Qwen3: per-head RMSNorm of queries and keys (``qk_layernorm``), ``kv_channels`` = the config's head_dim.
    Qwen3-MoE: every layer an MoE layer with top-k routing (``norm_topk_prob``: softmax over the k chosen logits,
    which equals the renormalised top-k probabilities; otherwise softmax over all experts, then top-k), the
    all-to-all token dispatcher, ``ep``-way expert parallelism with expert tensor parallelism 1, the router in
    ``router_dtype`` ("float32" / "float64"), no load-balancing loss inside mcore (the policy adds its own, see
    :class:`RouterBalance`), and sequence parallelism at TP > 1 (which mcore's MoE layer requires for training).
    Dense models use sequence parallelism at TP > 1 when ``sequence_parallel`` (``policy.sequence_parallel``).
    ``moe_permute_fusion``: TE's fused token permutation, used only where it imports (the TE spec on a GPU).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    extra: dict[str, Any] = fusion_flags(on_gpu, use_te)
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.is_moe:
        extra.update(
            num_moe_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_router_topk,
            moe_router_pre_softmax=not spec.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype={"float32": "fp32", "float64": "fp64"}[router_dtype],
            # Grouped GEMM comes with Transformer Engine (the local spec would need the grouped_gemm package).
            moe_grouped_gemm=use_te,
            moe_permute_fusion=moe_permute_fusion and use_te and fused_permute_imports(),
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            # mcore's MoE layer refuses to train at TP > 1 without it.
            sequence_parallel=tp > 1,
        )
    elif tp > 1 and sequence_parallel:
        extra.update(sequence_parallel=True)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # On the CPU (a GPU emulated on ``meta`` builds as on a GPU: see cpu_compat.emulate_device).
        use_cpu_initialization=not on_gpu and cpu_compat.device().type == "cpu",
        # Every parameter is overwritten from the checkpoint, but mcore only marks tensor-parallel parameters
        # (``tensor_model_parallel``, which the gradient norm relies on) inside its initialisation.
        perform_initialization=True,
        persist_layer_norm=False,
        # The schedules then leave the loss as returned (no division by the number of micro-batches) and
        # DDP does not pre-scale gradients by 1 / DP.
        calculate_per_token_loss=True,
        # Micro-batches differ in shape (token-budgeted rows, trimmed widths, packed lengths).
        variable_seq_lengths=True,
        # The dispatcher that runs with variable shapes (mcore refuses allgather with them); dense models need
        # it only to pass that check.
        moe_token_dispatcher_type="alltoall",
        **extra,
    )


def fused_permute_imports() -> bool:
    """Whether mcore found Transformer Engine's fused MoE permutation kernels (``moe_utils.fused_permute``)."""
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "fused_permute", None) is not None


def build_gpt_model(spec: weights.ModelSpec, config: Any, padded_vocab: int, use_te: bool) -> Any:
    """This rank's GPTModel stage (parameters uninitialised: load them next)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    moe = {"num_experts": spec.num_experts, "moe_grouped_gemm": use_te} if spec.is_moe else {}
    if use_te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_layernorm, **moe)
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, normalization="RMSNorm", **moe)
        if spec.is_moe:
            # The local spec stores pre_mlp_layernorm under the name of the norm that a dense TE layer fuses into
            # linear_fc1; an MoE layer has no such fusion under either spec, and TE checkpoints keep the plain
            # name. Keeping it too makes checkpoints of both specs load into either.
            keys = dict(layer_spec.submodules.sharded_state_dict_keys_map)
            keys.pop("pre_mlp_layernorm.", None)
            layer_spec.submodules.sharded_state_dict_keys_map = keys
        if config.sequence_parallel:
            layer_spec = _sequence_parallel_local_spec(layer_spec, config)
    define_missing_te_names()
    with cpu_compat.device_scope():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=padded_vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
            rope_scaling=spec.rope_scaling_factor is not None,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        )
    return place_model(model, model_device(), config.params_dtype)


def model_device() -> torch.device:
    """Where this process's model lives: its current GPU, else the CPU (or what ``cpu_compat`` emulates)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return cpu_compat.device()


def place_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Every parameter and buffer on ``device``, every floating-point parameter in ``dtype`` (in place).

    mcore builds most of a model on the current GPU, but not all of it: the MoE router's weight
    (``moe/router.py``: ``torch.empty(..., dtype=torch.float32)``, no device) and the local spec's torch norms
    (``torch_norm.py``: ``torch.nn.RMSNorm(...)``, host, float32) start on the host. Megatron-LM's ``get_model``
    moves the model with ``.cuda()`` and casts it to bf16 / fp16 (``Float16Module``) before DDP and the
    optimizer see it; this does the same. DDP would move only parameters it copies into its buffers (a frozen
    router never is), and a reference policy has no DDP at all.
    """
    model.to(device)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def define_missing_te_names() -> None:
    """Work around megatron-core 0.16.1 naming ``te_general_gemm`` without defining it when TE is absent.

    ``moe/moe_utils.py`` imports ``te_general_gemm`` inside its Transformer Engine ``try`` block only, then the
    router's gating tests ``te_general_gemm is not None``: a NameError on any machine without TE, GPU included.
    Later releases define it; this is a no-op there.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, as mcore's local spec builds it, that also runs under sequence parallelism.

    mcore's ``WrappedTorchNorm`` refuses sequence parallelism because it does not mark its weight: each TP rank
    then normalises a slice of the sequence, so the weight's gradient is partial on every rank until
    ``finalize_model_grads`` sums the gradients of parameters marked ``sequence_parallel`` over the TP group.
    This one marks it (per ``config.sequence_parallel``).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        """Build from mcore's norm arguments (``persist_layer_norm`` and the like are ignored, as mcore's are)."""
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _sequence_parallel_local_spec(layer_spec: Any, config: Any) -> Any:
    """The local layer spec with norms that support sequence parallelism, as a block spec (the final norm too).

    q / k norms act on whole sequences of TP-split heads; mcore sums their gradients over TP by name.
    """
    import copy

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer_spec = copy.deepcopy(layer_spec)
    sub = layer_spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = LocalRMSNorm
    attention = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not None and getattr(attention, name).__name__ == "WrappedTorchNorm":
            setattr(attention, name, LocalRMSNorm)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=LocalRMSNorm
    )


def load_hf_weights(model: Any, model_dir: str | Path, spec: weights.ModelSpec, padded_vocab: int) -> None:
    """Copy this rank's shards of an HF folder's safetensors into ``model`` (the unwrapped GPTModel)."""
    from megatron.core import parallel_state as ps

    experts = {}
    if spec.is_moe:
        experts = {
            "ep_size": ps.get_expert_model_parallel_world_size(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
        }
    weights.load_hf_into(
        dict(model.named_parameters()),
        weights.SafetensorsReader(model_dir),
        spec,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        padded_vocab=padded_vocab,
        **experts,
    )


def is_router(name: str) -> bool:
    """Whether a GPTModel parameter name is an MoE router's weight."""
    return name.endswith(".mlp.router.weight") or name.endswith(".mlp.router.bias")


def save_model_checkpoint(model: Any, directory: Path) -> None:
    """Collective: the weights of ``model`` (unwrapped GPTModel) as a dist checkpoint in ``directory``."""
    from megatron.core import dist_checkpointing

    try:  # megatron-core's writer processes import it and die without it, leaving the save hung forever
        import psutil  # noqa: F401
    except ImportError:
        raise RuntimeError("saving a Megatron checkpoint needs psutil: pip install psutil") from None
    _make_dir(directory)
    with cpu_compat.device_scope():
        dist_checkpointing.save(model.sharded_state_dict(), str(directory))


def _is_extra_state(key: str) -> bool:
    return key.endswith("._extra_state")


def load_model_checkpoint(model: Any, directory: Path) -> None:
    """Collective: load a dist checkpoint written by :func:`save_model_checkpoint` (any TP / PP) into ``model``.

    Across layer specs: mcore names the weights of both specs alike (the local spec maps its norms to the TE
    names), but a Transformer Engine model also asks for ``_extra_state`` entries (FP8 metadata, e.g. of its
    core attention) that a local-spec checkpoint does not hold. Those, and only those, may be absent: they
    keep their freshly built values (no FP8 history, which a bf16 run does not use). Any other absent
    tensor is an error naming it.

    Raises:
        ValueError: the checkpoint lacks a tensor the model needs.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    with cpu_compat.device_scope():
        state, _, absent = dist_checkpointing.load(
            model.sharded_state_dict(), str(directory), strict=StrictHandling.RETURN_UNEXPECTED
        )
        absent_weights = sorted(k for k in absent if not _is_extra_state(k))
        if absent_weights:
            raise ValueError(f"{directory}: the checkpoint lacks {len(absent_weights)} tensor(s): {absent_weights[:5]}")
        missing, unexpected = model.load_state_dict(state, strict=False)
    bad = sorted(k for k in missing if not _is_extra_state(k)) + sorted(unexpected)
    if bad:
        raise ValueError(f"{directory}: checkpoint and model disagree on {bad[:5]}")


def write_policy_files(directory: Path, source_dir: Path, meta: dict[str, Any]) -> None:
    """Rank 0: ``megatron.json``, the HF ``config.json`` and the tokenizer files next to the dist checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        src = source_dir / name
        if src.is_file() and src.resolve() != (directory / name).resolve():
            shutil.copyfile(src, directory / name)
    tmp = directory / (CHECKPOINT_META + ".tmp")
    tmp.write_text(json.dumps({"format": CHECKPOINT_FORMAT, **meta}, indent=2))
    os.replace(tmp, directory / CHECKPOINT_META)


def _make_dir(directory: Path) -> None:
    if distributed.rank() == 0:
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
    distributed.barrier()


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


# ----------------------------------------------------------------------------------------------------------------------
# Micro-batches.


@dataclass
class _MicroBatch:
    """One micro-batch laid out for the model; every sequence starts at position 0."""

    rows: torch.Tensor  # [n] indices into the batch
    input_ids: torch.Tensor  # [n, S] (padded) or [1, T] (packed)
    position_ids: torch.Tensor  # same shape
    attention_mask: torch.Tensor | None  # [n, 1, S, S] bool, True = masked (padded layout only)
    packed: Any  # PackedSeqParams or None
    targets: torch.Tensor  # like input_ids: the next token at every position
    response_index: torch.Tensor  # [n, r] flat token index of the logits predicting response token t
    response_mask: torch.Tensor  # [n, r] bool
    token_mask: torch.Tensor  # like input_ids, on the CPU: True on real tokens (False on padding)
    #: A copy run only to keep an expert-parallel group's forward passes in step (output discarded).
    filler: bool = False


def _row_lengths(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.prompt_mask.sum(1), batch.response_mask.sum(1)


def split_microbatches(batch: RolloutBatch, max_tokens: int, packed: bool) -> list[torch.Tensor]:
    """Consecutive row groups whose model input fits ``max_tokens`` tokens (at least one row each).

    Padded layout: rows x (longest prompt + longest response) of the group; packed: the sum of real lengths.
    A question's rollouts stay together wherever they fit (``batch.pack_questions``; nemo_disco.update).
    """
    p_len, r_len = _row_lengths(batch)

    def fits(start: int, stop: int) -> bool:
        if packed:
            return int((p_len[start:stop] + r_len[start:stop]).sum()) <= max_tokens
        return (stop - start) * (int(p_len[start:stop].max()) + int(r_len[start:stop].max())) <= max_tokens

    return pack_questions(batch.group_ids, fits)


def _prepare(
    batch: RolloutBatch, rows: torch.Tensor, packed: bool, device: torch.device, seq_multiple: int = 1
) -> _MicroBatch:
    """One micro-batch laid out for the model.

    ``seq_multiple``: the sequence length (packed: the total length) is padded to a multiple of it (sequence
    parallelism splits the sequence over the TP ranks). Padding follows every real token of a row (packed: it
    extends the last sequence), where causal attention keeps it away from the real tokens.
    """
    sub = batch.select(rows)
    n, width = sub.prompt_ids.shape
    p_len, r_len = _row_lengths(sub)
    if bool((p_len == 0).any()):
        bad = int(rows[int(torch.nonzero(p_len == 0)[0])])
        raise ValueError(f"rollout {bad} has an empty prompt: its first response token has no context")
    lens = p_len + r_len  # [n]
    r_eff = max(1, int(r_len.max()))
    ids = sub.input_ids  # [n, P + R]; the real tokens of row i are contiguous from column P - p_len[i]
    t = torch.arange(r_eff)
    response_mask = t.unsqueeze(0) < r_len.unsqueeze(1)  # [n, r]
    # Logits at position p_len - 1 + t predict response token t.
    pred = torch.where(response_mask, (p_len - 1).unsqueeze(1) + t, torch.zeros_like(t))  # [n, r]
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        tokens = [ids[i, width - int(p_len[i]) : width + int(r_len[i])] for i in range(n)]
        extra = -int(lens.sum()) % seq_multiple
        flat = torch.cat([*tokens, ids.new_zeros(extra)]).unsqueeze(0)  # [1, T]
        real = torch.arange(flat.shape[1]).unsqueeze(0) < int(lens.sum())  # [1, T]
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        cu[-1] += extra
        positions = torch.cat([torch.arange(int(x)) for x in lens[:-1]] + [torch.arange(int(lens[-1]) + extra)])
        positions = positions.unsqueeze(0)  # [1, T]
        targets = torch.cat([flat[:, 1:], flat.new_zeros(1, 1)], dim=1)  # crosses sequence ends only where unused
        longest = max(int(lens.max()), int(lens[-1]) + extra)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu.to(device),
            cu_seqlens_kv=cu.to(device),
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        index = cu[:-1].long().unsqueeze(1) + pred  # [n, r]
        return _MicroBatch(
            rows=rows,
            input_ids=flat.to(device),
            position_ids=positions.to(device),
            attention_mask=None,
            packed=params,
            targets=targets.to(device),
            response_index=index.to(device),
            response_mask=response_mask.to(device),
            token_mask=real,
        )
    seq = -(-int(lens.max()) // seq_multiple) * seq_multiple
    pos = torch.arange(seq)
    gather = ((width - p_len).unsqueeze(1) + pos).clamp(max=ids.shape[1] - 1)  # [n, S]
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [n, S]
    tokens = torch.where(valid, ids.gather(1, gather), torch.zeros_like(gather))
    targets = torch.cat([tokens[:, 1:], tokens.new_zeros(n, 1)], dim=1)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)  # [S, S] True above the diagonal
    mask = (causal.unsqueeze(0) | ~valid.unsqueeze(1)).unsqueeze(1)  # [n, 1, S, S]: future or padding keys
    index = torch.arange(n).unsqueeze(1) * seq + pred  # [n, r]
    return _MicroBatch(
        rows=rows,
        input_ids=tokens.to(device),
        position_ids=pos.expand(n, seq).contiguous().to(device),
        attention_mask=mask.to(device),
        packed=None,
        targets=targets.to(device),
        response_index=index.to(device),
        response_mask=response_mask.to(device),
        token_mask=valid,
    )


# ----------------------------------------------------------------------------------------------------------------------
# MoE router statistics and the optional load-balancing loss.


class RouterBalance:
    """The load-balancing loss of this stage's MoE routers: measured on real tokens every update, trained if asked.

    Per layer, over the N real tokens of a pass (padding and filler micro-batches excluded): ``f_i`` = the share
    of the N x k routing choices that picked expert i, ``P_i`` = expert i's mean routing probability (softmax
    over all E experts); ``loss = E * sum_i f_i P_i`` (the Switch Transformer loss as mcore normalises it: 1.0
    when the load is uniform, E / k at worst). Each layer's counts are summed over the data-parallel ranks first.
    :meth:`finish` reports the mean over layers (``router_balance_loss``) and the busiest expert's load relative
    to a uniform one, ``E * max_i f_i`` (``router_max_load``).

    Training it (``policy.router_aux_loss_coef`` = c > 0; 0 by default, as NeMo-RL's load-balancing type
    "none"): each micro-batch adds ``c * (its per-layer losses summed over layers) / (micro-batches summed over
    the data-parallel ranks)`` through mcore's ``MoEAuxLossAutoScaler``, so the update follows
    ``surrogate + c * mean over micro-batches of the summed layer losses``. mcore's own aux loss is left off: in
    per-token-loss mode it scales by the micro-batch's token count, which the policy's globally normalised
    surrogate does not divide away.

    The per-layer work runs in every MoE layer of every micro-batch, so it never waits for the GPU: real tokens
    are selected by masked arithmetic (no boolean indexing), each layer's sums stay on the device, and
    :meth:`finish` reads them once at the end of the pass.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: weights.ModelSpec,
        coef: float,
        recompute: bool,
        sp_group: distributed.Group = None,
    ) -> None:
        """Wrap the routing of every ``TopKRouter`` of ``model``.

        Args:
            model: this rank's GPTModel stage.
            spec: the architecture (experts, top-k).
            coef: ``policy.router_aux_loss_coef``.
            recompute: activation recomputation is on (a forward then runs twice).
            sp_group: the TP group under sequence parallelism (each rank routes a slice of the sequence), else None.
        """
        from megatron.core.transformer.moe.router import TopKRouter

        self.experts, self.topk, self.coef, self.recompute = spec.num_experts, spec.moe_router_topk, coef, recompute
        self.sp_group = sp_group
        self.active = False
        self.mask: torch.Tensor | None = None  # [S * B] real tokens of the running micro-batch, mcore's order
        self.scale = 0.0
        # layer number -> [2E + 1] float64 sums on the model's device: counts, probability sums, tokens
        self.sums: dict[int, torch.Tensor] = {}
        for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
            router.routing = functools.partial(self._routing, router, router.routing)

    def set_tokens(self, mb: _MicroBatch) -> None:
        """The real tokens of the micro-batch about to run, in mcore's [S, B] order (this rank's slice under SP).

        Moved to the model's device here, once per micro-batch, not in every layer (non-blocking: a host-to-device
        copy of a CPU tensor does not wait for the device's queue).
        """
        real = mb.token_mask.t() & (not mb.filler)  # [S, B]
        if self.sp_group is not None:
            real = real.chunk(distributed.world_size(self.sp_group))[distributed.rank(self.sp_group)]
        self.mask = real.reshape(-1).to(mb.input_ids.device, non_blocking=True)

    def start(self, mbs: list[_MicroBatch], dp_group: distributed.Group) -> None:
        """Begin a training pass over ``mbs`` (this DP rank's micro-batches)."""
        self.active, self.sums = True, {}
        if self.coef > 0:
            (total,) = distributed.sum_floats([float(sum(not mb.filler for mb in mbs))], group=dp_group)
            self.scale = self.coef / max(total, 1.0)

    def finish(self, dp_group: distributed.Group, pp_group: distributed.Group) -> dict[str, float]:
        """End the pass; the statistics of every layer of the model (same on every rank)."""
        self.active = False
        e, k = self.experts, self.topk
        layers = sorted(self.sums)
        stats = torch.stack([self.sums[n] for n in layers])  # [L_stage, 2E + 1]: counts, prob sums, tokens (device)
        distributed.all_reduce(stats, group=dp_group)
        if self.sp_group is not None:  # each TP rank routed a slice of the sequence
            distributed.all_reduce(stats, group=self.sp_group)
        tokens = stats[:, 2 * e :].clamp(min=1.0)
        share, mean_prob = stats[:, :e] / (k * tokens), stats[:, e : 2 * e] / tokens  # f_i, P_i per layer
        total = torch.stack([(e * share * mean_prob).sum(), stats.new_tensor(float(len(layers)))])
        busiest = (e * share).max().reshape(1)
        if pp_group is not None:
            distributed.all_reduce(total, group=pp_group)
            distributed.all_reduce(busiest, op="max", group=pp_group)
        loss, load = torch.cat([total[:1] / total[1:], busiest]).tolist()  # the pass's one read to the host
        return {"router_balance_loss": loss, "router_max_load": load}

    def _routing(
        self, router: Any, routing: Callable, logits: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = routing(logits, *args, **kwargs)
        if not self.active or self.mask is None:
            return probs, routing_map
        # Every layer of every micro-batch: no host sync (no boolean indexing, no float() / .item() / .cpu(), no
        # branch on a value). Padding and filler rows are zeroed by torch.where, which also keeps a non-finite
        # logit there out of the sums and their gradient.
        flat = logits.reshape(-1, self.experts)  # [T, E]
        real = self.mask if self.mask.device == flat.device else self.mask.to(flat.device)
        real = real.unsqueeze(-1)  # [T, 1]
        dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        scores = torch.softmax(torch.where(real, flat.to(dtype), 0.0), -1)  # [T, E]
        prob_sums = torch.where(real, scores, 0.0).sum(0)  # [E]
        counts = (routing_map.reshape(-1, self.experts) & real).sum(0).to(dtype)  # [E]
        n = real.sum().to(dtype).reshape(1)  # [1]
        row = torch.cat([counts, prob_sums.detach(), n]).double()  # this slice's sums, on the device
        if self.sp_group is not None:  # the loss is over the whole sequence: picks and tokens of every slice
            total = distributed.all_reduce(torch.cat([counts, n]), group=self.sp_group)
            counts, n = total[:-1], total[-1:]
        # With activation recomputation the forward runs twice (no grad, then with grad in the backward): count
        # the first. A layer without real tokens adds a row of zeros.
        if not (self.recompute and torch.is_grad_enabled()):
            self.sums[router.layer_number] = self.sums.get(router.layer_number, 0) + row
        if self.coef > 0 and torch.is_grad_enabled():
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            # E sum_i f_i P_i; under SP this slice's share of it (its tokens' probabilities, every slice's picks).
            # The factor E / (k n^2) in float64 as a Python float would be; n = 0 (no real token): counts and
            # probability sums are 0, the clamp keeps the loss 0 rather than NaN.
            factor = self.experts / (self.topk * n[0].double().clamp(min=1.0) ** 2)
            loss = factor.to(dtype) * (prob_sums * counts).sum()
            probs = MoEAuxLossAutoScaler.apply(probs, loss * self.scale)
        return probs, routing_map


# ----------------------------------------------------------------------------------------------------------------------


class MegatronPolicy:
    """pi_theta as a Megatron-Core GPTModel shard (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: str | Path,
        *,
        vocab_multiple: int | None = None,
        trainable: bool = True,
    ) -> None:
        """Build the model from an HF folder or a Megatron policy directory.

        Args:
            cfg: the run config (``policy.*``, ``generation.temperature``, ``algorithm.seed``).
            model_dir: an HF folder (config.json + safetensors) or a directory written by :meth:`save` /
                ``nemo_disco.convert.hf_to_megatron`` (its weights only; the optimizer starts fresh).
            vocab_multiple: pad the vocabulary to a multiple of lcm(this, TP) (Megatron's
                ``make_vocab_size_divisible_by``); default: the checkpoint's, else 128.
            trainable: False builds a forward-only model (a reference policy): no gradient buffers, no
                optimizer, no fp32 master weights; only :meth:`logprobs`, :meth:`offload` and :meth:`onload`.
        """
        cpu_compat.apply()
        from megatron.core import parallel_state as ps

        pc = cfg.policy
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.on_gpu = torch.cuda.is_available()
        self.dtype = _DTYPES[pc.dtype]
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
        init_parallel(self.tp, self.pp, cfg.algorithm.seed, ep=self.ep if self.spec.is_moe else None)
        # After init: under torchrun / srun it selects this process's GPU.
        self.device = model_device()
        from_checkpoint = is_checkpoint_dir(self.model_dir)
        meta = read_checkpoint_meta(self.model_dir) if from_checkpoint else {}
        self.vocab_multiple = vocab_multiple or meta.get("vocab_multiple") or weights.DEFAULT_VOCAB_MULTIPLE
        self.padded_vocab = weights.padded_vocab_size(self.spec.vocab_size, self.tp, self.vocab_multiple)
        self.use_te = use_transformer_engine(pc.transformer_engine, pc.dtype)
        self.layer_spec = LAYER_SPECS[0] if self.use_te else LAYER_SPECS[1]
        self.packed = self.use_te  # THD packing needs TE attention
        self.temperature = cfg.generation.temperature
        recompute = pc.activation_checkpointing
        self.tf_config = transformer_config(
            self.spec,
            tp=self.tp,
            pp=self.pp,
            dtype=self.dtype,
            use_te=self.use_te,
            recompute=recompute,
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
            self.balance = RouterBalance(self.gpt, self.spec, pc.router_aux_loss_coef, recompute, sp_group)
        if trainable:
            self.model = self._wrap_ddp()
            self.optimizer = self._build_optimizer()
        else:
            for p in self.gpt.parameters():
                p.requires_grad_(False)
            self.model, self.optimizer = self.gpt, None
        self.updates = 0
        self.total_updates = cfg.algorithm.steps * cfg.updates_per_step
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

    # ------------------------------------------------------------------------------------------------------------------
    # Construction helpers.

    def _wrap_ddp(self) -> Any:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        pc = self.cfg.policy
        dist_opt = self.on_gpu and pc.use_distributed_optimizer
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
        return self._build_megatron_optimizer() if self.on_gpu else self._build_torch_optimizer()

    def _build_megatron_optimizer(self) -> Any:
        """Mcore's optimizer (distributed when ``policy.use_distributed_optimizer``); the GPU path.

        Its parameter groups carry ``wd_mult`` / ``lr_mult``; :func:`set_group_hyperparameters` turns them
        into each group's decay and learning rate at every update.
        """
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        pc = self.cfg.policy
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
            use_distributed_optimizer=pc.use_distributed_optimizer and self.on_gpu,
        )
        with cpu_compat.device_scope():  # tests build it on CPU to compare its groups with the CPU path's
            optimizer = get_megatron_optimizer(opt_config, [self.model])
        if self.dtype == torch.float16:
            self.tf_config.grad_scale_func = optimizer.scale_loss
        set_group_hyperparameters(optimizer.param_groups, pc.lr, pc.weight_decay)
        return optimizer

    def _build_torch_optimizer(self) -> torch.optim.AdamW:
        """AdamW over the DDP gradient buffers with mcore's default decay groups; the CPU path."""
        pc = self.cfg.policy
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
        return split_microbatches(batch, self.cfg.policy.microbatch_tokens, self.packed)

    def _microbatches(self, batch: RolloutBatch) -> list[_MicroBatch]:
        groups = self.microbatch_rows(batch)
        multiple = self.tp if self.tf_config.sequence_parallel else 1
        mbs = [_prepare(batch, rows, self.packed, self.device, multiple) for rows in groups]
        if self.ep > 1:
            # Every MoE layer exchanges tokens with the other ranks of its expert-parallel group: all of them must
            # run as many forward passes. Ranks with fewer micro-batches add copies of a one-row micro-batch whose
            # output is discarded (zero loss, no log-probs stored, not counted in the router statistics).
            target = distributed.max_int(len(mbs), group=self.ep_group)
            filler = _prepare(batch, groups[0][:1], self.packed, self.device, multiple)
            filler = dataclasses.replace(filler, filler=True)
            mbs += [filler] * (target - len(mbs))
        return mbs

    def _response_logprobs(
        self, logits: torch.Tensor, mb: _MicroBatch, width: int, entropy: bool
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
            chunk_size=self.cfg.policy.logprob_chunk_size,
            entropy=entropy,
        )  # [b, s] each

        def pick(x: torch.Tensor) -> torch.Tensor:
            out = x.reshape(-1)[mb.response_index]  # [n, r]
            out = torch.where(mb.response_mask, out, torch.zeros_like(out))
            return torch.nn.functional.pad(out, (0, width - out.shape[1]))  # [n, R]

        return pick(lp), (pick(ent) if entropy else None)

    def _run(
        self,
        mbs: list[_MicroBatch],
        width: int,
        entropy: bool,
        on_output: Callable[[_MicroBatch, torch.Tensor, torch.Tensor | None], torch.Tensor],
        forward_only: bool,
    ) -> None:
        """One pass over the micro-batches through Megatron's schedule; ``on_output`` runs on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def loss_func(mb: _MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            lp, ent = self._response_logprobs(logits, mb, width, entropy)
            value = lp.sum() * 0.0 if mb.filler else on_output(mb, lp, ent)
            # A 3-tuple with calculate_per_token_loss: the schedule neither divides by num_tokens nor by the
            # number of micro-batches, so the backward is exactly d value / d theta.
            return value, torch.ones((), dtype=torch.int, device=value.device), {}

        def forward_step(data_iterator: Iterator[_MicroBatch], model: Any) -> tuple[torch.Tensor, Callable]:
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

        def store(mb: _MicroBatch, lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
            rows = mb.rows.to(self.device)
            lp_all[rows] = lp
            if ent_all is not None:
                ent_all[rows] = ent
            return lp.new_zeros(())

        self._run(self._microbatches(batch), width, entropy, store, forward_only=True)
        self._broadcast_from_last_stage(lp_all)
        if ent_all is not None:
            self._broadcast_from_last_stage(ent_all)
        return lp_all.cpu(), (ent_all.cpu() if ent_all is not None else None)

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

        def surrogate(mb: _MicroBatch, lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
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
        step_lr = lr_at(self.updates, self.cfg.policy, self.total_updates) if lr is None else lr
        clip = self.cfg.policy.grad_clip
        if self.on_gpu:
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
        set_group_hyperparameters(self.optimizer.param_groups, step_lr, self.cfg.policy.weight_decay)
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
        set_group_hyperparameters(self.optimizer.param_groups, step_lr, self.cfg.policy.weight_decay)
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
            bucket_bytes=self.cfg.generation.refit_bucket_mb * 2**20,
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
            bucket_bytes=self.cfg.generation.refit_bucket_mb * 2**20,
        )

    def _optimizer_sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        model_sd = self.gpt.sharded_state_dict()
        if self.on_gpu:
            return self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
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
        _make_dir(directory / "optimizer")
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
            "dtype": self.cfg.policy.dtype,
            "vocab_size": self.spec.vocab_size,
            "padded_vocab_size": self.padded_vocab,
            "vocab_multiple": self.vocab_multiple,
            "layer_spec": self.layer_spec,
        }

    def load(self, directory: Path) -> None:
        """Collective: restore what :meth:`save` wrote (at any TP / PP), or the weights of a weights-only dir."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        meta = read_checkpoint_meta(directory)
        self._check_meta(meta, directory)
        load_model_checkpoint(self.gpt, directory / "model")
        if self.on_gpu:
            self.optimizer.reload_model_params()
        if (directory / "optimizer").is_dir():
            with cpu_compat.device_scope():
                template = self._optimizer_sharded_state_dict(is_loading=True)
                state = dist_checkpointing.load(template, str(directory / "optimizer"))
            if not self.on_gpu:
                step = state["state"].pop("common_step")
                for s in state["state"].values():
                    s["step"] = torch.tensor(float(step), dtype=torch.float32)
            self.optimizer.load_state_dict(state)
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
