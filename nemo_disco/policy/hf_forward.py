"""The transformers policy's full-sequence forward over a Llama-family model's own modules (fewer ops, same bits).

``model(input_ids, ...)`` in transformers builds a 4-D mask through its masking utilities, dispatches every
RMSNorm, rotary embedding and attention call through its kernel and attention registries, and runs each op the
reference way: RMSNorm as six elementwise ops, the rotary embedding as ``q * cos + rotate_half(q) * sin`` with
a negation and a concatenation per call, the boolean mask turned into an additive one in every layer.
:func:`logits` computes the same function on the same modules and parameters:

- RMSNorm through ``torch.nn.functional.rms_norm`` where the input is float32 (the module's own forward
  otherwise: in bf16 the reference casts back before the weight product);
- the rotary embedding as one autograd function that writes the rotated halves directly and, in the backward,
  rotates the gradient back with two products and two sums;
- the mask made once per call as transformers makes it (``causal & key is a real token``; none, and a causal
  kernel, when no token is padding), in the additive form the attention turns a boolean mask into on every
  call, and scaled-dot-product attention with the keys and values repeated per query head as transformers
  repeats them.

In float32 every value and every gradient equals transformers' bit for bit (tests/unit/test_policy_hf_forward.py
checks logits and the gradient of every parameter for Qwen2, Llama, Qwen3 and Qwen3-MoE, with and without
padding), so the switch changes no run; a model :func:`supports` rejects runs through ``model(...)``. The saving
is small: 1-3% of a training update of the CPU benchmark's model (``benchmarks/bench_policy_forward.py``,
docs/benchmarks.md), where matrix products, attention and the memory-bound elementwise ops the reference
needs anyway dominate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nemo_disco.generation import kv_decode


def supports(model: torch.nn.Module) -> bool:
    """True when :func:`logits` runs ``model``: what the KV-cached decode loop supports (same module layout)."""
    return kv_decode.supports(model)


class _Rope(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, written half by half.

    Forward: ``out1 = x1 cos1 - x2 sin1``, ``out2 = x2 cos2 + x1 sin2`` (``a + (-b)`` is ``a - b`` exactly).
    Backward: ``dx = g cos + rotate_half^T(g sin)`` with ``rotate_half^T(y) = cat(y2, -y1)``. cos and sin are
    constants (no gradient).
    """

    @staticmethod
    def forward(ctx, x, cos, sin):  # noqa: ANN001, ANN205, D102
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x, dtype=torch.result_type(x, cos))  # x's memory layout, as x * cos has
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos[..., :half], out=o1)
        o1.sub_(x2 * sin[..., :half])
        torch.mul(x2, cos[..., half:], out=o2)
        o2.add_(x1 * sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205, D102
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        g_sin = grad * sin
        # Contiguous [B, heads, S, D], the layout transformers' backward gives this gradient: a reduction over it
        # downstream (Qwen3's q_norm weight) then sums in the same order.
        dx = torch.mul(grad, cos, out=torch.empty(grad.shape, dtype=grad.dtype, device=grad.device))
        dx[..., :half].add_(g_sin[..., half:])
        dx[..., half:].sub_(g_sin[..., :half])
        return dx, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` [B, heads, S, D] at cos, sin [B, S, D] (transformers' formula, exactly)."""
    return _Rope.apply(x, cos.unsqueeze(1), sin.unsqueeze(1))


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """[B, 1, S, S] additive mask: 0 where query i may attend key j (``j <= i``, key j real), -inf elsewhere.

    transformers' mask for scaled-dot-product attention (a row whose keys are all padding stays all masked), as
    the additive mask the attention makes of a boolean one on every call, made once here. None: no padding.
    """
    valid = attention_mask.bool()
    if bool(valid.all()):
        return None
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    allowed = (causal & valid[:, None, :]).unsqueeze(1)
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill_(~allowed, float("-inf"))


def _attention(attn: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, qk_norm: bool):  # noqa: ANN001, ANN202
    batch, length, _ = h.shape
    shape = (batch, length, -1, attn.head_dim)
    q = attn.q_proj(h).view(shape)
    k = attn.k_proj(h).view(shape)
    if qk_norm:
        q, k = kv_decode.rms_norm(attn.q_norm, q), kv_decode.rms_norm(attn.k_norm, k)
    q = rope(q.transpose(1, 2), cos, sin)
    k = rope(k.transpose(1, 2), cos, sin)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    group = q.shape[1] // k.shape[1]
    if group > 1:  # transformers' repeat_kv: each KV head once per query head of its group
        k = k[:, :, None].expand(batch, k.shape[1], group, length, attn.head_dim).reshape(q.shape)
        v = v[:, :, None].expand(batch, v.shape[1], group, length, attn.head_dim).reshape(q.shape)
    o = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=attn.attention_dropout if attn.training else 0.0,
        scale=attn.scaling,
        is_causal=mask is None and length > 1,
    )
    return attn.o_proj(o.transpose(1, 2).reshape(batch, length, -1))


def _layer(layer: torch.nn.Module, x: torch.Tensor, cos, sin, mask, qk_norm: bool) -> torch.Tensor:  # noqa: ANN001
    x = x + _attention(layer.self_attn, kv_decode.rms_norm(layer.input_layernorm, x), cos, sin, mask, qk_norm)
    return x + layer.mlp(kv_decode.rms_norm(layer.post_attention_layernorm, x))


def logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    activation_checkpointing: bool = False,
) -> torch.Tensor:
    """``model(input_ids, attention_mask, position_ids).logits`` for a model :func:`supports`, [B, S, V].

    Args:
        model: a transformers Qwen2 / Llama / Qwen3 / Qwen3-MoE causal LM.
        input_ids: [B, S] token ids.
        attention_mask: [B, S], nonzero on real tokens.
        position_ids: [B, S] positions.
        activation_checkpointing: recompute each layer in the backward instead of keeping its activations.
    """
    body = model.model
    qk_norm = model.config.model_type in kv_decode.QK_NORM_MODEL_TYPES
    x = body.embed_tokens(input_ids)
    cos, sin = body.rotary_emb(x, position_ids)
    mask = causal_padding_mask(attention_mask, x.dtype)
    for layer in body.layers:
        if activation_checkpointing and torch.is_grad_enabled():
            x = checkpoint(_layer, layer, x, cos, sin, mask, qk_norm, use_reentrant=False)
        else:
            x = _layer(layer, x, cos, sin, mask, qk_norm)
    return model.lm_head(kv_decode.rms_norm(body.norm, x))
