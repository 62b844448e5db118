"""Per-token log-probs and entropy of target tokens through a vocab-parallel softmax, chunked over tokens.

Each tensor-parallel rank holds the logits of its slice of the (padded) vocabulary. For a chunk of at most
``chunk_size`` tokens the shard's logits are converted to float32 and divided by the sampling temperature
(the generator samples from ``softmax(logits / temperature)``), then

- ``m = max_v z_v`` (all-reduce MAX over the group), ``S = sum_v exp(z_v - m)`` and the target's
  ``z_y`` (all-reduce SUM), so ``log p(y) = z_y - m - log S``;
- for the entropy, ``W = sum_v exp(z_v - m) (z_v - m)`` (same all-reduce), ``E[z] = m + W / S`` and
  ``H = m + log S - E[z]``.

Only one float32 ``[chunk, V / tp]`` block exists at a time (two with entropy), worked on in place; the
logits are never copied to float32 as a whole nor modified (mcore's ``vocab_parallel_cross_entropy``
overwrites its input). The backward
pass recomputes each chunk's softmax from the saved (model-dtype) logits and the per-token statistics:
``d log p(y) / dz_v = 1[v = y] - p_v`` and ``dH / dz_v = -p_v (z_v - E[z])``, times ``1 / temperature``.
Vocabulary padding columns (ids >= ``vocab_size``) are excluded from the softmax and get zero gradient.

With ``group=None`` the logits are the whole vocabulary (the transformers policy uses it that way).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nemo_disco import distributed


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: distributed.Group = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    chunk_size: int = 1024,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``targets`` under ``softmax(logits / temperature)``, differentiable.

    Args:
        logits: [B, S, Vs] or [T, Vs], this rank's vocabulary shard (columns ``vocab_start .. vocab_start + Vs``
            of the padded vocabulary), any float dtype; may be a non-contiguous view. Not modified.
        targets: [B, S] or [T] int64 global token ids in ``[0, vocab_size)``.
        temperature: the sampling temperature.
        group: the tensor-parallel process group holding the other shards (None: one shard, no communication).
        vocab_start: global id of this shard's first column.
        vocab_size: the real vocabulary size; columns at ids >= ``vocab_size`` are padding and ignored.
            None: every column is real.
        chunk_size: tokens per float32 block (``policy.logprob_chunk_size``).
        entropy: also return the entropy of the tempered distribution.

    Returns:
        logprobs with the shape of ``targets`` (float32) and entropy of the same shape or None.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size={chunk_size} must be >= 1")
    squeeze = logits.dim() == 2
    if squeeze:
        logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)  # [1, T, Vs]
    shard = logits.shape[-1]
    valid = shard if vocab_size is None else max(0, min(shard, vocab_size - vocab_start))
    if group is not None and distributed.world_size(group) == 1:
        group = None
    lp, ent = _VocabParallelLogprobs.apply(
        logits, targets, float(temperature), group, vocab_start, valid, int(chunk_size), bool(entropy)
    )
    if squeeze:
        lp = lp.squeeze(0)
        ent = ent.squeeze(0) if entropy else None
    return lp, (ent if entropy else None)


def _chunks(rows: int, length: int, chunk: int) -> Iterator[tuple[int, slice]]:
    """(row, token slice) blocks of at most ``chunk`` tokens covering a [rows, length] grid."""
    for row in range(rows):
        for start in range(0, length, chunk):
            yield row, slice(start, min(start + chunk, length))


def _flat_view(logits: torch.Tensor) -> torch.Tensor | None:
    """[1, B * S, Vs] view of [B, S, Vs] logits when the token dims merge without a copy, else None."""
    try:
        return logits.view(1, -1, logits.shape[-1])
    except RuntimeError:
        return None


class _VocabParallelLogprobs(torch.autograd.Function):
    """Chunked vocab-parallel log-softmax at the targets (and entropy); see the module docstring."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, group, vocab_start, valid, chunk, want_entropy):  # noqa: ANN001, ANN205, D102
        batch, length, _ = logits.shape
        flat = _flat_view(logits)
        # Chunk the flattened tokens when rows are contiguous, else row by row (no copy either way).
        src = flat if flat is not None else logits  # [rows, tokens, Vs]
        tgt = targets.reshape(1, -1) if flat is not None else targets  # [rows, tokens]
        # Per-token float32 statistics: log-partition, expected tempered logit, log-prob.
        stats = torch.zeros((3, *tgt.shape), dtype=torch.float32, device=logits.device)
        for r, cols in _chunks(*tgt.shape, chunk):
            t = tgt[r, cols] - vocab_start  # [c] local column of the target
            here = (t >= 0) & (t < valid)
            c = t.shape[0]
            if valid:
                # In-place float32 work on one [c, valid] block (two with entropy); always a copy, so the
                # logits are never modified even when they are float32 already.
                z = src[r, cols, :valid].to(torch.float32, copy=True).div_(temperature)
                m = z.max(dim=-1).values
                tz = torch.where(here, z.gather(1, t.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1), 0.0)
            else:  # this shard is all vocabulary padding
                m = torch.full((c,), float("-inf"), device=logits.device)
                tz = torch.zeros(c, device=logits.device)
            if group is not None:
                distributed.all_reduce(m, "max", group=group)
            parts = [torch.zeros(c, device=logits.device) for _ in range(3 if want_entropy else 2)]
            parts[1] = tz
            if valid:
                z.sub_(m.unsqueeze(-1))  # z - m
                if want_entropy:
                    e = torch.exp(z)  # [c, valid]
                    parts[0] = e.sum(-1)
                    # sum_v e_v (z_v - m): an elementwise product in float32 (a bmm / matmul here would run in
                    # TF32 on GPUs that allow it, rounding the entropy to ~1e-3); in place, no third block.
                    parts[2] = e.mul_(z).sum(-1)
                    del e
                else:
                    parts[0] = z.exp_().sum(-1)
                del z
            packed = torch.stack(parts)  # [2 or 3, c]
            if group is not None:
                distributed.all_reduce(packed, group=group)
            log_z = m + packed[0].log()
            stats[0, r, cols] = log_z
            if want_entropy:
                stats[1, r, cols] = m + packed[2] / packed[0]  # E[z]
            stats[2, r, cols] = packed[1] - log_z
        stats = stats.view(3, batch, length)
        logp = stats[2].clone()
        ent = stats[0] - stats[1] if want_entropy else logp.new_zeros(())
        ctx.save_for_backward(logits, targets, stats[0].clone(), stats[1].clone())
        ctx.config = (temperature, vocab_start, valid, chunk, want_entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):  # noqa: ANN001, ANN205, D102
        logits, targets, log_z, mean_z = ctx.saved_tensors
        temperature, vocab_start, valid, chunk, want_entropy = ctx.config
        grad = torch.zeros_like(logits)  # [B, S, Vs] in the logits' dtype; padding columns stay 0
        flat_logits, flat_grad = _flat_view(logits), _flat_view(grad)
        merged = flat_logits is not None and flat_grad is not None
        src, dst = (flat_logits, flat_grad) if merged else (logits, grad)

        def tokens(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(1, -1) if merged else t  # [rows, tokens]

        tgt, lz, mz = tokens(targets), tokens(log_z), tokens(mean_z)
        g_lp = tokens(grad_logp.float()) if grad_logp is not None else torch.zeros_like(lz)
        g_ent = tokens(grad_ent.float()) if want_entropy and grad_ent is not None else None
        if not valid:
            return grad, None, None, None, None, None, None, None
        for r, cols in _chunks(*tgt.shape, chunk):
            lz_c, g = lz[r, cols].unsqueeze(-1), g_lp[r, cols]
            # log p = z - log Z, in place on one float32 block (two with entropy).
            logp = src[r, cols, :valid].to(torch.float32, copy=True).div_(temperature).sub_(lz_c)  # [c, valid]
            if g_ent is not None:
                gz = torch.exp(logp)  # p
                # dz = p * (-g_lp - g_ent * (z - E[z])), with z - E[z] = log p + log Z - E[z].
                logp.add_(lz_c - mz[r, cols].unsqueeze(-1)).mul_(-g_ent[r, cols].unsqueeze(-1)).sub_(g.unsqueeze(-1))
                gz.mul_(logp)
            else:
                gz = logp.exp_().mul_(-g.unsqueeze(-1))  # in place: gz is logp's block
            del logp  # drop every reference before the next chunk allocates its block
            # + g at the target's column where this shard holds it: one column per token (clamped where the target
            # lies on another shard, then written back unchanged), so no nonzero and no host sync per chunk.
            t = tgt[r, cols] - vocab_start
            col = t.clamp(0, valid - 1).unsqueeze(-1)  # [c, 1]
            at = gz.gather(1, col).squeeze(-1)  # [c]
            gz.scatter_(1, col, torch.where((t >= 0) & (t < valid), at + g, at).unsqueeze(-1))
            dst[r, cols, :valid] = gz.div_(temperature)  # cast to the logits' dtype on copy
            del gz
        return grad, None, None, None, None, None, None, None
