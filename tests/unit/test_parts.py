"""nemo_disco.parts: the run config's loss section checked by the chosen loss's own parameter model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from loss_reference import write_docs_loss_example

from nemo_disco import config, losses, parts
from nemo_disco.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXEMPLAR = ROOT / "recipes" / "disco.yaml"
TINY = ROOT / "recipes" / "tiny-cpu.yaml"
GRPO = ROOT / "recipes" / "grpo-r1qwen1.5b-1n8g-8k.yaml"


def test_a_key_of_another_loss_fails_in_one_line_naming_the_losses_that_have_it(tmp_path):
    with pytest.raises(ConfigError) as err:
        parts.load(GRPO, ["loss.tau=1"])
    assert str(err.value) == "loss.tau is not a parameter of grpo (disco, drpo have it)"
    # In a recipe file: the file and the line that set it.
    (tmp_path / "mine.yaml").write_text("defaults:\n  - disco\n  - _self_\nloss:\n  name: gpg\n  kl_coef: 0.001\n")
    with pytest.raises(ConfigError) as err:
        parts.load(tmp_path / "mine.yaml")
    assert str(err.value) == (
        f"{tmp_path / 'mine.yaml'}:6: loss.kl_coef is not a parameter of gpg (grpo, grpo_rw, dr_grpo, grpo_er have it)"
    )


def test_an_unknown_key_names_the_losses_keys():
    with pytest.raises(ConfigError) as err:
        parts.load(GRPO, ["loss.clip=0.1"])
    assert str(err.value) == (
        "unknown config key 'loss.clip' (did you mean loss.clip_eps?); grpo takes: kl, max_log_ratio, clip_eps, "
        "clip_eps_high, kl_coef"
    )


def test_naming_another_loss_starts_the_section_afresh(tmp_path):
    # The exemplar sets disco's keys; a recipe or an override that names another loss keeps none of them, only the
    # keys every loss shares, and gets that loss's defaults.
    cfg = parts.load(TINY, ["loss.rollout_correction=seq_tis", "loss.name=grpo"])
    assert cfg.loss.model_dump() == {
        "name": "grpo",
        "rollout_correction": "seq_tis",
        "rollout_correction_cap": 2.0,
        **{k: v for k, v in losses.get_loss("grpo").hyperparameters.items() if k != "positive_threshold"},
    }
    # The same loss named again keeps what the layers before set for it.
    assert parts.load(TINY, ["loss.name=disco"]).loss.tau == 10.0
    (tmp_path / "lratio.yaml").write_text("defaults:\n  - disco\n  - _self_\nloss:\n  score: lratio\n  tau: 1.0\n")
    (tmp_path / "child.yaml").write_text("defaults:\n  - lratio\n  - _self_\nloss:\n  name: drpo\n")
    cfg = parts.load(tmp_path / "child.yaml")
    assert (cfg.loss.name, cfg.loss.score, cfg.loss.tau) == ("drpo", "logl", 10.0)
    # A recipe that names no loss adds to the one it inherits: a key that loss lacks fails.
    (tmp_path / "grpo_child.yaml").write_text(f"defaults:\n  - {GRPO.stem}\n  - _self_\nloss:\n  beta: 1.0\n")
    with pytest.raises(ConfigError, match=r"grpo_child.yaml:5: loss.beta is not a parameter of grpo \(disco, discob"):
        parts.load(tmp_path / "grpo_child.yaml")


def test_values_the_loss_reads_from_other_sections_come_from_there():
    cfg = parts.load(TINY, ["loss.name=drpo", "generation.max_response_tokens=64", "reward.positive_threshold=0.0"])
    hp = parts.loss_of(cfg).hyperparameters
    assert (hp["max_response_tokens"], hp["positive_threshold"]) == (64, 0.0)
    assert "max_response_tokens" not in cfg.loss.model_dump()  # stated once, in generation
    with pytest.raises(ConfigError, match="^loss.max_response_tokens is not set in the loss section: the loss reads "):
        parts.load(TINY, ["loss.name=drpo", "loss.max_response_tokens=64"])


def test_null_takes_the_losses_default_and_composing_twice_changes_nothing():
    cfg = parts.load(EXEMPLAR, ["loss.name=dapo", "loss.clip_eps_high=null"])
    assert cfg.loss.clip_eps_high == 0.28
    assert parts.compose(cfg) == cfg
    assert "entropy_coef: 0.001" in config.to_yaml(parts.load(EXEMPLAR, ["loss.name=grpo_er"]))
    # config alone leaves the loss's own keys to the loss: it validates the shared ones.
    assert config.load(GRPO, ["loss.tau=1"]).loss.tau == 1
    with pytest.raises(ConfigError, match="loss.rollout_correction_cap=0"):
        config.load(GRPO, ["loss.rollout_correction_cap=0"])


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(TINY), "--print-config", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_the_cli_takes_a_loss_of_the_users_own_and_names_what_is_wrong_in_one_line(tmp_path):
    name = write_docs_loss_example(tmp_path)  # docs/losses.md's worked example, on PYTHONPATH
    ok = _cli(tmp_path, f"loss.name={name}", "loss.scale=0.5")
    assert ok.returncode == 0, ok.stderr
    assert f"name: {name}" in ok.stdout and "scale: 0.5" in ok.stdout and "tau:" not in ok.stdout
    for override, fragment in (
        ("loss.name=no_such_losses:Mean", "loss 'no_such_losses:Mean': module 'no_such_losses' does not import"),
        ("loss.name=my_losses:Median", "module 'my_losses' has no 'Median'"),
        ("loss.scale=-1", "loss.scale=-1: input should be greater than 0"),
        ("loss.tau=1", f"loss.tau is not a parameter of {name} (disco, drpo have it)"),
    ):
        chosen = [] if override.startswith("loss.name") else [f"loss.name={name}"]
        bad = _cli(tmp_path, *chosen, override)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and fragment in lines[0], (override, bad.stderr)
