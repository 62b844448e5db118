"""The run config composed with its parts: the chosen loss's own parameters, checked by the loss's own model.

:mod:`nemo_disco.config` holds the sections and loads recipes; it imports no loss, so the ``loss`` section's keys
other than those every loss shares are open there. Each loss declares its parameter model once, beside the loss
(:func:`nemo_disco.losses.register_loss`, or the ``Params`` of a ``package.module:Class`` loss of the user's own).
Here the two meet, once, at start-up: :func:`compose` checks the section against the chosen loss's model and fills in
its defaults, :func:`load` is :func:`nemo_disco.config.load` composed, and :func:`loss_of` binds the loss.

A parameter a model reads from another section (:func:`nemo_disco.losses.from_run`: ``reward.positive_threshold``,
``generation.max_response_tokens``) comes from there and is refused in the ``loss`` section.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ValidationError

from nemo_disco import losses
from nemo_disco.config import ConfigError, LossConfig, RunConfig, key_place
from nemo_disco.config import load as load_config


class LossKeyError(ConfigError):
    """A key of the ``loss`` section the chosen loss does not take (``key``: its name in the section)."""

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
            raise LossKeyError(key, f"loss.{key} is not set in the loss section: the loss reads {from_run[key]}")
        if key not in loss.hparams.model_fields:
            raise LossKeyError(key, losses.not_a_parameter(loss, key, prefix="loss.", unknown="unknown config key"))
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


def compose(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its ``loss`` section checked against the chosen loss's model and completed with its defaults.

    The parameters read from other sections are left there. Composing a composed config changes nothing.

    Raises:
        ConfigError: one line (see :func:`loss_of`).
    """
    loss = loss_of(cfg)
    from_run = losses.run_keys(loss.hparams)
    own = {k: v for k, v in loss.hyperparameters.items() if k not in from_run}
    shared = {k: getattr(cfg.loss, k) for k in LossConfig.model_fields}
    return cfg.model_copy(update={"loss": LossConfig(**shared, **own)})


def load(recipe: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Compose, override and validate a recipe (:func:`nemo_disco.config.load`), its loss section included.

    Raises:
        ConfigError: one line naming the file (and line) or key.
    """
    cfg = load_config(recipe, overrides)
    try:
        return compose(cfg)
    except LossKeyError as err:
        given = any(o.lstrip("+~").startswith(f"loss.{err.key}=") for o in overrides)
        place = None if given else key_place(recipe, f"loss.{err.key}")
        raise ConfigError(f"{place}: {err}" if place else str(err)) from None
