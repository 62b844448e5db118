"""A KV-cached sampling loop over a transformers Llama-family model's own modules (the transformers generator's).

transformers' ``generate`` re-enters its whole machinery for every new token (attention-mask construction,
cache objects, attention dispatch, logits processors, stopping criteria). On a CPU with a small model that
overhead is a large share of the decode time. This loop calls the model's own modules (embedding, RMSNorms,
projections, rotary embedding, MLPs, final norm, LM head) on a preallocated KV cache: the same weights, so a
refit needs nothing more, and the same function; results differ from ``generate`` only by float rounding
(the generator tests check greedy outputs against ``generate`` token for token and sampled log-probs
against the policy). The one-token steps, the bulk of the work, keep what does not depend on the new token out
of the loop: each layer's q, k, v projections (and a dense MLP's gate and up projections) run as one matrix
product over weights concatenated once per call, the rotary cos / sin of every step are computed once, and the
attention's padding mask is an additive bias made once; RMSNorms (float32), plain linear layers and SiLU are
called as functions on the modules' weights, not through the modules (the same ops, bit for bit).

Supported: the families of :mod:`nemo_disco.families` that declare ``kv_decode`` (:func:`decodable`: today every
registered one, ``model_type`` qwen2, llama, qwen3 and qwen3_moe) without sliding-window attention. A family's
``qk_norm`` (Qwen3's per-head RMSNorms of queries and keys, ``q_norm`` / ``k_norm``, before RoPE) is applied where
its attention applies them; a Qwen3-MoE layer's MLP is its sparse block, called as a module.

The loop relies on transformers' module layout, which a transformers release may change. :func:`unsupported`
checks what it relies on, on the model itself, when a generator is built (its first use): the family; the
config (no sliding window); the modules and attributes it reads (``model.embed_tokens / layers / norm /
rotary_emb``, ``lm_head``, each layer's norms, ``self_attn`` and ``mlp``, the attention's ``q/k/v/o_proj`` as
``nn.Linear``, ``head_dim``, ``scaling``, and ``q_norm`` / ``k_norm`` where the family has them); and then the
function itself: a probe decodes a few tokens of a padded two-row batch and compares every step's logits with
``model(...)`` over the same tokens (so a changed rotary embedding's signature or formula, or any error the loop
raises, is caught there too). Anything it finds is a reason, in one line, and the generator decodes with
``generate`` instead. This module imports nothing of transformers at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from nemo_disco import families

_BODY_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_ATTN_VALUES = ("head_dim", "scaling")
#: The probe's largest relative difference from ``model(...)``'s logits, by parameter dtype (float rounding only:
#: the loop sums in another order).
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_PROBE_TOLERANCE_HALF = 5e-2

# pick(logits [B, V] float32) -> (next tokens [B] int64, their log-probs [B] float32)
Picker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def decodable() -> dict[str, families.Family]:
    """The families the loop runs (those of :data:`nemo_disco.families.FAMILIES` that declare ``kv_decode``)."""
    return {t: f for t, f in families.FAMILIES.items() if f.kv_decode}


def _layout(model: torch.nn.Module) -> str | None:
    """Why the model's family, config or modules are not what the loop reads, or None."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    runs = decodable()
    if model_type not in runs:
        return f"model_type {model_type!r} is not one of {', '.join(runs)}"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention (use_sliding_window)"
    other = sorted({t for t in getattr(cfg, "layer_types", None) or () if t != "full_attention"})
    if other:
        return f"layer_types {other} (only full_attention)"
    body = getattr(model, "model", None)
    missing = [f"model.{n}" for n in _BODY_PARTS if not hasattr(body, n)]
    missing += [] if hasattr(model, "lm_head") else ["lm_head"]
    if missing:
        return f"{type(model).__name__} has no {', '.join(missing)}"
    attn_values = _ATTN_VALUES + (("q_norm", "k_norm") if runs[model_type].qk_norm else ())
    for i, layer in enumerate(body.layers):
        where = f"{type(model).__name__}.model.layers.{i}"
        missing = [n for n in _LAYER_PARTS if not hasattr(layer, n)]
        if missing:
            return f"{where} has no {', '.join(missing)}"
        attn = layer.self_attn
        missing = [n for n in attn_values if not hasattr(attn, n)]
        if missing:
            return f"{where}.self_attn ({type(attn).__name__}) has no {', '.join(missing)}"
        not_linear = [n for n in _ATTN_LINEARS if not isinstance(getattr(attn, n, None), torch.nn.Linear)]
        if not_linear:
            return f"{where}.self_attn ({type(attn).__name__}): {', '.join(not_linear)} not torch.nn.Linear"
    return None


def _probe(model: torch.nn.Module) -> str | None:
    """Decode a few tokens of a padded two-row batch and compare each step's logits with ``model(...)``'s."""
    weight = model.model.embed_tokens.weight
    vocab, device, dtype = weight.shape[0], weight.device, weight.dtype
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (2, 5), generator=g)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0  # row 0 left-padded by two tokens
    seen: list[torch.Tensor] = []

    def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(logits.float())
        nxt = logits.argmax(-1)
        return nxt, torch.zeros(len(nxt), device=logits.device)

    steps = 3
    was_training = model.training
    model.eval()
    try:
        tokens, _ = sample(model, prompt.to(device), mask.to(device), steps, greedy)
        ours = torch.stack(seen, dim=1)  # [2, steps, V]
        refs = []
        with torch.inference_mode():
            for row in range(2):
                ids = torch.cat([prompt[row][mask[row].bool()].to(device), tokens[row, :-1]]).unsqueeze(0)
                logits = model(input_ids=ids, use_cache=False).logits[0, -steps:].float()
                refs.append(logits)
        ref = torch.stack(refs)
    except Exception as err:  # noqa: BLE001 - any failure of the loop on this transformers release is a reason
        return f"the decode probe raised {type(err).__name__}: {err}".splitlines()[0]
    finally:
        model.train(was_training)
    tolerance = _PROBE_TOLERANCE.get(dtype, _PROBE_TOLERANCE_HALF)
    err = float((ours - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
    if not err <= tolerance:  # also a NaN
        return f"the decode probe's logits differ from model(...)'s by {err:.2g} (relative; at most {tolerance:g})"
    return None


def unsupported(model: torch.nn.Module) -> str | None:
    """Why :func:`sample` cannot run ``model`` (one line), or None when it can (checks: module docstring).

    The layout checks first (no computation), then the probe (a few model calls on the model's device).
    """
    return _layout(model) or _probe(model)


def supports(model: torch.nn.Module) -> bool:
    """True when :func:`sample` can run ``model`` (:func:`unsupported` finds nothing)."""
    return unsupported(model) is None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, D]; cos, sin: [B, S, D]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def _fused_linear(parts: Sequence[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for linear layers applied to one input, their outputs side by side.

    None when they are not all plain ``nn.Linear`` layers, all with a bias or all without.
    """
    if not all(type(m) is torch.nn.Linear for m in parts):
        return None
    biases = [m.bias for m in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([m.weight for m in parts])
    return weight, (None if biases[0] is None else torch.cat(biases))


def rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a transformers RMSNorm: ``F.rms_norm`` where it equals the module bit for bit (float32).

    In float32 the fused function runs the reference's ops in the reference's order (tests compare values and
    gradients bit for bit); in another dtype the module itself runs (the reference casts back before the weight
    product).
    """
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if x.dtype == torch.float32 and weight is not None and weight.dtype == torch.float32 and eps is not None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return module(x)


def _linear(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module`` as a direct ``F.linear`` call when it is a plain ``nn.Linear`` (no module dispatch per call)."""
    if type(module) is not torch.nn.Linear:
        return module
    weight, bias = module.weight, module.bias
    return lambda x: F.linear(x, weight, bias)


def _activation(act: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.silu`` for a SiLU module (transformers' ``SiLUActivation`` is ``F.silu``), else the module."""
    import transformers.activations

    silu = (torch.nn.SiLU, getattr(transformers.activations, "SiLUActivation", torch.nn.SiLU))
    return F.silu if type(act) in silu else act


class _DecodeLayer:
    """One layer for the one-token steps, built per :func:`sample` call from the current weights.

    The q, k, v projections fused into one matrix (not with Qwen3's q / k norms) and a dense gated MLP's gate and
    up projections into another (an MoE block stays a module call); plain linear layers and a SiLU called as
    functions, not through their modules.
    """

    def __init__(self, layer: torch.nn.Module, qk_norm: bool) -> None:
        attn = layer.self_attn
        self.layer = layer
        self.attn = attn
        self.qkv = None if qk_norm else _fused_linear((attn.q_proj, attn.k_proj, attn.v_proj))
        self.o_proj = _linear(attn.o_proj)
        mlp = layer.mlp
        dense = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        self.gate_up = _fused_linear((mlp.gate_proj, mlp.up_proj)) if dense else None
        self.inter = mlp.gate_proj.out_features if dense else 0
        if self.gate_up is not None:
            self.down = _linear(mlp.down_proj)
            self.act = _activation(mlp.act_fn)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.layer.mlp(x)
        gate, up = F.linear(x, *self.gate_up).split(self.inter, dim=-1)
        return self.down(self.act(gate) * up)


@torch.inference_mode()
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
    family = families.FAMILIES.get(model.config.model_type)
    qk_norm = family is not None and family.qk_norm
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
    # Prefill: causal attention over the prompt, padding masked as keys. Each query also sees itself, so a
    # padding query never has every key masked (its output is unused but must stay finite: it is cached).
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
    mask = causal & (valid[:, None, :prompt_len] | torch.eye(prompt_len, dtype=torch.bool, device=device))
    mask = mask.unsqueeze(1)  # [B, 1, P, P]
    # Prefill: the model's modules over the whole prompt.
    cos, sin = body.rotary_emb(x, positions)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(batch, prompt_len, -1, head_dim)
        k = attn.k_proj(h).view(batch, prompt_len, -1, head_dim)
        if qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rope(q.transpose(1, 2), cos, sin)
        keys[i, :, :, :prompt_len] = _rope(k.transpose(1, 2), cos, sin)
        values[i, :, :, :prompt_len] = attn.v_proj(h).view(batch, prompt_len, -1, head_dim).transpose(1, 2)
        kc, vc = keys[i, :, :, :prompt_len], values[i, :, :, :prompt_len]
        o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, prompt_len, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    # One-token steps. Everything that does not depend on the new tokens is made once: the rotary cos / sin of
    # every step (each row's positions run on by one per step), the attention's additive mask (0 on every valid
    # key, -inf on the prompt's padding; every generated key is valid) and the fused projection weights.
    steps = torch.arange(1, max_tokens, device=device)
    step_pos = positions[:, -1:] + steps  # [B, max_tokens - 1]
    cos_all, sin_all = body.rotary_emb(x, step_pos) if max_tokens > 1 else (None, None)
    bias = torch.zeros(batch, 1, 1, prompt_len + max_tokens, dtype=torch.float32, device=device)
    bias[:, 0, 0, :prompt_len].masked_fill_(~valid[:, :prompt_len], float("-inf"))
    fused = [_DecodeLayer(layer, qk_norm) for layer in layers]
    lm_head = _linear(model.lm_head)
    heads = first.q_proj.out_features // head_dim
    qk_width = (heads + kv_heads) * head_dim
    group = heads // kv_heads
    end = prompt_len
    for step in range(max_tokens):
        if step:
            end += 1
            cos, sin = cos_all[:, step - 1 : step], sin_all[:, step - 1 : step]  # [B, 1, D]
            kb = bias[..., :end]
            for i, dl in enumerate(fused):
                layer, attn = dl.layer, dl.attn
                h = rms_norm(layer.input_layernorm, x)  # [B, 1, hidden]
                if dl.qkv is not None:
                    qkv = F.linear(h, *dl.qkv)
                    # q and k heads side by side through one rotary embedding: [B, heads + kv_heads, 1, D]
                    qk = _rope(qkv[..., :qk_width].view(batch, 1, -1, head_dim).transpose(1, 2), cos, sin)
                    q, k = qk[:, :heads], qk[:, heads:]
                    v = qkv[..., qk_width:].view(batch, 1, kv_heads, head_dim).transpose(1, 2)
                else:
                    q = attn.q_proj(h).view(batch, 1, -1, head_dim)
                    k = attn.k_proj(h).view(batch, 1, -1, head_dim)
                    if qk_norm:
                        q, k = attn.q_norm(q), attn.k_norm(k)
                    q = _rope(q.transpose(1, 2), cos, sin)
                    k = _rope(k.transpose(1, 2), cos, sin)
                    v = attn.v_proj(h).view(batch, 1, -1, head_dim).transpose(1, 2)
                keys[i, :, :, end - 1 : end] = k
                values[i, :, :, end - 1 : end] = v
                kc, vc = keys[i, :, :, :end], values[i, :, :, :end]
                # One query per row: two small matmuls beat the fused kernel's set-up on CPU.
                # Query heads grouped by KV head, (row, KV head) pairs as the batch of bmm (what matmul does).
                qg = q.reshape(batch * kv_heads, group, head_dim)
                scores = torch.bmm(qg, kc.reshape(batch * kv_heads, end, head_dim).transpose(1, 2)).float()
                scores = scores.view(batch, kv_heads, group, end).mul_(attn.scaling).add_(kb)  # [B, kv, g, L]
                probs = scores.softmax(-1).to(vc.dtype).view(batch * kv_heads, group, end)
                o = torch.bmm(probs, vc.reshape(batch * kv_heads, end, head_dim))  # [B * kv, g, D]: heads in order
                x = x + dl.o_proj(o.view(batch, 1, -1))
                x = x + dl.mlp(rms_norm(layer.post_attention_layernorm, x))
        logits = lm_head(rms_norm(body.norm, x[:, -1])).float()
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
        x = body.embed_tokens(nxt.unsqueeze(1))  # the next input: the new token at the next position
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)
