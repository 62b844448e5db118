"""Model families: every Hugging Face ``model_type`` the package builds and trains, each declared once, here.

A :class:`Family` holds all the package needs to know of one: its weight table (every tensor's Hugging Face and
Megatron-Core names, kind and shapes, which ``weights.py`` shards), its attention's and MLP's features
(``qkv_bias``, ``qk_norm``, ``moe``: read by ``weights.ModelSpec`` for the Megatron model and by ``plan.py``), the
transformers config class and fixed config keys of the tiny model built in code (``tiny.py``), and whether the
transformers generator's KV-cached decode loop runs it (``generation/kv_decode.py``). ``policy.tiny.architecture``
accepts the registered names (``config.TinyModelConfig``).

Torch-free and free of the rest of the package: ``config.py`` and ``plan.py`` read it where torch is absent.

The tables list, for every tensor, its Hugging Face name(s), its Megatron-Core name(s) (the local layer spec's
name first, then the Transformer Engine spec's), its kind (``replicated``, ``row``, ``vocab``, ``qkv``,
``gate_up``: how ``weights.py`` shards it, described there) and the names of its HF dimensions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

REPLICATED, ROW, VOCAB, QKV, GATE_UP = "replicated", "row", "vocab", "qkv", "gate_up"


@dataclass(frozen=True)
class Entry:
    """One row of a weight table.

    ``{layer}`` in a name is the (global HF / local mcore) layer index, ``{expert}`` the (global HF / local
    mcore) expert index. ``dims`` names each HF tensor's dimensions (see ``weights.hf_shapes``).
    """

    hf: tuple[str, ...]
    mcore: tuple[str, ...]
    kind: str
    dims: tuple[tuple[str, ...], ...]
    #: Owning pipeline stage of a non-layer entry: "first" or "last".
    stage: str = "last"
    #: Only present when the embeddings are not tied (the output layer).
    untied_only: bool = False

    @property
    def per_layer(self) -> bool:
        """Whether the entry repeats for every decoder layer."""
        return "{layer}" in self.hf[0]

    @property
    def per_expert(self) -> bool:
        """Whether the entry repeats for every expert of a MoE layer (split over expert-parallel ranks)."""
        return "{expert}" in self.hf[0]


_H = "model.layers.{layer}."
_M = "decoder.layers.{layer}."
_HIDDEN = ("hidden",)
EMBED = Entry(
    ("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), VOCAB, (("vocab", "hidden"),), "first"
)


def _norm(hf: str, local: str, fused_into: str) -> Entry:
    """A layer's RMSNorm weight: mcore's local spec names it on its own, TE's fuses it into the next linear layer."""
    return Entry((_H + hf,), (_M + local, _M + fused_into + ".layer_norm_weight"), REPLICATED, (_HIDDEN,))


_INPUT_NORM = _norm("input_layernorm.weight", "input_layernorm.weight", "self_attention.linear_qkv")
_QKV = Entry(
    (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
    (_M + "self_attention.linear_qkv.weight",),
    QKV,
    (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")),
)
_QKV_BIAS = Entry(
    (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
    (_M + "self_attention.linear_qkv.bias",),
    QKV,
    (("q",), ("kv",), ("kv",)),
)
_Q_NORM = Entry(
    (_H + "self_attn.q_norm.weight",), (_M + "self_attention.q_layernorm.weight",), REPLICATED, (("head_dim",),)
)
_K_NORM = Entry(
    (_H + "self_attn.k_norm.weight",), (_M + "self_attention.k_layernorm.weight",), REPLICATED, (("head_dim",),)
)
_O = Entry((_H + "self_attn.o_proj.weight",), (_M + "self_attention.linear_proj.weight",), ROW, (("hidden", "q"),))
_POST_NORM = _norm("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1")
_GATE_UP = Entry(
    (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
    (_M + "mlp.linear_fc1.weight",),
    GATE_UP,
    (("ffn", "hidden"), ("ffn", "hidden")),
)
_DOWN = Entry((_H + "mlp.down_proj.weight",), (_M + "mlp.linear_fc2.weight",), ROW, (("hidden", "ffn"),))
_ROUTER = Entry((_H + "mlp.gate.weight",), (_M + "mlp.router.weight",), REPLICATED, (("experts", "hidden"),))
_EXPERT = "mlp.experts.{expert}."
_EXPERT_GATE_UP = Entry(
    (_H + _EXPERT + "gate_proj.weight", _H + _EXPERT + "up_proj.weight"),
    (_M + "mlp.experts.local_experts.{expert}.linear_fc1.weight", _M + "mlp.experts.linear_fc1.weight{expert}"),
    GATE_UP,
    (("moe_ffn", "hidden"), ("moe_ffn", "hidden")),
)
_EXPERT_DOWN = Entry(
    (_H + _EXPERT + "down_proj.weight",),
    (_M + "mlp.experts.local_experts.{expert}.linear_fc2.weight", _M + "mlp.experts.linear_fc2.weight{expert}"),
    ROW,
    (("hidden", "moe_ffn"),),
)
_FINAL_NORM = Entry(("model.norm.weight",), ("decoder.final_layernorm.weight",), REPLICATED, (_HIDDEN,))
_LM_HEAD = Entry(("lm_head.weight",), ("output_layer.weight",), VOCAB, (("vocab", "hidden"),), untied_only=True)

_ATTENTION = (_INPUT_NORM, _QKV)
QWEN2: tuple[Entry, ...] = (EMBED, *_ATTENTION, _QKV_BIAS, _O, _POST_NORM, _GATE_UP, _DOWN, _FINAL_NORM, _LM_HEAD)
LLAMA: tuple[Entry, ...] = (EMBED, *_ATTENTION, _O, _POST_NORM, _GATE_UP, _DOWN, _FINAL_NORM, _LM_HEAD)
QWEN3: tuple[Entry, ...] = (
    EMBED, *_ATTENTION, _Q_NORM, _K_NORM, _O, _POST_NORM, _GATE_UP, _DOWN, _FINAL_NORM, _LM_HEAD,
)  # fmt: skip
QWEN3_MOE: tuple[Entry, ...] = (
    EMBED, *_ATTENTION, _Q_NORM, _K_NORM, _O, _POST_NORM, _ROUTER, _EXPERT_GATE_UP, _EXPERT_DOWN, _FINAL_NORM,
    _LM_HEAD,
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """What the package knows of one model family (one Hugging Face ``model_type``)."""

    model_type: str
    #: The weight table: every tensor of the model, HF <-> Megatron-Core (see the module docstring).
    table: tuple[Entry, ...]
    #: The transformers config class of the tiny model built in code (a name of ``transformers``'s namespace).
    config_class: str
    #: Biases on the q, k and v projections (Qwen2).
    qkv_bias: bool = False
    #: An RMSNorm over each query / key head before RoPE (Qwen3's ``q_norm`` / ``k_norm``).
    qk_norm: bool = False
    #: Routed experts in every layer's MLP: the config's ``num_experts`` (or ``num_local_experts``),
    #: ``num_experts_per_tok``, ``moe_intermediate_size`` and ``norm_topk_prob``; no shared experts.
    moe: bool = False
    #: Whether the transformers generator's KV-cached decode loop runs it (else it decodes with ``generate()``).
    kv_decode: bool = True
    #: Further keys of the tiny model's transformers config, fixed for the family.
    tiny_config: Mapping[str, Any] = field(default_factory=dict, compare=False)


#: The registered families by ``model_type``, in the order they were registered.
FAMILIES: dict[str, Family] = {}

#: Well-known model types that need what the Megatron model here does not build, and why.
UNSUPPORTED_MODEL_TYPES = {
    "qwen3_next": "linear attention (Gated DeltaNet layers)",
    "qwen2_moe": "shared experts",
    "gpt_oss": "attention sinks and sliding-window layers",
    "gemma2": "sliding-window layers and logit soft-capping",
    "gemma3_text": "sliding-window layers",
    "mistral": "sliding-window attention",
    "deepseek_v3": "multi-latent attention",
}


def register_family(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES`.

    Raises:
        ValueError: a ``model_type`` registered twice or listed as unsupported, an MoE family without the
            expert entries or a dense one with them.
    """
    name = family.model_type
    if name in FAMILIES:
        raise ValueError(f"model family {name!r} is registered twice")
    if name in UNSUPPORTED_MODEL_TYPES:
        raise ValueError(f"model family {name!r} is listed as unsupported ({UNSUPPORTED_MODEL_TYPES[name]})")
    if family.moe != any(e.per_expert for e in family.table):
        has = "lacks" if family.moe else "has"
        raise ValueError(f"model family {name!r}: moe={family.moe} but its table {has} per-expert entries")
    FAMILIES[name] = family
    return family


def get_family(model_type: Any) -> Family:
    """The registered family of ``model_type``.

    Raises:
        ValueError: not registered, in one line: why (for a well-known unsupported one) and the registered names.
    """
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = f" ({UNSUPPORTED_MODEL_TYPES[model_type]})" if model_type in UNSUPPORTED_MODEL_TYPES else ""
    raise ValueError(f"model_type={model_type!r} is not supported{why}; supported: {sorted(FAMILIES)}")


# Qwen2 / Qwen2.5 (and the DeepSeek-R1-Distill-Qwen models).
register_family(Family("qwen2", QWEN2, "Qwen2Config", qkv_bias=True))
# Llama 3.x (and DeepSeek-R1-Distill-Llama).
register_family(Family("llama", LLAMA, "LlamaConfig"))
# Qwen3 dense.
register_family(Family("qwen3", QWEN3, "Qwen3Config", qk_norm=True))
# Qwen3-MoE: every layer sparse, top-k probabilities renormalised (the Qwen3-30B-A3B layout).
register_family(
    Family(
        "qwen3_moe",
        QWEN3_MOE,
        "Qwen3MoeConfig",
        qk_norm=True,
        moe=True,
        tiny_config={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    )
)
