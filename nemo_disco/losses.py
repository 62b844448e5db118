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

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

# GRPO's advantage normaliser: A = (r - mean) / (std + ADV_EPS).
ADV_EPS = 1e-6

# ----------------------------------------------------------------------------------------------------------------------
# Hyper-parameters: one frozen dataclass per loss family, defined beside its loss; its fields (each with its default
# and its check) are exactly the keyword arguments the loss takes. The run config leaves a value null to take these
# defaults (config.loss_kwargs); get_loss binds them once.


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _hp(default: Any, check: Callable[[Any], bool], want: str) -> Any:
    """A hyper-parameter field: its default and its check (``want`` says what a valid value is)."""
    return field(default=default, metadata={"check": check, "want": want})


def _positive(default: float) -> Any:
    return _hp(default, lambda v: _number(v) and v > 0, "> 0")


def _optional_positive(default: float | None) -> Any:
    return _hp(default, lambda v: v is None or (_number(v) and v > 0), "None or > 0")


def _non_negative(default: float) -> Any:
    return _hp(default, lambda v: _number(v) and v >= 0, ">= 0")


def _flag(default: bool) -> Any:
    return _hp(default, lambda v: isinstance(v, bool), "a bool")


def _choice(default: str, *options: str) -> Any:
    return _hp(default, lambda v: v in options, " or ".join(repr(o) for o in options))


@dataclass(frozen=True)
class _Hyper:
    """Hyper-parameters every loss takes."""

    positive_threshold: float = _hp(0.5, _number, "a finite number")
    # Estimator of KL(pi_old || pi_theta): the constraint of DisCO, a monitored metric for the GRPO family.
    kl: str = _choice("k1", "k1", "k3")
    max_log_ratio: float = _positive(20.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.metadata["check"](value):
                raise ValueError(f"{f.name}={value!r} must be {f.metadata['want']}")

    @property
    def needs_reference(self) -> bool:
        """Whether these settings need the reference policy's log-probs."""
        return False


# ----------------------------------------------------------------------------------------------------------------------
# Coupling: how far the coefficients c_i = dL/dstats_i of an objective reach (Loss.coupling).

ROLLOUT, QUESTION, MINIBATCH = "rollout", "question", "minibatch"
COUPLINGS = (ROLLOUT, QUESTION, MINIBATCH)


def _rollout_coupled(p: _Hyper, first_update: bool, weighted: bool) -> str:
    """Linear in each rollout's statistics with coefficients known in advance (GRPO family, DAPO, GPG).

    The advantages come from rewards, the clip is per token, the denominators (N, Q, T_q, T_tot, alpha) and
    the KL-to-reference and entropy terms are sums of per-rollout statistics; rollout i's weight is its own.
    """
    return ROLLOUT


def _question_coupled(p: _Hyper, first_update: bool, weighted: bool) -> str:
    """Nonlinear or weight-normalised within a question only (GRPO_RW's weighted means, TRPA's pairs).

    TRPA's trust region ``tr_kl_coef * sum_i tr_kl_i / T_tot`` is linear in the statistics: no coupling.
    """
    if weighted and getattr(p, "divisor", "all") == "valid":
        return MINIBATCH  # the divisor counts questions whose weights are > 0, over the whole mini-batch
    return QUESTION


def _constrained_coupling(p: DiscoParams | DiscobParams, first_update: bool, weighted: bool) -> str:
    """DisCO, DisCO-b: the DRO / mean terms couple one question; the KL hinge couples the whole mini-batch.

    The hinge ``beta [K - delta]_+^2`` (and the authors' ``sg(max(beta (K - delta), 0)) K``) and its gradient
    are exactly 0 where K = 0 <= delta, i.e. at the first update of a step (pi_theta = pi_old: every token's
    k1 ``old - new`` and k3 ``expm1(d) - d`` are 0), and everywhere with beta = 0.
    """
    if weighted and p.divisor == "valid":
        return MINIBATCH  # the divisor counts questions whose weights are > 0, over the whole mini-batch
    return QUESTION if first_update or p.beta == 0 else MINIBATCH


# ----------------------------------------------------------------------------------------------------------------------
# The Loss object, registry and the trainer-facing helpers.


@dataclass(frozen=True)
class Loss:
    """One objective: per-rollout statistics + a mini-batch objective of them.

    Attributes:
        name: registry key.
        stat_names: column order of the [N, K] statistics tensor.
        needs_entropy: ``stats`` needs the per-token entropy [N, T].
        needs_reference: ``stats`` needs the reference policy's log-probs [N, T]. For the GRPO family this
            depends on ``kl_coef``: :func:`get_loss` with hyper-parameters (or :meth:`bind`) resolves it.
        hparams: frozen dataclass whose fields (defaults and checks) are the hyper-parameters this loss takes.
        stats_fn: ``(logprobs, old_logprobs, mask, entropy, ref_logprobs, params) -> [N, K]``.
        objective_fn: ``(stats, group_ids, rewards, weights, params) -> (loss, metrics)``.
        coupling_fn: ``(params, first_update, weighted) -> ROLLOUT | QUESTION | MINIBATCH``: how far the
            coefficients ``c_i = dL/dstats_i`` reach (see :meth:`coupling`).
        bound: the hyper-parameters bound by :func:`get_loss` / :meth:`bind` (validated once); None: defaults.
            The methods use them; hyper-parameters passed to a method replace them for that call (validated).
    """

    name: str
    stat_names: tuple[str, ...]
    needs_entropy: bool
    needs_reference: bool
    hparams: type[_Hyper]
    stats_fn: Callable[..., Tensor]
    objective_fn: Callable[..., tuple[Tensor, dict[str, Tensor | float]]]
    coupling_fn: Callable[[Any, bool, bool], str]
    bound: _Hyper | None = None

    def params(self, **hp: Any) -> _Hyper:
        """Validate hyper-parameters into this loss's params dataclass.

        Raises:
            ValueError: one line naming the loss and the unknown or invalid key.
        """
        names = [f.name for f in fields(self.hparams)]
        unknown = sorted(set(hp) - set(names))
        if unknown:
            raise ValueError(f"loss {self.name!r} got unknown hyper-parameter(s) {unknown}; it takes {names}")
        try:
            return self.hparams(**hp)
        except ValueError as err:
            raise ValueError(f"loss {self.name!r}: {err}") from None

    def bind(self, **hp: Any) -> Loss:
        """This loss with these hyper-parameters validated and bound (``needs_reference`` resolved for them)."""
        p = self.params(**hp)
        return replace(self, needs_reference=self.needs_reference or p.needs_reference, bound=p)

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The bound hyper-parameters (defaults where none were bound), every one of them."""
        return asdict(self._resolve({}))

    def _resolve(self, hp: dict[str, Any]) -> _Hyper:
        """The bound hyper-parameters; with ``hp``, those replaced (validated: the trainer never passes any)."""
        if not hp:
            return self.bound if self.bound is not None else self.params()
        return self.params(**({**asdict(self.bound), **hp} if self.bound is not None else hp))

    def coupling(self, *, first_update: bool, weighted: bool, **hp: Any) -> str:
        """How far this objective couples rollouts, for these hyper-parameters: the rows ``c_i = dL/dstats_i`` reads.

        * ``ROLLOUT``: ``c_i`` depends on rollout i's own statistics only (and on what is known before any
          forward: group ids, rewards, token counts, its own weight);
        * ``QUESTION``: on the statistics and weights of rollout i's question;
        * ``MINIBATCH``: on the statistics of the whole mini-batch.

        ``first_update``: the weights are still pi_old's (the first update of a step), so every KL(pi_old ||
        pi_theta) estimate is exactly 0. ``weighted``: rollout weights take part; at a one-pass first update the
        weights of rollouts not yet forwarded are not known. A coupling up to the question lets one forward with
        gradients give the exact coefficients of a micro-batch of whole questions (:mod:`nemo_disco.update`).
        """
        return self.coupling_fn(self._resolve(hp), first_update, weighted)

    def stats(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        mask: Tensor,
        *,
        entropy: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        **hp: Any,
    ) -> Tensor:
        """Per-rollout statistics [N, K] (columns ``stat_names``), differentiable w.r.t. ``logprobs``.

        Args:
            logprobs: [N, T] current token log-probs (with grad in pass 2).
            old_logprobs: [N, T] pi_old's token log-probs.
            mask: [N, T] bool (or 0/1), True on response tokens.
            entropy: [N, T] per-token entropy (only used when ``needs_entropy``).
            ref_logprobs: [N, T] reference log-probs (only used by the GRPO family's KL regulariser).
            **hp: this loss's hyper-parameters (see ``hparams``); the objective's ones are accepted too.
        """
        p = self._resolve(hp)
        _check_tokens(logprobs, old_logprobs, mask, entropy=entropy, ref_logprobs=ref_logprobs)
        if self.needs_entropy and entropy is None:
            raise ValueError(f"loss {self.name!r} needs entropy=[N, T] (per-token entropy of the policy)")
        if p.needs_reference and ref_logprobs is None:
            why = f"with kl_coef={p.kl_coef} > 0" if isinstance(p, ClipParams) else "(a log-ratio to the reference)"
            raise ValueError(
                f"loss {self.name!r} {why} needs ref_logprobs=[N, T]; "
                "build it with losses.get_loss(name, **hp) so that needs_reference is set"
            )
        return self.stats_fn(logprobs, old_logprobs, mask, entropy, ref_logprobs, p)

    def objective(
        self,
        stats: Tensor,
        group_ids: Tensor,
        rewards: Tensor,
        *,
        weights: Tensor | None = None,
        **hp: Any,
    ) -> tuple[Tensor, dict[str, Tensor | float]]:
        """The mini-batch loss (0-dim, differentiable w.r.t. ``stats``) and its metrics (detached).

        Args:
            stats: [N, K] statistics of the whole mini-batch (columns ``stat_names``).
            group_ids: [N] int64 question ids, any order, any group sizes.
            rewards: [N] float.
            weights: [N] float >= 0 rollout weights (rollout correction) or None (all 1).
            **hp: this loss's hyper-parameters.
        """
        p = self._resolve(hp)
        n = stats.shape[0]
        if stats.dim() != 2 or stats.shape[1] != len(self.stat_names):
            raise ValueError(f"loss {self.name!r}: stats must be [N, {len(self.stat_names)}], got {list(stats.shape)}")
        if n == 0:
            raise ValueError(f"loss {self.name!r}: empty mini-batch (stats has 0 rows)")
        for key, t in (("group_ids", group_ids), ("rewards", rewards), ("weights", weights)):
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"loss {self.name!r}: {key} must be [{n}], got {list(t.shape)}")
        group_ids = group_ids.to(stats.device)
        rewards = rewards.to(stats.device, stats.dtype)
        if weights is not None:
            weights = weights.detach().to(stats.device, stats.dtype)
            if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
                raise ValueError(f"loss {self.name!r}: weights must be finite and >= 0")
        return self.objective_fn(stats, group_ids, rewards, weights, p)

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        mask: Tensor,
        group_ids: Tensor,
        rewards: Tensor,
        *,
        entropy: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        weights: Tensor | None = None,
        **hp: Any,
    ) -> tuple[Tensor, dict[str, float]]:
        """``loss, metrics = fn(logprobs, old_logprobs, mask, group_ids, rewards, **hyperparameters)``.

        The full-batch loss (differentiable w.r.t. ``logprobs``) and its metrics as python floats.
        """
        st = self.stats(logprobs, old_logprobs, mask, entropy=entropy, ref_logprobs=ref_logprobs, **hp)
        loss, metrics = self.objective(st, group_ids, rewards, weights=weights, **hp)
        return loss, _floats(metrics, loss)


def get_loss(name: str, **hp: Any) -> Loss:
    """The registered loss ``name`` with its hyper-parameters validated and bound once (defaults for the rest).

    ``loss(logprobs, old_logprobs, mask, group_ids, rewards, entropy=, ref_logprobs=, weights=)`` then returns
    ``(value, metrics)``; its ``stats`` / ``objective`` / ``coupling`` and :func:`coefficients` use the bound values.

    Raises:
        ValueError: unknown name (the message lists the valid names) or invalid hyper-parameters.
    """
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(LOSSES)}")
    return LOSSES[name].bind(**hp)


def default_of(key: str) -> Any:
    """The default of hyper-parameter ``key`` in the losses that take it (None where they disagree or none does)."""
    values = {repr(f.default): f.default for loss in LOSSES.values() for f in fields(loss.hparams) if f.name == key}
    return next(iter(values.values())) if len(values) == 1 else None


def coefficients(
    loss: Loss,
    stats: Tensor,
    group_ids: Tensor,
    rewards: Tensor,
    *,
    weights: Tensor | None = None,
    **hp: Any,
) -> tuple[Tensor, float, dict[str, float]]:
    """``c = dL/dstats`` of the whole mini-batch objective, the loss value and its metrics.

    The objective is evaluated in float64 on a detached leaf copy of ``stats`` and differentiated with
    ``torch.autograd.grad``; nothing else is touched.

    Args:
        loss: the :class:`Loss`.
        stats: [N, K] statistics of the whole mini-batch (pass 1, gathered over data-parallel ranks).
        group_ids: [N] question ids.
        rewards: [N] rewards.
        weights: [N] rollout weights or None.
        **hp: the loss's hyper-parameters.

    Returns:
        ``(c [N, K] detached, in stats' dtype and device; loss value; metrics as python floats)``.
    """
    leaf = stats.detach().to(torch.float64).requires_grad_(True)
    with torch.enable_grad():
        value, metrics = loss.objective(leaf, group_ids, rewards, weights=weights, **hp)
        (grad,) = torch.autograd.grad(value, leaf, allow_unused=True)
    coeffs = torch.zeros_like(leaf) if grad is None else grad
    floats = _floats(metrics, value)
    return coeffs.to(stats.dtype), floats["loss"], floats


def surrogate(coeffs: Tensor, stats: Tensor) -> Tensor:
    """``sum(coeffs * stats)``: its gradient, summed over micro-batches and ranks, is the full-batch gradient.

    Args:
        coeffs: [n, K] rows of :func:`coefficients` for the micro-batch's rollouts (detached here).
        stats: [n, K] the micro-batch's statistics, with grad.
    """
    if coeffs.shape != stats.shape:
        raise ValueError(f"surrogate: coeffs {list(coeffs.shape)} and stats {list(stats.shape)} differ")
    return (coeffs.detach() * stats).sum()


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
    _check_tokens(old_logprobs, gen_logprobs, mask)
    with torch.no_grad():
        m = mask.bool()
        diff = torch.where(m, old_logprobs.double() - gen_logprobs.double(), 0.0)  # [N, T]
        log_ratio = diff.sum(1)  # [N]
        log_cap = math.log(cap)
        w = torch.exp(log_ratio.clamp(max=log_cap))  # [N]
        n = max(int(w.numel()), 1)
        metrics = {
            "mismatch/truncated_share": float((log_ratio > log_cap).double().sum()) / n,
            "mismatch/weight_mean": float(w.mean()) if w.numel() else 0.0,
            "mismatch/weight_min": float(w.min()) if w.numel() else 0.0,
            "mismatch/weight_max": float(w.max()) if w.numel() else 0.0,
            "mismatch/weight_ess_share": float(w.sum() ** 2 / (n * (w**2).sum())) if w.numel() else 0.0,
        }
    return w, metrics


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
    _check_tokens(old_logprobs, gen_logprobs, mask)
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


def _divisor(kind: str, num_groups: int, valid: Tensor) -> Tensor | int:
    """Q (``all``) or the number of questions with a positive and a negative (``valid``, at least 1)."""
    return num_groups if kind == "all" else valid.sum().clamp(min=1)


def _group_metrics(
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


def _floats(metrics: dict[str, Tensor | float], loss: Tensor) -> dict[str, float]:
    """Metrics as python floats with one device sync; adds ``loss``."""
    out = {k: v for k, v in metrics.items() if not isinstance(v, Tensor)}
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in keys] + [loss.detach().double()])
    flat = values.tolist()
    out.update({k: float(v) for k, v in zip(keys, flat[:-1], strict=True)})
    out["loss"] = float(flat[-1])
    return {k: float(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Token-level helpers (the only code that sees [N, T]).


def _check_tokens(logprobs: Tensor, other: Tensor, mask: Tensor, **optional: Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got {list(logprobs.shape)}")
    for key, t in (("old/gen logprobs", other), ("mask", mask), *optional.items()):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{key} must be {list(logprobs.shape)} like logprobs, got {list(t.shape)}")


def _log_ratio(logprobs: Tensor, base: Tensor, m: Tensor) -> Tensor:
    """Token log-ratio ``logprobs - base`` on valid tokens, exactly 0 on padding. [N, T] -> [N, T].

    Padding may hold anything (even inf or nan): ``where`` keeps it out of values and gradients, and the
    exact zeros make exp(0) - 1 = 0 there, so sums over padding add nothing.
    """
    return torch.where(m, logprobs - base, 0.0)


def _clamp_counted(raw: Tensor, bound: float) -> tuple[Tensor, Tensor]:
    """``clamp(raw, -bound, bound)`` and the number of clamped tokens per row [N] (no gradient)."""
    clamped = raw.detach().abs().gt_(bound).sum(1, dtype=raw.dtype)  # [N]
    return raw.clamp(-bound, bound), clamped


def _kl_sum(raw: Tensor, d: Tensor | None, kind: str) -> Tensor:
    """Per-row sum of the KL(pi_old || pi_theta) estimator (tokens sampled from pi_old). [N, T] -> [N].

    With ``raw = log rho = logp - old_logp`` and ``d`` its clamp: ``k1 = old - new = -raw``;
    ``k3 = rho - 1 - log rho`` (the low-variance estimator; exponent clamped).
    """
    return -raw.sum(1) if kind == "k1" else (torch.expm1(d) - d).sum(1)


def _masked_sum(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, 0.0).sum(1)  # [N, T] -> [N]


# ----------------------------------------------------------------------------------------------------------------------
# DisCO / DisCO-b: score statistics.


@dataclass(frozen=True)
class DiscoParams(_Hyper):
    """DisCO (eq. 10-11): score, DRO temperature, KL constraint (eq. 9), compat switch, divisor."""

    score: str = _choice("logl", "logl", "lratio")
    tau: float = _positive(10.0)
    delta: float = _non_negative(1e-4)
    beta: float = _non_negative(1e3)
    official_compat: bool = _flag(False)
    divisor: str = _choice("all", "all", "valid")


@dataclass(frozen=True)
class DiscobParams(_Hyper):
    """DisCO-b (eq. 7-8): as DisCO without tau."""

    score: str = _choice("logl", "logl", "lratio")
    delta: float = _non_negative(1e-4)
    beta: float = _non_negative(1e3)
    official_compat: bool = _flag(False)
    divisor: str = _choice("all", "all", "valid")


@dataclass(frozen=True)
class DrpoParams(DiscoParams):
    """DRPO: DisCO with positives weighted by ``exp((1 - L / max_response_tokens) / drpo_lambda)``, L their length."""

    drpo_lambda: float = _positive(0.1)
    max_response_tokens: int = _hp(8192, lambda v: _integer(v) and v >= 1, "an int >= 1")


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
    raw = _log_ratio(logprobs, old_logprobs, m)  # [N, T]
    d, clamped = (None, torch.zeros_like(n))
    if p.score == "lratio" or p.kl == "k3":
        d, clamped = _clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    if p.score == "logl":
        total = _masked_sum(logprobs, m)  # [N]
    else:
        total = torch.expm1(d).sum(1) + n  # sum_t exp(d) over valid tokens (padding: expm1(0) = 0)
    score = total / n.clamp(min=1)  # [N]
    return torch.stack([score, _kl_sum(raw, d, p.kl), n, clamped], dim=1)  # [N, 4]


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
    J = term.sum() / _divisor(p.divisor, Q, valid)
    metrics = _group_metrics(inv, Q, rewards, pos, score.detach(), score.detach())
    return _constrained(J, stats, p, metrics)


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
    J = term.sum() / _divisor(p.divisor, Q, valid)
    metrics = _group_metrics(inv, Q, rewards, pos, score.detach(), score.detach())
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
    J = term.sum() / _divisor(p.divisor, Q, valid)
    metrics = _group_metrics(inv, Q, rewards, pos, score.detach(), score.detach())
    return _constrained(J, stats, p, metrics)


# ----------------------------------------------------------------------------------------------------------------------
# GRPO family: clipped-ratio statistics.


@dataclass(frozen=True)
class ClipParams(_Hyper):
    """PPO-clipped GRPO family: clip range (clip_eps_high None = symmetric) and KL regulariser to a reference."""

    clip_eps: float = _hp(0.2, lambda v: _number(v) and 0 < v < 1, "in (0, 1)")
    clip_eps_high: float | None = _optional_positive(None)
    kl_coef: float = _non_negative(0.0)

    @property
    def needs_reference(self) -> bool:
        """The KL regulariser (kl_coef > 0) needs the reference policy's log-probs."""
        return self.kl_coef > 0


@dataclass(frozen=True)
class GrpoRwParams(ClipParams):
    """GRPO_RW (eq. 6): the question average uses the same divisor switch as DisCO."""

    divisor: str = _choice("all", "all", "valid")


@dataclass(frozen=True)
class DrGrpoParams(ClipParams):
    """Dr. GRPO: the constant token-sum normaliser (the generation's max response length)."""

    max_response_tokens: int = _hp(8192, lambda v: _integer(v) and v >= 1, "an int >= 1")


@dataclass(frozen=True)
class DapoParams(_Hyper):
    """DAPO: clip-higher (eps_low 0.2, eps_high 0.28; DAPO paper §3.1), no KL term."""

    clip_eps: float = _hp(0.2, lambda v: _number(v) and 0 < v < 1, "in (0, 1)")
    clip_eps_high: float | None = _optional_positive(0.28)


@dataclass(frozen=True)
class GrpoErParams(ClipParams):
    """GRPO-ER: GRPO plus an entropy bonus."""

    entropy_coef: float = _non_negative(1e-3)


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
    raw = _log_ratio(logprobs, old_logprobs, m)  # [N, T]
    d, clamped = _clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    rho = torch.exp(d)  # [N, T]; exactly 1 on padding
    pos_sum = _masked_sum(rho.clamp(max=hi), m)  # [N]
    neg_sum = _masked_sum(rho.clamp(min=lo), m)  # [N]
    # Padding has rho = 1, inside (lo, hi): no mask needed for the counts.
    r = rho.detach()
    clip_high = (r > hi).sum(1, dtype=logprobs.dtype)  # [N]
    clip_low = (r < lo).sum(1, dtype=logprobs.dtype)  # [N]
    kl_sum = _kl_sum(raw, d, p.kl)  # [N]
    if ref_logprobs is not None and p.needs_reference:
        dr, ref_clamped = _clamp_counted(_log_ratio(ref_logprobs, logprobs, m), p.max_log_ratio)  # log(ref / theta)
        ref_kl = (torch.expm1(dr) - dr).sum(1)  # [N]  (0 on padding: dr = 0 there)
    else:
        ref_kl, ref_clamped = torch.zeros_like(n), torch.zeros_like(n)
    cols = [pos_sum, neg_sum, n, clip_high, clip_low, kl_sum, clamped, ref_kl, ref_clamped]
    if with_entropy:
        cols.append(_masked_sum(entropy, m))
    return torch.stack(cols, dim=1)  # [N, K]


def _clip_parts(
    stats: Tensor, rewards: Tensor, p: ClipParams | DapoParams
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Columns of :data:`CLIP_STATS` used by every GRPO-family objective."""
    u, v, n, hi, lo = stats[:, 0], stats[:, 1], stats[:, 2], stats[:, 3], stats[:, 4]
    return u, v, n, hi, lo, rewards > p.positive_threshold


def _advantage(rewards: Tensor, index: Tensor, num_groups: int, *, normalise: bool) -> Tensor:
    """Group-relative advantage [N]: r - mean_q r, divided by (population std_q r + ADV_EPS) if ``normalise``."""
    count = torch.bincount(index, minlength=num_groups).to(rewards.dtype)  # [Q]
    mean = rewards.new_zeros(num_groups).index_add(0, index, rewards) / count  # [Q]
    centred = rewards - mean[index]  # [N]
    if not normalise:
        return centred
    std = (rewards.new_zeros(num_groups).index_add(0, index, centred**2) / count).sqrt()  # [Q]
    return centred / (std[index] + ADV_EPS)


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


def _ones(n: Tensor, weights: Tensor | None) -> Tensor:
    return torch.ones_like(n) if weights is None else weights


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
    adv = _advantage(rewards, inv, Q, normalise=True)  # [N]
    w = _ones(n, weights)
    N = stats.shape[0]
    J = (w * _clipped_sum(adv, u, v) / n.clamp(min=1)).sum() / N
    reg = p.kl_coef * (w * stats[:, 7] / n.clamp(min=1)).sum() / N
    metrics = _group_metrics(inv, Q, rewards, pos, (u / n.clamp(min=1)).detach(), (v / n.clamp(min=1)).detach())
    metrics["clip_frac"] = _clip_frac(adv, hi, lo, n)
    return _regularised(J, stats, reg, metrics, n)


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
    J = torch.where(valid, mean_pos - mean_neg, 0.0).sum() / _divisor(p.divisor, Q, valid)
    reg = p.kl_coef * (_ones(n, weights) * stats[:, 7] / n.clamp(min=1)).sum() / stats.shape[0]
    metrics = _group_metrics(inv, Q, rewards, pos, f_pos.detach(), f_neg.detach())
    # Positives take the min (clipped above), negatives the max (clipped below), in questions that count.
    sign = torch.where(valid[inv], torch.where(pos, 1.0, -1.0), 0.0).to(stats.dtype)
    metrics["clip_frac"] = _clip_frac(sign, hi, lo, n)
    return _regularised(J, stats, reg, metrics, n)


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
    adv = _advantage(rewards, inv, Q, normalise=False)  # [N]
    w = _ones(n, weights)
    N, L = stats.shape[0], float(p.max_response_tokens)
    J = (w * _clipped_sum(adv, u, v)).sum() / (N * L)
    reg = p.kl_coef * (w * stats[:, 7]).sum() / (N * L)
    metrics = _group_metrics(inv, Q, rewards, pos, (u / n.clamp(min=1)).detach(), (v / n.clamp(min=1)).detach())
    metrics["clip_frac"] = _clip_frac(adv, hi, lo, n)
    return _regularised(J, stats, reg, metrics, n)


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
    adv = _advantage(rewards, inv, Q, normalise=True)  # [N]
    J = (_ones(n, weights) * _clipped_sum(adv, u, v)).sum() / n.sum().clamp(min=1)
    metrics = _group_metrics(inv, Q, rewards, pos, (u / n.clamp(min=1)).detach(), (v / n.clamp(min=1)).detach())
    metrics["clip_frac"] = _clip_frac(adv, hi, lo, n)
    return _regularised(J, stats, J.new_zeros(()), metrics, n)


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


def _clip_stats_with_entropy(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    p: GrpoErParams,
) -> Tensor:
    """:func:`clip_stats` plus ``entropy_sum`` (GRPO-ER)."""
    return clip_stats(logprobs, old_logprobs, mask, entropy, ref_logprobs, p, with_entropy=True)


# ----------------------------------------------------------------------------------------------------------------------
# GPG: plain policy gradient on the summed token log-likelihood.


@dataclass(frozen=True)
class GpgParams(_Hyper):
    """GPG (arXiv 2504.02546): F_norm (eq. 6), the correction alpha = B / (B - M) (eq. 7-8), eq. 5's normaliser."""

    adv_std_norm: bool = _flag(False)
    alpha_correction: bool = _flag(True)
    token_norm: str = _choice("question", "question", "batch")


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
    raw = _log_ratio(logprobs, old_logprobs, m)  # [N, T]
    d, clamped = (None, torch.zeros_like(n))
    if p.kl == "k3":
        d, clamped = _clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    logp_sum = _masked_sum(logprobs, m)  # [N]
    return torch.stack([logp_sum, n, _kl_sum(raw, d, p.kl), clamped], dim=1)  # [N, 4]


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
    adv = _advantage(rewards, inv, Q, normalise=p.adv_std_norm)  # [N]
    w = _ones(n, weights)
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
    metrics = _group_metrics(inv, Q, rewards, pos, mean_logp, mean_logp)
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


# ----------------------------------------------------------------------------------------------------------------------
# TRPA: pairwise preference term on log-ratios to the reference, trust-region KL to pi_old.


@dataclass(frozen=True)
class TrpaParams(_Hyper):
    """TRPA (arXiv 2504.04524): preference-term beta, KTPO anisotropy, trust-region KL coefficient (authors' script)."""

    trpa_beta: float = _positive(0.1)
    trpa_anisotropy: float = _positive(2.5)
    tr_kl_coef: float = _non_negative(1e-3)

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
    h = _log_ratio(logprobs, ref_logprobs, m).sum(1) / n.clamp(min=1)  # [N]
    raw = _log_ratio(logprobs, old_logprobs, m)  # [N, T]  log(theta / old)
    d, clamped = _clamp_counted(raw, p.max_log_ratio)  # [N, T], [N]
    tr_kl = (torch.expm1(-d) + d).sum(1)  # [N]  k3 with x = -d = log(old / theta); 0 on padding
    return torch.stack([h, tr_kl, n, _kl_sum(raw, d, p.kl), clamped], dim=1)  # [N, 5]


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
    w = _ones(n, weights)
    pair_w = w[:, None] * w[None, :]  # [N, N]
    P = better.sum()
    J = torch.where(better, pair_w * torch.nn.functional.logsigmoid(z), 0.0).sum() / P.clamp(min=1)
    tokens = n.sum().clamp(min=1)
    K_tr = tr_kl.sum() / tokens
    penalty = p.tr_kl_coef * K_tr
    metrics = _group_metrics(inv, Q, rewards, pos, h.detach(), h.detach())
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


def _registered(
    name: str,
    hparams: type[_Hyper],
    stat_names: tuple[str, ...],
    stats_fn: Callable[..., Tensor],
    objective_fn: Callable[..., tuple[Tensor, dict[str, Tensor | float]]],
    coupling_fn: Callable[[Any, bool, bool], str],
    *,
    needs_entropy: bool = False,
) -> Loss:
    # needs_reference as the registry defaults want it (the GRPO family's kl_coef = 0: no; TRPA: always);
    # get_loss(name, **hp) resolves it for other hyper-parameters.
    return Loss(
        name, stat_names, needs_entropy, hparams().needs_reference, hparams, stats_fn, objective_fn, coupling_fn
    )


LOSSES: dict[str, Loss] = {
    "disco": _registered("disco", DiscoParams, SCORE_STATS, score_stats, disco_objective, _constrained_coupling),
    "discob": _registered("discob", DiscobParams, SCORE_STATS, score_stats, discob_objective, _constrained_coupling),
    "drpo": _registered("drpo", DrpoParams, SCORE_STATS, score_stats, drpo_objective, _constrained_coupling),
    "grpo": _registered("grpo", ClipParams, CLIP_STATS, clip_stats, grpo_objective, _rollout_coupled),
    "grpo_rw": _registered("grpo_rw", GrpoRwParams, CLIP_STATS, clip_stats, grpo_rw_objective, _question_coupled),
    "dr_grpo": _registered("dr_grpo", DrGrpoParams, CLIP_STATS, clip_stats, dr_grpo_objective, _rollout_coupled),
    "dapo": _registered("dapo", DapoParams, CLIP_STATS, clip_stats, dapo_objective, _rollout_coupled),
    "grpo_er": _registered(
        "grpo_er",
        GrpoErParams,
        CLIP_STATS + ("entropy_sum",),
        _clip_stats_with_entropy,
        grpo_er_objective,
        _rollout_coupled,
        needs_entropy=True,
    ),
    "gpg": _registered("gpg", GpgParams, GPG_STATS, gpg_stats, gpg_objective, _rollout_coupled),
    "trpa": _registered("trpa", TrpaParams, TRPA_STATS, trpa_stats, trpa_objective, _question_coupled),
}
