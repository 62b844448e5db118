"""TRPA: pairwise preferences on log-ratios to the reference, a trust-region KL to pi_old."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from nemo_disco.losses.base import Hyper, question_coupled
from nemo_disco.losses.reduce import (
    clamp_counted,
    group_index,
    group_metrics,
    kl_estimate_sum,
    log_ratio,
    weights_or_ones,
)
from nemo_disco.losses.registry import register_loss

# ----------------------------------------------------------------------------------------------------------------------
# TRPA: pairwise preference term on log-ratios to the reference, trust-region KL to pi_old.


class TrpaParams(Hyper):
    """TRPA (arXiv 2504.04524): preference-term beta, KTPO anisotropy, trust-region KL coefficient (authors' script)."""

    # Values of the authors' main_TRPA.sh: preference-term beta, KTPO factor on beta for pairs won by a correct
    # rollout, trust-region KL(pi_old, pi_theta) coefficient (tr_kl_loss_coef).
    trpa_beta: float = Field(0.1, gt=0)
    trpa_anisotropy: float = Field(2.5, gt=0)
    tr_kl_coef: float = Field(1e-3, ge=0)

    @property
    def needs_reference(self) -> bool:
        """The preference term is a log-ratio to the reference policy: always."""
        return True


TRPA_STATS = ("ref_log_ratio", "tr_kl_sum", "tokens", "kl_sum", "clamped")


def trpa_stats(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    p: TrpaParams,
) -> Tensor:
    """TRPA statistics [N, 5].

    * ``ref_log_ratio`` h_i = mean over the rollout's tokens of log pi_theta - log pi_ref (0 without tokens);
    * ``tr_kl_sum``: sum_t of the trust-region term k3 = exp(x) - x - 1 with x = log pi_old - log pi_theta
      (exponent clamped at +-``max_log_ratio``);
    * ``tokens`` n_i; ``kl_sum``: the monitored KL(pi_old || pi_theta) estimator (``kl``); ``clamped``: clamps.
    """
    if ref_logprobs is None:
        raise ValueError("trpa needs ref_logprobs=[N, T]")
    m = mask.bool()
    n = m.sum(1, dtype=logprobs.dtype)  # [N]
    h = log_ratio(logprobs, ref_logprobs, m).sum(1) / n.clamp(min=1)  # [N]
    raw = log_ratio(logprobs, old_logprobs, m)  # [N, T]  log(theta / old)
    d, clamped = clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    tr_kl = (torch.expm1(-d) + d).sum(1)  # [N]  k3 with x = -d = log(old / theta); 0 on padding
    return torch.stack([h, tr_kl, n, kl_estimate_sum(raw, d, p.kl), clamped], dim=1)  # [N, 5]


@register_loss("trpa", params=TrpaParams, stat_names=TRPA_STATS, stats=trpa_stats, coupling=question_coupled)
def trpa_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: TrpaParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """TRPA (Su et al., arXiv 2504.04524): pairwise preferences on log-ratios to pi_ref, a trust region to pi_old.

    Rule-based preference levels rank a question's rollouts; every better / worse pair is a preference.

    The paper's own text could not be read while writing this: the form below is the authors' code (GitHub
    XueruiSu/Trust-Region-Preference-Approximation: ``verl/trainer/ppo/core_algos.py``
    ``compute_pairwise_policy_loss``, ``verl/workers/actor/dp_actor.py``, ``main_TRPA.sh``) checked against
    published summaries of the paper (``-E_{(x, y1, y2) ~ D_old} log sigmoid(beta(y1) log pi_theta(y1|x) /
    pi_ref(y1|x) - ...)`` plus a KL trust region to pi_theta_old); no equation numbers are cited for that reason.

    * **Preference levels** (paper: 1 correct answer, 2 wrong answer, 3 empty answer, 4 format error; the code's
      math rules in ``math_reward_pl.py``). Here a rollout's level is the rank of its reward within its
      question: with {0, 1} (or {-1, +1}) rewards two levels, correct > incorrect. Levels 3-4 need the grader to
      report format checks, which do not reach the loss; rewards that encode them (e.g. 1 / 0 / -0.5 / -1) work
      unchanged.
    * **Pairs**: every (winner w, loser l) of the same question with ``r_w > r_l``. With
      ``h_i`` = token mean of log pi_theta - log pi_ref and ``beta_w = trpa_beta * trpa_anisotropy`` when the
      winner is level 1 (``r_w > positive_threshold``; KTPO), ``trpa_beta`` otherwise:
      ``J = sum_pairs w_w w_l log sigmoid(beta_w (h_w - h_l)) / P``. **Denominator**: P, the number of pairs of
      the whole mini-batch (questions pooled, unweighted); no pair -> J = 0 (logged ``pairs``).
    * **Trust region**: ``tr_kl_coef * K_tr`` with K_tr the token mean over all valid tokens of the mini-batch of
      ``exp(x) - x - 1``, ``x = log pi_old - log pi_theta`` (the code's ``low_var_kl`` against the old
      log-probs; unweighted). Loss = ``-J + tr_kl_coef * K_tr``.

    Departures from the authors' code: the pairs and both means are those of the mini-batch (the code pairs and
    averages within each micro-batch, so pairs split across micro-batches are dropped); a mini-batch without
    pairs adds 0 (the code falls back to ``-mean log sigmoid(+-h_i)``, + for level 1); the k3 exponent is clamped
    at ``max_log_ratio`` (the code clamps the k3 value at 10); the code's ``use_sqrt_trkl`` variant (off in its
    script) is not offered. The code also computes a KL to the reference (``kl_loss_coef`` 0.001) but, with the
    TRPA loss on, only logs it: it is not part of this loss either. Whether the paper's h is the token mean (the
    code) or the sequence log-ratio (the summaries' notation) is not settled here.
    """
    h, tr_kl, n = stats[:, 0], stats[:, 1], stats[:, 2]  # [N]
    inv, Q = group_index(group_ids)
    pos = rewards > p.positive_threshold  # [N]
    better = (inv[:, None] == inv[None, :]) & (rewards[:, None] > rewards[None, :])  # [N, N]: row beats column
    beta_w = torch.where(pos, h.new_tensor(p.trpa_beta * p.trpa_anisotropy), h.new_tensor(p.trpa_beta))  # [N]
    z = beta_w[:, None] * (h[:, None] - h[None, :])  # [N, N]
    w = weights_or_ones(n, weights)
    pair_w = w[:, None] * w[None, :]  # [N, N]
    P = better.sum()
    J = torch.where(better, pair_w * torch.nn.functional.logsigmoid(z), 0.0).sum() / P.clamp(min=1)
    tokens = n.sum().clamp(min=1)
    K_tr = tr_kl.sum() / tokens
    penalty = p.tr_kl_coef * K_tr
    metrics = group_metrics(inv, Q, rewards, pos, h.detach(), h.detach())
    with torch.no_grad():
        ordered = torch.where(better, (z > 0).to(h.dtype), 0.0).sum()
    metrics.update(
        objective=J.detach(),
        kl=(stats[:, 3].sum() / tokens).detach(),
        tr_kl=K_tr.detach(),
        constraint_active=0.0,
        penalty=penalty.detach(),
        lratio_clamped=stats[:, 4].detach().sum(),
        pairs=P.to(h.dtype),
        pair_accuracy=ordered / P.clamp(min=1),
    )
    return -J + penalty, metrics
