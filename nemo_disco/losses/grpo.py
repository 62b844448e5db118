"""The GRPO family: GRPO, GRPO_RW, Dr. GRPO, DAPO and GRPO-ER on PPO-clipped ratio statistics."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from nemo_disco.losses.base import Hyper, from_run, question_coupled, rollout_coupled
from nemo_disco.losses.reduce import (
    clamp_counted,
    group_advantage,
    group_index,
    group_metrics,
    kl_estimate_sum,
    log_ratio,
    masked_sum,
    question_divisor,
    weighted_group_mean,
    weights_or_ones,
)
from nemo_disco.losses.registry import register_loss

# ----------------------------------------------------------------------------------------------------------------------
# GRPO family: clipped-ratio statistics.


class ClipParams(Hyper):
    """PPO-clipped GRPO family: clip range (clip_eps_high None = symmetric) and KL regulariser to a reference."""

    # PPO / GRPO clip range [1 - clip_eps, 1 + clip_eps_high] of the token ratio (the authors' verl clip_ratio 0.2).
    clip_eps: float = Field(0.2, gt=0, lt=1)
    clip_eps_high: float | None = Field(None, gt=0)
    # KL regulariser to a reference policy (the paper's baselines: 0.001); > 0 builds the reference policy.
    kl_coef: float = Field(0.0, ge=0)

    @property
    def needs_reference(self) -> bool:
        """The KL regulariser (kl_coef > 0) needs the reference policy's log-probs."""
        return self.kl_coef > 0


class GrpoRwParams(ClipParams):
    """GRPO_RW (eq. 6): the question average uses the same divisor switch as DisCO."""

    divisor: Literal["all", "valid"] = "all"


class DrGrpoParams(ClipParams):
    """Dr. GRPO: the constant token-sum normaliser (the generation's max response length)."""

    max_response_tokens: int = from_run("generation.max_response_tokens", 8192, ge=1)


class DapoParams(Hyper):
    """DAPO: clip-higher (eps_low 0.2, eps_high 0.28; DAPO paper §3.1), no KL term."""

    clip_eps: float = Field(0.2, gt=0, lt=1)
    clip_eps_high: float | None = Field(0.28, gt=0)


class GrpoErParams(ClipParams):
    """GRPO-ER: GRPO plus an entropy bonus."""

    # Entropy bonus coefficient (verl's default entropy_coeff); > 0, else the loss is GRPO's.
    entropy_coef: float = Field(1e-3, gt=0)


CLIP_STATS = ("pos_sum", "neg_sum", "tokens", "clip_high", "clip_low", "kl_sum", "clamped", "ref_kl_sum", "ref_clamped")


def clip_stats(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    p: ClipParams | DapoParams,
    *,
    with_entropy: bool = False,
) -> Tensor:
    """PPO-clipped statistics [N, 9] (+ ``entropy_sum`` when ``with_entropy``).

    With rho_t = exp(clamp(logp - old_logp, +-max_log_ratio)) and clip range [1 - eps_low, 1 + eps_high]:

    * ``pos_sum`` = sum_t min(rho, clip(rho)) = sum_t min(rho, 1 + eps_high): the token term of an A > 0
      rollout is A * min(rho, clip(rho)) (eq. 5, f+);
    * ``neg_sum`` = sum_t max(rho, clip(rho)) = sum_t max(rho, 1 - eps_low): for A < 0 the term is
      A * max(rho, clip(rho)) (eq. 5, f-). So min(rho A, clip(rho) A) is a function of these two sums;
    * ``tokens``; ``clip_high`` / ``clip_low``: tokens with rho above / below the range (clip-fraction metric);
    * ``kl_sum``: KL(pi_old || pi_theta) estimator (monitoring); ``clamped``: log-ratio clamps;
    * ``ref_kl_sum``: sum_t of k3(theta || ref) = exp(ref - logp) - (ref - logp) - 1 (GRPO's regulariser;
      0 without ``ref_logprobs``), ``ref_clamped``;
    * ``entropy_sum``: sum_t of the per-token entropy.
    """
    m = mask.bool()
    n = m.sum(1, dtype=logprobs.dtype)  # [N]
    lo = 1.0 - p.clip_eps
    hi = 1.0 + (p.clip_eps if p.clip_eps_high is None else p.clip_eps_high)
    raw = log_ratio(logprobs, old_logprobs, m)  # [N, T]
    d, clamped = clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    rho = torch.exp(d)  # [N, T]; exactly 1 on padding
    pos_sum = masked_sum(rho.clamp(max=hi), m)  # [N]
    neg_sum = masked_sum(rho.clamp(min=lo), m)  # [N]
    # Padding has rho = 1, inside (lo, hi): no mask needed for the counts.
    r = rho.detach()
    clip_high = (r > hi).sum(1, dtype=logprobs.dtype)  # [N]
    clip_low = (r < lo).sum(1, dtype=logprobs.dtype)  # [N]
    kl_sum = kl_estimate_sum(raw, d, p.kl)  # [N]
    if ref_logprobs is not None and p.needs_reference:
        dr, ref_clamped = clamp_counted(log_ratio(ref_logprobs, logprobs, m), p.max_log_ratio)  # log(ref / theta)
        ref_kl = (torch.expm1(dr) - dr).sum(1)  # [N]  (0 on padding: dr = 0 there)
    else:
        ref_kl, ref_clamped = torch.zeros_like(n), torch.zeros_like(n)
    cols = [pos_sum, neg_sum, n, clip_high, clip_low, kl_sum, clamped, ref_kl, ref_clamped]
    if with_entropy:
        cols.append(masked_sum(entropy, m))
    return torch.stack(cols, dim=1)  # [N, K]


def _clip_parts(
    stats: Tensor, rewards: Tensor, p: ClipParams | DapoParams
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Columns of :data:`CLIP_STATS` used by every GRPO-family objective."""
    u, v, n, hi, lo = stats[:, 0], stats[:, 1], stats[:, 2], stats[:, 3], stats[:, 4]
    return u, v, n, hi, lo, rewards > p.positive_threshold


def _clipped_sum(adv: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """sum_t min(rho_t A, clip(rho_t) A) per rollout [N]: A * pos_sum if A > 0, else A * neg_sum (0 at A = 0)."""
    return adv * torch.where(adv > 0, u, v)


def _clip_frac(adv: Tensor, hi: Tensor, lo: Tensor, n: Tensor) -> Tensor:
    """Share of valid tokens whose clipped term is the active one (no gradient).

    Those are tokens with rho > 1 + eps_high in A > 0 rollouts and rho < 1 - eps_low in A < 0 rollouts.
    """
    clipped = torch.where(adv > 0, hi, torch.where(adv < 0, lo, 0.0))
    return (clipped.sum() / n.sum().clamp(min=1)).detach()


def _regularised(
    J: Tensor,
    stats: Tensor,
    reg: Tensor,
    metrics: dict[str, Tensor | float],
    n: Tensor,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Return ``-J + reg`` and the GRPO-family metrics shared by every variant."""
    tokens = n.sum().clamp(min=1)
    metrics.update(
        objective=J.detach(),
        kl=(stats[:, 5].sum() / tokens).detach(),
        ref_kl=(stats[:, 7].sum() / tokens).detach(),
        constraint_active=0.0,
        penalty=reg.detach(),
        lratio_clamped=stats[:, 6].detach().sum(),
        ref_clamped=stats[:, 8].detach().sum(),
    )
    return -J + reg, metrics


@register_loss("grpo", params=ClipParams, stat_names=CLIP_STATS, stats=clip_stats, coupling=rollout_coupled)
def grpo_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: ClipParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """GRPO (§4, eq. 4-5): group-normalised advantage, PPO-clipped ratio surrogate.

    ``A_i = (r_i - mean_q r) / (std_q r + 1e-6)`` with the POPULATION std of the question's rewards;
    per token ``min(rho A, clip(rho, 1 - clip_eps, 1 + (clip_eps_high or clip_eps)) A)``.
    **Objective denominator**: token mean within each rollout, then mean over the N rollouts:
    ``J = (1/N) sum_i w_i sum_t min(...) / n_i``. **Regulariser denominator**: the same, on
    ``kl_coef * k3(theta || ref)`` per token (off at kl_coef 0). Loss = -J + reg. Rollout weights w_i
    multiply each rollout's loss (1 when None).
    """
    u, v, n, hi, lo, pos = _clip_parts(stats, rewards, p)
    inv, Q = group_index(group_ids)
    adv = group_advantage(rewards, inv, Q, normalise=True)  # [N]
    w = weights_or_ones(n, weights)
    N = stats.shape[0]
    J = (w * _clipped_sum(adv, u, v) / n.clamp(min=1)).sum() / N
    reg = p.kl_coef * (w * stats[:, 7] / n.clamp(min=1)).sum() / N
    metrics = group_metrics(inv, Q, rewards, pos, (u / n.clamp(min=1)).detach(), (v / n.clamp(min=1)).detach())
    metrics["clip_frac"] = _clip_frac(adv, hi, lo, n)
    return _regularised(J, stats, reg, metrics, n)


@register_loss("grpo_rw", params=GrpoRwParams, stat_names=CLIP_STATS, stats=clip_stats, coupling=question_coupled)
def grpo_rw_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: GrpoRwParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """GRPO_RW (eq. 6): GRPO with the question weight sqrt(p(1 - p)) removed.

    ``term_q = mean_w_{i in P_q} f+(o_i) - mean_w_{j in N_q} f-(o_j)`` with f+ = token mean of
    min(rho, clip(rho)) and f- = token mean of max(rho, clip(rho)) (eq. 5); questions without a positive
    or a negative add 0. **Objective denominator**: Q (``divisor="all"``) or the questions with both
    (``"valid"``), like DisCO. **Regulariser**: as GRPO (token mean per rollout, mean over N).
    """
    u, v, n, hi, lo, pos = _clip_parts(stats, rewards, p)
    inv, Q = group_index(group_ids)
    f_pos, f_neg = u / n.clamp(min=1), v / n.clamp(min=1)  # [N]
    mean_pos, w_pos = weighted_group_mean(f_pos, inv, Q, pos, weights)  # [Q]
    mean_neg, w_neg = weighted_group_mean(f_neg, inv, Q, ~pos, weights)  # [Q]
    valid = (w_pos > 0) & (w_neg > 0)  # [Q]
    J = torch.where(valid, mean_pos - mean_neg, 0.0).sum() / question_divisor(p.divisor, Q, valid)
    reg = p.kl_coef * (weights_or_ones(n, weights) * stats[:, 7] / n.clamp(min=1)).sum() / stats.shape[0]
    metrics = group_metrics(inv, Q, rewards, pos, f_pos.detach(), f_neg.detach())
    # Positives take the min (clipped above), negatives the max (clipped below), in questions that count.
    sign = torch.where(valid[inv], torch.where(pos, 1.0, -1.0), 0.0).to(stats.dtype)
    metrics["clip_frac"] = _clip_frac(sign, hi, lo, n)
    return _regularised(J, stats, reg, metrics, n)


@register_loss("dr_grpo", params=DrGrpoParams, stat_names=CLIP_STATS, stats=clip_stats, coupling=rollout_coupled)
def dr_grpo_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: DrGrpoParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Dr. GRPO (app. B.3): advantage ``r_i - mean_q r`` (no std), no per-rollout length normalisation.

    **Objective denominator**: each rollout's token SUM of min(rho A, clip(rho) A) is divided by the
    constant ``max_response_tokens``, then mean over the N rollouts. **Regulariser**: ``kl_coef * k3``
    aggregated the same way (token sum / max_response_tokens, mean over N).
    """
    u, v, n, hi, lo, pos = _clip_parts(stats, rewards, p)
    inv, Q = group_index(group_ids)
    adv = group_advantage(rewards, inv, Q, normalise=False)  # [N]
    w = weights_or_ones(n, weights)
    N, L = stats.shape[0], float(p.max_response_tokens)
    J = (w * _clipped_sum(adv, u, v)).sum() / (N * L)
    reg = p.kl_coef * (w * stats[:, 7]).sum() / (N * L)
    metrics = group_metrics(inv, Q, rewards, pos, (u / n.clamp(min=1)).detach(), (v / n.clamp(min=1)).detach())
    metrics["clip_frac"] = _clip_frac(adv, hi, lo, n)
    return _regularised(J, stats, reg, metrics, n)


@register_loss("dapo", params=DapoParams, stat_names=CLIP_STATS, stats=clip_stats, coupling=rollout_coupled)
def dapo_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: DapoParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """DAPO (token-level policy gradient with clip-higher): GRPO's normalised advantage (population std).

    **Objective denominator**: token level, ``J = sum_i w_i sum_t min(rho A, clip(rho) A) / sum_i n_i`` over
    all valid tokens of the mini-batch (each token of rollout i weighted by w_i; the denominator is the
    unweighted token count). No KL term. Dynamic sampling and overlong shaping are trainer-side.
    """
    u, v, n, hi, lo, pos = _clip_parts(stats, rewards, p)
    inv, Q = group_index(group_ids)
    adv = group_advantage(rewards, inv, Q, normalise=True)  # [N]
    J = (weights_or_ones(n, weights) * _clipped_sum(adv, u, v)).sum() / n.sum().clamp(min=1)
    metrics = group_metrics(inv, Q, rewards, pos, (u / n.clamp(min=1)).detach(), (v / n.clamp(min=1)).detach())
    metrics["clip_frac"] = _clip_frac(adv, hi, lo, n)
    return _regularised(J, stats, J.new_zeros(()), metrics, n)


def clip_stats_with_entropy(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    p: GrpoErParams,
) -> Tensor:
    """:func:`clip_stats` plus ``entropy_sum`` (GRPO-ER)."""
    return clip_stats(logprobs, old_logprobs, mask, entropy, ref_logprobs, p, with_entropy=True)


@register_loss(
    "grpo_er",
    params=GrpoErParams,
    stat_names=(*CLIP_STATS, "entropy_sum"),
    stats=clip_stats_with_entropy,
    coupling=rollout_coupled,
    needs_entropy=True,
)
def grpo_er_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: GrpoErParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """GRPO-ER: GRPO plus an entropy bonus.

    As :func:`grpo_objective`, then ``loss -= entropy_coef * H`` with H the token mean of the policy's
    per-token entropy over all valid tokens of the mini-batch (**denominator** sum_i n_i; unweighted).
    """
    loss, metrics = grpo_objective(stats[:, : len(CLIP_STATS)], group_ids, rewards, weights, p)
    H = stats[:, len(CLIP_STATS)].sum() / stats[:, 2].sum().clamp(min=1)
    metrics["entropy"] = H.detach()
    return loss - p.entropy_coef * H, metrics
