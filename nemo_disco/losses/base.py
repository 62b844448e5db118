"""The loss object and its machinery.

Hyper-parameter models, coupling declarations, :class:`Loss`, :func:`coefficients` and :func:`surrogate` (the
exact two-pass gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor

from nemo_disco.losses.reduce import check_tokens

# ----------------------------------------------------------------------------------------------------------------------
# Hyper-parameters: one pydantic model per loss, defined beside the loss and declared with it (registry.register_loss).
# Its fields (type, range, default) are exactly the keyword arguments the loss takes: it is the schema of the run
# config's ``loss`` section for that loss, and get_loss binds its values once.

#: Field metadata naming the run-config key a parameter is read from (:func:`from_run`).
RUN_KEY = "run_key"


def from_run(key: str, default: Any, **constraints: Any) -> Any:
    """A parameter the run config sets from another section (``key``, e.g. ``generation.max_response_tokens``).

    The ``loss`` section does not take it: the value is the run's own, so the two cannot disagree.
    """
    return Field(default, json_schema_extra={RUN_KEY: key}, **constraints)


class Hyper(BaseModel):
    """Hyper-parameters every loss takes; a loss's parameter model subclasses it with its own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, validate_default=True)

    # Rollouts with a reward above it are positives: the run's reward.positive_threshold.
    positive_threshold: float = from_run("reward.positive_threshold", 0.5)
    # Estimator of KL(pi_old || pi_theta): the constraint of DisCO, a monitored metric for the GRPO family.
    kl: Literal["k1", "k3"] = "k1"
    # Largest |log pi_theta - log pi_old| fed to exp() (L-ratio score, k3 estimators; clamped, counted).
    max_log_ratio: float = Field(20.0, gt=0)

    @property
    def needs_reference(self) -> bool:
        """Whether these settings need the reference policy's log-probs."""
        return False


def run_keys(model: type[Hyper]) -> dict[str, str]:
    """The parameters of ``model`` read from elsewhere in the run config: name -> dotted config key."""
    out = {}
    for name, f in model.model_fields.items():
        extra = f.json_schema_extra
        if isinstance(extra, dict) and RUN_KEY in extra:
            out[name] = str(extra[RUN_KEY])
    return out


def validation_message(err: ValidationError, prefix: str = "") -> str:
    """A pydantic error of a parameter model as one line: ``tau=-1.0: input should be greater than 0``.

    ``prefix`` is put before each key (``loss.`` in the run config's spelling).
    """
    found: dict[str, list[str]] = {}
    for e in err.errors():
        # A union's members name themselves in the location (constrained-float, literal['auto']): one key, its
        # members' messages joined by "or".
        keys = [str(x) for x in e["loc"] if isinstance(x, int) or str(x).isidentifier()]
        msg = e["msg"].removeprefix("Value error, ")
        msg = msg[:1].lower() + msg[1:]
        head = f"{prefix}{'.'.join(keys)}={e['input']!r}" if keys else ""
        found.setdefault(head, []).append(msg)
    return "; ".join(f"{head}: {' or '.join(msgs)}" if head else " or ".join(msgs) for head, msgs in found.items())


# ----------------------------------------------------------------------------------------------------------------------
# Coupling: how far the coefficients c_i = dL/dstats_i of an objective reach (Loss.coupling).

ROLLOUT, QUESTION, MINIBATCH = "rollout", "question", "minibatch"
COUPLINGS = (ROLLOUT, QUESTION, MINIBATCH)


def rollout_coupled(p: Hyper, first_update: bool, weighted: bool) -> str:
    """Linear in each rollout's statistics with coefficients known in advance (GRPO family, DAPO, GPG).

    The advantages come from rewards, the clip is per token, the denominators (N, Q, T_q, T_tot, alpha) and
    the KL-to-reference and entropy terms are sums of per-rollout statistics; rollout i's weight is its own.
    """
    return ROLLOUT


def question_coupled(p: Hyper, first_update: bool, weighted: bool) -> str:
    """Nonlinear or weight-normalised within a question only (GRPO_RW's weighted means, TRPA's pairs).

    TRPA's trust region ``tr_kl_coef * sum_i tr_kl_i / T_tot`` is linear in the statistics: no coupling.
    """
    if weighted and getattr(p, "divisor", "all") == "valid":
        return MINIBATCH  # the divisor counts questions whose weights are > 0, over the whole mini-batch
    return QUESTION


def constrained_coupling(p: Hyper, first_update: bool, weighted: bool) -> str:
    """DisCO, DisCO-b: the DRO / mean terms couple one question; the KL hinge couples the whole mini-batch.

    The hinge ``beta [K - delta]_+^2`` (and the authors' ``sg(max(beta (K - delta), 0)) K``) and its gradient
    are exactly 0 where K = 0 <= delta, i.e. at the first update of a step (pi_theta = pi_old: every token's
    k1 ``old - new`` and k3 ``expm1(d) - d`` are 0), and everywhere with beta = 0.
    """
    if weighted and p.divisor == "valid":
        return MINIBATCH  # the divisor counts questions whose weights are > 0, over the whole mini-batch
    return QUESTION if first_update or p.beta == 0 else MINIBATCH


# ----------------------------------------------------------------------------------------------------------------------
# The Loss object and the trainer-facing helpers (the registry: nemo_disco.losses.registry).


@dataclass(frozen=True)
class Loss:
    """One objective: per-rollout statistics + a mini-batch objective of them.

    Attributes:
        name: registry key.
        stat_names: column order of the [N, K] statistics tensor.
        needs_entropy: ``stats`` needs the per-token entropy [N, T].
        needs_reference: ``stats`` needs the reference policy's log-probs [N, T]. For the GRPO family this
            depends on ``kl_coef``: :func:`get_loss` with hyper-parameters (or :meth:`bind`) resolves it.
        hparams: the loss's parameter model (pydantic): its fields, with their ranges and defaults, are the
            hyper-parameters this loss takes.
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
    hparams: type[Hyper]
    stats_fn: Callable[..., Tensor]
    objective_fn: Callable[..., tuple[Tensor, dict[str, Tensor | float]]]
    coupling_fn: Callable[[Any, bool, bool], str]
    bound: Hyper | None = None

    def params(self, **hp: Any) -> Hyper:
        """Validate hyper-parameters into this loss's parameter model.

        Raises:
            ValueError: one line naming the loss and the unknown or invalid key.
        """
        names = list(self.hparams.model_fields)
        unknown = sorted(set(hp) - set(names))
        if unknown:
            raise ValueError(f"loss {self.name!r} got unknown hyper-parameter(s) {unknown}; it takes {names}")
        try:
            return self.hparams(**hp)
        except ValidationError as err:
            raise ValueError(f"loss {self.name!r}: {validation_message(err)}") from None

    def bind(self, **hp: Any) -> Loss:
        """This loss with these hyper-parameters validated and bound (``needs_reference`` resolved for them)."""
        p = self.params(**hp)
        return replace(self, needs_reference=self.needs_reference or p.needs_reference, bound=p)

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The bound hyper-parameters (defaults where none were bound), every one of them."""
        return self._resolve({}).model_dump()

    def _resolve(self, hp: dict[str, Any]) -> Hyper:
        """The bound hyper-parameters; with ``hp``, those replaced (validated: the trainer never passes any)."""
        if not hp:
            return self.bound if self.bound is not None else self.params()
        return self.params(**({**self.bound.model_dump(), **hp} if self.bound is not None else hp))

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
        check_tokens(logprobs, old_logprobs, mask, entropy=entropy, ref_logprobs=ref_logprobs)
        if self.needs_entropy and entropy is None:
            raise ValueError(f"loss {self.name!r} needs entropy=[N, T] (per-token entropy of the policy)")
        if p.needs_reference and ref_logprobs is None:
            # The GRPO family (ClipParams) needs it for its KL regulariser; TRPA always.
            why = f"with kl_coef={p.kl_coef} > 0" if hasattr(p, "kl_coef") else "(a log-ratio to the reference)"
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


def _floats(metrics: dict[str, Tensor | float], loss: Tensor) -> dict[str, float]:
    """Metrics as python floats with one device sync; adds ``loss``."""
    out = {k: v for k, v in metrics.items() if not isinstance(v, Tensor)}
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in keys] + [loss.detach().double()])
    flat = values.tolist()
    out.update({k: float(v) for k, v in zip(keys, flat[:-1], strict=True)})
    out["loss"] = float(flat[-1])
    return {k: float(v) for k, v in out.items()}
