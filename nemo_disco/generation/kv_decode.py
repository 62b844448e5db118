"""A KV-cached sampling loop over a transformers Llama-family model's own modules (the transformers generator's).

transformers' ``generate`` re-enters its whole machinery for every new token (attention-mask construction,
cache objects, attention dispatch, logits processors, stopping criteria). On a CPU with a small model that
overhead is a large share of the decode time. This loop calls the model's own modules (embedding, RMSNorms,
projections, rotary embedding, MLPs, final norm, LM head) on a preallocated KV cache: the same weights, so a
refit needs nothing more, and the same function; results differ from ``generate`` only by float rounding
(the generator tests check greedy outputs against ``generate`` token for token and sampled log-probs
against the policy).

Supported: ``model_type`` qwen2, llama, qwen3 and qwen3_moe (the project's architectures) without
sliding-window attention. Qwen3's per-head RMSNorms of queries and keys (``q_norm`` / ``k_norm``, before RoPE)
are applied where its attention applies them; a Qwen3-MoE layer's MLP is its sparse block, called as a
module. :func:`supports` says so, and the generator falls back to ``generate`` for anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")
#: Model types whose attention normalises each query / key head (``q_norm``, ``k_norm``) before RoPE.
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")

# pick(logits [B, V] float32) -> (next tokens [B] int64, their log-probs [B] float32)
Picker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def supports(model: torch.nn.Module) -> bool:
    """True when :func:`sample` can run ``model`` (a transformers Qwen2 / Llama / Qwen3 / Qwen3-MoE causal LM)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return False
    parts = _ATTN_PARTS + (("q_norm", "k_norm") if cfg.model_type in QK_NORM_MODEL_TYPES else ())
    body = getattr(model, "model", None)
    if body is None or not all(hasattr(body, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    if not hasattr(model, "lm_head"):
        return False
    return all(
        all(hasattr(layer, n) for n in _LAYER_PARTS) and all(hasattr(layer.self_attn, n) for n in parts)
        for layer in body.layers
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, D]; cos, sin: [B, S, D]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_tokens: int,
    pick: Picker,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate up to ``max_tokens`` tokens for each left-padded prompt.

    Every row is sampled at every step until all rows have produced a stop token (as ``generate`` does, so a
    seeded ``pick`` draws the same random stream); a row's tokens after its first stop token are ``pad_id``.
    The KV cache is allocated once for ``P + max_tokens`` positions (the size ``generate``'s cache reaches
    when a row runs to ``max_tokens``).

    Args:
        model: a model for which :func:`supports` is True, in eval mode.
        input_ids: [B, P] prompts, left-padded.
        attention_mask: [B, P] 1 on prompt tokens, 0 on padding.
        max_tokens: new tokens at most.
        pick: chooses each row's next token from its logits and returns its log-prob.
        stop_ids: tokens that end a row (kept as its last token); empty: every row runs ``max_tokens``.
        pad_id: the token written after a row has stopped.

    Returns:
        tokens [B, steps] int64 and log-probs [B, steps] float32 (steps <= max_tokens).
    """
    body = model.model
    layers = list(body.layers)
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if max_tokens < 1:
        return torch.zeros((batch, 0), dtype=torch.long, device=device), torch.zeros((batch, 0), device=device)
    valid = torch.zeros(batch, prompt_len + max_tokens, dtype=torch.bool, device=device)
    valid[:, :prompt_len] = attention_mask.bool()
    # Positions as generate() numbers them: the first real token of a left-padded prompt is position 0.
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    first = layers[0].self_attn
    head_dim = first.head_dim
    qk_norm = model.config.model_type in QK_NORM_MODEL_TYPES
    kv_heads = first.k_proj.out_features // head_dim
    cache_shape = (len(layers), batch, kv_heads, prompt_len + max_tokens, head_dim)
    dtype = body.embed_tokens.weight.dtype
    keys = torch.empty(cache_shape, dtype=dtype, device=device)
    values = torch.empty(cache_shape, dtype=dtype, device=device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []

    x = body.embed_tokens(input_ids)
    start, end = 0, prompt_len
    # Prefill: causal attention over the prompt, padding masked as keys. Each query also sees itself, so a
    # padding query never has every key masked (its output is unused but must stay finite: it is cached).
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
    mask = causal & (valid[:, None, :prompt_len] | torch.eye(prompt_len, dtype=torch.bool, device=device))
    mask = mask.unsqueeze(1)  # [B, 1, P, P]
    for step in range(max_tokens):
        cos, sin = body.rotary_emb(x, positions)
        seq = x.shape[1]
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, seq, -1, head_dim)
            k = attn.k_proj(h).view(batch, seq, -1, head_dim)
            if qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = _rope(q.transpose(1, 2), cos, sin)
            k = _rope(k.transpose(1, 2), cos, sin)
            keys[i, :, :, start:end] = k
            values[i, :, :, start:end] = attn.v_proj(h).view(batch, seq, -1, head_dim).transpose(1, 2)
            kc, vc = keys[i, :, :, :end], values[i, :, :, :end]
            if seq > 1:
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
            else:
                # One query per row: two small matmuls beat the fused kernel's set-up on CPU.
                heads = q.shape[1]
                qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)  # query heads grouped by KV head
                scores = torch.matmul(qg, kc.transpose(-1, -2)).float() * attn.scaling  # [B, kv, g, L]
                scores = scores.masked_fill(~mask, float("-inf"))
                o = torch.matmul(scores.softmax(-1).to(vc.dtype), vc).view(batch, heads, 1, head_dim)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, seq, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = model.lm_head(body.norm(x[:, -1])).float()
        nxt, lp = pick(logits)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens.append(nxt)
        logps.append(lp)
        if len(stops):
            done = done | torch.isin(nxt, stops)
            if bool(done.all()):
                break
        if step + 1 == max_tokens:
            break
        # The next input: the new token at the next position, attending to every valid key so far.
        valid[:, end] = True
        positions = positions[:, -1:] + 1
        x = body.embed_tokens(nxt.unsqueeze(1))
        start, end = end, end + 1
        mask = valid[:, None, None, :end]  # [B, 1, 1, L]
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)
