"""Rollout correction: importance weights and monitoring metrics for the generator / trainer log-prob mismatch."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nemo_disco.losses.reduce import check_tokens


def rollout_weights(
    old_logprobs: Tensor,
    gen_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str = "none",
    cap: float = 2.0,
) -> tuple[Tensor | None, dict[str, float]]:
    """Per-rollout importance weights for the generator / trainer log-prob mismatch (detached).

    ``seq_tis`` (sequence-level truncated importance sampling): ``w_i = min(exp(sum_t m (old - gen)), cap)``,
    the likelihood ratio pi_old(o_i) / pi_gen(o_i) of the whole response, truncated at ``cap``; computed in
    log space so it never overflows. The objectives use them as self-normalised weights within a question
    (DisCO family) or as per-rollout loss multipliers (GRPO family).

    The same as :func:`log_ratios`, then :func:`capped_weights` and :func:`weight_metrics` (a trainer that gets
    the rows of a batch at different times computes each row once with those).

    Args:
        old_logprobs: [N, T] the training policy's (pi_old) token log-probs.
        gen_logprobs: [N, T] the generator's sampling token log-probs.
        mask: [N, T] response tokens.
        mode: ``"none"`` (returns ``(None, {})``) or ``"seq_tis"``.
        cap: truncation C > 0.

    Returns:
        ``(weights [N] float64 or None, metrics)``: ``mismatch/truncated_share`` (rollouts whose ratio
        exceeds cap), ``mismatch/weight_mean``, ``mismatch/weight_min``, ``mismatch/weight_max``,
        ``mismatch/weight_ess_share`` ((sum w)^2 / (N sum w^2)).
    """
    if mode == "none":
        return None, {}
    if mode != "seq_tis":
        raise ValueError(f"rollout correction mode={mode!r} must be 'none' or 'seq_tis'")
    if not cap > 0:
        raise ValueError(f"rollout correction cap={cap} must be > 0")
    log_ratio = log_ratios(old_logprobs, gen_logprobs, mask)
    w = capped_weights(log_ratio, cap)
    return w, weight_metrics(log_ratio, w, cap)


def log_ratios(old_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N] float64 ``sum_t m (old - gen)``: each rollout's log likelihood ratio log pi_old(o_i) / pi_gen(o_i).

    Args:
        old_logprobs: [N, T] the training policy's (pi_old) token log-probs.
        gen_logprobs: [N, T] the generator's sampling token log-probs.
        mask: [N, T] response tokens.
    """
    check_tokens(old_logprobs, gen_logprobs, mask)
    with torch.no_grad():
        m = mask.bool()
        diff = torch.where(m, old_logprobs.double() - gen_logprobs.double(), 0.0)  # [N, T]
        return diff.sum(1)  # [N]


def capped_weights(log_ratio: Tensor, cap: float) -> Tensor:
    """[N] ``min(exp(log_ratio), cap)``, in log space (``seq_tis``'s weights of :func:`log_ratios`)."""
    with torch.no_grad():
        return torch.exp(log_ratio.clamp(max=math.log(cap)))  # [N]


def weight_metrics(log_ratio: Tensor, w: Tensor, cap: float) -> dict[str, float]:
    """The monitoring metrics of :func:`rollout_weights` from a batch's log ratios [N] and weights [N]."""
    with torch.no_grad():
        n = max(int(w.numel()), 1)
        return {
            "mismatch/truncated_share": float((log_ratio > math.log(cap)).double().sum()) / n,
            "mismatch/weight_mean": float(w.mean()) if w.numel() else 0.0,
            "mismatch/weight_min": float(w.min()) if w.numel() else 0.0,
            "mismatch/weight_max": float(w.max()) if w.numel() else 0.0,
            "mismatch/weight_ess_share": float(w.sum() ** 2 / (n * (w**2).sum())) if w.numel() else 0.0,
        }


def mismatch_metrics(old_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the generator's log-probs are from the training policy's (monitoring only).

    With ``d = old - gen`` per valid token:

    * ``mismatch/kl_k3``: token mean of ``exp(d) - 1 - d``, the k3 estimator of KL(pi_gen || pi_old)
      (tokens are sampled from pi_gen),
    * ``mismatch/max_abs_logprob_diff``: max |d|,
    * ``mismatch/seq_logratio_mean`` / ``_std``: mean / population std over rollouts of sum_t d.

    Args:
        old_logprobs: [N, T] the training policy's token log-probs.
        gen_logprobs: [N, T] the generator's token log-probs.
        mask: [N, T] response tokens.
    """
    check_tokens(old_logprobs, gen_logprobs, mask)
    with torch.no_grad():
        m = mask.bool()
        d = torch.where(m, old_logprobs.double() - gen_logprobs.double(), 0.0)  # [N, T]
        tokens = int(m.sum())
        seq = d.sum(1)  # [N]
        return {
            "mismatch/kl_k3": float(torch.where(m, torch.expm1(d) - d, 0.0).sum()) / max(tokens, 1),
            "mismatch/max_abs_logprob_diff": float(d.abs().max()) if d.numel() else 0.0,
            "mismatch/seq_logratio_mean": float(seq.mean()) if seq.numel() else 0.0,
            "mismatch/seq_logratio_std": float(seq.std(correction=0)) if seq.numel() else 0.0,
        }
