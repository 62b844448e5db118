"""DisCO objectives (arXiv 2505.12366) and their baselines as pure tensor functions.

Every loss is split in two:

1. ``stats(logprobs, old_logprobs, mask, ...) -> [N, K]``: per-rollout statistics, each a function of
   that rollout's own tokens only (a token-mean score, a token-sum of per-token KL terms, the token
   count, clipped-token counts). They never depend on the padding width T, so micro-batches of any
   width give the same rows; constant normalisers (Dr. GRPO's max response length) are
   hyper-parameters.
2. ``objective(stats [N, K], group_ids, rewards, ...) -> (loss, metrics)``: any (nonlinear) function
   of the statistics of the whole mini-batch: grouping by question, the DRO log-mean-exp, the KL
   constraint, every denominator.

This makes the mini-batch gradient exact for any micro-batching and data-parallel layout. By the
chain rule ``dL/dtheta = sum_i sum_k (dL/dstats[i, k]) * dstats[i, k]/dtheta``, so the trainer

* pass 1: computes the stats of the whole mini-batch without grad (all-gathered over data-parallel ranks),
* calls :func:`coefficients` once: ``c = dL/dstats`` by autograd on that small [N, K] tensor,
* pass 2: backwards ``surrogate(c[rows], stats(micro-batch))`` per micro-batch and SUMS the gradients
  over micro-batches and ranks (never averages).

Each loss declares how far its coefficients reach (:meth:`Loss.coupling`: one rollout, one question, the whole
mini-batch); where that is no further than a question, one pass suffices for micro-batches of whole questions
(:mod:`nemo_disco.update` does both).

Losses are minimised: ``loss = -objective + penalty (+ regularisers)``. Positives are rollouts with
``reward > positive_threshold`` (0.5 suits {0, 1} rewards, 0.0 suits {-1, +1}).

Denominators (Q = questions = distinct group ids of the mini-batch, N = rollouts, n_i = valid tokens
of rollout i, T_tot = sum_i n_i):

=========  ============================================  ====================================
loss       objective                                      constraint / regulariser
=========  ============================================  ====================================
disco      sum_q term_q / Q  (``divisor="valid"``: only   KL token mean over T_tot (eq. 9)
           questions with a positive AND a negative)
discob     same as disco                                  same as disco
drpo       same as disco (positives length-weighted)      same as disco
grpo       mean over N of the per-rollout token mean      kl_coef x mean over N of the token
                                                          mean of k3(theta || ref)
grpo_rw    sum_q term_q / Q, like disco                   same as grpo
dr_grpo    mean over N of token SUM / max_response_tokens same as grpo with the same aggregation
dapo       sum over all tokens / T_tot                    none
grpo_er    as grpo                                        as grpo, minus entropy_coef x entropy
                                                          token mean over T_tot
gpg        alpha x sum_q (sum_{i in q} A_i logp_sum_i     none; alpha = N / (N - M), M =
           / T_q) / Q, T_q = question q's tokens          rollouts of questions whose rewards
           (eq. 5, ``token_norm="question"``); or         are all equal (eq. 7-8)
           alpha sum_i A_i logp_sum_i / T_tot (batch)
trpa       sum over (winner, loser) pairs of log          tr_kl_coef x token mean over T_tot
           sigmoid(.) / P, P = pairs of the mini-batch    of k3(log pi_old - log pi_theta)
=========  ============================================  ====================================

Rollout correction (``weights`` [N], e.g. from :func:`rollout_weights`): in the DisCO family and GRPO_RW
every mean over a question's positives or negatives is a self-normalised weighted mean
(:func:`weighted_group_mean`, :func:`weighted_group_logmeanexp`; the DRO term becomes
``tau log(sum_j w_j exp(s_j / tau) / sum_j w_j)``); in GRPO, Dr. GRPO, DAPO and GPG each rollout's loss (each
token's, for DAPO) is multiplied by w_i, its KL regulariser included; in TRPA each pair's term by w_w w_l.
Denominators N, Q, T_q, T_tot and P stay unweighted, and so do DisCO's KL constraint, GRPO-ER's entropy bonus,
GPG's alpha and TRPA's trust-region term. ``weights=None`` means all 1.

Departures from the paper: questions with no positive or no negative add 0 (Algorithm 1 is undefined
for them) and, by default, still count in Q (as the authors' code does); the L-ratio exponent is
clamped at +-``max_log_ratio`` (counted in ``lratio_clamped``). Departures from the authors' code
(reference: their ``core_algos.py``), each reproducible with ``official_compat=True``: the constraint
gradient here is the paper's ``2 beta [K - delta]_+ dK`` (the code's is half), and the DRO term uses
log-MEAN-exp (the code: log-SUM-exp, a constant ``tau log |N_q|`` away). Unlike the code, the objective
is that of the whole mini-batch (the code groups and normalises per micro-batch), the logged objective
is its true value (the code logs a surrogate of value ~1), and positives are thresholded (the code needs
reward exactly 1 / 0).
"""

from nemo_disco.losses.base import (
    COUPLINGS,
    MINIBATCH,
    QUESTION,
    ROLLOUT,
    Hyper,
    Loss,
    coefficients,
    from_run,
    run_keys,
    surrogate,
    validation_message,
)
from nemo_disco.losses.correction import mismatch_metrics, rollout_weights
from nemo_disco.losses.disco import (
    SCORE_STATS,
    DiscobParams,
    DiscoParams,
    DrpoParams,
    disco_objective,
    discob_objective,
    drpo_objective,
    score_stats,
)
from nemo_disco.losses.gpg import GPG_STATS, GpgParams, gpg_objective, gpg_stats
from nemo_disco.losses.grpo import (
    CLIP_STATS,
    ClipParams,
    DapoParams,
    DrGrpoParams,
    GrpoErParams,
    GrpoRwParams,
    clip_stats,
    dapo_objective,
    dr_grpo_objective,
    grpo_er_objective,
    grpo_objective,
    grpo_rw_objective,
)
from nemo_disco.losses.reduce import ADV_EPS, group_index, weighted_group_logmeanexp, weighted_group_mean
from nemo_disco.losses.registry import LOSSES, find_loss, get_loss, load_loss, not_a_parameter, register_loss
from nemo_disco.losses.trpa import TRPA_STATS, TrpaParams, trpa_objective, trpa_stats

__all__ = [
    "ADV_EPS",
    "CLIP_STATS",
    "COUPLINGS",
    "GPG_STATS",
    "LOSSES",
    "MINIBATCH",
    "QUESTION",
    "ROLLOUT",
    "SCORE_STATS",
    "TRPA_STATS",
    "ClipParams",
    "DapoParams",
    "DiscoParams",
    "DiscobParams",
    "DrGrpoParams",
    "DrpoParams",
    "GpgParams",
    "GrpoErParams",
    "GrpoRwParams",
    "Hyper",
    "Loss",
    "TrpaParams",
    "clip_stats",
    "coefficients",
    "dapo_objective",
    "disco_objective",
    "discob_objective",
    "dr_grpo_objective",
    "drpo_objective",
    "find_loss",
    "from_run",
    "get_loss",
    "gpg_objective",
    "gpg_stats",
    "group_index",
    "grpo_er_objective",
    "grpo_objective",
    "grpo_rw_objective",
    "load_loss",
    "mismatch_metrics",
    "not_a_parameter",
    "register_loss",
    "rollout_weights",
    "run_keys",
    "score_stats",
    "surrogate",
    "trpa_objective",
    "trpa_stats",
    "validation_message",
    "weighted_group_logmeanexp",
    "weighted_group_mean",
]
