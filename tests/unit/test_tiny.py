"""Tiny models built in code: the supervised warm-up that runs to a held-out accuracy target, and its keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_disco import config, tiny
from nemo_disco.config import ConfigError
from nemo_disco.data import load_problems

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
# Eight training problems that are also the "held-out" ones: a tiny model memorises some of them within ~40
# updates at lr 1e-2, so a target is reached in a unit test's time. Accuracy on 8 problems is a multiple of 1/8.
FAST = ["algorithm.warmup_sft_lr=1e-2", "algorithm.warmup_eval_every=20", "reward.workers=1"]


def _cfg(*overrides: str) -> config.RunConfig:
    return config.load(RECIPE, [*FAST, *overrides])


@pytest.fixture(scope="module")
def eight() -> list:
    return load_problems("synthetic:arithmetic", synthetic_size=8, seed=0)[0]


def _fresh(tmp_path: Path, name: str) -> Path:
    return tiny.build_model(_cfg().policy.tiny, tmp_path / name, seed=0)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _greedy_accuracy_independently(model_dir: Path, problems: list) -> float:
    """transformers' own generate() (not the project's decode loop) and the in-process grader (not the pool)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_disco.rewards import score_response

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]  # the trainer's stop tokens
    correct = 0.0
    for p in problems:
        ids = torch.tensor([tok.encode(f"{p.problem}=", add_special_tokens=False)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, eos_token_id=stops
        )
        correct += score_response(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), p.answer)
    return correct / len(problems)


def test_warm_up_stops_at_the_first_evaluation_that_reaches_the_band(tmp_path, eight):
    cfg = _cfg("algorithm.warmup_target=[0.1,1.0]", "algorithm.warmup_sft_steps=400")
    model = _fresh(tmp_path, "target")
    result = tiny.warm_up(model, eight, cfg, eval_problems=eight)

    assert result.status == "in_band"
    assert result.steps < 400 and result.steps % 20 == 0
    assert [s for s, _ in result.history] == list(range(20, result.steps + 1, 20))  # every 20 updates, then stop
    assert all(acc < 0.1 for _, acc in result.history[:-1])
    assert result.accuracy == result.history[-1][1] >= 0.1
    assert result.problems == 8 and (result.accuracy * 8).is_integer()
    # The figure is the saved model's real greedy accuracy, re-measured by another decoder and grader.
    assert _greedy_accuracy_independently(model, eight) == result.accuracy
    saved = json.loads((model / "warmup.json").read_text())
    assert saved["status"] == "in_band" and saved["steps"] == result.steps and saved["target"] == [0.1, 1.0]
    assert saved["message"] == result.message and "target band 0.1-1" in result.message

    # Measuring does not perturb training: a plain warm-up of the same number of updates gives the same weights.
    plain = _fresh(tmp_path, "plain")
    fixed = tiny.warm_up(
        plain, eight, _cfg("algorithm.warmup_target=null", f"algorithm.warmup_sft_steps={result.steps}")
    )
    assert fixed.status == "fixed" and fixed.steps == result.steps and fixed.history == ()
    a, b = _weights(model), _weights(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_jump_past_the_band_is_reported(tmp_path, eight, caplog):
    # On 8 problems the accuracy moves in steps of 1/8 = 0.125: nothing lands in [0.05, 0.1], so the first
    # evaluation at or above 0.05 is above the band.
    cfg = _cfg("algorithm.warmup_target=[0.05,0.1]", "algorithm.warmup_sft_steps=400")
    with caplog.at_level(logging.WARNING, logger="nemo_disco.tiny"):
        result = tiny.warm_up(_fresh(tmp_path, "jump"), eight, cfg, eval_problems=eight)
    assert result.status == "above_band" and result.accuracy >= 0.125
    assert "ABOVE the target band 0.05-0.1" in result.message and "algorithm.warmup_eval_every" in result.message
    assert [r.getMessage() for r in caplog.records] == [result.message]


def test_hitting_the_cap_is_a_warning_naming_the_keys(tmp_path, eight, caplog):
    # 12 updates, evaluated every 5: at 5, 10 and at the cap (12); a random model is nowhere near 0.9.
    cfg = _cfg("algorithm.warmup_target=[0.9,1.0]", "algorithm.warmup_sft_steps=12", "algorithm.warmup_eval_every=5")
    model = _fresh(tmp_path, "cap")
    with caplog.at_level(logging.WARNING, logger="nemo_disco.tiny"):
        result = tiny.warm_up(model, eight, cfg, eval_problems=eight)
    assert result.status == "cap_reached" and result.steps == 12
    assert [s for s, _ in result.history] == [5, 10, 12]
    assert result.accuracy < 0.9
    assert "BELOW the target band 0.9-1" in result.message
    assert "algorithm.warmup_sft_steps=12" in result.message and "Raise algorithm.warmup_sft_steps" in result.message
    assert [r.levelname for r in caplog.records] == ["WARNING"] and caplog.records[0].getMessage() == result.message
    assert json.loads((model / "warmup.json").read_text())["status"] == "cap_reached"


def test_a_target_without_problems_to_measure_is_refused(tmp_path, eight):
    with pytest.raises(ValueError, match="no held-out problems"):
        tiny.warm_up(_fresh(tmp_path, "none"), eight, _cfg(), eval_problems=[])


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("algorithm.warmup_target=[0.6,0.4]", "algorithm.warmup_target=[0.6, 0.4] must be a band [low, high]"),
        ("algorithm.warmup_target=[0,0.4]", "with 0 < low < high <= 1"),
        ("algorithm.warmup_target=[0.5]", "algorithm.warmup_target"),
        ("algorithm.warmup_sft_steps=0", "algorithm.warmup_target needs algorithm.warmup_sft_steps > 0"),
        ("data.val=null", "algorithm.warmup_target needs data.val and data.val_max_problems"),
        ("data.val_max_problems=null", "algorithm.warmup_target needs data.val and data.val_max_problems"),
        ("algorithm.warmup_eval_every=0", "algorithm.warmup_eval_every=0"),
        ("algorithm.warmup_eval_problems=0", "algorithm.warmup_eval_problems=0"),
    ],
)
def test_warm_up_keys_are_checked_at_load_time(override, fragment):
    overrides = [override, "data.val_every=0"] if override == "data.val=null" else [override]
    with pytest.raises(ConfigError) as err:
        config.load(RECIPE, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_the_recipe_target_can_be_switched_off():
    cfg = config.load(RECIPE, ["algorithm.warmup_target=null", "data.val=null", "data.val_every=0"])
    assert cfg.algorithm.warmup_target is None


def test_too_few_held_out_problems_for_validation_and_target_is_one_line(tmp_path):
    from nemo_disco.algorithm import prepare_model

    # Validation takes the first 500 held-out problems, the warm-up would measure on the next 256 (the recipe's
    # warmup_eval_problems); a 600-problem split has only 100 left.
    cfg = config.load(RECIPE, ["data.synthetic_size=600", "data.val_max_problems=500", f"logging.run_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        prepare_model(cfg, tmp_path)
    msg = str(err.value)
    assert "has 600 problems" in msg and "data.val_max_problems=500" in msg
    assert "algorithm.warmup_eval_problems=256" in msg and "\n" not in msg
    assert not (tmp_path / "init_model").exists()


def test_the_warm_up_logs_its_progress_against_the_target(tmp_path, eight, caplog):
    cfg = _cfg("algorithm.warmup_target=[0.9,1.0]", "algorithm.warmup_sft_steps=12", "algorithm.warmup_eval_every=5")
    with caplog.at_level(logging.INFO, logger="nemo_disco.tiny"):
        result = tiny.warm_up(_fresh(tmp_path, "progress"), eight, cfg, eval_problems=eight)
    lines = [r.getMessage() for r in caplog.records]
    assert (
        lines[0] == "warm-up: up to 12 supervised updates, measured every 5 on 8 held-out problems (target band 0.9-1)"
    )
    progress = [line for line in lines if line.startswith("warm-up: ") and "/12 updates (" in line]
    assert [line.split()[1] for line in progress] == ["5/12", "10/12", "12/12"]
    for line, (_, acc) in zip(progress, result.history, strict=True):
        assert line.endswith(f"s), held-out greedy accuracy {acc:.3f} (target band 0.9-1)")
    assert lines[-1] == result.message


def test_a_warm_up_without_target_logs_updates_done(tmp_path, eight, caplog):
    cfg = _cfg("algorithm.warmup_target=null", "algorithm.warmup_sft_steps=45")
    with caplog.at_level(logging.INFO, logger="nemo_disco.tiny"):
        tiny.warm_up(_fresh(tmp_path, "fixed"), eight, cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "warm-up: up to 45 supervised updates"
    assert [line.split()[1] for line in lines[1:-1]] == ["20/45", "40/45", "45/45"]


def _cached_warm_up(tmp_path: Path, name: str, eight: list, cache: Path, *overrides: str) -> Path:
    cfg = _cfg("algorithm.warmup_target=null", "algorithm.warmup_sft_steps=30", *overrides)
    model = _fresh(tmp_path, name)
    tiny.warm_up(model, eight, cfg, cache=cache)
    return model


def _same_folder(a: Path, b: Path) -> bool:
    names = sorted(f.name for f in a.iterdir())
    return names == sorted(f.name for f in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def test_a_second_identical_warm_up_reuses_the_cached_model(tmp_path, eight, caplog, monkeypatch):
    cache = tmp_path / "cache"
    first = _cached_warm_up(tmp_path, "first", eight, cache)
    (entry,) = cache.iterdir()
    assert (entry / "model.safetensors").is_file() and (entry / "warmup.json").is_file()

    def no_updates(*args: object) -> None:
        raise AssertionError("a reused warm-up makes no update")

    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="nemo_disco.tiny"):
        m.setattr(tiny, "_sft_update", no_updates)
        second = _cached_warm_up(tmp_path, "second", eight, cache)
    assert _same_folder(first, second)  # weights, config, tokenizer and warmup.json: byte for byte
    reused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: reused")]
    assert reused == [f"warm-up: reused {entry} (same model, data, seed and settings)"]

    # Anything that changes the result is another entry: the learning rate, the updates, the initial weights.
    _cached_warm_up(tmp_path, "lr", eight, cache, "algorithm.warmup_sft_lr=5e-3")
    _cached_warm_up(tmp_path, "steps", eight, cache, "algorithm.warmup_sft_steps=31")
    other = tiny.build_model(_cfg().policy.tiny, tmp_path / "seed", seed=1)
    tiny.warm_up(other, eight, _cfg("algorithm.warmup_target=null", "algorithm.warmup_sft_steps=30"), cache=cache)
    assert len(list(cache.iterdir())) == 4


@pytest.mark.parametrize("damage", ["weights", "manifest", "missing"])
def test_a_damaged_cache_entry_is_ignored_redone_and_replaced(tmp_path, eight, caplog, damage):
    cache = tmp_path / "cache"
    first = _cached_warm_up(tmp_path, "first", eight, cache)
    (entry,) = cache.iterdir()
    if damage == "weights":
        data = bytearray((entry / "model.safetensors").read_bytes())
        data[-5] ^= 0xFF
        (entry / "model.safetensors").write_bytes(bytes(data))
    elif damage == "manifest":
        (entry / "cache-entry.json").write_text("{not json")
    else:
        (entry / "model.safetensors").unlink()
    with caplog.at_level(logging.INFO, logger="nemo_disco.tiny"):
        second = _cached_warm_up(tmp_path, "second", eight, cache)
    messages = [r.getMessage() for r in caplog.records]
    damaged = [m for m in messages if m.startswith(f"warm-up cache entry {entry} is damaged (")]
    assert len(damaged) == 1 and damaged[0].endswith("): ignored, warming up again")
    assert not any(m.startswith("warm-up: reused") for m in messages)
    assert any(m.startswith("warm-up: 20/30 updates") for m in messages)  # redone
    assert _same_folder(first, second)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nemo_disco.tiny"):
        third = _cached_warm_up(tmp_path, "third", eight, cache)  # the entry was replaced by a sound one
    assert any(r.getMessage().startswith("warm-up: reused") for r in caplog.records) and _same_folder(first, third)


def test_the_warm_up_cache_key_is_checked_at_load_time():
    assert config.load(RECIPE, []).algorithm.warmup_cache is True
    assert config.load(RECIPE, ["algorithm.warmup_cache=false"]).algorithm.warmup_cache is False
    with pytest.raises(ConfigError) as err:
        config.load(RECIPE, ["algorithm.warmup_cache=sometimes"])
    assert "algorithm.warmup_cache" in str(err.value)
