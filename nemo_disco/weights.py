"""Hugging Face <-> Megatron-Core GPTModel weight maps and streaming export.

For the model families of :mod:`nemo_disco.families` (Qwen2 / Qwen2.5, Llama 3.x, Qwen3 dense and Qwen3-MoE
today). The map is the project's own: Megatron-Bridge, which provides such maps upstream, needs
Python >= 3.12, megatron-core >= 0.19 and GPU-only dependencies, while the CPU stack runs Python 3.11 and
megatron-core 0.16.1.

Each family's table (``nemo_disco.families``, where the families are declared) lists, for every tensor, its
Hugging Face name(s), its Megatron-Core name(s) (the local layer spec's name first, then the Transformer Engine
spec's), its kind and its HF shape(s); this module shards them. The kinds:

- ``replicated``: the same full tensor on every tensor-parallel (TP) rank (norms, Qwen3's per-head q / k
  norms, the MoE router);
- ``row``: row-parallel linear, split along the input dim (dim 1): ``o_proj``, ``down_proj``;
- ``vocab``: embedding / output layer, rows padded to the padded vocabulary then split along dim 0;
- ``qkv``: ``q_proj``, ``k_proj``, ``v_proj`` fused into ``linear_qkv`` with the layout mcore splits at run
  time: for each of the ``ng`` query groups, ``[q heads of group g (nh / ng of them), k_g, v_g]``; the fused
  rows are then split contiguously over TP (weights and biases alike). ``head_dim`` is read from the config
  and need not be ``hidden / heads`` (Qwen3-4B: hidden 2560, 32 heads of 128);
- ``gate_up``: SwiGLU ``gate_proj`` and ``up_proj`` fused into ``linear_fc1``; TP rank r holds
  ``[gate_r; up_r]`` (mcore's GLU chunks the *local* output in two halves), not a slice of ``[gate; up]``.

Mixture of experts (Qwen3-MoE): the router (``mlp.gate``, [E, h]) is replicated; each expert's gate / up /
down is a ``gate_up`` / ``row`` entry of its own, named with ``{expert}``. Experts are split over the
expert-parallel (EP) ranks: EP rank r holds global experts ``r * E / EP ...`` as its local experts
``0 ... E / EP - 1`` (local spec ``mlp.experts.local_experts.{j}.linear_fc1.weight``, Transformer Engine
grouped GEMM ``mlp.experts.linear_fc1.weight{j}``). Expert tensor parallelism is 1 (NeMo-RL's default): an
expert is never split over TP ranks, so expert entries are sharded with TP size 1.

Layers are split evenly over pipeline-parallel (PP) stages: global layer ``i`` lives on stage
``i // (L / PP)`` as local layer ``i % (L / PP)``. The embedding is on the first stage, the final norm and the
output layer on the last one; with tied embeddings and PP > 1 the last stage also holds a copy of the
embedding as ``output_layer.weight`` (mcore keeps the two in sync), which export skips.

HF names are checkpoint names: those of the safetensors files, the hub and vLLM. transformers >= 5 keeps a
MoE layer's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, h], ``mlp.experts.down_proj``
[E, h, I]); :func:`to_checkpoint_layout` and :func:`to_module_layout` translate between the two.

Adding an architecture is registering a :class:`nemo_disco.families.Family` with its table and features (qkv bias,
q / k norms, routed experts), which :meth:`ModelSpec.from_hf_config` reads; a config that differs in other ways
needs a branch there.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_disco import distributed, families
from nemo_disco.families import (  # noqa: F401  (re-exported: the tables are the families')
    GATE_UP,
    LLAMA,
    QKV,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    REPLICATED,
    ROW,
    VOCAB,
    Entry,
)

#: Torch dtypes by the names the config uses (``policy.dtype``, the generator's dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Megatron's default ``make_vocab_size_divisible_by``.
DEFAULT_VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the weight map and the Megatron model need, read from an HF ``config.json``."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling_factor: float | None = None
    #: Qwen3: RMSNorm over each query / key head before RoPE.
    qk_layernorm: bool = False
    #: Routed experts per MoE layer; 0 for a dense model.
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    #: Renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE: true).
    norm_topk_prob: bool = False

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config.json") -> ModelSpec:
        """Parse a Hugging Face config dict of a registered family (:data:`nemo_disco.families.FAMILIES`).

        Raises:
            ValueError: an unsupported architecture or feature, one line naming ``source`` and the key.
        """
        arch = config.get("model_type")
        try:
            family = families.get_family(arch)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={config['hidden_act']!r} is not supported (only silu)")
        for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if config.get(key):
                raise ValueError(f"{source}: {key}=true is not supported")
        other = sorted({t for t in config.get("layer_types") or () if t != "full_attention"})
        if other:
            raise ValueError(
                f"{source}: layer_types has {other} layers; only full_attention is supported "
                "(no sliding-window or linear attention)"
            )
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = None
        if rope_type == "llama3":
            # mcore implements llama3 scaling with these three constants fixed.
            fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            for key, value in fixed.items():
                if float(rope.get(key, value)) != value:
                    raise ValueError(f"{source}: rope {key}={rope[key]} is not supported (mcore fixes it at {value})")
            factor = float(rope["factor"])
        elif rope_type != "default":
            raise ValueError(f"{source}: rope_type={rope_type!r} is not supported (default or llama3)")
        heads = int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        moe: dict[str, Any] = {}
        if family.moe:
            moe = cls._moe_fields(config, source)
        return cls(
            architecture=arch,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            rope_scaling_factor=factor,
            qk_layernorm=family.qk_norm,
            **moe,
        )

    @staticmethod
    def _moe_fields(config: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Routed experts (Qwen3-MoE's keys): every layer sparse, no shared experts (else fails naming its key)."""
        if int(config.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(
                f"{source}: decoder_sparse_step={config['decoder_sparse_step']} is not supported (every layer MoE: 1)"
            )
        if config.get("mlp_only_layers"):
            raise ValueError(
                f"{source}: mlp_only_layers={list(config['mlp_only_layers'])} is not supported (every layer MoE)"
            )
        if config.get("shared_expert_intermediate_size"):
            raise ValueError(f"{source}: shared_expert_intermediate_size is set; shared experts are not supported")
        # The hub's config.json says num_experts; transformers >= 5 saves num_local_experts.
        experts = config.get("num_experts") or config.get("num_local_experts")
        if not experts:
            raise ValueError(f"{source}: model_type={config.get('model_type')} without num_experts")
        return {
            "num_experts": int(experts),
            "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
            "moe_router_topk": int(config["num_experts_per_tok"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        }

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        """Read ``<model_dir>/config.json``."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path}: not found (expected a Hugging Face model folder)")
        return cls.from_hf_config(json.loads(path.read_text()), str(path))


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = DEFAULT_VOCAB_MULTIPLE) -> int:
    """Vocabulary rows of the Megatron embedding: ``vocab_size`` rounded up to a multiple of lcm(multiple, TP).

    Unlike Megatron-LM's ``multiple * TP``, the padding does not change with TP whenever TP divides
    ``multiple`` (1, 2, 4, ... 128 for the default 128), so a checkpoint reshards to another TP unchanged.
    """
    step = math.lcm(multiple, tp_size)
    return -(-vocab_size // step) * step


# ----------------------------------------------------------------------------------------------------------------------
# Sharding of one entry.


def _qkv_fuse(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[(nh + 2 ng) hd, ...] in mcore's per-group order [q_g..., k_g, v_g] from HF's separate q / k / v."""
    ng, hd = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // ng
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(ng, per * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1
    )  # [ng, (per + 2) hd, ...]
    return fused.reshape(ng * (per + 2) * hd, *rest)


def _qkv_split(spec: ModelSpec, fused: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`_qkv_fuse`: [q, k, v]."""
    ng, hd = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // ng
    rest = fused.shape[1:]
    grouped = fused.reshape(ng, (per + 2) * hd, *rest)
    q, k, v = grouped.split([per * hd, hd, hd], dim=1)
    return [q.reshape(ng * per * hd, *rest), k.reshape(ng * hd, *rest), v.reshape(ng * hd, *rest)]


def to_shard(
    kind: str, tensors: Sequence[torch.Tensor], spec: ModelSpec, tp_size: int, tp_rank: int, padded_vocab: int
) -> torch.Tensor:
    """This TP rank's Megatron tensor from the entry's full HF tensors (in the entry's ``hf`` order)."""
    if kind == REPLICATED:
        return tensors[0]
    if kind == ROW:
        return tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == VOCAB:
        full = tensors[0]
        if padded_vocab > full.shape[0]:  # [V, h] -> [V_padded, h], zero rows
            full = torch.cat([full, full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == QKV:
        return _qkv_fuse(spec, *tensors).chunk(tp_size, dim=0)[tp_rank]
    if kind == GATE_UP:
        gate, up = tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    raise ValueError(f"unknown weight kind {kind!r}")


def from_shards(kind: str, shards: Sequence[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """The entry's full HF tensors from every TP rank's Megatron tensor (TP rank order)."""
    if kind == REPLICATED:
        return [shards[0]]
    if kind == ROW:
        return [torch.cat(list(shards), dim=1)]
    if kind == VOCAB:
        return [torch.cat(list(shards), dim=0)[: spec.vocab_size]]
    if kind == QKV:
        return _qkv_split(spec, torch.cat(list(shards), dim=0))
    if kind == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown weight kind {kind!r}")


def hf_shapes(entry: Entry, spec: ModelSpec) -> list[tuple[int, ...]]:
    """Full HF shapes of an entry's tensors (one expert's, for an expert entry)."""
    hd = spec.head_dim
    size = {
        "vocab": spec.vocab_size,
        "hidden": spec.hidden_size,
        "q": spec.num_attention_heads * hd,
        "kv": spec.num_query_groups * hd,
        "head_dim": hd,
        "ffn": spec.ffn_hidden_size,
        "experts": spec.num_experts,
        "moe_ffn": spec.moe_ffn_hidden_size,
    }
    return [tuple(size[d] for d in dims) for dims in entry.dims]


# ----------------------------------------------------------------------------------------------------------------------
# Pipeline placement.


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global layer indices held by pipeline stage ``pp_rank`` (even split).

    Raises:
        ValueError: ``num_layers`` not divisible by ``pp_size``.
    """
    if num_layers % pp_size:
        raise ValueError(f"num_hidden_layers={num_layers} is not divisible by pipeline_parallel_size={pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def stage_of_layer(layer: int, num_layers: int, pp_size: int) -> tuple[int, int]:
    """(stage, local index) of global layer ``layer``."""
    per = num_layers // pp_size
    return layer // per, layer % per


@dataclass(frozen=True)
class Placement:
    """One table entry instantiated for one layer: where it lives and under which names.

    For an expert entry the placement covers every expert of the layer: ``hf_names`` lists expert 0's
    tensors, then expert 1's, ...; ``mcore_names`` keep ``{expert}`` for the local expert index.
    """

    entry: Entry
    hf_names: tuple[str, ...]
    stage: int
    #: mcore name candidates on the owning stage (local layer index filled in).
    mcore_names: tuple[str, ...]

    def expert_hf_names(self, expert: int) -> tuple[str, ...]:
        """The HF names of global expert ``expert`` (an expert entry only)."""
        k = len(self.entry.hf)
        return self.hf_names[expert * k : (expert + 1) * k]

    def expert_mcore_names(self, local: int) -> tuple[str, ...]:
        """The mcore name candidates of local expert ``local`` (an expert entry only)."""
        return tuple(n.format(expert=local) for n in self.mcore_names)


def placements(spec: ModelSpec, pp_size: int) -> list[Placement]:
    """Every HF tensor group of the model, in HF order, with its owning pipeline stage.

    The output layer of a tied model is not listed: it is the embedding.
    """
    out: list[Placement] = []
    last = pp_size - 1
    for entry in families.get_family(spec.architecture).table:
        if entry.untied_only and spec.tie_word_embeddings:
            continue
        if entry.per_layer:
            experts = range(spec.num_experts) if entry.per_expert else [None]
            for layer in range(spec.num_layers):
                stage, local = stage_of_layer(layer, spec.num_layers, pp_size)
                hf = tuple(n.format(layer=layer, expert=e) for e in experts for n in entry.hf)
                mcore = tuple(n.format(layer=local, expert="{expert}") for n in entry.mcore)
                out.append(Placement(entry, hf, stage, mcore))
        else:
            stage = 0 if entry.stage == "first" else last
            out.append(Placement(entry, entry.hf, stage, entry.mcore))
    return out


def _resolve(candidates: Sequence[str], names: Mapping[str, Any]) -> str | None:
    return next((n for n in candidates if n in names), None)


def local_experts(spec: ModelSpec, ep_size: int) -> int:
    """Experts per expert-parallel rank.

    Raises:
        ValueError: ``ep_size`` does not divide the number of experts.
    """
    if spec.num_experts % ep_size:
        raise ValueError(
            f"policy.expert_parallel_size={ep_size} does not divide the model's {spec.num_experts} experts"
        )
    return spec.num_experts // ep_size


# ----------------------------------------------------------------------------------------------------------------------
# Import: HF checkpoint -> this rank's Megatron parameters.


class SafetensorsReader:
    """Lazy reader of an HF folder's ``*.safetensors`` (single file or sharded with an index)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.model_dir}: no *.safetensors weights found")
        self._handles = {f: safe_open(str(self.model_dir / f), framework="pt") for f in files}
        self._where = {name: f for f, h in self._handles.items() for name in h.keys()}

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self._where)

    def __call__(self, name: str) -> torch.Tensor:
        """The full tensor ``name``."""
        if name not in self._where:
            raise ValueError(f"{self.model_dir}: tensor {name!r} not found in the safetensors files")
        return self._handles[self._where[name]].get_tensor(name)


def load_hf_into(
    params: Mapping[str, torch.Tensor],
    read: Callable[[str], torch.Tensor],
    spec: ModelSpec,
    *,
    tp_size: int,
    tp_rank: int,
    pp_size: int,
    pp_rank: int,
    padded_vocab: int,
    ep_size: int = 1,
    ep_rank: int = 0,
) -> None:
    """Copy this rank's shard of every HF tensor into the Megatron parameters ``params`` (in place).

    Args:
        params: this rank's Megatron parameters by name (``model.named_parameters()`` of the unwrapped GPTModel).
        read: full HF tensor by name (e.g. a :class:`SafetensorsReader`).
        spec: the architecture.
        tp_size: tensor-parallel size.
        tp_rank: this rank's tensor-parallel index.
        pp_size: pipeline-parallel size.
        pp_rank: this rank's pipeline stage.
        padded_vocab: embedding / output-layer rows (see :func:`padded_vocab_size`).
        ep_size: expert-parallel size (MoE).
        ep_rank: this rank's expert-parallel index: it holds experts ``ep_rank * E / ep_size ...``.

    Raises:
        ValueError: a parameter that no table entry covers, or a shape mismatch (naming both names).
    """
    filled: set[str] = set()
    per_rank = local_experts(spec, ep_size) if spec.is_moe else 0
    for place in placements(spec, pp_size):
        if place.stage != pp_rank:
            continue
        if place.entry.per_expert:
            for j in range(per_rank):
                hf_names = place.expert_hf_names(ep_rank * per_rank + j)
                name = _resolve(place.expert_mcore_names(j), params)
                if name is None:
                    raise ValueError(f"Megatron model has none of {place.expert_mcore_names(j)} for {hf_names}")
                # Expert tensor parallelism is 1: every rank of the expert's EP rank holds it whole.
                _copy_shard(params[name], place.entry.kind, hf_names, name, read, spec, 1, 0, padded_vocab)
                filled.add(name)
            continue
        name = _resolve(place.mcore_names, params)
        if name is None:
            raise ValueError(f"Megatron model has none of {place.mcore_names} for {place.hf_names}")
        _copy_shard(params[name], place.entry.kind, place.hf_names, name, read, spec, tp_size, tp_rank, padded_vocab)
        filled.add(name)
    if spec.tie_word_embeddings and "output_layer.weight" in params:
        # PP > 1 with tied embeddings: the last stage's output layer starts as a copy of the embedding.
        name = "output_layer.weight"
        _copy_shard(params[name], VOCAB, families.EMBED.hf, name, read, spec, tp_size, tp_rank, padded_vocab)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"the weight map for {spec.architecture} does not cover Megatron parameters {missing}")


def _copy_shard(
    param: torch.Tensor,
    kind: str,
    hf_names: Sequence[str],
    name: str,
    read: Callable[[str], torch.Tensor],
    spec: ModelSpec,
    tp_size: int,
    tp_rank: int,
    padded_vocab: int,
) -> None:
    shard = to_shard(kind, [read(n) for n in hf_names], spec, tp_size, tp_rank, padded_vocab)
    if tuple(shard.shape) != tuple(param.shape):
        raise ValueError(
            f"{tuple(hf_names)} -> {name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(shard)


# ----------------------------------------------------------------------------------------------------------------------
# Export: this rank's Megatron parameters -> full HF tensors on every rank, streamed.


def _group_size(group: distributed.Group) -> int:
    return distributed.world_size(group) if group is not None else 1


def _placement_shapes(place: Placement, spec: ModelSpec) -> list[tuple[int, ...]]:
    shapes = hf_shapes(place.entry, spec)
    return shapes * spec.num_experts if place.entry.per_expert else shapes


def export_hf(
    params: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    *,
    tp_group: distributed.Group = None,
    pp_group: distributed.Group = None,
    ep_group: distributed.Group = None,
    bucket_bytes: int = 512 * 2**20,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, full tensor) for the whole model on every rank of the TP x PP (x EP) group (collective).

    The owning stage gathers each tensor's TP shards (one all-gather per tensor; a MoE layer's experts with
    one all-gather over the expert-parallel group per expert entry) and converts it to HF layout; consecutive
    tensors of one stage are packed into a flat bucket of at most ``bucket_bytes`` (a larger tensor group
    travels alone) and broadcast to the other stages. At most one bucket of full tensors is alive at a time
    on a rank: the model is never materialised whole. Every rank of the model-parallel group (and, with
    experts, of the expert-parallel group) must consume the iterator to the end, in lockstep. Yielded
    tensors may share storage with the model or the bucket: copy them to keep them.

    Args:
        params: this rank's Megatron parameters by name (unwrapped GPTModel), or tensors of the same shapes
            (e.g. their gradients).
        spec: the architecture.
        tp_group: the tensor-parallel group (None: size 1).
        pp_group: the pipeline-parallel group (None: size 1).
        ep_group: the expert-parallel group (None: size 1; MoE only).
        bucket_bytes: upper bound of one broadcast bucket (a larger tensor travels alone).
    """
    tp_size, pp_size = _group_size(tp_group), _group_size(pp_group)
    pp_rank = distributed.rank(pp_group) if pp_size > 1 else 0
    sample = next(iter(params.values()))
    dtype, device = sample.dtype, sample.device
    plan = placements(spec, pp_size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buckets: list[list[Placement]] = []
    size = 0
    for place in plan:
        nbytes = sum(math.prod(s) for s in _placement_shapes(place, spec)) * itemsize
        if not buckets or buckets[-1][0].stage != place.stage or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(place)
        size += nbytes
    for bucket in buckets:
        owner = bucket[0].stage
        names = [n for place in bucket for n in place.hf_names]
        shapes = [s for place in bucket for s in _placement_shapes(place, spec)]
        if pp_rank == owner:
            tensors = [t for place in bucket for t in _gather_full(params, place, spec, tp_group, tp_size, ep_group)]
        if pp_size > 1:
            src = distributed.global_rank(pp_group, owner)
            if pp_rank == owner:
                flat = torch.cat([t.reshape(-1) for t in tensors])
            else:
                flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype, device=device)
            distributed.broadcast(flat, src=src, group=pp_group)
            parts = flat.split([math.prod(s) for s in shapes])
            tensors = [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]
        yield from zip(names, tensors, strict=True)
        del tensors


def _gather_full(
    params: Mapping[str, torch.Tensor],
    place: Placement,
    spec: ModelSpec,
    tp_group: distributed.Group,
    tp_size: int,
    ep_group: distributed.Group = None,
) -> list[torch.Tensor]:
    if place.entry.per_expert:
        return _gather_experts(params, place, spec, ep_group)
    name = _resolve(place.mcore_names, params)
    if name is None:
        raise ValueError(f"Megatron model has none of {place.mcore_names} for {place.hf_names}")
    local = params[name].detach()
    if tp_size == 1 or place.entry.kind == REPLICATED:
        shards = [local]
    else:
        shards = distributed.all_gather(local, group=tp_group)
    return from_shards(place.entry.kind, shards, spec)


def _gather_experts(
    params: Mapping[str, torch.Tensor], place: Placement, spec: ModelSpec, ep_group: distributed.Group
) -> list[torch.Tensor]:
    """Every expert's HF tensors (expert-major) from this EP rank's local experts and the other EP ranks'."""
    ep_size = _group_size(ep_group)
    per_rank = local_experts(spec, ep_size)
    local = []
    for j in range(per_rank):
        name = _resolve(place.expert_mcore_names(j), params)
        if name is None:
            raise ValueError(f"Megatron model has none of {place.expert_mcore_names(j)} for {place.hf_names}")
        local.append(params[name].detach())
    stacked = torch.stack(local)  # [E / EP, ...]
    if ep_size > 1:
        stacked = torch.cat(distributed.all_gather(stacked, group=ep_group))  # [E, ...]: EP rank r's block is r-th
    return [t for e in range(spec.num_experts) for t in from_shards(place.entry.kind, [stacked[e]], spec)]


# ----------------------------------------------------------------------------------------------------------------------
# transformers' in-memory layout of MoE experts <-> checkpoint names.

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_ONE_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def to_checkpoint_layout(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Module tensors -> checkpoint tensors (other tensors pass through).

    A fused ``gate_up_proj`` [E, 2I, h] / ``down_proj`` [E, h, I] becomes each expert's ``gate_proj`` /
    ``up_proj`` [I, h] and ``down_proj`` [h, I] (views).
    """
    for name, tensor in named:
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            if m["proj"] == "gate_up_proj":
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{m['prefix']}.{e}.gate_proj.weight", gate
                yield f"{m['prefix']}.{e}.up_proj.weight", up
            else:
                yield f"{m['prefix']}.{e}.down_proj.weight", tensor[e]


def checkpoint_shapes(module_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The checkpoint names and shapes of a model whose module tensors have ``module_shapes``."""
    meta = ((n, torch.empty(s, device="meta")) for n, s in module_shapes.items())
    return {n: tuple(t.shape) for n, t in to_checkpoint_layout(meta)}


def to_module_layout(
    weights: Iterable[tuple[str, torch.Tensor]], module_shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors -> the module tensors of a model with ``module_shapes`` (inverse of to_checkpoint_layout).

    Each fused expert tensor is yielded once all its experts' tensors have arrived (any order); other
    tensors pass through, unchecked (the consumer checks names and shapes).

    Raises:
        ValueError: an expert tensor that arrives twice or belongs to no fused tensor, or a stream that ends
            with a fused tensor incomplete (naming it).
    """
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in weights:
        m = _ONE_EXPERT.match(name)
        target = m and f"{m['prefix']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
        if m is None or target not in module_shapes:
            yield name, tensor
            continue
        shape = module_shapes[target]
        experts = shape[0]
        parts = pending.setdefault(target, {})
        key = (int(m["expert"]), m["proj"])
        if key in parts or key[0] >= experts:
            why = "arrived twice" if key in parts else f"is beyond the model's {experts} experts"
            raise ValueError(f"refit tensor {name!r} {why}")
        parts[key] = tensor
        per_expert = 1 if m["proj"] == "down_proj" else 2
        if len(parts) == experts * per_expert:
            if per_expert == 1:
                fused = torch.stack([parts[(e, "down_proj")] for e in range(experts)])
            else:
                fused = torch.stack(
                    [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(experts)]
                )
            del pending[target]
            yield target, fused
    if pending:
        incomplete = sorted(pending)[:3]
        raise ValueError(f"the refit left out expert tensors of {len(pending)} fused tensor(s), e.g. {incomplete}")
