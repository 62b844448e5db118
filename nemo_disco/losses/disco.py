"""The DisCO family: DisCO (DRO log-mean-exp), DisCO-b, DRPO, their score statistics and the KL hinge constraint."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from nemo_disco.losses.base import Hyper, constrained_coupling, from_run
from nemo_disco.losses.reduce import (
    clamp_counted,
    group_index,
    group_metrics,
    kl_estimate_sum,
    log_ratio,
    masked_sum,
    question_divisor,
    weighted_group_logmeanexp,
    weighted_group_mean,
)
from nemo_disco.losses.registry import register_loss

# ----------------------------------------------------------------------------------------------------------------------
# DisCO / DisCO-b: score statistics.


class DiscobParams(Hyper):
    """DisCO-b (eq. 7-8): score, KL constraint (eq. 9), compat switch, divisor."""

    # logl: mean token log-prob; lratio: mean token pi_theta / pi_old (paper §5.1).
    score: Literal["logl", "lratio"] = "logl"
    # KL trust-region threshold and squared-hinge penalty coefficient (paper §6, the authors' script).
    delta: float = Field(1e-4, ge=0)
    beta: float = Field(1e3, ge=0)
    # true: the authors' code (half the constraint gradient, log-sum-exp; docs/departures.md).
    official_compat: bool = False
    # Questions in the objective's denominator: all of the mini-batch (the authors' code) or only those with a
    # positive and a negative rollout.
    divisor: Literal["all", "valid"] = "all"


class DiscoParams(DiscobParams):
    """DisCO (eq. 10-11): DisCO-b's parameters and the DRO temperature."""

    # DRO temperature: 10 for logl, 1 for lratio (paper §6, the authors' script).
    tau: float = Field(10.0, gt=0)


class DrpoParams(DiscoParams):
    """DRPO: DisCO with positives weighted by ``exp((1 - L / max_response_tokens) / drpo_lambda)``, L their length."""

    # Temperature lambda of the positives' length weights (smaller: a stronger preference for short correct ones;
    # the authors' run_drpo_1.5b_8k.sh Lambda).
    drpo_lambda: float = Field(0.1, gt=0)
    max_response_tokens: int = from_run("generation.max_response_tokens", 8192, ge=1)


SCORE_STATS = ("score", "kl_sum", "tokens", "clamped")


def score_stats(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    p: DiscoParams | DiscobParams,
) -> Tensor:
    """DisCO statistics [N, 4]: ``score``, ``kl_sum``, ``tokens``, ``clamped``.

    * ``score`` s_i (§5.1): ``logl`` = mean over the rollout's tokens of log pi_theta; ``lratio`` = mean of
      pi_theta / pi_old = exp(clamp(logp - old_logp, +-max_log_ratio)). A rollout without tokens scores 0.
    * ``kl_sum``: sum over its tokens of the KL(pi_old || pi_theta) estimator (``kl``: k1 or k3).
    * ``tokens`` n_i (constant) and ``clamped`` (tokens whose log-ratio hit the clamp; no gradient).
    """
    m = mask.bool()
    n = m.sum(1, dtype=logprobs.dtype)  # [N]
    raw = log_ratio(logprobs, old_logprobs, m)  # [N, T]
    d, clamped = (None, torch.zeros_like(n))
    if p.score == "lratio" or p.kl == "k3":
        d, clamped = clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    if p.score == "logl":
        total = masked_sum(logprobs, m)  # [N]
    else:
        total = torch.expm1(d).sum(1) + n  # sum_t exp(d) over valid tokens (padding: expm1(0) = 0)
    score = total / n.clamp(min=1)  # [N]
    return torch.stack([score, kl_estimate_sum(raw, d, p.kl), n, clamped], dim=1)  # [N, 4]


def _kl_constraint(kl_sum: Tensor, tokens: Tensor, p: DiscoParams | DiscobParams) -> tuple[Tensor, Tensor]:
    """K = token mean of the KL estimator over all valid tokens of the mini-batch, and its penalty.

    Paper (eq. 9, alg. 1): ``beta * [K - delta]_+^2`` (gradient ``2 beta [K - delta]_+ dK``). Authors' code
    (``official_compat``): ``sg(max(beta (K - delta), 0)) * K`` (gradient ``beta [K - delta]_+ dK``; value as
    the code computes it).
    """
    K = kl_sum.sum() / tokens.sum().clamp(min=1)
    if p.official_compat:
        return K, (p.beta * (K - p.delta)).clamp(min=0).detach() * K
    return K, p.beta * (K - p.delta).clamp(min=0) ** 2


def _constrained(
    J: Tensor, stats: Tensor, p: DiscoParams | DiscobParams, metrics: dict[str, Tensor | float]
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Return ``-J + penalty`` and the constraint metrics."""
    K, penalty = _kl_constraint(stats[:, 1], stats[:, 2], p)
    loss = -J + penalty
    metrics.update(
        objective=J.detach(),
        kl=K.detach(),
        constraint_active=(K.detach() > p.delta).to(stats.dtype),
        penalty=penalty.detach(),
        lratio_clamped=stats[:, 3].detach().sum(),
    )
    return loss, metrics


@register_loss("disco", params=DiscoParams, stat_names=SCORE_STATS, stats=score_stats, coupling=constrained_coupling)
def disco_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: DiscoParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """DisCO (eq. 10-11, alg. 1): DRO objective J_2 under the KL constraint.

    Per question q with positives P_q and negatives N_q (w = rollout weights, 1 when None; each mean is
    self-normalised)::

        term_q = mean_w_{i in P_q} s_i - tau * log( sum_{j in N_q} w_j exp(s_j / tau) / sum_{j in N_q} w_j )

    (= the mean over positives of ``-tau log mean_neg exp((s_j - s_i) / tau)``). Questions without a
    positive or a negative add 0. **Objective denominator**: J = sum_q term_q / Q with Q all questions of the
    mini-batch (``divisor="all"``) or those with both (``"valid"``). **Constraint denominator**: K is the token
    mean over all valid tokens of the mini-batch (unweighted). Loss = -J + beta [K - delta]_+^2.

    ``official_compat=True`` (authors' code): log-SUM-exp over negatives (J lower by
    ``tau log |N_q| / divisor`` per valid question, same gradient; with weights, the weighted log-mean-exp plus
    ``log |N_q|``) and the penalty ``sg(max(beta (K - delta), 0)) K`` (half the paper's gradient; the value is
    the code's). The authors' code logs a surrogate of value ~1 for the DRO term; the objective here is the true
    log-sum-exp value.
    """
    score = stats[:, 0]  # [N]
    inv, Q = group_index(group_ids)
    pos = rewards > p.positive_threshold  # [N]
    mean_pos, w_pos = weighted_group_mean(score, inv, Q, pos, weights)  # [Q]
    lme_neg, w_neg = weighted_group_logmeanexp(score / p.tau, inv, Q, ~pos, weights)  # [Q]
    if p.official_compat:
        n_neg = score.new_zeros(Q).index_add(0, inv, (~pos).to(score.dtype))  # [Q]
        lme_neg = lme_neg + torch.log(n_neg.clamp(min=1))
    valid = (w_pos > 0) & (w_neg > 0)  # [Q]
    term = torch.where(valid, mean_pos - p.tau * lme_neg, 0.0)  # [Q]  eq. 10
    J = term.sum() / question_divisor(p.divisor, Q, valid)
    metrics = group_metrics(inv, Q, rewards, pos, score.detach(), score.detach())
    return _constrained(J, stats, p, metrics)


@register_loss("discob", params=DiscobParams, stat_names=SCORE_STATS, stats=score_stats, coupling=constrained_coupling)
def discob_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: DiscobParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """DisCO-b (eq. 7-8): mean score of positives minus mean score of negatives, under the KL constraint.

    ``term_q = mean_w_{i in P_q} s_i - mean_w_{j in N_q} s_j`` (self-normalised weighted means; questions
    without a positive or a negative add 0). **Objective denominator**: Q (``divisor="all"``) or the
    questions with both (``"valid"``). **Constraint denominator**: token mean over all valid tokens of the
    mini-batch, as DisCO. ``official_compat=True`` changes only the penalty to the code's
    ``sg(max(beta (K - delta), 0)) K``.
    """
    score = stats[:, 0]  # [N]
    inv, Q = group_index(group_ids)
    pos = rewards > p.positive_threshold  # [N]
    mean_pos, w_pos = weighted_group_mean(score, inv, Q, pos, weights)  # [Q]
    mean_neg, w_neg = weighted_group_mean(score, inv, Q, ~pos, weights)  # [Q]
    valid = (w_pos > 0) & (w_neg > 0)  # [Q]
    term = torch.where(valid, mean_pos - mean_neg, 0.0)  # [Q]  eq. 7
    J = term.sum() / question_divisor(p.divisor, Q, valid)
    metrics = group_metrics(inv, Q, rewards, pos, score.detach(), score.detach())
    return _constrained(J, stats, p, metrics)


def _length_log_weights(tokens: Tensor, index: Tensor, num_groups: int, select: Tensor, p: DrpoParams) -> Tensor:
    """DRPO's log length weights ``(1 - L_i / L_max) / lambda`` shifted by their largest in the question. [N] -> [N].

    ``L_i`` = ``tokens`` (the response length), ``L_max`` = ``max_response_tokens``. Only ratios within a question
    matter (the weights are normalised over its positives), so the shift by the largest log weight among the selected
    rows of each question keeps exp() in range for any lambda; unselected rows get 0.
    """
    log_w = (1.0 - tokens / p.max_response_tokens) / p.drpo_lambda  # [N]
    peak = log_w.new_full((num_groups,), -math.inf)
    peak = peak.scatter_reduce(0, index, torch.where(select, log_w, -math.inf), "amax")  # [Q]
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    return torch.where(select, log_w - peak[index], 0.0)  # [N]


@register_loss("drpo", params=DrpoParams, stat_names=SCORE_STATS, stats=score_stats, coupling=constrained_coupling)
def drpo_objective(
    stats: Tensor, group_ids: Tensor, rewards: Tensor, weights: Tensor | None, p: DrpoParams
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """DRPO: DisCO's DRO term with the positives weighted towards short responses, under the KL constraint.

    Per question q with positives P_q and negatives N_q (w = rollout weights, 1 when None; L_i the response length
    in tokens, L_max = ``max_response_tokens``, lambda = ``drpo_lambda``)::

        u_i    = w_i exp((1 - L_i / L_max) / lambda)                                        (i in P_q)
        term_q = sum_{i in P_q} u_i s_i / sum_{i in P_q} u_i
                 - tau * log( sum_{j in N_q} w_j exp(s_j / tau) / sum_{j in N_q} w_j )

    i.e. the u-weighted mean over positives of ``s_i - tau log mean_w_{j in N_q} exp(s_j / tau)`` (the DRO term
    does not depend on i). As lambda grows, u_i -> w_i and DRPO becomes DisCO. Questions without a positive or a
    negative add 0. **Objective denominator**: J = sum_q term_q / Q with Q all questions of the mini-batch
    (``divisor="all"``, the authors' code) or those with both (``"valid"``). **Constraint denominator**: K is
    the token mean over all valid tokens of the mini-batch (unweighted). Loss = -J + beta [K - delta]_+^2.

    ``official_compat=True``: as DisCO's (log-SUM-exp over negatives, the code's penalty). Departures from the
    authors' ``compute_policy_loss_drpo`` beyond DisCO's: ``L_max`` is ``max_response_tokens`` (the code divides
    by the padded width of the response tensor, which in their verl equals the response budget
    ``data.max_response_length``; here the weight never depends on how a micro-batch is padded); the length
    weights are shifted by their largest per question before exp() (the same normalised weights, finite for any
    lambda); groups of any size (the code reshapes to equal-sized groups); the score of a response without tokens
    is 0 (the code divides by zero). The rollout weights multiply the length weights (the code has none).
    """
    score, tokens = stats[:, 0], stats[:, 2].detach()  # [N], [N]
    inv, Q = group_index(group_ids)
    pos = rewards > p.positive_threshold  # [N]
    w = torch.ones_like(score) if weights is None else weights
    length_w = torch.exp(_length_log_weights(tokens, inv, Q, pos, p))  # [N]; 1 for a question's shortest positive
    mean_pos, w_pos = weighted_group_mean(score, inv, Q, pos, w * length_w)  # [Q]
    lme_neg, w_neg = weighted_group_logmeanexp(score / p.tau, inv, Q, ~pos, weights)  # [Q]
    if p.official_compat:
        n_neg = score.new_zeros(Q).index_add(0, inv, (~pos).to(score.dtype))  # [Q]
        lme_neg = lme_neg + torch.log(n_neg.clamp(min=1))
    valid = (w_pos > 0) & (w_neg > 0)  # [Q]
    term = torch.where(valid, mean_pos - p.tau * lme_neg, 0.0)  # [Q]
    J = term.sum() / question_divisor(p.divisor, Q, valid)
    metrics = group_metrics(inv, Q, rewards, pos, score.detach(), score.detach())
    return _constrained(J, stats, p, metrics)
