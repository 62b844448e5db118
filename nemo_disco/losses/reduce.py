"""Shared reductions: token-level helpers (the only code that sees [N, T]) and question-level group helpers."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# ----------------------------------------------------------------------------------------------------------------------
# Token-level helpers (the only code that sees [N, T]).


def check_tokens(logprobs: Tensor, other: Tensor, mask: Tensor, **optional: Tensor | None) -> None:
    """Raise ValueError unless ``logprobs`` is [N, T] and every other tensor given has its shape."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got {list(logprobs.shape)}")
    for key, t in (("old/gen logprobs", other), ("mask", mask), *optional.items()):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{key} must be {list(logprobs.shape)} like logprobs, got {list(t.shape)}")


def log_ratio(logprobs: Tensor, base: Tensor, m: Tensor) -> Tensor:
    """Token log-ratio ``logprobs - base`` on valid tokens, exactly 0 on padding. [N, T] -> [N, T].

    Padding may hold anything (even inf or nan): ``where`` keeps it out of values and gradients, and the
    exact zeros make exp(0) - 1 = 0 there, so sums over padding add nothing.
    """
    return torch.where(m, logprobs - base, 0.0)


def clamp_counted(raw: Tensor, bound: float) -> tuple[Tensor, Tensor]:
    """``clamp(raw, -bound, bound)`` and the number of clamped tokens per row [N] (no gradient)."""
    clamped = raw.detach().abs().gt_(bound).sum(1, dtype=raw.dtype)  # [N]
    return raw.clamp(-bound, bound), clamped


def kl_estimate_sum(raw: Tensor, d: Tensor | None, kind: str) -> Tensor:
    """Per-row sum of the KL(pi_old || pi_theta) estimator (tokens sampled from pi_old). [N, T] -> [N].

    With ``raw = log rho = logp - old_logp`` and ``d`` its clamp: ``k1 = old - new = -raw``;
    ``k3 = rho - 1 - log rho`` (the low-variance estimator; exponent clamped).
    """
    return -raw.sum(1) if kind == "k1" else (torch.expm1(d) - d).sum(1)


def masked_sum(x: Tensor, m: Tensor) -> Tensor:
    """Per-row sum of ``x`` over the valid tokens ``m``."""
    return torch.where(m, x, 0.0).sum(1)  # [N, T] -> [N]


# ----------------------------------------------------------------------------------------------------------------------
# Group helpers: pure functions of per-rollout vectors and a dense question index.


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense question index [N] in 0..Q-1 (order of the sorted distinct ids) and Q."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(uniq.numel())


def _rollout_weights(values: Tensor, select: Tensor, weights: Tensor | None) -> Tensor:
    """[N] weight of each rollout inside a selection: w_i on selected rows, 0 elsewhere."""
    ones = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    return torch.where(select, ones, 0.0)


def weighted_group_mean(
    values: Tensor, index: Tensor, num_groups: int, select: Tensor, weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Self-normalised weighted mean per group over the selected rows.

    ``mean_q = sum_{i in q, select_i} w_i v_i / sum_{i in q, select_i} w_i`` (0 where that weight sum is 0).

    Args:
        values: [N] per-rollout values.
        index: [N] dense group index (:func:`group_index`).
        num_groups: Q.
        select: [N] bool, the rows that take part (e.g. the positives).
        weights: [N] rollout weights, or None for all 1.

    Returns:
        ``(mean [Q], weight_sum [Q])``.
    """
    w = _rollout_weights(values, select, weights)  # [N]
    num = values.new_zeros(num_groups).index_add(0, index, w * torch.where(select, values, 0.0))  # [Q]
    den = values.new_zeros(num_groups).index_add(0, index, w)  # [Q]
    has = den > 0
    return torch.where(has, num / torch.where(has, den, 1.0), 0.0), den


def weighted_group_logmeanexp(
    values: Tensor, index: Tensor, num_groups: int, select: Tensor, weights: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Weighted log-mean-exp per group over the selected rows, with max subtraction.

    ``lme_q = log(sum_{i in q, select_i} w_i exp(v_i) / sum_{i in q, select_i} w_i)`` (0 where the weight sum
    is 0). With all weights 1 this is ``logsumexp - log(count)``.

    Args:
        values: [N] per-rollout values.
        index: [N] dense group index (:func:`group_index`).
        num_groups: Q.
        select: [N] bool, the rows that take part (e.g. the negatives).
        weights: [N] rollout weights, or None for all 1.

    Returns:
        ``(lme [Q], weight_sum [Q])``.
    """
    w = _rollout_weights(values, select, weights)  # [N]
    live = w > 0
    # The max over rows that carry weight keeps exp() in range; it is a constant shift (no gradient needed).
    peak = values.new_full((num_groups,), -math.inf)
    peak = peak.scatter_reduce(0, index, torch.where(live, values.detach(), -math.inf), "amax")  # [Q]
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    shifted = torch.where(live, values - peak[index], 0.0)  # [N]
    total = values.new_zeros(num_groups).index_add(0, index, w * torch.exp(shifted))  # [Q]
    den = values.new_zeros(num_groups).index_add(0, index, w)  # [Q]
    has = den > 0
    lme = peak + torch.log(torch.where(has, total, 1.0)) - torch.log(torch.where(has, den, 1.0))
    return torch.where(has, lme, 0.0), den


def question_divisor(kind: str, num_groups: int, valid: Tensor) -> Tensor | int:
    """Q (``all``) or the number of questions with a positive and a negative (``valid``, at least 1)."""
    return num_groups if kind == "all" else valid.sum().clamp(min=1)


def group_metrics(
    index: Tensor,
    num_groups: int,
    rewards: Tensor,
    pos: Tensor,
    pos_score: Tensor,
    neg_score: Tensor,
) -> dict[str, Tensor | float]:
    """Question-level counts and score summaries (detached)."""
    with torch.no_grad():
        count = torch.bincount(index, minlength=num_groups).to(rewards.dtype)  # [Q]
        n_pos = rewards.new_zeros(num_groups).index_add(0, index, pos.to(rewards.dtype))  # [Q]
        r_max = rewards.new_full((num_groups,), -math.inf).scatter_reduce(0, index, rewards, "amax")
        r_min = rewards.new_full((num_groups,), math.inf).scatter_reduce(0, index, rewards, "amin")
        no_pos = (n_pos == 0).sum()
        no_neg = (n_pos == count).sum()
        neg = ~pos
        return {
            "questions": float(num_groups),
            "no_positive": no_pos,
            "no_negative": no_neg,
            "no_positive_share": no_pos / num_groups,
            "no_negative_share": no_neg / num_groups,
            "zero_variance_share": (r_max == r_min).sum() / num_groups,
            "p_mean": (n_pos / count).mean(),
            # 0 when the mini-batch has no positive (no negative) rollout.
            "score_pos_mean": torch.where(pos, pos_score, 0.0).sum() / pos.sum().clamp(min=1),
            "score_neg_mean": torch.where(neg, neg_score, 0.0).sum() / neg.sum().clamp(min=1),
        }


# GRPO's advantage normaliser: A = (r - mean) / (std + ADV_EPS).
ADV_EPS = 1e-6


def group_advantage(rewards: Tensor, index: Tensor, num_groups: int, *, normalise: bool) -> Tensor:
    """Group-relative advantage [N]: r - mean_q r, divided by (population std_q r + ADV_EPS) if ``normalise``."""
    count = torch.bincount(index, minlength=num_groups).to(rewards.dtype)  # [Q]
    mean = rewards.new_zeros(num_groups).index_add(0, index, rewards) / count  # [Q]
    centred = rewards - mean[index]  # [N]
    if not normalise:
        return centred
    std = (rewards.new_zeros(num_groups).index_add(0, index, centred**2) / count).sqrt()  # [Q]
    return centred / (std[index] + ADV_EPS)


def weights_or_ones(n: Tensor, weights: Tensor | None) -> Tensor:
    """The rollout weights, or ones like ``n`` where there are none."""
    return torch.ones_like(n) if weights is None else weights
