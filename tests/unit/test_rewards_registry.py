"""nemo_disco.rewards.registry: each grader declared once; the reward section's keys checked by the chosen grader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import parts
from nemo_disco.config import ConfigError, RewardConfig
from nemo_disco.rewards import GRADERS, Grader, GraderParams, GraderPool, get_grader, register_grader, score_response
from nemo_disco.rollouts.rollouter import build_grader

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-cpu.yaml"

#: (response, gold, expected score) with each grader's defaults: a grader that registers adds its cases here.
CASES: dict[str, list[tuple[str, str | list[str], float]]] = {
    "math_verify": [
        (r"<think>2+6</think> so \boxed{8}", "8", 1.0),
        (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),  # equal values: math-verify accepts an unreduced fraction
        (r"\boxed{2^3}", "8", 1.0),
        (r"\boxed{7}", ["9", "7"], 1.0),
        (r"\boxed{7}</think> \boxed{9}", "7", 0.0),  # only the text after </think> is graded
        (r"\boxed{(1, 2)}", r"\left( 1, 2 \right)", 1.0),
        (r"\boxed{3}", "8", 0.0),
    ],
    "deepscaler": [
        (r"<think>2+6</think> so \boxed{8}", "8", 1.0),
        (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 0.0),  # DeepScaleR: a fraction must be reduced
        (r"\boxed{2^3}", "8", 0.0),  # an integer only by an integer
        (r"\boxed{7} no wait \boxed{9}", ["9", "7"], 1.0),  # the last box, any gold
        (r"\boxed{9} no wait \boxed{7}", "9", 0.0),
        (r"\boxed{(1, 2)}", r"\left( 1, 2 \right)", 1.0),
        (r"\boxed{3}", "8", 0.0),
    ],
}


def test_every_registered_grader_has_cases_and_a_declaration():
    assert set(CASES) == set(GRADERS)
    for name, grader in GRADERS.items():
        assert grader.name == name and issubclass(grader.params, GraderParams) and grader.description
        # A grader's own keys must not shadow the keys every grader shares.
        assert not set(grader.params.model_fields) & set(RewardConfig.model_fields), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_grader_grades_known_cases_through_the_pool(name):
    responses, golds, expected = zip(*CASES[name], strict=True)
    with GraderPool(name, timeout_s=30.0, workers=2) as pool:
        scores, metrics = pool.score(list(responses), list(golds))
    assert scores == list(expected)
    assert metrics["reward/errors"] == metrics["reward/timeouts"] == 0.0
    # The same verdicts in this process (score_response dispatches through the registry too).
    assert [score_response(r, g, name) for r, g, _ in CASES[name]] == list(expected)


def test_require_think_reaches_the_workers_of_the_pool_the_trainer_builds(tmp_path):
    base = [f"logging.run_dir={tmp_path}", "reward.grader=deepscaler"]
    without_think, with_think = r"so \boxed{8}", r"<think>2+6=8</think> so \boxed{8}"
    cfg = parts.load(TINY, [*base, "reward.require_think=true"])
    assert cfg.reward.require_think is True and parts.grader_params(cfg) == {"require_think": True}
    with build_grader(cfg) as pool:
        assert pool.params == {"require_think": True}
        scores, _ = pool.score([without_think, with_think], ["8", "8"])
    assert scores == [0.0, 1.0]
    lenient = parts.load(TINY, base)  # the grader's default: false, filled into the section
    assert lenient.reward.require_think is False
    with build_grader(lenient) as pool:
        assert pool.score([without_think, with_think], ["8", "8"])[0] == [1.0, 1.0]


def test_a_reward_key_of_another_grader_or_an_unknown_grader_fails_in_one_line(tmp_path):
    base = [f"logging.run_dir={tmp_path}"]
    with pytest.raises(ConfigError) as err:
        parts.load(TINY, [*base, "reward.require_think=true"])
    assert str(err.value) == "reward.require_think is not a parameter of math_verify (deepscaler has it)"
    with pytest.raises(ConfigError) as err:
        parts.load(TINY, [*base, "reward.grader=exact"])
    assert str(err.value) == f"reward.grader: unknown grader 'exact'; registered: {', '.join(GRADERS)}"
    with pytest.raises(ConfigError) as err:
        parts.load(TINY, [*base, "reward.grader=deepscaler", "reward.require_thnk=true"])
    assert str(err.value) == (
        "unknown config key 'reward.require_thnk' (did you mean reward.require_think?); deepscaler takes: require_think"
    )
    with pytest.raises(ConfigError, match=r"^reward.require_think='maybe': input should be a valid boolean"):
        parts.load(TINY, [*base, "reward.grader=deepscaler", "reward.require_think=maybe"])
    with pytest.raises(ConfigError, match=r"^reward.grader='no-such': "):  # not a name: the schema's pattern
        parts.load(TINY, [*base, "reward.grader=no-such"])


def test_a_recipe_key_of_another_grader_is_named_with_its_file_and_line(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        f"defaults: [tiny-cpu, _self_]\nlogging:\n  run_dir: {tmp_path}\nreward:\n  require_think: true\n"
    )
    with pytest.raises(ConfigError) as err:
        parts.load(recipe)
    assert str(err.value) == f"{recipe}:5: reward.require_think is not a parameter of math_verify (deepscaler has it)"


def test_naming_another_grader_starts_the_section_afresh(tmp_path):
    recipe = tmp_path / "strict.yaml"
    recipe.write_text(
        f"defaults: [tiny-cpu, _self_]\nlogging:\n  run_dir: {tmp_path}\n"
        "reward:\n  grader: deepscaler\n  require_think: true\n  workers: 1\n"
    )
    strict = parts.load(recipe)
    assert (strict.reward.grader, strict.reward.require_think, strict.reward.workers) == ("deepscaler", True, 1)
    other = parts.load(recipe, ["reward.grader=math_verify"])  # deepscaler's key is dropped, shared keys stay
    assert other.reward.model_extra == {} and other.reward.workers == 1
    assert parts.grader_params(other) == {}
    assert parts.compose(strict) == strict


def test_the_cli_refuses_another_graders_key_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cli = [sys.executable, "-m", "nemo_disco.cli"]
    train = [*cli, "train", "--config", str(TINY), f"logging.run_dir={tmp_path}"]
    shown = ["--print-config"]
    bad = subprocess.run(
        [*train, "reward.require_think=true", *shown], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "nemo-disco train: error: reward.require_think is not a parameter of math_verify (deepscaler has it)"
    ]
    unknown = subprocess.run([*train, "reward.grader=exact", *shown], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        f"nemo-disco train: error: reward.grader: unknown grader 'exact'; registered: {', '.join(GRADERS)}"
    ]
    good = subprocess.run(
        [*train, "reward.grader=deepscaler", "reward.require_think=true", *shown],
        capture_output=True,
        text=True,
        env=env,
    )
    assert good.returncode == 0 and "  require_think: true\n" in good.stdout
    evaluation = [*cli, "eval", "--model", str(tmp_path)]
    bad = subprocess.run([*evaluation, "reward.grader=exact", *shown], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"nemo-disco eval: error: reward.grader: unknown grader 'exact'; registered: {', '.join(GRADERS)}"
    ]
    flag = subprocess.run([*evaluation, "--grader", "exact", *shown], capture_output=True, text=True, env=env)
    assert flag.returncode == 2 and "--grader: invalid choice: 'exact'" in flag.stderr


def test_lookups_and_registration_fail_in_one_line():
    with pytest.raises(ValueError, match=r"^unknown grader 'exact'; registered: "):
        get_grader("exact")
    with pytest.raises(ValueError, match="already registered"):
        register_grader(GRADERS["deepscaler"])
    with pytest.raises(ValueError, match="must be an identifier"):
        register_grader(Grader("no-such", GRADERS["deepscaler"].fn, GraderParams, "x"))
    with pytest.raises(ValueError, match=r"^grader deepscaler parameter require_think: Input should be a valid bool"):
        GraderPool("deepscaler", timeout_s=1.0, workers=1, params={"require_think": "maybe"})
    with pytest.raises(ValueError, match=r"^grader math_verify parameter require_think: Extra inputs"):
        score_response(r"\boxed{8}", "8", "math_verify", require_think=True)
    assert "no-such" not in GRADERS
