"""The registry of losses: each declares itself once (:func:`register_loss`); :func:`get_loss` finds and binds one.

A loss is declared by decorating its objective::

    @register_loss("disco", params=DiscoParams, stat_names=SCORE_STATS, stats=score_stats,
                   coupling=constrained_coupling)
    def disco_objective(stats, group_ids, rewards, weights, p): ...

``params`` is its parameter model (a :class:`~nemo_disco.losses.base.Hyper` subclass: the types, ranges and
defaults of its hyper-parameters, and the schema of the run config's ``loss`` section when it is chosen).

A loss of the user's own is named ``"package.module:Class"`` (:func:`load_loss`): the class gives the same
declaration as attributes (``Params``, ``stat_names``, ``stats``, ``objective``, optional ``coupling`` and
``needs_entropy``; docs/losses.md) and is trained exactly like a registered loss.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor

from nemo_disco.losses.base import MINIBATCH, Hyper, Loss, run_keys

Objective = TypeVar("Objective", bound=Callable[..., tuple[Tensor, dict[str, Tensor | float]]])

#: Every registered loss by name, in the order of declaration.
LOSSES: dict[str, Loss] = {}

#: ``package.module:Class``: a loss of the user's own.
USER_LOSS = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def register_loss(
    name: str,
    *,
    params: type[Hyper],
    stat_names: tuple[str, ...],
    stats: Callable[..., Tensor],
    coupling: Callable[[Any, bool, bool], str],
    needs_entropy: bool = False,
) -> Callable[[Objective], Objective]:
    """Declare the decorated objective as the loss ``name``: its parameter model, statistics and coupling.

    Args:
        name: the registry key (``loss.name`` in a recipe).
        params: the parameter model; its fields are the hyper-parameters the loss takes.
        stat_names: the column names of the ``[N, K]`` statistics ``stats`` returns.
        stats: ``(logprobs, old_logprobs, mask, entropy, ref_logprobs, p) -> [N, K]``.
        coupling: ``(p, first_update, weighted) -> ROLLOUT | QUESTION | MINIBATCH`` (:meth:`Loss.coupling`).
        needs_entropy: ``stats`` reads the per-token entropy.

    Raises:
        ValueError: ``name`` is registered already or is not an identifier.
    """

    def declare(objective: Objective) -> Objective:
        if not name.isidentifier():
            raise ValueError(f"loss name {name!r} must be an identifier")
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        LOSSES[name] = _loss(name, params, stat_names, stats, objective, coupling, needs_entropy)
        return objective

    return declare


def _loss(
    name: str,
    params: type[Hyper],
    stat_names: tuple[str, ...],
    stats: Callable[..., Tensor],
    objective: Callable[..., tuple[Tensor, dict[str, Tensor | float]]],
    coupling: Callable[[Any, bool, bool], str],
    needs_entropy: bool,
) -> Loss:
    # needs_reference as the model's defaults want it (the GRPO family's kl_coef = 0: no; TRPA: always);
    # get_loss(name, **hp) resolves it for other hyper-parameters.
    return Loss(name, tuple(stat_names), needs_entropy, params().needs_reference, params, stats, objective, coupling)


def find_loss(name: str) -> Loss:
    """The loss ``name``: a registered name, or ``"package.module:Class"`` (:func:`load_loss`); unbound.

    Raises:
        ValueError: one line: an unknown name (listing the valid ones) or a user loss that does not load.
    """
    if name in LOSSES:
        return LOSSES[name]
    if USER_LOSS.match(name):
        return load_loss(name)
    hint = difflib.get_close_matches(name, list(LOSSES), n=1)
    did = f" (did you mean {hint[0]}?)" if hint else ""
    raise ValueError(
        f"unknown loss {name!r}{did}; valid names: {', '.join(LOSSES)}, or package.module:Class for a loss of your own"
    )


def get_loss(name: str, **hp: Any) -> Loss:
    """The loss ``name`` with its hyper-parameters validated and bound once (defaults for the rest).

    ``loss(logprobs, old_logprobs, mask, group_ids, rewards, entropy=, ref_logprobs=, weights=)`` then returns
    ``(value, metrics)``; its ``stats`` / ``objective`` / ``coupling`` and :func:`coefficients` use the bound values.

    Raises:
        ValueError: unknown name (the message lists the valid names), a key the loss does not take (naming the
            losses that take it) or an invalid value.
    """
    loss = find_loss(name)
    for key in hp:
        if key not in loss.hparams.model_fields:
            raise ValueError(not_a_parameter(loss, key))
    return loss.bind(**hp)


def not_a_parameter(loss: Loss, key: str, prefix: str = "", unknown: str = "unknown hyper-parameter") -> str:
    """One line for a key ``loss`` does not take: the losses that take it, or else the keys it does take.

    ``tau is not a parameter of grpo (disco, drpo have it)``; ``unknown hyper-parameter 'betta' (did you mean
    beta?); disco takes: ...``. ``prefix`` spells the key as the caller does (``loss.`` in the run config); the
    listed keys leave out those read from elsewhere in the run config (:func:`~nemo_disco.losses.base.from_run`)
    when a prefix is given.
    """
    owners = [n for n, other in LOSSES.items() if key in other.hparams.model_fields]
    if owners:
        have = "has" if len(owners) == 1 else "have"
        return f"{prefix}{key} is not a parameter of {loss.name} ({', '.join(owners)} {have} it)"
    names = [n for n in loss.hparams.model_fields if not (prefix and n in run_keys(loss.hparams))]
    hint = difflib.get_close_matches(key, names, n=1)
    did = f" (did you mean {prefix}{hint[0]}?)" if hint else ""
    return f"{unknown} '{prefix}{key}'{did}; {loss.name} takes: {', '.join(names)}"


def load_loss(spec: str) -> Loss:
    """A loss of the user's own, ``"package.module:Class"``: imported and declared as a registered loss is.

    The class declares (as class attributes; static methods for the functions):

    * ``Params``: its parameter model, a subclass of :class:`~nemo_disco.losses.base.Hyper`;
    * ``stat_names``: the columns of its statistics; ``stats(logprobs, old_logprobs, mask, entropy, ref_logprobs,
      p) -> [N, K]``: per-rollout statistics, each a function of that rollout's own tokens;
    * ``objective(stats, group_ids, rewards, weights, p) -> (loss, metrics)``: the mini-batch loss;
    * optional ``coupling(p, first_update, weighted)``: how far its coefficients reach (default: the whole
      mini-batch, always exact); optional ``needs_entropy`` (default False).

    Raises:
        ValueError: one line naming ``spec``: the module does not import, the class is missing or incomplete.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import failure of the user's module is the user's to fix
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"loss {spec!r}: module {module_name!r} does not import: {first}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"loss {spec!r}: module {module_name!r} has no {attr!r}")
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, Hyper)):
        raise ValueError(f"loss {spec!r}: {attr}.Params must be a parameter model, a subclass of losses.Hyper")
    missing = [a for a in ("stat_names", "stats", "objective") if getattr(cls, a, None) is None]
    if missing:
        raise ValueError(f"loss {spec!r}: {attr} lacks {', '.join(missing)} (docs/losses.md: a loss of your own)")
    try:
        return _loss(
            spec,
            params,
            tuple(cls.stat_names),
            cls.stats,
            cls.objective,
            getattr(cls, "coupling", None) or _whole_minibatch,
            bool(getattr(cls, "needs_entropy", False)),
        )
    except Exception as err:  # e.g. a Params whose defaults do not validate
        raise ValueError(f"loss {spec!r}: {str(err).strip().splitlines()[0]}") from None


def _whole_minibatch(p: Any, first_update: bool, weighted: bool) -> str:
    """The coupling of a loss that declares none: the whole mini-batch (two passes, exact for any objective)."""
    return MINIBATCH
