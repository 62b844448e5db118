"""One optimizer update of a mini-batch as one unit: statistics, coefficients, surrogate, backward.

The exact update (:mod:`nemo_disco.losses`) backwards ``sum_i c_i . stats_i(theta)`` with ``c = dL/dstats`` of the
whole mini-batch objective. In general the coefficients need the statistics of every rollout first, so an update
takes two passes over its mini-batch::

    pass 1   forward without gradients -> statistics, all-gathered over data-parallel ranks -> c (coefficients)
             (free at the first update of a step: the weights are pi_old's, whose log-probs the trainer has)
    pass 2   per micro-batch: forward with gradients, backward of sum(c[rows] * stats(rows))

Where the objective couples rollouts no further than their question (``Loss.coupling``) and every micro-batch
of every data-parallel rank holds whole questions, the coefficients of a micro-batch follow from its own
statistics, so one forward with gradients gives statistics, exact coefficients and backward::

    one pass per micro-batch: forward with gradients -> stats(rows) -> c[rows] -> backward of sum(c[rows] * stats)

At the first update of a step the one pass also gives pi_old's log-probs of the mini-batch (the weights have
not moved: they ARE the current log-probs, detached), so the trainer does not forward it without gradients at
all: F + B instead of 2F + B. DisCO's KL hinge couples the whole mini-batch but is exactly 0, with a zero
gradient, at that update (K = 0 <= delta), so DisCO takes one pass there and two at later updates; the GRPO
family (per-rollout coefficients) takes one pass at every update.

The coefficients of a micro-batch are those of the whole mini-batch objective evaluated on a statistics tensor
whose other rows hold placeholders (the statistics of log-probs 0 against old log-probs 0: the true token counts,
a KL of 0, arbitrary scores), differentiated w.r.t. the micro-batch's rows. Under the declared coupling they do
not read the placeholders: the gradient is the two-pass one (``tests/unit/test_update.py`` checks it against
full-batch autograd in float64 for every loss, layout and update index). The loss value and its metrics are
those of the whole mini-batch: its statistics are gathered after the backward (no second forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from nemo_disco import distributed, losses
from nemo_disco.batch import RolloutBatch, StepRows, whole_questions
from nemo_disco.losses.correction import capped_weights, log_ratios, weight_metrics
from nemo_disco.policy.base import Policy


@dataclass(frozen=True)
class Minibatch:
    """One update's rollouts, with what the trainer attached to them.

    Attributes:
        full: the whole mini-batch, every data-parallel rank's rows: their group ids, rewards and response masks
            are read (a :class:`~nemo_disco.batch.StepRows`, or a whole :class:`RolloutBatch`).
        local: this rank's rows of ``full`` (rows ``rows``) with ``ref_logprobs`` attached when the loss needs
            them, and ``old_logprobs`` (pi_old's, float32 [n, R]); None only at a first update taken in one pass,
            which makes them.
        rows: ``local``'s rows within ``full`` (``_dp_slice`` of the trainer: contiguous).
        old_entropy: [n, R] pi_old's per-token entropy of ``local`` (a first update in two passes uses it as
            pass 1's when the loss needs entropy) or None.
        weights: [N] rollout weights of ``full`` (rollout correction) or None: none, or (a first update in one
            pass) computed from the old log-probs that pass makes, with ``correction``.
    """

    full: RolloutBatch | StepRows
    local: RolloutBatch
    rows: slice
    old_entropy: Tensor | None = None
    weights: Tensor | None = None


@dataclass(frozen=True)
class Correction:
    """Rollout correction (``losses.rollout_weights``): mode ``none`` or ``seq_tis``, and its cap.

    The one way the trainer and an update compute rollout weights: each rollout's log ratio once
    (:meth:`log_ratios`), its weight from it (:meth:`weights`), the step's metrics from both (:meth:`metrics`).
    """

    mode: str = "none"
    cap: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in ("none", "seq_tis"):
            raise ValueError(f"rollout correction mode={self.mode!r} must be 'none' or 'seq_tis'")
        if not self.cap > 0:
            raise ValueError(f"rollout correction cap={self.cap} must be > 0")

    @property
    def weighted(self) -> bool:
        """Whether rollouts carry weights."""
        return self.mode != "none"

    def log_ratios(self, old_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor) -> Tensor:
        """[N] float64 log pi_old(o_i) / pi_gen(o_i) of [N, T] token log-probs (``mask``: response tokens)."""
        return log_ratios(old_logprobs, gen_logprobs, mask)

    def weights(self, log_ratio: Tensor) -> Tensor:
        """[N] float64 weights of :meth:`log_ratios`' values (``seq_tis``: ratios truncated at ``cap``)."""
        return capped_weights(log_ratio, self.cap)

    def metrics(self, log_ratio: Tensor | None, weights: Tensor | None) -> dict[str, float]:
        """``mismatch/weight_*`` and ``mismatch/truncated_share`` of a batch ({} without a correction)."""
        if not self.weighted or log_ratio is None or weights is None:
            return {}
        return weight_metrics(log_ratio, weights, self.cap)


@dataclass(frozen=True)
class Plan:
    """How an update runs: 1 or 2 passes, and why (one line for the log)."""

    passes: int
    why: str


@dataclass
class Result:
    """What an update did.

    Attributes:
        metrics: the loss's metrics (``loss``, ``objective``, ...) and the policy's (``grad_norm``, ``lr``,
            ``skipped``, ``surrogate``).
        forwards: forward passes over the mini-batch this update ran (one pass: 1; two passes: 2, or 1 at a first
            update, whose pass 1 is pi_old's log-probs).
        trained: the policy ran an optimizer update (False: skipped before any backward, non-finite loss).
        old_logprobs: [n, R] pi_old's log-probs of ``local`` made by a one-pass first update (float64), else None.
        old_entropy: [n, R] their entropy (with ``old_logprobs``).
        weights: [n] ``local``'s rollout weights made by a one-pass first update, else None.
        log_ratios: [n] the log ratios those weights come from (:meth:`Correction.log_ratios`), else None.
    """

    metrics: dict[str, float]
    forwards: int
    trained: bool = True
    old_logprobs: Tensor | None = None
    old_entropy: Tensor | None = None
    weights: Tensor | None = field(default=None, repr=False)
    log_ratios: Tensor | None = field(default=None, repr=False)


def plan(
    policy: Policy,
    loss: losses.Loss,
    full: RolloutBatch | StepRows,
    local: RolloutBatch,
    rows: slice,
    *,
    first_update: bool,
    correction: Correction,
) -> Plan:
    """One pass or two for this update; the same answer on every rank (collective when distributed).

    One pass needs: the loss's coupling (``Loss.coupling``) at this update index reaches no further than a
    question; for a question coupling, every question whole on one data-parallel rank and in one of its
    micro-batches (``policy.microbatch_rows``); no pipeline parallelism (the surrogate runs on the last stage
    only, where the statistics would stay).
    """
    coupling = loss.coupling(first_update=first_update, weighted=correction.weighted)
    where = "the first update" if first_update else "a later update"
    if getattr(policy, "pp", 1) > 1:
        return Plan(2, "pipeline parallelism: statistics exist on the last stage only")
    if coupling == losses.MINIBATCH:
        return Plan(2, f"loss {loss.name} couples the whole mini-batch at {where}")
    ok = True
    if coupling == losses.QUESTION:
        gids = full.group_ids
        mine = gids[rows]
        # Whole on this rank: each of its questions has all its rollouts here.
        on_rank = torch.isin(gids, mine)
        ok = int(on_rank.sum()) == len(mine)
        ok = ok and whole_questions(mine, policy.microbatch_rows(local))
    if distributed.world_size() > 1:
        ok = not distributed.any_rank(not ok)
    if not ok:
        return Plan(2, f"loss {loss.name} couples a question's rollouts, and a question spans micro-batches or ranks")
    if coupling == losses.ROLLOUT:
        return Plan(1, f"loss {loss.name}'s coefficients are per rollout at {where}")
    return Plan(1, f"loss {loss.name} couples a question's rollouts at {where}; micro-batches hold whole questions")


def run(
    policy: Policy,
    loss: losses.Loss,
    mb: Minibatch,
    *,
    passes: int,
    first_update: bool,
    correction: Correction = Correction(),
    entropy_metric: bool = True,
) -> Result:
    """One optimizer update of ``mb`` in ``passes`` (from :func:`plan`) passes.

    Args:
        policy: the trained policy.
        loss: the loss, its hyper-parameters bound (``losses.get_loss(name)``).
        mb: the mini-batch.
        passes: 1 or 2, as :func:`plan` decided (on every rank).
        first_update: the weights are pi_old's (the step's first update).
        correction: the rollout correction (a one-pass first update computes its rows' weights).
        entropy_metric: a one-pass first update also returns pi_old's entropy (``train/entropy``).
    """
    if passes == 1:
        return _one_pass(policy, loss, mb, first_update, correction, entropy_metric)
    return _two_passes(policy, loss, mb, first_update)


def _gather(t: Tensor, policy: Policy) -> Tensor:
    return distributed.all_gather_rows(t, policy.dp_group) if policy.dp_size > 1 else t


def _two_passes(policy: Policy, loss: losses.Loss, mb: Minibatch, first_update: bool) -> Result:
    local = mb.local
    if local.old_logprobs is None:
        raise ValueError("update in two passes: the mini-batch needs old_logprobs attached")
    if first_update:  # the weights are still pi_old's: the current log-probs ARE the old ones
        lp, ent = local.old_logprobs, mb.old_entropy
    else:
        lp, ent = policy.logprobs(local, entropy=loss.needs_entropy)
    old, mask, ref = local.old_logprobs, local.response_mask, local.ref_logprobs
    stats = _gather(loss.stats(lp, old, mask, entropy=ent, ref_logprobs=ref), policy)
    coeffs, value, metrics = losses.coefficients(loss, stats, mb.full.group_ids, mb.full.rewards, weights=mb.weights)
    forwards = 1 if first_update else 2
    if not math.isfinite(value):
        return Result({**metrics, "skipped": 1.0}, forwards - 1, trained=False)
    c_local = coeffs[mb.rows]

    def surrogate_fn(idx: Tensor, lp: Tensor, ent: Tensor | None) -> Tensor:
        dev = lp.device
        st = loss.stats(
            lp,
            old[idx].to(dev),
            mask[idx].to(dev),
            entropy=ent,
            ref_logprobs=ref[idx].to(dev) if ref is not None else None,
        )
        return losses.surrogate(c_local[idx].to(dev, st.dtype), st)

    out = policy.train_minibatch(local, surrogate_fn, entropy=loss.needs_entropy)
    return Result({**metrics, **out}, forwards)


def placeholder_stats(loss: losses.Loss, batch: RolloutBatch | StepRows) -> Tensor:
    """Statistics [N, K] (float64) of log-probs 0 against old log-probs 0: true token counts, KL 0, any scores."""
    mask = batch.response_mask
    zeros = torch.zeros(mask.shape, dtype=torch.float64)
    with torch.no_grad():
        return loss.stats(
            zeros,
            zeros,
            mask,
            entropy=zeros if loss.needs_entropy else None,
            ref_logprobs=zeros if loss.needs_reference else None,
        )


def _to_host(value: Tensor | None, shape: tuple[int, int]) -> Tensor:
    """``value`` as float64 on the host; zeros of ``shape`` when no micro-batch filled it."""
    if value is None:
        return torch.zeros(shape, dtype=torch.float64)
    return value.to("cpu", torch.float64)


def _one_pass(
    policy: Policy,
    loss: losses.Loss,
    mb: Minibatch,
    first_update: bool,
    correction: Correction,
    entropy_metric: bool,
) -> Result:
    local, full, start = mb.local, mb.full, mb.rows.start
    if not first_update and local.old_logprobs is None:
        raise ValueError("update in one pass after the first: the mini-batch needs old_logprobs attached")
    n, width = local.response_ids.shape
    template = placeholder_stats(loss, full)  # [N, K]
    stats_local = torch.full((n, template.shape[1]), math.nan, dtype=torch.float64)
    make_old = first_update and local.old_logprobs is None
    want_entropy = loss.needs_entropy or (make_old and entropy_metric)
    # pi_old's log-probs and entropy stay on the policy's device until the pass ends: one copy to the host per
    # mini-batch, not one blocking copy per micro-batch (fp32 -> fp64 is exact either way).
    kept: dict[str, Tensor] = {}

    def keep(name: str, idx: Tensor, value: Tensor) -> None:
        if name not in kept:
            kept[name] = torch.zeros((n, width), dtype=value.dtype, device=value.device)
        kept[name][idx.to(value.device)] = value.detach()

    make_weights = make_old and correction.weighted
    w_full = None
    if mb.weights is not None:
        w_full = mb.weights.to(torch.float64)
    elif make_weights:
        w_full = torch.ones(len(full), dtype=torch.float64)  # placeholders: only the rows' own weights are read
    w_local = torch.ones(n, dtype=torch.float64) if make_weights else None
    ratio_local = torch.zeros(n, dtype=torch.float64) if make_weights else None
    nonfinite = [False]

    def surrogate_fn(idx: Tensor, lp: Tensor, ent: Tensor | None) -> Tensor:
        dev = lp.device
        sub = local.select(idx)
        mask = sub.response_mask.to(dev)
        if make_old:
            old = lp.detach()  # pi_theta = pi_old exactly: every KL estimate is 0
            keep("old", idx, old)
            if want_entropy and ent is not None:
                keep("entropy", idx, ent)
        else:
            old = sub.old_logprobs.to(dev)
        ref = sub.ref_logprobs.to(dev) if sub.ref_logprobs is not None else None
        st = loss.stats(lp, old, mask, entropy=ent if loss.needs_entropy else None, ref_logprobs=ref)
        rows = idx + start  # [n] rows within the mini-batch
        weights = w_full
        if make_weights:
            r_rows = correction.log_ratios(old.cpu(), sub.gen_logprobs, sub.response_mask)
            w_rows = correction.weights(r_rows)
            ratio_local[idx], w_local[idx] = r_rows, w_rows
            weights = w_full.clone()
            weights[rows] = w_rows
        filled = template.clone()
        filled[rows] = st.detach().to("cpu", torch.float64)
        stats_local[idx] = filled[rows]
        coeffs, value, _ = losses.coefficients(loss, filled, full.group_ids, full.rewards, weights=weights)
        c = coeffs[rows]
        if not math.isfinite(value):  # the policy then skips the update (non-finite surrogate)
            nonfinite[0] = True
            c = torch.full_like(c, math.nan)
        return losses.surrogate(c.to(dev, st.dtype), st)

    out = policy.train_minibatch(local, surrogate_fn, entropy=want_entropy)
    old_out = ent_out = None
    if make_old:
        old_out = _to_host(kept.get("old"), (n, width))
        ent_out = _to_host(kept.get("entropy"), (n, width)) if want_entropy else None
    # The mini-batch's loss and metrics, from the statistics the pass computed (and its weights).
    cols = [stats_local] if w_local is None else [stats_local, w_local[:, None]]
    gathered = _gather(torch.cat(cols, dim=1), policy)
    stats = gathered[:, : template.shape[1]]
    weights = gathered[:, -1] if w_local is not None else w_full
    _, _, metrics = losses.coefficients(loss, stats, full.group_ids, full.rewards, weights=weights)
    if nonfinite[0]:
        out = {**out, "skipped": 1.0}
    return Result(
        {**metrics, **out},
        1,
        old_logprobs=old_out,
        old_entropy=ent_out,
        weights=w_local,
        log_ratios=ratio_local,
    )
