"""The run config composed with its parts: each chosen part's own parameters, checked by the part's own model.

:mod:`nemo_disco.config` holds the sections and loads recipes; it imports no part, so the keys of the ``loss``,
``generation`` and ``reward`` sections other than those every loss / backend / grader shares are open there. Each
part declares its parameter model once: a loss beside its code (:func:`nemo_disco.losses.register_loss`, or the
``Params`` of a ``package.module:Class`` loss of the user's own), a generator backend in :mod:`nemo_disco.generators`,
a grader beside its code (:func:`nemo_disco.rewards.register_grader`). Here they meet, once, at start-up:
:func:`compose` checks each section against the chosen part's model and fills in its defaults, :func:`load` is
:func:`nemo_disco.config.load` composed, :func:`loss_of` binds the loss and :func:`grader_params` gives the grading
workers their parameters.

A parameter a model reads from another section (:func:`nemo_disco.losses.from_run`: ``reward.positive_threshold``,
``generation.max_response_tokens``) comes from there and is refused in the ``loss`` section.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from nemo_disco import generators, losses
from nemo_disco.config import (
    ConfigError,
    GenerationConfig,
    LossConfig,
    RewardConfig,
    RunConfig,
    _PartSection,
    key_place,
)
from nemo_disco.config import load as load_config
from nemo_disco.registry import Registry
from nemo_disco.rewards.registry import GRADERS, GraderParams

T = TypeVar("T")


class PartKeyError(ConfigError):
    """A key of a part's section that the chosen part does not take (``key``: its dotted name in the run config)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _find(cfg: RunConfig) -> losses.Loss:
    try:
        loss = losses.find_loss(cfg.loss.name)
    except ValueError as err:
        raise ConfigError(f"loss.name: {err}") from None
    clash = sorted(set(loss.hparams.model_fields) & set(LossConfig.model_fields))
    if clash:
        raise ConfigError(f"loss {loss.name!r}: its parameter(s) {clash} clash with the loss section's shared keys")
    return loss


def _hyperparameters(cfg: RunConfig, loss: losses.Loss) -> dict[str, Any]:
    """The chosen loss's hyper-parameters: the section's values (null: the loss's default) and the run's values."""
    from_run = losses.run_keys(loss.hparams)
    hp: dict[str, Any] = {}
    for key, value in (cfg.loss.model_extra or {}).items():
        if key in from_run:
            raise PartKeyError(
                f"loss.{key}", f"loss.{key} is not set in the loss section: the loss reads {from_run[key]}"
            )
        if key not in loss.hparams.model_fields:
            raise PartKeyError(
                f"loss.{key}", losses.not_a_parameter(loss, key, prefix="loss.", unknown="unknown config key")
            )
        if value is not None:
            hp[key] = value
    for key, path in from_run.items():
        value: Any = cfg
        for name in path.split("."):
            if not isinstance(value, BaseModel) or name not in type(value).model_fields:
                raise ConfigError(f"loss {loss.name!r}: its parameter {key} reads {path}, which is not a config key")
            value = getattr(value, name)
        hp[key] = value
    return hp


def loss_of(cfg: RunConfig) -> losses.Loss:
    """The run's loss with every hyper-parameter validated and bound (defaults for those the config leaves out).

    Raises:
        ConfigError: one line: an unknown loss, a key it does not take (naming the losses that do) or a bad value.
    """
    loss = _find(cfg)
    hp = _hyperparameters(cfg, loss)
    try:
        loss.hparams(**hp)
    except ValidationError as err:  # in the run config's spelling: loss.tau=-1.0: input should be greater than 0
        raise ConfigError(losses.validation_message(err, prefix="loss.")) from None
    return loss.bind(**hp)


def _part_params(section: str, values: _PartSection, models: Mapping[str, type[BaseModel]]) -> BaseModel:
    """The extra keys of part section ``section`` (``values``) checked by the chosen part's model, with its defaults.

    ``models``: every registered part's parameter model by name; the chosen one is ``values``'s ``PART_KEY``.

    Raises:
        PartKeyError: a key the chosen part does not take: naming the parts that have it, or the closest key.
        ConfigError: a bad value (``generation.sleep_level=3: input should be 0, 1, 2 or 'auto'``).
    """
    chosen = getattr(values, values.PART_KEY)
    own = models[chosen].model_fields
    for key in values.model_extra or {}:
        if key in own:
            continue
        owners = [name for name, model in models.items() if key in model.model_fields]
        if owners:
            have = "has" if len(owners) == 1 else "have"
            message = f"{section}.{key} is not a parameter of {chosen} ({', '.join(owners)} {have} it)"
        else:
            hint = difflib.get_close_matches(key, [*type(values).model_fields, *own], n=1)
            did = f" (did you mean {section}.{hint[0]}?)" if hint else ""
            message = f"unknown config key '{section}.{key}'{did}; {chosen} takes: {', '.join(own) or 'nothing'}"
        raise PartKeyError(f"{section}.{key}", message)
    try:
        return models[chosen](**(values.model_extra or {}))
    except ValidationError as err:
        raise ConfigError(losses.validation_message(err, prefix=f"{section}.")) from None


def find_part(registry: Registry[T], key: str, name: str) -> T:
    """The part called ``name`` in ``registry``, as config key ``key`` chose it.

    Raises:
        ConfigError: ``reward.grader: unknown grader 'x'; registered: ...`` (one line).
    """
    try:
        return registry.find(name)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def generation_of(cfg: RunConfig) -> generators.BackendParams:
    """The run's generator backend's own parameters, validated (defaults for those the config leaves out).

    Raises:
        ConfigError: one line: an unknown backend, a key it does not take (naming the backends that do), a bad
            value, or ranks per engine for a backend that runs one process per engine.
    """
    g = cfg.generation
    backend = find_part(generators.BACKENDS, "generation.backend", g.backend)
    params = _part_params("generation", g, {name: b.params for name, b in generators.BACKENDS.items()})
    if g.tensor_parallel_size != 1 and not backend.tensor_parallel:
        tp = [n for n, b in generators.BACKENDS.items() if b.tensor_parallel]
        raise ConfigError(
            f"generation.tensor_parallel_size={g.tensor_parallel_size} needs generation.backend={' or '.join(tp)} "
            f"({g.backend} runs one engine per process)"
        )
    return params  # type: ignore[return-value]


def reward_of(cfg: RunConfig) -> GraderParams:
    """The run's grader's own parameters, validated (defaults for those the config leaves out).

    Raises:
        ConfigError: one line: an unknown grader, a key it does not take (naming the graders that do) or a bad value.
    """
    find_part(GRADERS, "reward.grader", cfg.reward.grader)
    return _part_params("reward", cfg.reward, {name: g.params for name, g in GRADERS.items()})  # type: ignore[return-value]


def grader_params(cfg: RunConfig) -> dict[str, Any]:
    """The run's grader's parameters as a :class:`~nemo_disco.rewards.GraderPool` takes them (every key)."""
    return reward_of(cfg).model_dump(mode="json")


def compose(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its part sections checked against the chosen parts' models and completed with their defaults.

    ``loss``: the chosen loss's parameters (those read from other sections are left there); ``generation``: the
    chosen backend's; ``reward``: the chosen grader's. Composing a composed config changes nothing.

    Raises:
        ConfigError: one line (see :func:`loss_of`, :func:`generation_of`, :func:`reward_of`).
    """
    loss = loss_of(cfg)
    from_run = losses.run_keys(loss.hparams)
    own = {k: v for k, v in loss.hyperparameters.items() if k not in from_run}
    shared = {k: getattr(cfg.loss, k) for k in LossConfig.model_fields}
    backend = generation_of(cfg)
    generation = {k: getattr(cfg.generation, k) for k in GenerationConfig.model_fields}
    grader = reward_of(cfg)
    reward = {k: getattr(cfg.reward, k) for k in RewardConfig.model_fields}
    return cfg.model_copy(
        update={
            "loss": LossConfig(**shared, **own),
            "generation": GenerationConfig(**generation, **backend.model_dump()),
            "reward": RewardConfig(**reward, **grader.model_dump()),
        }
    )


def load(recipe: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Compose, override and validate a recipe (:func:`nemo_disco.config.load`), its loss section included.

    Raises:
        ConfigError: one line naming the file (and line) or key.
    """
    return compose_loaded(load_config(recipe, overrides), recipe, overrides)


def compose_loaded(cfg: RunConfig, recipe: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """:func:`compose` of ``cfg``, loaded from ``recipe`` and ``overrides``: a bad loss key is named where it is set.

    For a caller that needs the config before torch loads (the losses import it): ``nemo-disco train`` sets
    OpenMP's environment from the loaded config first.

    Raises:
        ConfigError: one line naming the file (and line) or key.
    """
    try:
        return compose(cfg)
    except PartKeyError as err:
        given = any(o.lstrip("+~").startswith(f"{err.key}=") for o in overrides)
        place = None if given else key_place(recipe, err.key)
        raise ConfigError(f"{place}: {err}" if place else str(err)) from None
