"""GPG: plain policy gradient on the summed token log-likelihood, alpha-corrected."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from nemo_disco.losses.base import Hyper, rollout_coupled
from nemo_disco.losses.reduce import (
    clamp_counted,
    group_advantage,
    group_index,
    group_metrics,
    kl_estimate_sum,
    log_ratio,
    masked_sum,
    weights_or_ones,
)
from nemo_disco.losses.registry import register_loss

# ----------------------------------------------------------------------------------------------------------------------
# GPG: plain policy gradient on the summed token log-likelihood.


class GpgParams(Hyper):
    """GPG (arXiv 2504.02546): F_norm (eq. 6), the correction alpha = B / (B - M) (eq. 7-8), eq. 5's normaliser."""

    # F_norm = the question's reward std instead of 1 (eq. 6; tab. 1 ablation).
    adv_std_norm: bool = False
    # Scale by alpha = B / (B - M), M = rollouts of questions whose rewards are all equal (eq. 7-8).
    alpha_correction: bool = True
    # Eq. 5's token normaliser: each question's own tokens, or all tokens of the mini-batch (the authors' trainer).
    token_norm: Literal["question", "batch"] = "question"


GPG_STATS = ("logp_sum", "tokens", "kl_sum", "clamped")


def gpg_stats(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    p: GpgParams,
) -> Tensor:
    """GPG statistics [N, 4]: ``logp_sum``, ``tokens``, ``kl_sum``, ``clamped``.

    ``logp_sum`` = sum_t log pi_theta over the rollout's tokens (the only column with gradient), ``tokens`` n_i,
    ``kl_sum`` the monitored KL(pi_old || pi_theta) estimator (``kl``), ``clamped`` its exponent clamps (k3).
    """
    m = mask.bool()
    n = m.sum(1, dtype=logprobs.dtype)  # [N]
    raw = log_ratio(logprobs, old_logprobs, m)  # [N, T]
    d, clamped = (None, torch.zeros_like(n))
    if p.kl == "k3":
        d, clamped = clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    logp_sum = masked_sum(logprobs, m)  # [N]
    return torch.stack([logp_sum, n, kl_estimate_sum(raw, d, p.kl), clamped], dim=1)  # [N, 4]


@register_loss("gpg", params=GpgParams, stat_names=GPG_STATS, stats=gpg_stats, coupling=rollout_coupled)
def gpg_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: GpgParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """GPG (Chu et al., arXiv 2504.02546 v4): the policy gradient with the group-mean baseline, alpha-corrected.

    The correction is for questions whose rollouts all get the same reward. No ratio, no clipping, no KL, no
    reference model.

    * Advantage (eq. 6): ``A_i = (r_i - mean_q r) / F_norm`` with ``F_norm = 1`` (the paper's final recipe, tab. 1)
      or, with ``adv_std_norm=True``, the question's population reward std + 1e-6 (tab. 1's ``F_norm = std``
      ablation; GRPO's normaliser).
    * Objective (eq. 5, maximised): ``J = E_q[sum_{i in q} A_i sum_t log pi_theta(o_i,t) / sum_{i in q} |o_i|]``.
      **Denominator** (``token_norm="question"``, eq. 5 as written): each question's own token count T_q, then
      the mean over the Q questions of the mini-batch; ``token_norm="batch"``: all valid tokens of the mini-batch
      T_tot (what the authors' trainer and verl's ``loss_mode: gpg`` with ``token-mean`` compute).
    * Correction (eq. 7-8, "accurate gradient estimation"): ``J <- alpha J`` with ``alpha = B / (B - M)``, B the
      rollouts of the mini-batch and M those in questions whose rewards are all equal (their A is 0, so the plain
      mean dilutes the gradient by (B - M) / B); alpha = 1 when every question has equal rewards (J is 0 then) or
      with ``alpha_correction=False`` (tab. 1's ``alpha = 1`` rows). Logged as ``alpha``.
    * Rollout weights w_i multiply each rollout's term; T_q, T_tot, Q, B and M stay unweighted.

    Where the authors' code differs (GitHub AMAP-ML/GPG, ``open-r1/src/open_r1/gpg_trainer.py``), the paper is
    followed: the code divides by the tokens of the (micro-)batch, not the question (``token_norm="batch"``); it
    counts B and M in questions over one generation batch (the same ratio for equal group sizes) where they are
    counted in rollouts over the mini-batch here. verl's ``compute_gpg_outcome_advantage`` uses
    ``alpha = B / (number of rollouts with a non-zero reward)``, which is not eq. 7 (for {0, 1} rewards it is
    B / #correct); not reproduced. The GPG repository's 1.5B recipe (``open-rs``) inherits TRL's defaults: std
    normalisation (+1e-4, sample std) and no alpha.

    Not part of this loss: the valid-share threshold beta_th of Alg. 1 (0.6 in tab. 1), which keeps sampling
    until (B - M) / B >= beta_th. It is a sampler rule: ``algorithm.dynamic_sampling=true`` with
    ``algorithm.min_valid_share=0.6`` (the GPG recipe; the authors' trainer counts zero-variance questions by
    reward std <= 1e-5, the sampler by having both a positive and a negative rollout, the same for {0, 1}
    rewards). Alg. 1 takes one update per batch: with several mini-batches per step the
    later updates use rollouts of pi_old != pi_theta without a ratio, as the paper's objective has none.
    """
    logp_sum, n = stats[:, 0], stats[:, 1]  # [N], [N]
    inv, Q = group_index(group_ids)
    pos = rewards > p.positive_threshold  # [N]
    adv = group_advantage(rewards, inv, Q, normalise=p.adv_std_norm)  # [N]
    w = weights_or_ones(n, weights)
    term = w * adv * logp_sum  # [N]
    if p.token_norm == "question":
        t_q = n.new_zeros(Q).index_add(0, inv, n)  # [Q]
        per_q = n.new_zeros(Q).index_add(0, inv, term) / t_q.clamp(min=1)  # [Q]
        J = per_q.sum() / Q
    else:
        J = term.sum() / n.sum().clamp(min=1)
    with torch.no_grad():
        r_max = rewards.new_full((Q,), -math.inf).scatter_reduce(0, inv, rewards, "amax")  # [Q]
        r_min = rewards.new_full((Q,), math.inf).scatter_reduce(0, inv, rewards, "amin")  # [Q]
        zero_var = (r_max == r_min)[inv]  # [N]
        B, M = stats.shape[0], int(zero_var.sum())
        alpha = B / (B - M) if M < B else 1.0
    if p.alpha_correction:
        J = alpha * J
    mean_logp = (logp_sum / n.clamp(min=1)).detach()
    metrics = group_metrics(inv, Q, rewards, pos, mean_logp, mean_logp)
    metrics.update(
        objective=J.detach(),
        kl=(stats[:, 2].sum() / n.sum().clamp(min=1)).detach(),
        constraint_active=0.0,
        penalty=0.0,
        lratio_clamped=stats[:, 3].detach().sum(),
        alpha=alpha if p.alpha_correction else 1.0,
        valid_share=(B - M) / B,
    )
    return -J, metrics
