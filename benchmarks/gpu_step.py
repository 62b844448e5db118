"""One-command GPU benchmark of the parts of a training step, against measured hardware ceilings.

Meant for one H200 (or any CUDA GPU) with NO network and only torch installed (transformers and vLLM are used
when they import, never required). The model is a randomly initialised network with the architecture of
DeepSeek-R1-Distill-Qwen-1.5B (Qwen2: hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960,
vocab 151936, untied lm_head) in bf16; nothing is downloaded.

Parts (each prints which code path ran; a failing part is reported and the others still run):

- ``peaks``: achievable HBM bandwidth (a large device-to-device copy, bytes read + written) and the bf16
  matmul rate (a large ``torch.matmul``): the ceilings everything else is compared with.
- ``decode``: fixed-length generation (EOS ignored) with the best available path: vLLM if it imports, else
  the static-KV-cache decoder below replayed as CUDA graphs (and, when transformers imports, transformers
  ``generate`` with its static cache for comparison). Decode tokens/s is compared with the bandwidth bound:
  every decode step must read all weights once plus the KV cache of the current context.
- ``train``: forward + backward of the policy on packed rows (several documents per row, positions restart
  at each document, block-causal attention); MFU = (6 * N_matmul * tokens + attention FLOPs) / time over
  the measured matmul peak.
- ``refit``: copying the policy's weights into the generator's model, seconds per GB.
- ``step``: a whole synthetic step (generate, old log-probs, one policy-gradient update with AdamW, refit);
  rollout tokens per second per GPU.

The policy is transformers' ``Qwen2ForCausalLM`` when transformers imports, else :class:`MiniQwen2` (the
same network in plain torch, HF parameter names). The generator is :class:`MiniQwen2` with a static KV cache.

Run::

    python benchmarks/gpu_step.py                 # on the GPU machine; prints a JSON summary last
    python benchmarks/gpu_step.py --smoke         # tiny sizes on CPU (what the unit test runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelShape:
    """Qwen2 hyper-parameters (defaults: DeepSeek-R1-Distill-Qwen-1.5B's config.json)."""

    vocab_size: int = 151936
    hidden_size: int = 1536
    num_layers: int = 28
    num_heads: int = 12
    num_kv_heads: int = 2
    intermediate_size: int = 8960
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.hidden_size // self.num_heads

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul (every linear layer and lm_head; not the embedding lookup)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h  # q, k, v, o
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * h


@dataclass(frozen=True)
class Sizes:
    """Workload sizes of every part."""

    copy_bytes: int
    matmul_n: int
    decode_batch: int
    decode_prompt: int
    decode_tokens: int
    train_rows: int
    train_row_tokens: int
    train_doc_tokens: tuple[int, int]
    train_iters: int
    step_rollouts: int
    step_prompt: int
    step_response: int
    step_microbatch_rows: int
    graph_bucket: int


FULL = Sizes(
    copy_bytes=4 << 30,
    matmul_n=8192,
    decode_batch=128,
    decode_prompt=256,
    decode_tokens=512,
    train_rows=2,
    train_row_tokens=4096,
    train_doc_tokens=(256, 2048),
    train_iters=5,
    step_rollouts=128,
    step_prompt=256,
    step_response=512,
    step_microbatch_rows=8,
    graph_bucket=128,
)
SMOKE = Sizes(
    copy_bytes=8 << 20,
    matmul_n=128,
    decode_batch=4,
    decode_prompt=8,
    decode_tokens=8,
    train_rows=2,
    train_row_tokens=48,
    train_doc_tokens=(8, 24),
    train_iters=2,
    step_rollouts=4,
    step_prompt=8,
    step_response=8,
    step_microbatch_rows=2,
    graph_bucket=4,
)
SMOKE_SHAPE = ModelShape(
    vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)


# ----------------------------------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Wall-clock timing that waits for the device before reading the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        """Wait for queued device work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any], warmup: int = 1, repeat: int = 3) -> float:
        """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup`` untimed runs."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------------
# The model in plain torch (HF Qwen2 parameter names, so state dicts move between it and transformers unchanged)


class RMSNorm(nn.Module):
    """Qwen2's RMSNorm (statistics in float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim]."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions (q/k/v with bias, o without, as in Qwen2)."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        hd = s.head_dim
        self.heads, self.kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, hd
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * hd, bias=True)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(s.num_heads * hd, s.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [B, S, H]; cos/sin: [B, S, hd] -> q [B, nh, S, hd], k and v [B, nkv, S, hd]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, hd]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B, nh, S, hd] -> [B, S, H]."""
        b, _, s, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout (HF ``rotate_half``)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, H] -> [B, S, H]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Body(nn.Module):
    """Embedding, layers, final norm (the HF ``model.`` prefix)."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class MiniQwen2(nn.Module):
    """Qwen2 causal LM in plain torch: full-sequence forward (training, prefill) and static-KV-cache decode.

    Parameter names equal transformers' ``Qwen2ForCausalLM`` ones, so ``load_state_dict`` moves weights
    between the two unchanged (that is the refit path of this benchmark).
    """

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.shape = s
        self.model = Body(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # k, v: [layers, B, nkv, max_len, hd]

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, S] -> cos, sin: [B, S, hd]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of a full-sequence forward; fills the KV cache (positions 0..S-1) when one is allocated.

        Args:
            input_ids: [B, S].
            position_ids: [B, S] (restart at 0 at each packed document).
            attn_mask: [B, 1, S, S] bool (True = attend) or None for plain causal attention.

        Returns:
            logits [B, S, V].
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._cos_sin(position_ids, x.dtype)
        s_len = input_ids.shape[1]
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
            if self.cache is not None:
                self.cache[0][i, :, :, :s_len] = k
                self.cache[1][i, :, :, :s_len] = v
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=True
            )
            x = x + a.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))

    def allocate_cache(self, batch: int, max_len: int) -> None:
        """Static KV cache for ``batch`` sequences of up to ``max_len`` tokens."""
        s = self.shape
        p = self.lm_head.weight
        shape = (s.num_layers, batch, s.num_kv_heads, max_len, s.head_dim)
        self.cache = (
            torch.zeros(shape, dtype=p.dtype, device=p.device),
            torch.zeros(shape, dtype=p.dtype, device=p.device),
        )

    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor, ctx: int) -> torch.Tensor:
        """One decode step at position ``pos`` attending over the first ``ctx`` cache slots.

        Shapes are static (``pos`` is a 0-dim device tensor), so the step can be captured in a CUDA graph.

        Args:
            tokens: [B] the previous tokens.
            pos: 0-dim int64, their position (the same for every row: prompts have equal length).
            ctx: cache slots read (>= pos + 1; the rest are masked).

        Returns:
            logits [B, V] float32.
        """
        assert self.cache is not None
        kc, vc = self.cache
        x = self.model.embed_tokens(tokens).unsqueeze(1)  # [B, 1, H]
        positions = pos.view(1, 1).expand(tokens.shape[0], 1)
        cos, sin = self._cos_sin(positions, x.dtype)
        valid = (torch.arange(ctx, device=tokens.device) <= pos).view(1, 1, 1, ctx)
        index = pos.view(1)
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)  # q [B, nh, 1, hd]
            kc[i].index_copy_(2, index, k)
            vc[i].index_copy_(2, index, v)
            o = F.scaled_dot_product_attention(
                q, kc[i, :, :, :ctx], vc[i, :, :, :ctx], attn_mask=valid, enable_gqa=True
            )
            x = x + a.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))[:, 0].float()


def init_random_(model: nn.Module, seed: int = 0) -> None:
    """Random weights (normal, std 0.02; norms 1): the benchmark needs the architecture, not a checkpoint."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                p.normal_(0.0, 0.02, generator=gen)


def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample at temperature 1 with the exponential-race trick (no host sync, graph-safe).

    Args:
        logits: [B, V] float32.

    Returns:
        tokens [B] int64 and their log-probs [B].
    """
    logp = torch.log_softmax(logits, dim=-1)
    race = logp.exp() / torch.empty_like(logp).exponential_()
    tok = race.argmax(dim=-1)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------------
# Builders


def build_policy(
    shape: ModelShape, device: torch.device, dtype: torch.dtype, kind: str = "auto"
) -> tuple[nn.Module, str]:
    """The trained model: transformers' Qwen2ForCausalLM when importable (``kind="auto"``), else MiniQwen2."""
    try:
        if kind == "mini":
            raise ImportError("MiniQwen2 asked for (--policy mini)")
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError as err:
        model: nn.Module = MiniQwen2(shape).to(device=device, dtype=dtype)
        init_random_(model)
        return model, f"MiniQwen2 (plain torch; transformers not used: {err})"
    cfg = Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
        use_sliding_window=False,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    init_random_(model)
    import transformers

    return model, f"transformers {transformers.__version__} Qwen2ForCausalLM (sdpa)"


def policy_logits(policy: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] -> logits [B, S, V] for either policy class (packed rows: positions restart per document)."""
    if isinstance(policy, MiniQwen2):
        return policy(input_ids, position_ids, attn_mask=block_causal_mask(position_ids))
    # transformers builds the block-causal mask itself from restarting position_ids when no mask is given.
    return policy(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, S] positions -> [B, 1, S, S] bool mask: causal within each document (a restart at 0 opens one)."""
    if not bool((position_ids[:, 1:] == 0).any()):
        return None
    doc = (position_ids == 0).cumsum(dim=1)  # [B, S] document index
    same = doc.unsqueeze(2) == doc.unsqueeze(1)
    s = position_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


# ----------------------------------------------------------------------------------------------------------------------
# Parts


def part_peaks(clock: Clock, sizes: Sizes, dtype: torch.dtype) -> dict[str, Any]:
    """Measured copy bandwidth and matmul rate (the ceilings)."""
    dev = clock.device
    n = sizes.copy_bytes // 2
    src = torch.randn(n, device=dev, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy = clock.time(lambda: dst.copy_(src), warmup=2, repeat=10)
    bw = 2 * src.numel() * src.element_size() / t_copy  # bytes read + bytes written
    m = sizes.matmul_n
    a = torch.randn(m, m, device=dev, dtype=dtype)
    b = torch.randn(m, m, device=dev, dtype=dtype)
    t_mm = clock.time(lambda: torch.matmul(a, b), warmup=3, repeat=10)
    return {
        "copy_gb": sizes.copy_bytes / 1e9,
        "bandwidth_gb_s": bw / 1e9,
        "matmul_n": m,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_tflops": 2 * m**3 / t_mm / 1e12,
    }


def _state_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def part_refit(clock: Clock, policy: nn.Module, engine: nn.Module) -> dict[str, Any]:
    """Copy every policy weight into the engine's parameter of the same HF name (what a colocated refit does)."""
    src = dict(policy.named_parameters())
    dst = dict(engine.named_parameters())
    names = [n for n in dst if n in src]
    missing = sorted(set(dst) - set(src))
    if missing:
        raise ValueError(f"engine parameters absent from the policy: {missing[:5]}")

    @torch.no_grad()
    def copy() -> None:
        for n in names:
            dst[n].copy_(src[n])

    t = clock.time(copy, warmup=1, repeat=3)
    gb = _state_bytes(engine) / 1e9
    return {"path": "state_dict copy, policy -> MiniQwen2 engine (same device)", "gb": gb, "s": t, "s_per_gb": t / gb}


def _prompts(batch: int, length: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


@torch.no_grad()
def engine_generate(
    engine: MiniQwen2, prompts: torch.Tensor, new_tokens: int, use_graphs: bool, bucket: int
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Fixed-length sampling of ``new_tokens`` tokens per prompt with the static cache.

    With ``use_graphs`` one CUDA graph per context bucket of ``bucket`` slots is captured (decode steps read
    only the cache slots of their bucket) and replayed; else every step runs eagerly.

    Returns:
        tokens [B, new_tokens], their log-probs [B, new_tokens], and the path name.
    """
    b, p = prompts.shape
    total = p + new_tokens
    dev = prompts.device
    if engine.cache is None or engine.cache[0].shape[1] != b or engine.cache[0].shape[3] < total:
        engine.cache = None
        engine.allocate_cache(b, total)
    positions = torch.arange(p, device=dev).expand(b, p)
    first = engine(prompts, positions)[:, -1].float()  # prefill: writes cache slots 0..p-1
    tok, lp = sample(first)
    out_tok = torch.empty(b, new_tokens, dtype=torch.long, device=dev)
    out_lp = torch.empty(b, new_tokens, dtype=torch.float32, device=dev)
    out_tok[:, 0], out_lp[:, 0] = tok, lp
    pos = torch.tensor(p, device=dev)
    cur = tok.clone()
    if not use_graphs:
        for t in range(1, new_tokens):
            ctx = min(total, (int(p + t) // bucket + 1) * bucket)
            tok, lp = sample(engine.decode_step(cur, pos, ctx))
            out_tok[:, t], out_lp[:, t] = tok, lp
            cur.copy_(tok)
            pos += 1
        return out_tok, out_lp, "MiniQwen2 static KV cache, eager"
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def capture(ctx: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        # Warm up on a side stream, then capture; the cache slot written meanwhile is rewritten on replay.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                sample(engine.decode_step(cur, pos, ctx))
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            g_tok, g_lp = sample(engine.decode_step(cur, pos, ctx))
        return g, g_tok, g_lp

    for t in range(1, new_tokens):
        ctx = min(total, ((p + t) // bucket + 1) * bucket)
        if ctx not in graphs:
            graphs[ctx] = capture(ctx)
        g, g_tok, g_lp = graphs[ctx]
        g.replay()
        out_tok[:, t], out_lp[:, t] = g_tok, g_lp
        cur.copy_(g_tok)
        pos += 1
    return out_tok, out_lp, f"MiniQwen2 static KV cache, CUDA graphs per {bucket}-slot context bucket"


def decode_bound(shape: ModelShape, engine_bytes: int, batch: int, prompt: int, new_tokens: int, bw: float) -> float:
    """Tokens/s if every decode step only moved its minimal bytes at bandwidth ``bw`` (bytes/s).

    A step reads every weight once (the embedding lookup reads only B rows: counted as the whole matrix
    minus those, i.e. excluded) plus the K and V cache of the context so far (prompt + tokens already made).
    """
    embed = shape.vocab_size * shape.hidden_size * 2
    weights = engine_bytes - embed
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2  # K and V, bf16
    # Context averaged over the decode steps: prompt + (new_tokens - 1) / 2.
    mean_ctx = prompt + (new_tokens - 1) / 2
    step_bytes = weights + batch * mean_ctx * kv_per_token
    return batch * bw / step_bytes


def part_decode(
    clock: Clock, shape: ModelShape, sizes: Sizes, engine: MiniQwen2, policy: nn.Module, peaks: dict, budget: Deadline
) -> dict[str, Any]:
    """Fixed-length decode throughput of every available path, against the bandwidth bound."""
    dev = clock.device
    b, p, n = sizes.decode_batch, sizes.decode_prompt, sizes.decode_tokens
    prompts = _prompts(b, p, shape.vocab_size, dev)
    results: dict[str, Any] = {}
    bound = decode_bound(shape, _state_bytes(engine), b, p, n, peaks["bandwidth_gb_s"] * 1e9)
    paths: list[tuple[str, Callable[[], Any]]] = []
    if _importable("vllm"):
        paths.append(("vllm", lambda: vllm_generate(shape, prompts, n)))
    if dev.type == "cuda":
        paths.append(("engine_graphs", lambda: engine_generate(engine, prompts, n, True, sizes.graph_bucket)))
    paths.append(("engine_eager", lambda: engine_generate(engine, prompts, n, False, sizes.graph_bucket)))
    if not isinstance(policy, MiniQwen2):
        paths.append(("hf_generate_static", lambda: hf_generate(policy, prompts, n)))
    for key, fn in paths:
        if budget.expired():
            results[key] = {"skipped": "time budget"}
            continue
        try:
            info: dict[str, str] = {}

            def run(fn: Callable[[], Any] = fn, info: dict[str, str] = info) -> None:
                info["path"] = fn()[2]

            t = clock.time(run, warmup=1, repeat=2)
            tps = b * n / t
            results[key] = {
                "path": info["path"],
                "seconds": t,
                "tokens_per_s": tps,
                "bound_tokens_per_s": bound,
                "fraction_of_bound": tps / bound,
            }
        except Exception as err:  # noqa: BLE001  (a missing path is reported, the others still run)
            results[key] = {"failed": f"{type(err).__name__}: {err}".splitlines()[0]}
            traceback.print_exc(file=sys.stderr)
    ok = {k: v for k, v in results.items() if "tokens_per_s" in v}
    best = max(ok, key=lambda k: ok[k]["tokens_per_s"]) if ok else None
    return {"batch": b, "prompt_tokens": p, "new_tokens": n, "best": best, "paths": results}


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@torch.no_grad()
def hf_generate(policy: nn.Module, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, None, str]:
    """transformers ``generate`` with its static cache, sampling, EOS disabled (fixed length), not compiled."""
    from transformers import GenerationConfig

    gc = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        cache_implementation="static",
        disable_compile=True,
    )
    policy.eval()
    out = policy.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=gc)
    if out.shape[1] != prompts.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - prompts.shape[1]} new tokens, expected {new_tokens}")
    return out[:, prompts.shape[1] :], None, "transformers generate, static cache, eager (no torch.compile)"


def vllm_generate(shape: ModelShape, prompts: torch.Tensor, new_tokens: int) -> tuple[None, None, str]:
    """vLLM with dummy (random) weights, token-id prompts, ``ignore_eos``; the engine is built once."""
    global _VLLM
    import vllm

    if _VLLM is None:
        from transformers import Qwen2Config

        folder = Path(tempfile.mkdtemp(prefix="gpu_step_vllm_"))
        Qwen2Config(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            max_position_embeddings=shape.max_position_embeddings,
            rope_theta=shape.rope_theta,
            tie_word_embeddings=False,
            architectures=["Qwen2ForCausalLM"],
        ).save_pretrained(folder)
        _VLLM = vllm.LLM(
            model=str(folder),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            gpu_memory_utilization=0.35,
            max_model_len=prompts.shape[1] + new_tokens,
            seed=0,
        )
    sp = vllm.SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    reqs = [{"prompt_token_ids": row} for row in prompts.tolist()]
    outs = _VLLM.generate(reqs, sp, use_tqdm=False)
    made = {len(o.outputs[0].token_ids) for o in outs}
    if made != {new_tokens}:
        raise RuntimeError(f"vLLM made {sorted(made)} tokens per request, expected {new_tokens}")
    return None, None, f"vLLM {vllm.__version__} (dummy weights, CUDA graphs)"


_VLLM: Any = None


def _packed_rows(
    sizes: Sizes, vocab: int, device: torch.device, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Rows of ``train_row_tokens`` tokens, each several random-length documents back to back.

    Returns:
        input_ids [R, L], position_ids [R, L] (restart per document), and the document lengths of every row.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lo, hi = sizes.train_doc_tokens
    ids = torch.randint(0, vocab, (sizes.train_rows, sizes.train_row_tokens), generator=gen)
    pos = torch.empty_like(ids)
    docs = []
    for r in range(sizes.train_rows):
        lengths, used = [], 0
        while used < sizes.train_row_tokens:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), sizes.train_row_tokens - used)
            pos[r, used : used + n] = torch.arange(n)
            lengths.append(n)
            used += n
        docs.append(lengths)
    return ids.to(device), pos.to(device), docs


def train_flops(shape: ModelShape, tokens: int, docs: list[list[int]]) -> float:
    """FLOPs of forward + backward: 6 * N_matmul * tokens plus causal attention within each document.

    Attention forward per layer and document of length L: QK^T and PV, 2 * L^2 * d each, half of it causal
    (d = heads * head_dim): 2 * L^2 * d; backward twice the forward: 6 * L^2 * d in all.
    """
    d = shape.num_heads * shape.head_dim
    attn = 6 * shape.num_layers * d * sum(n * n for row in docs for n in row)
    return 6 * shape.matmul_params() * tokens + attn


def part_train(clock: Clock, shape: ModelShape, sizes: Sizes, policy: nn.Module, peaks: dict) -> dict[str, Any]:
    """Forward + backward on packed rows; MFU against the measured matmul rate."""
    ids, pos, docs = _packed_rows(sizes, shape.vocab_size, clock.device)
    policy.train()

    def fwd_bwd() -> None:
        logits = policy_logits(policy, ids, pos)  # [R, L, V]
        # Next-token loss inside each document (the last token of a document predicts nothing).
        target = torch.roll(ids, -1, dims=1)
        keep = torch.roll(pos, -1, dims=1) != 0
        loss = F.cross_entropy(logits[keep].float(), target[keep])
        loss.backward()

    t = clock.time(fwd_bwd, warmup=1, repeat=sizes.train_iters)
    policy.zero_grad(set_to_none=True)
    tokens = ids.numel()
    flops = train_flops(shape, tokens, docs)
    achieved = flops / t
    peak = peaks["matmul_tflops"] * 1e12
    return {
        "path": f"{type(policy).__name__} fwd+bwd, {sizes.train_rows} packed rows x {sizes.train_row_tokens} tokens",
        "tokens": tokens,
        "documents": sum(len(r) for r in docs),
        "seconds": t,
        "tokens_per_s": tokens / t,
        "tflops": achieved / 1e12,
        "mfu_vs_measured_peak": achieved / peak,
    }


def part_step(
    clock: Clock, shape: ModelShape, sizes: Sizes, policy: nn.Module, engine: MiniQwen2, best_decode: str | None
) -> dict[str, Any]:
    """A whole synthetic step: generate, old log-probs, one policy-gradient update (AdamW), refit."""
    dev = clock.device
    b, p, r = sizes.step_rollouts, sizes.step_prompt, sizes.step_response
    prompts = _prompts(b, p, shape.vocab_size, dev, seed=2)
    use_graphs = best_decode == "engine_graphs"
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    timings: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        clock.sync()
        t0 = time.perf_counter()
        out = fn()
        clock.sync()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        return out

    def one_step() -> None:
        tokens, _, _ = timed("generate", lambda: engine_generate(engine, prompts, r, use_graphs, sizes.graph_bucket))
        seqs = torch.cat([prompts, tokens], dim=1)  # [B, P + R]
        positions = torch.arange(p + r, device=dev).expand(b, -1)
        rows = sizes.step_microbatch_rows

        def token_logprobs(sl: slice) -> torch.Tensor:
            logits = policy_logits(policy, seqs[sl], positions[sl])[:, p - 1 : -1].float()  # [mb, R, V]
            return torch.log_softmax(logits, -1).gather(-1, seqs[sl, p:].unsqueeze(-1)).squeeze(-1)  # [mb, R]

        def old() -> torch.Tensor:
            policy.eval()
            with torch.no_grad():
                return torch.cat([token_logprobs(slice(s, s + rows)) for s in range(0, b, rows)])

        old_lp = timed("old_logprobs", old)
        # Random per-rollout coefficients stand in for dL/ds (the cost does not depend on their values).
        coeff = torch.randn(b, device=dev) / b

        def train() -> None:
            policy.train()
            opt.zero_grad(set_to_none=True)
            for s in range(0, b, rows):
                sl = slice(s, s + rows)
                score = torch.exp(token_logprobs(sl) - old_lp[sl]).mean(-1)  # [mb] L-ratio score
                (coeff[sl] * score).sum().backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()

        timed("train", train)
        timed("refit", lambda: part_refit_once(policy, engine))

    one_step()  # warm-up (optimizer state, graphs, allocator)
    timings.clear()
    clock.sync()
    t0 = time.perf_counter()
    one_step()
    clock.sync()
    total = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    return {
        "path": f"decode: {'CUDA graphs' if use_graphs else 'eager'} MiniQwen2 engine; policy {type(policy).__name__}",
        "rollouts": b,
        "prompt_tokens": p,
        "response_tokens": r,
        "seconds": total,
        "phases_s": timings,
        "rollout_tokens_per_s_per_gpu": b * r / total,
        "tokens_per_s_per_gpu": b * (p + r) / total,
    }


@torch.no_grad()
def part_refit_once(policy: nn.Module, engine: nn.Module) -> None:
    """Policy -> engine weight copy (by HF name)."""
    dst = dict(engine.named_parameters())
    for n, p in policy.named_parameters():
        if n in dst:
            dst[n].copy_(p)


@torch.no_grad()
def engine_check(policy: nn.Module, engine: MiniQwen2, shape: ModelShape, device: torch.device) -> dict[str, float]:
    """The engine computes the policy's function: max |logit difference| on a packed row and on a decode step."""
    ids, pos, _ = _packed_rows(
        Sizes(**{**asdict(SMOKE), "train_rows": 1, "train_row_tokens": 24}), shape.vocab_size, device
    )
    policy.eval()
    ref = policy_logits(policy, ids, pos).float()
    got = engine(ids, pos, attn_mask=block_causal_mask(pos)).float()
    # Decode: prefill 6 tokens, then one cached step must equal the full forward's 7th position.
    seq = ids[:, :7]
    full = policy_logits(policy, seq, torch.arange(7, device=device).unsqueeze(0)).float()[:, -1]
    saved = engine.cache
    engine.cache = None
    engine.allocate_cache(1, 8)
    engine(seq[:, :6], torch.arange(6, device=device).unsqueeze(0))
    step = engine.decode_step(seq[:, 6], torch.tensor(6, device=device), 8)
    engine.cache = saved
    return {
        "packed_forward_max_abs_diff": float((ref - got).abs().max()),
        "decode_step_max_abs_diff": float((full - step).abs().max()),
    }


class Deadline:
    """The wall-clock budget of the whole run; parts starting after it are skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def expired(self) -> bool:
        """True once the budget is spent."""
        return time.perf_counter() > self.end


# ----------------------------------------------------------------------------------------------------------------------


def run(smoke: bool, budget_s: float, policy_kind: str = "auto") -> dict[str, Any]:
    """Every part in order; returns the JSON summary."""
    start = time.perf_counter()
    deadline = Deadline(budget_s)
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMOKE_SHAPE if smoke else ModelShape()
    sizes = SMOKE if smoke else FULL
    clock = Clock(device)
    summary: dict[str, Any] = {
        "mode": "smoke" if smoke else "full",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).removeprefix("torch."),
        "importable": {m: _importable(m) for m in ("transformers", "vllm", "megatron.core", "transformer_engine")},
        "model": {**asdict(shape), "matmul_params": shape.matmul_params()},
        "sizes": asdict(sizes),
    }
    if not smoke and not cuda:
        summary["warning"] = "no CUDA device: the full sizes ran on the CPU (use --smoke for a quick check)"
    _say(f"device {summary['device']}, torch {torch.__version__}, importable {summary['importable']}")

    torch.manual_seed(0)
    policy, policy_path = build_policy(shape, device, dtype, policy_kind)
    engine = MiniQwen2(shape).to(device=device, dtype=dtype)
    summary["policy"] = policy_path
    summary["params"] = sum(p.numel() for p in policy.parameters())
    _say(f"policy: {policy_path}, {summary['params'] / 1e9:.3f} B parameters")

    def attempt(name: str, fn: Callable[[], dict]) -> None:
        if deadline.expired():
            summary[name] = {"skipped": "time budget"}
            _say(f"{name}: skipped (time budget)")
            return
        t0 = time.perf_counter()
        try:
            summary[name] = fn()
        except Exception as err:  # noqa: BLE001  (report and go on with the other parts)
            traceback.print_exc(file=sys.stderr)
            summary[name] = {"failed": f"{type(err).__name__}: {err}".splitlines()[0]}
        _say(f"{name} ({time.perf_counter() - t0:.1f} s): {json.dumps(summary[name])}")

    attempt("peaks", lambda: part_peaks(clock, sizes, torch.bfloat16 if cuda else torch.float32))
    peaks = summary.get("peaks", {})
    if "bandwidth_gb_s" not in peaks:
        summary["total_s"] = time.perf_counter() - start
        return summary
    attempt("refit", lambda: part_refit(clock, policy, engine))
    attempt("engine_check", lambda: engine_check(policy, engine, shape, device))
    attempt("decode", lambda: part_decode(clock, shape, sizes, engine, policy, peaks, deadline))
    attempt("train", lambda: part_train(clock, shape, sizes, policy, peaks))
    attempt("step", lambda: part_step(clock, shape, sizes, policy, engine, summary.get("decode", {}).get("best")))
    summary["total_s"] = time.perf_counter() - start
    return summary


def _say(msg: str) -> None:
    print(f"[gpu_step] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (seconds; what the unit test runs)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON summary to this file")
    ap.add_argument(
        "--budget-s", type=float, default=400.0, help="parts that would start after this many seconds are skipped"
    )
    ap.add_argument(
        "--policy",
        choices=("auto", "mini"),
        default="auto",
        help="auto: transformers' Qwen2 when importable; mini: the plain-torch MiniQwen2 (as without transformers)",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    summary = run(args.smoke, args.budget_s, args.policy)
    text = json.dumps(summary, indent=1, default=str)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print("GPU_STEP_SUMMARY " + json.dumps(summary, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
