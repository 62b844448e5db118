"""The registry of losses by name: :data:`LOSSES`, :func:`get_loss` (binds hyper-parameters), :func:`default_of`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from torch import Tensor

from nemo_disco.losses.base import Hyper, Loss, constrained_coupling, question_coupled, rollout_coupled
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
    clip_stats_with_entropy,
    dapo_objective,
    dr_grpo_objective,
    grpo_er_objective,
    grpo_objective,
    grpo_rw_objective,
)
from nemo_disco.losses.trpa import TRPA_STATS, TrpaParams, trpa_objective, trpa_stats


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


def _registered(
    name: str,
    hparams: type[Hyper],
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
    "disco": _registered("disco", DiscoParams, SCORE_STATS, score_stats, disco_objective, constrained_coupling),
    "discob": _registered("discob", DiscobParams, SCORE_STATS, score_stats, discob_objective, constrained_coupling),
    "drpo": _registered("drpo", DrpoParams, SCORE_STATS, score_stats, drpo_objective, constrained_coupling),
    "grpo": _registered("grpo", ClipParams, CLIP_STATS, clip_stats, grpo_objective, rollout_coupled),
    "grpo_rw": _registered("grpo_rw", GrpoRwParams, CLIP_STATS, clip_stats, grpo_rw_objective, question_coupled),
    "dr_grpo": _registered("dr_grpo", DrGrpoParams, CLIP_STATS, clip_stats, dr_grpo_objective, rollout_coupled),
    "dapo": _registered("dapo", DapoParams, CLIP_STATS, clip_stats, dapo_objective, rollout_coupled),
    "grpo_er": _registered(
        "grpo_er",
        GrpoErParams,
        CLIP_STATS + ("entropy_sum",),
        clip_stats_with_entropy,
        grpo_er_objective,
        rollout_coupled,
        needs_entropy=True,
    ),
    "gpg": _registered("gpg", GpgParams, GPG_STATS, gpg_stats, gpg_objective, rollout_coupled),
    "trpa": _registered("trpa", TrpaParams, TRPA_STATS, trpa_stats, trpa_objective, question_coupled),
}
