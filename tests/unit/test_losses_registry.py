"""nemo_disco.losses.registry: names, lookup errors, hyper-parameters from the run config and their defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nemo_disco import config as config_lib
from nemo_disco import losses
from nemo_disco.config import ConfigError, LossConfig


def test_registry_and_lookup_errors() -> None:
    names = ["disco", "discob", "drpo", "grpo", "grpo_rw", "dr_grpo", "dapo", "grpo_er", "gpg", "trpa"]
    assert list(losses.LOSSES) == names
    with pytest.raises(ValueError, match="valid names: " + ", ".join(names)):
        losses.get_loss("ppo")
    with pytest.raises(ValueError, match=r"loss 'disco' got unknown hyper-parameter\(s\) \['clip_eps'\]"):
        losses.get_loss("disco", clip_eps=0.2)
    with pytest.raises(ValueError, match="loss 'disco': tau=-1.0 must be > 0"):
        losses.get_loss("disco", tau=-1.0)
    with pytest.raises(ValueError, match="score='ratio' must be 'logl' or 'lratio'"):
        losses.get_loss("discob", score="ratio")


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_loss_kwargs_from_config(name: str) -> None:
    cfg = config_lib.validate(
        {
            "loss": {
                "name": name,
                "tau": 2.0,
                "entropy_coef": 0.01 if name == "grpo_er" else None,
                "drpo_lambda": 0.3 if name == "drpo" else None,
            },
            "reward": {"positive_threshold": 0.0},
            "generation": {"max_response_tokens": 4096},
        }
    )
    hp = config_lib.loss_kwargs(cfg)
    fn = losses.get_loss(name, **hp)
    assert hp["positive_threshold"] == 0.0
    assert set(hp) <= {f.name for f in dataclasses.fields(fn.hparams)}
    assert hp.get("tau") == (2.0 if name in ("disco", "drpo") else None)
    assert ("max_response_tokens" in hp) == (name in ("dr_grpo", "drpo"))
    if name in ("dr_grpo", "drpo"):
        assert hp["max_response_tokens"] == 4096
    assert hp.get("drpo_lambda") == (0.3 if name == "drpo" else None)
    if name == "grpo_er":
        assert hp["entropy_coef"] == 0.01
    fn.params(**hp)  # accepted as is


def test_loss_kwargs_rejects_terms_the_loss_lacks() -> None:
    with pytest.raises(ConfigError, match="loss.kl_coef=0.001 has no effect with loss.name=disco"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "disco", "kl_coef": 0.001}}))
    with pytest.raises(ConfigError, match="loss.kl_coef=0.001 has no effect with loss.name=dapo"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "dapo", "kl_coef": 0.001}}))
    with pytest.raises(ConfigError, match="loss.entropy_coef=0.01 has no effect with loss.name=grpo"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "grpo", "entropy_coef": 0.01}}))
    # GPG's and TRPA's keys, away from their defaults, for a loss without them.
    with pytest.raises(ConfigError, match="loss.alpha_correction=False has no effect with loss.name=dr_grpo"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "dr_grpo", "alpha_correction": False}}))
    with pytest.raises(ConfigError, match="loss.trpa_beta=0.2 has no effect with loss.name=gpg"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "gpg", "trpa_beta": 0.2}}))
    with pytest.raises(ConfigError, match="loss.kl_coef=0.001 has no effect with loss.name=trpa"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "trpa", "kl_coef": 0.001}}))
    # At their defaults they are no choice, so every loss accepts them.
    hp = config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "trpa", "trpa_beta": 0.2, "tr_kl_coef": 0.0}}))
    assert hp["trpa_beta"] == 0.2 and hp["tr_kl_coef"] == 0.0 and hp["trpa_anisotropy"] == 2.5
    assert config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "disco"}}))["tau"] == 10.0
    with pytest.raises(ConfigError, match="loss.drpo_lambda=0.5 has no effect with loss.name=disco"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "disco", "drpo_lambda": 0.5}}))


def test_loss_defaults_live_beside_the_loss_only():
    # The schema holds no default of its own for a loss hyper-parameter: null means the loss's default, so
    # loss.name=dapo gets DAPO's clip-higher and grpo_er its entropy bonus without the recipe that sets them.
    from nemo_disco.config import AlgorithmConfig

    for key, f in LossConfig.model_fields.items():
        if key not in ("name", "rollout_correction", "rollout_correction_cap"):
            assert f.default is None, key
    assert "minibatch_prompts" in AlgorithmConfig.model_fields  # (the schema is still where other defaults live)
    exemplar = config_lib.load(Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml")
    for name, key, expected in (("dapo", "clip_eps_high", 0.28), ("grpo", "clip_eps_high", None),
                                ("grpo_er", "entropy_coef", 1e-3), ("disco", "tau", 10.0)):  # fmt: skip
        cfg = config_lib.validate({**exemplar.model_dump(mode="json"), "loss": {"name": name}})
        assert config_lib.loss_kwargs(cfg)[key] == expected, (name, key)
        cfg = config_lib.validate(
            {**exemplar.model_dump(mode="json"), "loss": {**exemplar.loss.model_dump(), "name": name}}
        )
        assert config_lib.loss_kwargs(cfg)[key] == expected, (name, key, "on the exemplar's loss section")
    assert losses.get_loss("dapo").hyperparameters["clip_eps_high"] == 0.28
