"""Building a Megatron-Core GPTModel and reading / writing its weights: the training policy and conversion share it.

``nemo_disco.policy.megatron`` (training) and ``nemo_disco.convert`` (HF <-> Megatron checkpoints) both build the
model here, so conversion does not import the trainer.

  - Parallel layout: :func:`init_parallel` starts ``parallel_state`` for TP x PP (x EP for MoE) from the default
    process group (torchrun / srun started it; a single process without one gets a one-rank gloo group).
  - ``policy.transformer_engine``: ``auto`` takes the Transformer Engine layer spec on a GPU in bf16 / fp16
    and the local spec on the CPU or in float32 (TE has no fp32 packed attention and runs fp32 GEMMs in TF32);
    a GPU run in 16-bit whose TE does not import stops with the import error and the remedy
    (:func:`decide_transformer_engine`); ``true`` requires TE; ``false`` is the local spec. On CPU
    ``cpu_compat`` patches the CUDA assumptions.
  - Fused kernels from apex (masked softmax, gradient-accumulation fusion) are switched on only when their
    extension modules import (:func:`fusion_flags`); TE does not provide them, and mcore would raise.
  - Weights: :func:`load_hf_weights` copies this rank's shards from an HF folder (``nemo_disco.weights``);
    :func:`save_model_checkpoint` / :func:`load_model_checkpoint` write and read a Megatron dist checkpoint
    (tensors stored globally: it loads at any TP / PP, and across layer specs); :func:`write_policy_files` and
    :func:`read_checkpoint_meta` the ``megatron.json`` beside it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from nemo_disco import distributed, files, weights
from nemo_disco.policy import cpu_compat

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
    "with policy.activation_checkpointing=full for short sequences only: the local layer spec materialises "
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
    """Whether ``path`` is a policy directory written by ``MegatronPolicy.save`` or ``hf_to_megatron``."""
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
    recompute: bool | Literal["selective", "full"],
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
    ``megatron_moe.RouterBalance``), and sequence parallelism at TP > 1 (which mcore's MoE layer requires for training).
    Dense models use sequence parallelism at TP > 1 when ``sequence_parallel`` (``policy.sequence_parallel``).
    ``moe_permute_fusion``: TE's fused token permutation, used only where it imports (the TE spec on a GPU).
    ``recompute`` (``policy.activation_checkpointing``): False = none; "selective" = mcore's selective recomputation
    of the core attention (its default ``recompute_modules``); "full" (or True) = every layer from its input.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    extra: dict[str, Any] = fusion_flags(on_gpu, use_te)
    if recompute == "selective":
        extra.update(recompute_granularity="selective")
    elif recompute in (True, "full"):
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute is not False:
        raise ValueError(f"recompute={recompute!r}: expected False, 'selective' or 'full'")
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


def save_model_checkpoint(model: Any, directory: Path) -> None:
    """Collective: the weights of ``model`` (unwrapped GPTModel) as a dist checkpoint in ``directory``."""
    from megatron.core import dist_checkpointing

    try:  # megatron-core's writer processes import it and die without it, leaving the save hung forever
        import psutil  # noqa: F401
    except ImportError:
        raise RuntimeError("saving a Megatron checkpoint needs psutil: pip install psutil") from None
    make_empty_dir(directory)
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


def make_empty_dir(directory: Path) -> None:
    """Collective: ``directory`` emptied (rank 0 deletes and recreates it), then a barrier."""
    if distributed.rank() == 0:
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
    distributed.barrier()
