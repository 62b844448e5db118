"""``nemo-disco plan``: per-GPU memory of every phase of an RL step, and the step's time and cost, from a recipe.

Torch-free (it runs on a login node in a fraction of a second). The model's shapes come from a Hugging Face
``config.json``: the recipe's ``policy.model_path`` folder, else the hub cache, else the copy shipped in
``nemo_disco/model_configs/`` for every shipped recipe's model; ``policy.tiny`` for a model built in code.

Per GPU and per phase (``generation``, ``refit``, ``logprobs``, ``training``; an asynchronous run's trainer and
generator GPUs apart) each term is given in bytes with its formula (docs/planning.md):

- weights, fp32 gradient buffers and Adam state as Megatron-Core lays them out for this package
  (``nemo_disco.policy.megatron``: ``grad_reduce_in_fp32=True``; the distributed optimizer keeps fp32 master
  weights and both moments for 1 / DP of the parameters, experts over the expert data-parallel group);
- the activations one micro-batch keeps for the backward (Korthikanti et al. 2022's per-layer accounting,
  applied to RMSNorm, grouped-query attention, SwiGLU and routed experts, for Transformer Engine's kernels or
  mcore's local spec), with the recipe's recomputation, sequence parallelism and pipeline stages in flight;
- the logits of a micro-batch and the float32 blocks of the chunked vocab-parallel log-prob
  (``nemo_disco.policy.logprobs``);
- the vLLM engine: weights at the generation TP, the KV cache that ``gpu_memory_utilization`` leaves, the CUDA
  graph pool and what each sleep level keeps; what offload keeps of the policy while the engine runs.

The step time is an estimate from stated rates (:data:`MFU`, the GPU's peak bf16 FLOP/s, :data:`HBM_EFFICIENCY` of
its HBM bandwidth, the link's bandwidth), not a measurement. ``train`` runs :func:`check_at_startup` on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_disco import families, generators

GIB = 1024**3
#: Megatron's default ``make_vocab_size_divisible_by`` (``nemo_disco.weights.DEFAULT_VOCAB_MULTIPLE``).
VOCAB_MULTIPLE = 128
#: The config.json of every shipped recipe's model, named ``<org>--<name>.json``.
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
#: The tiny tokenizer's vocabulary (``nemo_disco.tiny.VOCAB_SIZE``; that module imports torch).
TINY_VOCAB = 128

# Assumptions (docs/planning.md states each).
#: CUDA context, cuBLAS workspaces and NCCL buffers of one process, outside PyTorch's allocator.
RUNTIME_BYTES = int(1.5 * GIB)
#: vLLM's CUDA-graph pool (decode batch sizes up to max_num_seqs); kept while the engine sleeps.
CUDA_GRAPH_BYTES = int(1.5 * GIB)
#: vLLM's default sequences per decode batch (max_num_seqs) and prefill tokens when the recipe leaves them.
VLLM_MAX_NUM_SEQS = 256
VLLM_DEFAULT_BATCHED_TOKENS = 8192
#: Model FLOP utilisation of the training and log-prob passes.
MFU = 0.35
#: Mean response length as a share of generation.max_response_tokens (for time, not memory: memory takes the max).
MEAN_RESPONSE_SHARE = 0.5
#: Share of the HBM bandwidth a decode step reaches (weights and KV cache read once per generated token).
HBM_EFFICIENCY = 0.6
#: Per-GPU inter-node bandwidth (one 400 Gb/s NIC per GPU).
NETWORK_BYTES_PER_S = 50e9

PHASES = ("generation", "refit", "logprobs", "training")


@dataclass(frozen=True)
class Gpu:
    """A GPU model: memory as ``torch.cuda.get_device_properties().total_memory`` reports it, and its rates."""

    name: str
    memory_bytes: int
    bf16_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float


GPUS = {
    g.name: g
    for g in (
        Gpu("h100-80gb", 85_520_809_984, 989e12, 3.35e12, 450e9),
        Gpu("h200-141gb", 150_754_820_096, 989e12, 4.8e12, 450e9),
        Gpu("a100-80gb", 85_097_971_712, 312e12, 2.039e12, 300e9),
        Gpu("a100-40gb", 42_505_273_344, 312e12, 1.555e12, 300e9),
    )
}
#: The hardware each recipe names (``cluster`` comments: 8 x 80 GB per node); the default of ``--gpu``.
DEFAULT_GPU = "h100-80gb"


class PlanError(ValueError):
    """The plan cannot be made (unknown GPU, no config.json for the model): one line."""


# ----------------------------------------------------------------------------------------------------------------------
# Model shapes.


@dataclass(frozen=True)
class Shapes:
    """What the plan needs of a model's ``config.json``."""

    source: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str) -> Shapes:
        """Parse the fields of a ``config.json`` of a registered family (:data:`nemo_disco.families.FAMILIES`)."""
        try:
            family = families.get_family(config["model_type"])
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
            return cls(
                source=source,
                model_type=family.model_type,
                layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                ffn=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=family.qkv_bias,
                qk_norm=family.qk_norm,
                experts=experts if family.moe else 0,
                topk=int(config.get("num_experts_per_tok") or 0) if family.moe else 0,
                moe_ffn=int(config.get("moe_intermediate_size") or 0) if family.moe else 0,
            )
        except KeyError as err:
            raise PlanError(f"{source}: no {err.args[0]}") from None
        except ValueError as err:  # an unregistered family, or a value that is not a number
            raise PlanError(f"{source}: {err}") from None

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are routed experts."""
        return self.experts > 0


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def config_json(model_path: str) -> tuple[dict[str, Any], str]:
    """The ``config.json`` of ``model_path`` and where it was read: a local folder, the hub cache, the shipped copy.

    Raises:
        PlanError: none of the three has it.
    """
    local = Path(model_path).expanduser() / "config.json"
    candidates = [local]
    if "/" in model_path and not Path(model_path).expanduser().exists():
        repo = _hub_cache() / f"models--{model_path.replace('/', '--')}"
        ref = repo / "refs" / "main"
        if ref.is_file():
            candidates.append(repo / "snapshots" / ref.read_text().strip() / "config.json")
        candidates += sorted((repo / "snapshots").glob("*/config.json"))
        candidates.append(MODEL_CONFIGS / f"{model_path.replace('/', '--')}.json")
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text()), str(path)
    raise PlanError(
        f"policy.model_path={model_path}: no config.json in that folder, in the hub cache ({_hub_cache()}) nor "
        f"among the shipped ones ({MODEL_CONFIGS})"
    )


def model_shapes(cfg: Any) -> Shapes:
    """The shapes of the recipe's model (``policy.tiny`` when ``policy.model_path`` is null)."""
    pc = cfg.policy
    if pc.model_path is None:
        t = pc.tiny
        tiny = {
            "model_type": t.architecture,
            "num_hidden_layers": t.num_layers,
            "hidden_size": t.hidden_size,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "head_dim": t.head_dim,
            "intermediate_size": t.intermediate_size,
            "vocab_size": TINY_VOCAB,
            "tie_word_embeddings": t.tie_word_embeddings,
            "num_experts": t.num_experts,
            "num_experts_per_tok": t.num_experts_per_tok,
            "moe_intermediate_size": t.moe_intermediate_size,
        }
        return Shapes.from_hf_config(tiny, "policy.tiny")
    config, source = config_json(pc.model_path)
    return Shapes.from_hf_config(config, source)


def padded_vocab(vocab: int, tp: int) -> int:
    """Rows of the Megatron embedding (``nemo_disco.weights.padded_vocab_size``)."""
    step = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-vocab // step) * step


# ----------------------------------------------------------------------------------------------------------------------
# Parameters per rank.


@dataclass(frozen=True)
class Counts:
    """Elements per rank of one pipeline stage: parameters, the fp32 gradient buffers, the optimizer's shard."""

    weights: int
    dense_trainable: int
    expert_trainable: int
    frozen: int
    dp: int
    expert_dp: int
    optimizer: int

    @property
    def grads(self) -> int:
        """Gradient-buffer elements: every trainable parameter of the rank (the buffers are never sharded)."""
        return self.dense_trainable + self.expert_trainable


def layer_params(s: Shapes, tp: int, ep: int) -> tuple[int, int, int]:
    """(dense, expert, router) parameters of one transformer layer on one rank (expert tensor parallelism 1)."""
    qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
    attn = qkv_rows * s.hidden // tp + s.hidden * s.heads * s.head_dim // tp
    attn += qkv_rows // tp if s.qkv_bias else 0
    attn += 2 * s.head_dim if s.qk_norm else 0
    norms = 2 * s.hidden
    if not s.is_moe:
        return attn + norms + 3 * s.ffn * s.hidden // tp, 0, 0
    return attn + norms, (s.experts // ep) * 3 * s.moe_ffn * s.hidden, s.experts * s.hidden


def stage_layers(layers: int, pp: int, stage: int) -> int:
    """Layers of a pipeline stage (mcore's even split; ``nemo_disco.weights.layer_range``)."""
    return len(range(stage * layers // pp, (stage + 1) * layers // pp))


def rank_counts(s: Shapes, tp: int, pp: int, ep: int, world: int, stage: int, freeze_router: bool = True) -> Counts:
    """Element counts of a rank of pipeline ``stage`` at TP x PP (x EP) in a world of ``world`` trainer ranks."""
    vp = padded_vocab(s.vocab, tp)
    n = stage_layers(s.layers, pp, stage)
    dense, expert, router = (n * x for x in layer_params(s, tp, ep))
    if stage == 0:
        dense += vp * s.hidden // tp  # embedding
    if stage == pp - 1:
        dense += s.hidden  # final norm
        if not s.tied or pp > 1:  # tied at PP > 1: the last stage keeps its own copy of the embedding
            dense += vp * s.hidden // tp
    frozen = router if freeze_router else 0
    dense += router - frozen
    dp = world // (tp * pp)
    expert_dp = world // (pp * ep)
    optimizer = -(-dense // dp) + (-(-expert // expert_dp) if expert else 0)
    return Counts(dense + expert + frozen, dense, expert, frozen, dp, expert_dp, optimizer)


# ----------------------------------------------------------------------------------------------------------------------
# The plan.


@dataclass
class Term:
    """One term of a GPU's memory: its bytes in each phase and how they are computed."""

    name: str
    formula: str
    phases: dict[str, int] = field(default_factory=dict)


@dataclass
class Group:
    """The GPUs of one role (every GPU of a synchronous run; an asynchronous run's trainer or generator)."""

    role: str
    gpus: int
    note: str
    terms: list[Term] = field(default_factory=list)

    def add(self, name: str, formula: str, **phases: float) -> None:
        """Add a term present in the given phases."""
        self.terms.append(Term(name, formula, {p: int(v) for p, v in phases.items()}))

    def phase_names(self) -> list[str]:
        """The phases this group's GPUs go through, in step order."""
        seen = {p for t in self.terms for p in t.phases}
        return [p for p in PHASES if p in seen]

    def total(self, phase: str) -> int:
        """Bytes in use on one GPU of the group during ``phase``."""
        return sum(t.phases.get(phase, 0) for t in self.terms)


def _bytes_of(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def micro_batch_tokens(cfg: Any) -> int:
    """Tokens of the largest micro-batch.

    The budget (``policy.microbatch_tokens``), or one full-length row when a row exceeds it, and at most the
    full-length rows one data-parallel rank trains in an update (a mini-batch's rollouts / DP).
    """
    g, a = cfg.generation, cfg.algorithm
    row = g.max_prompt_tokens + g.max_response_tokens
    rows = max(1, a.minibatch_prompts * a.rollouts_per_prompt // cfg.data_parallel_size)
    return min(max(cfg.policy.microbatch_tokens, row), rows * row)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's shape and how the layers run it (see :func:`micro_batch_bytes`)."""

    tokens: int
    seq: int
    tp: int = 1
    sp: bool = False
    dtype_bytes: int = 2
    recompute: Any = False
    chunk: int = 1024
    entropy: bool = True
    #: "te": Transformer Engine (fused RMSNorm + linear, fused attention, fused SwiGLU; packed rows, the GPU path);
    #: "local": mcore's local spec (torch RMSNorm, unfused attention keeping s^2 scores, padded rows; the CPU path).
    kernels: str = "te"
    layers: int = 1
    in_flight: int = 1
    last_stage: bool = True


def layer_activation_bytes(s: Shapes, mb: MicroBatch) -> tuple[int, str]:
    """Bytes one layer keeps for its backward with no recomputation, and the formula.

    Korthikanti et al. 2022 (sec. 4.1) count each tensor a layer saves for its backward. Counted here for the layers
    this package builds (RMSNorm, grouped-query attention, SwiGLU or routed experts, no dropout), per token, with
    ``t`` = TP and ``e`` the element size:

    - ``te``: each fused norm + linear keeps its input and the normalised output (``2e h`` twice, ``/t`` with
      sequence parallelism); the fused attention keeps q, k, v and its output (``e (2q + 2kv) / t``, no ``s^2``
      scores), Qwen3's q / k norms their inputs (``2e (q + kv) / t``); the fused SwiGLU its input and output
      (``3e f / t``).
    - ``local``: torch's RMSNorm keeps its float32 input and normalised output (``16 h``) and the linear the
      model-dtype copy (``2e h``); the unfused attention keeps q, k and v expanded to every head (``3e q / t``), its
      output (``e q / t``), and per score the float32 softmax and the model-dtype probabilities
      (``(4 + e) a s / t``); the unfused SwiGLU ``5e f / t``.
    """
    t, h, d, e = mb.tp, s.hidden, s.head_dim, mb.dtype_bytes
    q, kv = s.heads * d, s.kv_heads * d
    nd = t if mb.sp else 1
    if mb.kernels == "te":
        per_token = 4 * e * h / nd + e * (2 * q + 2 * kv) / t + (2 * e * (q + kv) / t if s.qk_norm else 0)
        formula = f"T*(4e h{'/t' if mb.sp else ''} + e(2q+2kv)/t" + (" + 2e(q+kv)/t" if s.qk_norm else "")
        mlp, mlp_formula = 3 * e * s.ffn / t, "3e f/t"
    else:
        per_token = 16 * h / nd + 2 * e * h / nd + 4 * e * q / t + (4 + e) * s.heads * mb.seq / t
        per_token += 8 * (q + kv) / t if s.qk_norm else 0
        formula = f"T*(16h + 2e h + 4e q/t + (4+e) a s/t{' + 8(q+kv)/t' if s.qk_norm else ''}"
        mlp, mlp_formula = 5 * e * s.ffn / t, "5e f/t"
    if s.is_moe:
        # Routed tokens: the layer's tokens after sequence parallelism (MoE runs it at TP > 1), k copies each: the
        # permuted input and the expert output (h each), fc1 output and activation (3 f_moe); fp64 router logits
        # and probabilities (16 E).
        k = s.topk / t
        mlp = e * k * (2 * h + 3 * s.moe_ffn) + 16 * s.experts / t
        mlp_formula = "e k/t (2h + 3f_moe) + 16E/t"
    return int(mb.tokens * (per_token + mlp)), f"{formula} + {mlp_formula})"


def layer_forward_bytes(s: Shapes, mb: MicroBatch) -> int:
    """The working set of one layer's forward without autograd (the log-prob pass): its largest sub-block.

    The MLP's fc1 output, activation and output (``e (3f + 2h) / t`` per token, routed tokens for MoE); the
    unfused attention's scores in the model dtype, their float32 copy, the masked copy and the softmax
    (``(e + 12) a s / t``) beside q, k, v.
    """
    t, e, h = mb.tp, mb.dtype_bytes, s.hidden
    f = s.moe_ffn * s.topk if s.is_moe else s.ffn
    mlp = e * (3 * f + 2 * h) / t
    q = s.heads * s.head_dim
    attn = e * (4 * q) / t + ((e + 12) * s.heads * mb.seq / t if mb.kernels == "local" else 0)
    return int(mb.tokens * max(mlp, attn))


def micro_batch_bytes(s: Shapes, vocab: int, mb: MicroBatch) -> dict[str, dict[str, int]]:
    """Per phase (``training``, ``logprobs``), the bytes of one micro-batch: ``activations``, ``logits``, ``chunk``.

    Training keeps, per pipeline stage, ``in_flight`` micro-batches of ``layers`` layers (1F1B: the first stage
    holds PP of them): every tensor of :func:`layer_activation_bytes`, or with full recomputation each layer's
    input only (``e T h``) plus one layer recomputed in the backward, which is never alive at once with the
    logits' backward (the larger of the two counts). The last stage adds the logits ``e T V / t`` (kept for the
    log-prob backward) and their gradient, the final norm and the output layer's input, and the float32
    ``[chunk, V / t]`` blocks of the chunked log-prob (two with the entropy). The log-prob pass keeps no
    activations: its peak is the larger of one layer's forward working set and the logits (twice with the
    local spec's padded rows: mcore transposes them to ``[b, s, V]`` by a copy).
    """
    t, e, h = mb.tp, mb.dtype_bytes, s.hidden
    nd = t if mb.sp else 1
    per_layer, formula = layer_activation_bytes(s, mb)
    boundary = e * mb.tokens * h // nd
    logits = e * mb.tokens * vocab // t if mb.last_stage else 0
    blocks = 2 if mb.entropy else 1
    chunk = 4 * min(mb.chunk, mb.tokens) * vocab // t * blocks if mb.last_stage else 0
    final = (16 * h + e * h) * mb.tokens // nd if mb.kernels == "local" else 3 * e * h * mb.tokens // nd
    final = final if mb.last_stage else 0
    copies = 2 if mb.kernels == "local" else 1
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qk_norm = (q + kv) * (8 if mb.kernels == "local" else 2 * e) / t if s.qk_norm else 0
    if mb.kernels == "local":
        # The attention's share of a layer and the gradient of its s^2 scores (float32 softmax, model-dtype probs).
        attn_part = mb.tokens * ((8 * h + e * h) / nd + 4 * e * q / t + (4 + e) * s.heads * mb.seq / t + qk_norm)
        attn_grad = mb.tokens * (4 + e) * s.heads * mb.seq / t
    else:
        attn_part = mb.tokens * (2 * e * h / nd + e * (2 * q + 2 * kv) / t + qk_norm)
        attn_grad = mb.tokens * e * (q + 2 * kv) / t
    logit_work = 2 * logits + chunk  # the logits' backward: logits, their gradient, the float32 blocks
    if mb.recompute == "full":
        kept = mb.in_flight * mb.layers * boundary
        work = max(per_layer, attn_part + attn_grad)  # the recomputed layer, then its attention's backward
        act = kept + final + max(0, int(work) - logit_work)
        act_formula = (
            f"{mb.in_flight} in flight x {mb.layers} layers x e T h{'/t' if mb.sp else ''} + one layer recomputed "
            f"({formula}; or its attention with the scores' gradient) beyond the logits' backward"
        )
    else:  # selective recomputes the core attention; with the fused kernel it saves nothing, with the local one s^2
        if mb.recompute == "selective" and mb.kernels == "local":
            per_layer -= int(mb.tokens * (4 + e) * s.heads * mb.seq / t)
        act = mb.in_flight * mb.layers * per_layer + final + max(0, int(attn_grad) - logit_work)
        act_formula = (
            f"{mb.in_flight} in flight x {mb.layers} layers x {formula} (+ the attention's gradient beyond the "
            "logits' backward)"
        )
    fwd = layer_forward_bytes(s, mb)
    lp_logits = copies * logits
    return {
        "training": {"activations": act, "logits": 2 * logits, "chunk": chunk},
        "logprobs": {"activations": max(0, fwd - lp_logits - chunk), "logits": lp_logits, "chunk": chunk},
        "formula": {"activations": act_formula},  # type: ignore[dict-item]
    }


def _engine_profile_bytes(s: Shapes, tp: int, batched_tokens: int) -> int:
    """Bytes of vLLM's profiling forward: a layer's bf16 intermediates at the batched tokens; the fp32 sampler."""
    f = s.moe_ffn * s.topk if s.is_moe else s.ffn
    return int(2 * batched_tokens * (4 * s.hidden + 3 * f / tp) + 4 * VLLM_MAX_NUM_SEQS * s.vocab * 2)


@dataclass
class Plan:
    """The memory plan of a recipe on a GPU model, and its step time and cost."""

    gpu: Gpu
    shapes: Shapes
    groups: list[Group]
    step: dict[str, Any]
    notes: list[str]

    def peaks(self) -> list[tuple[Group, str, int]]:
        """(group, phase, bytes) of every phase of every group."""
        return [(g, p, g.total(p)) for g in self.groups for p in g.phase_names()]

    @property
    def peak(self) -> tuple[Group, str, int]:
        """The group and phase with the most bytes on one GPU."""
        return max(self.peaks(), key=lambda x: x[2])

    @property
    def fits(self) -> bool:
        """Whether the peak fits the device's memory."""
        return self.peak[2] <= self.gpu.memory_bytes

    def phase_label(self, group: Group, phase: str) -> str:
        """``phase`` for a synchronous run, ``role/phase`` for an asynchronous one."""
        return phase if len(self.groups) == 1 else f"{group.role}/{phase}"

    def largest_term(self) -> Term:
        """The largest term of the peak phase."""
        group, phase, _ = self.peak
        return max(group.terms, key=lambda t: t.phases.get(phase, 0))

    def to_json(self) -> dict[str, Any]:
        """The plan as one JSON-able object (``nemo-disco plan --json``)."""
        group, phase, peak = self.peak
        terms: dict[str, dict[str, int]] = {}
        formulas: dict[str, str] = {}
        for g in self.groups:
            for t in g.terms:
                name = t.name if len(self.groups) == 1 else f"{g.role}/{t.name}"
                terms[name] = {self.phase_label(g, p): b for p, b in t.phases.items()}
                formulas[name] = t.formula
        return {
            "gpu": self.gpu.name,
            "device_bytes": self.gpu.memory_bytes,
            "peak_bytes": peak,
            "peak_phase": self.phase_label(group, phase),
            "fits": self.fits,
            "headroom_bytes": self.gpu.memory_bytes - peak,
            "model": {"source": self.shapes.source, "model_type": self.shapes.model_type},
            "groups": {g.role: {"gpus": g.gpus, "note": g.note} for g in self.groups},
            "phases": {self.phase_label(g, p): b for g, p, b in self.peaks()},
            "terms": terms,
            "formulas": formulas,
            "step": self.step,
            "notes": self.notes,
        }


def _policy_terms(cfg: Any, s: Shapes, group: Group, resident: bool = False) -> dict[str, int]:  # noqa: PLR0915
    """Add the trained policy's terms (weights, gradients, optimizer, activations, logits); its per-rank counts.

    ``resident``: the policy stays on the GPU while the generator runs (the transformers generator: no offload).
    """
    pc = cfg.policy
    tp, pp, ep = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.expert_parallel_size if s.is_moe else 1
    world = cfg.world_size
    e = _bytes_of(pc.dtype)
    sp = tp > 1 and (pc.sequence_parallel or s.is_moe)
    vp = padded_vocab(s.vocab, tp)
    tokens = micro_batch_tokens(cfg)
    kernels = "local" if pc.transformer_engine is False or pc.dtype == "float32" else "te"
    # The heaviest stage: the first keeps pp micro-batches in flight (1F1B), the last holds the logits.
    candidates = []
    for stage in sorted({0, pp - 1}):
        c = rank_counts(s, tp, pp, ep, world, stage, pc.freeze_router)
        mb = MicroBatch(
            tokens=tokens,
            seq=cfg.generation.max_prompt_tokens + cfg.generation.max_response_tokens,
            tp=tp,
            sp=sp,
            dtype_bytes=e,
            recompute=pc.activation_checkpointing,
            chunk=pc.logprob_chunk_size,
            kernels=kernels,
            layers=stage_layers(s.layers, pp, stage),
            in_flight=pp - stage,
            last_stage=stage == pp - 1,
        )
        m = micro_batch_bytes(s, vp, mb)
        score = c.weights * e + 4 * c.grads + 12 * c.optimizer + sum(m["training"].values())
        candidates.append((score, stage, c, m))
    _, stage, c, m = max(candidates, key=lambda x: x[0])
    act_formula = m["formula"]["activations"]
    logits, chunk = m["logprobs"]["logits"], m["training"]["chunk"]
    group.note = f"TP {tp} x PP {pp}{f' x EP {ep}' if s.is_moe else ''}, DP {c.dp}; pipeline stage {stage} shown"
    # Offloaded while a colocated vLLM engine generates; an asynchronous trainer has no engine.
    on = ("generation", "refit", "logprobs", "training") if resident else ("refit", "logprobs", "training")
    group.add(
        "policy weights",
        f"{e} B x {c.weights:,} params on the rank (layers/PP, matrices/TP, {'experts/EP, ' if s.is_moe else ''}"
        f"vocab {vp}/TP)",
        **dict.fromkeys(on, c.weights * e),
    )
    keep = ("generation", "refit", "logprobs", "training") if resident else ("logprobs", "training")
    group.add(
        "gradient buffers",
        f"4 B (fp32, grad_reduce_in_fp32) x {c.grads:,} trainable params",
        **dict.fromkeys(keep, 4 * c.grads),
    )
    opt_bytes = 12 if e == 2 else 8
    shard = (
        f"dense {c.dense_trainable:,}/DP {c.dp}"
        + (f" + experts {c.expert_trainable:,}/EDP {c.expert_dp}" if s.is_moe else "")
        if pc.use_distributed_optimizer
        else f"{c.grads:,} (no distributed optimizer)"
    )
    opt_elems = c.optimizer if pc.use_distributed_optimizer else c.grads
    group.add(
        "optimizer states",
        f"{opt_bytes} B ({'fp32 master + ' if e == 2 else ''}Adam m, v) x {shard} = {opt_elems:,}",
        **dict.fromkeys(keep, opt_bytes * opt_elems),
    )
    group.add(
        "activations",
        f"{act_formula}; T={tokens} tokens/micro-batch, recompute={pc.activation_checkpointing}, SP={sp}, "
        f"{kernels} kernels (log-probs: one layer's forward working set beyond the logits)",
        training=m["training"]["activations"],
        logprobs=m["logprobs"]["activations"],
    )
    if logits:
        group.add(
            "logits",
            f"e T V/t = {e} x {tokens} x {vp}/{tp}{' x2 (transposed copy)' if kernels == 'local' else ''}; "
            "training: with their gradient",
            logprobs=logits,
            training=m["training"]["logits"],
        )
        group.add(
            "log-prob chunk",
            f"4 B x chunk {min(pc.logprob_chunk_size, tokens)} x V/t x 2 blocks (log-softmax, entropy)",
            logprobs=chunk,
            training=chunk,
        )
    if _needs_reference(cfg):
        group.add(
            "reference weights",
            f"{e} B x {c.weights:,} (forward-only copy, on the GPU for its pass)",
            logprobs=c.weights * e,
        )
    return {"weights": c.weights, "grads": c.grads, "optimizer": opt_elems, "dp": c.dp}


def kv_bytes_per_token(s: Shapes, tp: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one token's KV cache on one GPU of a vLLM engine: k and v of every layer, KV heads over TP.

    A KV head is replicated when TP exceeds the KV heads (``max(kv_heads / TP, 1)``).
    """
    return 2 * s.layers * max(s.kv_heads // tp, 1) * s.head_dim * dtype_bytes


def kv_tokens(budget_bytes: float, s: Shapes, tp: int = 1, dtype_bytes: int = 2, block_size: int = 0) -> int:
    """Tokens a KV cache of ``budget_bytes`` holds (whole blocks of ``block_size`` tokens when given)."""
    tokens = int(budget_bytes // kv_bytes_per_token(s, tp, dtype_bytes))
    return tokens - tokens % block_size if block_size else tokens


def _engine_terms(cfg: Any, s: Shapes, gpu: Gpu, group: Group, colocated: bool) -> dict[str, float]:
    """Add the vLLM engine's terms; returns its KV-cache capacity (tokens) and weights per GPU."""
    g, own = cfg.generation, generators.params_of(cfg, "vllm")
    tg = g.tensor_parallel_size
    util = generators.gpu_memory_utilization(cfg)
    level = generators.sleep_level(cfg)
    weights = 2 * _param_total(s) / tg
    batched = own.max_num_batched_tokens or VLLM_DEFAULT_BATCHED_TOKENS
    profile = _engine_profile_bytes(s, tg, batched)
    budget = util * gpu.memory_bytes
    kv = max(0.0, budget - weights - profile)
    kv_per_token = kv_bytes_per_token(s, tg)
    graphs = 0 if own.enforce_eager else CUDA_GRAPH_BYTES
    group.add(
        "vLLM weights",
        f"2 B x {_param_total(s):,} params / generation TP {tg}",
        generation=weights,
        refit=weights,
        **({"logprobs": weights, "training": weights} if colocated and level == 0 else {}),
    )
    group.add(
        "vLLM KV cache",
        f"gpu_memory_utilization {util} x device - weights - profile = {kv / 2**30:.1f} GiB = "
        f"{int(kv // kv_per_token):,} tokens of {kv_per_token:,} B (2 x L x kv_heads/TP x d x 2 B)",
        generation=kv,
        **({"logprobs": kv, "training": kv} if colocated and level == 0 else {}),
    )
    group.add(
        "vLLM profile",
        f"activations of a {batched}-token forward + fp32 sampler logits {VLLM_MAX_NUM_SEQS} x V (inside the share)",
        generation=profile,
    )
    kept = "kept while asleep" if colocated and level > 0 else ""
    eager = " (enforce_eager: none)" if own.enforce_eager else ""
    group.add(
        "vLLM CUDA graphs",
        f"{CUDA_GRAPH_BYTES / GIB:.1f} GiB assumed{eager} {kept}".strip(),
        **dict.fromkeys(PHASES if colocated else ("generation", "refit"), graphs),
    )
    group.add(
        "refit bucket",
        f"generation.refit_bucket_mb {g.refit_bucket_mb} MB, sent and received",
        refit=2 * g.refit_bucket_mb * 2**20,
    )
    return {"kv_tokens": kv // kv_per_token, "weights_per_gpu": weights, "kv_per_token": kv_per_token}


def _hf_generator_terms(cfg: Any, s: Shapes, group: Group, phases: tuple[str, ...] = PHASES) -> dict[str, float]:
    """Add the transformers generator's terms (its own copy of the weights, the KV cache of its batch)."""
    g, e = cfg.generation, _bytes_of(cfg.policy.dtype)
    weights = e * _param_total(s)
    rows, length = generators.params_of(cfg, "hf").hf_batch_size, g.max_prompt_tokens + g.max_response_tokens
    per_token = kv_bytes_per_token(s, 1, e)
    # Not colocated (rollouts.local.is_colocated: vLLM only): it never sleeps, its weights stay on the GPU.
    group.add(
        "generator weights",
        f"{e} B x {_param_total(s):,} params (transformers; never put to sleep)",
        **dict.fromkeys(phases, weights),
    )
    group.add(
        "generator KV cache",
        f"generation.hf_batch_size {rows} x {length} tokens x {per_token:,} B",
        generation=rows * length * per_token,
    )
    return {"kv_tokens": rows * length, "weights_per_gpu": weights, "kv_per_token": per_token, "max_batch": rows}


def _param_total(s: Shapes) -> int:
    """Parameters of the whole model (unpadded vocabulary), as a Hugging Face checkpoint holds them."""
    dense, expert, router = layer_params(s, 1, 1)
    return s.layers * (dense + expert + router) + s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden


def _active_params(s: Shapes) -> int:
    """Parameters one token passes through (MoE: k of the experts), embedding lookup excluded."""
    dense, expert, router = layer_params(s, 1, 1)
    if s.is_moe:
        expert = expert * s.topk // s.experts
    return s.layers * (dense + expert + router) + s.vocab * s.hidden


@dataclass(frozen=True)
class Rates:
    """The assumptions of the step-time estimate (``nemo-disco plan --mfu --mean-response-tokens``)."""

    mfu: float = MFU
    mean_response_tokens: float | None = None  # None: MEAN_RESPONSE_SHARE x generation.max_response_tokens
    hbm_efficiency: float = HBM_EFFICIENCY


def _step_time(cfg: Any, s: Shapes, gpu: Gpu, engine: dict[str, float], rates: Rates) -> dict[str, Any]:
    """Seconds of a step's generation, refit and training at the stated rates, and the run's GPU-hours."""
    g, a, pc = cfg.generation, cfg.algorithm, cfg.policy
    rollouts = a.prompts_per_step * a.rollouts_per_prompt
    mean_resp = rates.mean_response_tokens or MEAN_RESPONSE_SHARE * g.max_response_tokens
    seq = g.max_prompt_tokens / 2 + mean_resp
    tokens = rollouts * seq
    n_active = _active_params(s)
    attn = 6 * 2 * s.layers * s.heads * s.head_dim * seq / 2  # QK^T and AV, causal half, fwd + bwd
    recompute = 2 * n_active if pc.activation_checkpointing == "full" else 0
    reference = 2 * n_active if _needs_reference(cfg) else 0
    train_flops = tokens * (6 * n_active + attn + recompute + 2 * n_active + reference)  # + the old log-prob pass
    trainers = cfg.world_size
    train_s = train_flops / (trainers * gpu.bf16_flops * rates.mfu)
    tg = g.tensor_parallel_size
    engines = (cfg.generation_world_size or cfg.world_size) // tg
    per_engine = math.ceil(rollouts / engines)
    most = engine.get("max_batch", VLLM_MAX_NUM_SEQS)
    batch = max(1, min(per_engine, most, int(engine["kv_tokens"] // (g.max_prompt_tokens + mean_resp))))
    rounds = math.ceil(per_engine / batch)
    kv_read = batch * (g.max_prompt_tokens + mean_resp) * engine["kv_per_token"]
    decode_step_s = (engine["weights_per_gpu"] + kv_read) / (gpu.hbm_bytes_per_s * rates.hbm_efficiency)
    gen_s = rounds * g.max_response_tokens * decode_step_s
    refit_bytes = 2 * _param_total(s)
    link = gpu.nvlink_bytes_per_s if not a.async_rollouts else NETWORK_BYTES_PER_S
    refit_s = refit_bytes / tg / link
    total_gpus = cfg.world_size + cfg.generation_world_size
    step_s = max(gen_s, train_s) + refit_s if a.async_rollouts else gen_s + refit_s + train_s
    return {
        "assumptions": {
            "mfu": rates.mfu,
            "hbm_efficiency": rates.hbm_efficiency,
            "mean_response_tokens": mean_resp,
            "bf16_flops_per_gpu": gpu.bf16_flops,
            "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
            "refit_link_bytes_per_s": link,
        },
        "params": _param_total(s),
        "active_params": n_active,
        "tokens_per_step": int(tokens),
        "train_flops": train_flops,
        "train_s": train_s,
        "decode_batch": batch,
        "decode_rounds": rounds,
        "generation_s": gen_s,
        "refit_bytes": refit_bytes,
        "refit_s": refit_s,
        "step_s": step_s,
        "steps": a.steps,
        "gpus": total_gpus,
        "gpu_hours": step_s * a.steps * total_gpus / 3600,
    }


def make_plan(cfg: Any, gpu: str | Gpu = DEFAULT_GPU, shapes: Shapes | None = None, rates: Rates = Rates()) -> Plan:
    """The memory plan and step-time estimate of a validated :class:`~nemo_disco.config.RunConfig`.

    Raises:
        PlanError: an unknown GPU model or a model whose config.json is nowhere to be found.
    """
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise PlanError(f"--gpu {gpu}: unknown GPU model; known: {', '.join(GPUS)}")
        gpu = GPUS[gpu]
    s = shapes or model_shapes(cfg)
    notes = []
    if cfg.policy.backend != "megatron":
        notes.append(
            "policy.backend=hf: planned as the Megatron layout (transformers keeps no fp32 gradient buffer); train "
            "does not check it"
        )
    if cfg.algorithm.async_rollouts:
        trainer = Group("trainer", cfg.world_size, "")
        _policy_terms(cfg, s, trainer)
        trainer.add("runtime", "CUDA context, cuBLAS, NCCL (assumed)", **dict.fromkeys(PHASES[1:], RUNTIME_BYTES))
        trainer.terms = [_only(t, ("refit", "logprobs", "training")) for t in trainer.terms]
        generator = Group(
            "generator",
            cfg.generation_world_size,
            f"vLLM TP {cfg.generation.tensor_parallel_size}, sleep level {generators.sleep_level(cfg)}"
            if cfg.generation.backend == "vllm"
            else "transformers generator",
        )
        if cfg.generation.backend == "vllm":
            engine = _engine_terms(cfg, s, gpu, generator, colocated=False)
        else:
            engine = _hf_generator_terms(cfg, s, generator, phases=("generation", "refit"))
        generator.add("runtime", "CUDA context, NCCL (assumed)", generation=RUNTIME_BYTES, refit=RUNTIME_BYTES)
        groups = [trainer, generator]
    else:
        group = Group("gpu", cfg.world_size, "")
        vllm = cfg.generation.backend == "vllm"
        _policy_terms(cfg, s, group, resident=not vllm)
        if vllm:
            engine = _engine_terms(cfg, s, gpu, group, colocated=True)
            group.note += (
                f"; vLLM TP {cfg.generation.tensor_parallel_size} colocated, sleep level {generators.sleep_level(cfg)}"
            )
        else:
            engine = _hf_generator_terms(cfg, s, group)
            group.note += "; transformers generator beside the resident policy"
        group.add("runtime", "CUDA context, cuBLAS, NCCL (assumed)", **dict.fromkeys(PHASES, RUNTIME_BYTES))
        groups = [group]
    groups = [_drop_empty(g) for g in groups]
    return Plan(gpu, s, groups, _step_time(cfg, s, gpu, engine, rates), notes)


def _only(term: Term, phases: tuple[str, ...]) -> Term:
    return Term(term.name, term.formula, {p: b for p, b in term.phases.items() if p in phases})


def _drop_empty(group: Group) -> Group:
    group.terms = [t for t in group.terms if any(t.phases.values())]
    return group


# ----------------------------------------------------------------------------------------------------------------------
# Start-up check and output.


REMEDIES = {
    "activations": "policy.activation_checkpointing=full, a smaller policy.microbatch_tokens or a larger "
    "policy.tensor_parallel_size",
    "logits": "a smaller policy.microbatch_tokens or a larger policy.tensor_parallel_size",
    "log-prob chunk": "a smaller policy.logprob_chunk_size",
    "policy weights": "a larger policy.tensor_parallel_size or policy.pipeline_parallel_size",
    "gradient buffers": "a larger policy.tensor_parallel_size or policy.pipeline_parallel_size",
    "optimizer states": "more data-parallel ranks (cluster.nodes) or a larger policy.tensor_parallel_size",
    "vLLM KV cache": "a lower generation.gpu_memory_utilization",
    "vLLM weights": "a larger generation.tensor_parallel_size",
    "vLLM profile": "a smaller generation.max_num_batched_tokens",
    "vLLM CUDA graphs": "generation.enforce_eager=true",
}


def refusal(plan: Plan) -> str | None:
    """One line saying why the plan does not fit its GPU, naming the largest term and a remedy; None if it fits."""
    if plan.fits:
        return None
    group, phase, peak = plan.peak
    term = plan.largest_term()
    remedy = REMEDIES.get(term.name.split("/")[-1], "a larger policy.tensor_parallel_size")
    return (
        f"the memory plan needs {peak / GIB:.1f} GiB per GPU in the {plan.phase_label(group, phase)} phase, over the "
        f"{plan.gpu.name}'s {plan.gpu.memory_bytes / GIB:.1f} GiB; largest term: {term.name} "
        f"{term.phases[phase] / GIB:.1f} GiB: try {remedy} (nemo-disco plan shows every term; "
        "policy.memory_check=false skips this check)"
    )


def gpu_of_device(total_memory: int, name: str = "") -> Gpu:
    """The :class:`Gpu` of a device found at start-up: its memory, and the rates of the closest known model."""
    lowered = name.lower()
    family = "h200" if "h200" in lowered else "a100" if "a100" in lowered else "h100"
    known = min(
        (g for g in GPUS.values() if g.name.startswith(family)),
        key=lambda g: abs(g.memory_bytes - total_memory),
        default=GPUS[DEFAULT_GPU],
    )
    return Gpu(name or known.name, total_memory, known.bf16_flops, known.hbm_bytes_per_s, known.nvlink_bytes_per_s)


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}" if b else "-"


def render(plan: Plan, recipe: str) -> str:
    """The human-readable table: terms x phases per group, the peak, headroom, fit; then time and cost."""
    lines = [f"{recipe} on {plan.gpu.name} ({plan.gpu.memory_bytes / GIB:.1f} GiB), model {plan.shapes.source}"]
    for g in plan.groups:
        phases = g.phase_names()
        lines.append("")
        lines.append(f"[{g.role}: {g.gpus} GPU(s); {g.note}]  GiB per GPU")
        width = max(len(t.name) for t in g.terms) + 2
        lines.append("term".ljust(width) + "".join(p.rjust(12) for p in phases) + "   formula")
        for t in g.terms:
            lines.append(
                t.name.ljust(width) + "".join(_gib(t.phases.get(p, 0)).rjust(12) for p in phases) + f"   {t.formula}"
            )
        lines.append("total".ljust(width) + "".join(_gib(g.total(p)).rjust(12) for p in phases))
    group, phase, peak = plan.peak
    head = plan.gpu.memory_bytes - peak
    lines += [
        "",
        f"peak {peak / GIB:.1f} GiB in {plan.phase_label(group, phase)}; headroom {head / GIB:.1f} GiB of "
        f"{plan.gpu.memory_bytes / GIB:.1f}; fits: {'yes' if plan.fits else 'NO'}",
    ]
    st = plan.step
    lines += [
        "",
        f"step time (estimate: MFU {st['assumptions']['mfu']}, HBM efficiency {st['assumptions']['hbm_efficiency']}, "
        f"mean response {st['assumptions']['mean_response_tokens']:.0f} tokens): "
        f"generation {st['generation_s']:.0f} s (decode batch {st['decode_batch']} x {st['decode_rounds']} round(s), "
        f"HBM bound) + refit {st['refit_s']:.2f} s ({st['refit_bytes'] / 1e9:.1f} GB) + training {st['train_s']:.0f} s "
        f"({st['train_flops']:.2e} FLOP, {st['active_params'] / 1e9:.2f}B active params) = {st['step_s']:.0f} s",
        f"cost: {st['steps']} steps x {st['step_s']:.0f} s x {st['gpus']} GPUs = {st['gpu_hours']:.0f} GPU-hours",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    if not plan.fits:
        lines.append(f"does not fit: {refusal(plan)}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments."""
    p.add_argument("--config", required=True, help="recipe YAML (recipes/*.yaml)")
    p.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPUS), help="GPU model (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--mfu", type=float, default=MFU, help="model FLOP utilisation of training (default: %(default)s)")
    p.add_argument(
        "--mean-response-tokens",
        type=float,
        default=None,
        help=f"mean response length for the time estimate (default: {MEAN_RESPONSE_SHARE} x the cap)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. policy.tensor_parallel_size=2")


def _needs_reference(cfg: Any) -> bool:
    """Whether the run's loss needs the reference policy (the GRPO family with ``kl_coef`` > 0), as the loss says.

    The losses import torch, which this module does not need otherwise: imported here, when a plan is made.
    """
    from nemo_disco import parts

    return parts.loss_of(cfg).needs_reference


def command(args: argparse.Namespace) -> int:
    """``nemo-disco plan``: print the plan; exit 0 whether or not it fits (``train`` refuses what does not)."""
    from nemo_disco import config as config_lib

    cfg = config_lib.load(args.config, args.overrides)
    plan = make_plan(cfg, args.gpu, rates=Rates(mfu=args.mfu, mean_response_tokens=args.mean_response_tokens))
    print(json.dumps(plan.to_json(), indent=1) if args.json else render(plan, Path(args.config).name))
    return 0


def check_at_startup(cfg: Any, gpu: str | None = None) -> str | None:
    """The start-up check of ``train``: the refusal line when the plan's peak exceeds the GPU's memory, else None.

    ``gpu``: a GPU model to check against (``train --gpu``); None: the device found (no check without CUDA).
    Skipped (None) with ``policy.memory_check=false``, for ``policy.backend=hf`` (the plan is the Megatron layout's)
    or when the model's config.json is nowhere to be found.
    """
    if not cfg.policy.memory_check or cfg.policy.backend != "megatron":  # the plan is the Megatron layout's
        return None
    if gpu is None:
        import torch

        if not torch.cuda.is_available():
            return None
        from nemo_disco import distributed

        # This process's own GPU (the launcher's local rank): no CUDA context on another rank's device.
        props = torch.cuda.get_device_properties(distributed.cuda_device_index())
        device: str | Gpu = gpu_of_device(props.total_memory, props.name)
    else:
        device = gpu
    try:
        return refusal(make_plan(cfg, device))
    except PlanError:
        return None
