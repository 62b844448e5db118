"""nemo_disco.rewards.scoring: graders on real benchmark answers and adversarial text; user reward functions."""

from __future__ import annotations

import re
import sys

import pytest

from nemo_disco.data import SHIPPED_BENCHMARK_DIR
from nemo_disco.rewards import GRADERS, GraderPool, score_response

BENCH_DIR = SHIPPED_BENCHMARK_DIR  # the benchmark files shipped with the package


# ----------------------------------------------------------------------------------------------------------------------
# Real benchmark answers in equivalent rewritten forms


def _boxed(answer: str) -> str:
    return f"Let me compute step by step. The result follows. Therefore the answer is $\\boxed{{{answer}}}$."


def _benchmark_cases() -> list[tuple[str, str | list[str], str, float]]:
    """(case name, gold from the benchmark file, response, expected score under both graders)."""
    from nemo_disco.data import load_problems

    math = [p.answer for p in load_problems(BENCH_DIR / "math.json")[0]]
    aime = [p.answer for p in load_problems(BENCH_DIR / "aime.json")[0]]
    amc = [p.answer for p in load_problems(BENCH_DIR / "amc.json")[0]]
    minerva = [p.answer for p in load_problems(BENCH_DIR / "minerva.json")[0]]
    olympiad = [p.answer for p in load_problems(BENCH_DIR / "olympiad_bench.json")[0]]
    cases = []

    # A fraction with a terminating decimal, e.g. \frac{11}{2}: decimal, \dfrac, a/b, spaced.
    frac = next(a for a in math if re.fullmatch(r"\\frac\{\d+\}\{(2|4|5|8)\}", a))
    num, den = map(int, re.findall(r"\d+", frac))
    cases += [
        ("frac-as-decimal", frac, _boxed(str(num / den)), 1.0),
        ("dfrac", frac, _boxed(frac.replace("\\frac", "\\dfrac")), 1.0),
        ("a/b", frac, _boxed(f"{num}/{den}"), 1.0),
        ("frac-spaced", frac, _boxed(f"\\frac{{ {num} }}{{ {den} }}"), 1.0),
        ("frac-wrong", frac, _boxed(f"\\frac{{{num + 1}}}{{{den}}}"), 0.0),
    ]
    # A tuple written with \left( \right), e.g. \left( 3, \frac{\pi}{2} \right).
    tup = next(a for a in math if a.startswith("\\left(") and a.endswith("\\right)"))
    bare = tup.replace("\\left", "").replace("\\right", "")
    cases += [
        ("tuple-bare", tup, _boxed(bare), 1.0),
        ("tuple-nospace", tup, _boxed(bare.replace(" ", "")), 1.0),
        ("tuple-dfrac", tup, _boxed(tup.replace("\\frac", "\\dfrac")), 1.0),
        ("tuple-wrong", tup, _boxed(bare.replace("(", "(1+", 1)), 0.0),
    ]
    # Degrees: 90^\circ written without the degree sign and with braces.
    deg = next(a for a in math if re.fullmatch(r"\d+\^\\circ", a))
    value = deg.split("^")[0]
    cases += [
        ("degrees-plain", deg, _boxed(value), 1.0),
        ("degrees-braced", deg, _boxed(f"{value}^{{\\circ}}"), 1.0),
        ("degrees-wrong", deg, _boxed(str(int(value) + 1)), 0.0),
    ]
    # AIME answers with a leading zero ("025") and units after an integer answer.
    lead = next(a for a in aime if a.startswith("0"))
    cases += [
        ("aime-leading-zero", lead, _boxed(str(int(lead))), 1.0),
        ("aime-units", lead, _boxed(f"{int(lead)} \\text{{ cm}}"), 1.0),
        ("aime-wrong", lead, _boxed(str(int(lead) + 1)), 0.0),
    ]
    # AMC answers are JSON floats (142.0) loaded as "142"; the response writes 142.0 or 142.
    cases += [
        ("amc-int", amc[0], _boxed(amc[0]), 1.0),
        ("amc-float", amc[0], _boxed(f"{amc[0]}.0"), 1.0),
        ("amc-wrong", amc[0], _boxed(str(int(amc[0]) * 2 + 1)), 0.0),
    ]
    # Minerva: scientific notation in the gold ("3.3e12") against LaTeX \times 10^{12}.
    sci = next(a for a in minerva if re.fullmatch(r"\d+\.\d+e\d+", a[0]))
    mantissa, exponent = sci[0].split("e")
    cases += [
        ("minerva-sci", sci, _boxed(f"{mantissa} \\times 10^{{{exponent}}}"), 1.0),
        ("minerva-sci-wrong", sci, _boxed(f"{mantissa} \\times 10^{{{int(exponent) + 1}}}"), 0.0),
    ]
    # OlympiadBench: a list of golds written in $...$.
    olym = next(a for a in olympiad if re.fullmatch(r"\$\\frac\{\d+\}\{\d+\}\$", a[0]))
    cases += [
        ("olympiad-dollars", olym, _boxed(olym[0].strip("$")), 1.0),
        ("olympiad-wrong", olym, _boxed(olym[0].strip("$").replace("frac{", "frac{1")), 0.0),
    ]
    # Boxed inside a sentence, after a </think>; only the text after </think> counts.
    gold = aime[0]
    cases += [
        (
            "think-then-answer",
            gold,
            f"<think>maybe \\boxed{{{int(gold) + 1}}}</think> The answer is $\\boxed{{{gold}}}$.",
            1.0,
        ),
        (
            "answer-only-in-think",
            gold,
            f"<think>it is \\boxed{{{gold}}}</think> The answer is $\\boxed{{{int(gold) + 1}}}$.",
            0.0,
        ),
        ("no-answer", gold, "I am not sure.", 0.0),
    ]
    return cases


@pytest.mark.parametrize("grader", GRADERS)
def test_benchmark_answers_in_equivalent_forms(grader):
    # What is graded, not how fast: a budget no loaded CI machine reaches (sympy's first simplifications can take
    # seconds there), so that a timeout cannot pass for a wrong grade. The 2 s pool checks the timeouts.
    cases = _benchmark_cases()
    with GraderPool(grader, timeout_s=60.0, workers=2) as pool:
        scores, metrics = pool.score([c[2] for c in cases], [c[1] for c in cases])
    got = {c[0]: s for c, s in zip(cases, scores, strict=True)}
    assert got == {c[0]: c[3] for c in cases}, grader
    assert metrics["reward/timeouts"] == 0 and metrics["reward/errors"] == 0


def test_graders_differ_where_documented():
    # DeepScaleR rule: an unreduced fraction is wrong; math-verify accepts the equal value.
    assert score_response(r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", "deepscaler") == 0.0
    assert score_response(r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", "math_verify") == 1.0
    # DeepScaleR rule: an integer gold needs a literal integer (2^3 is not simplified).
    assert score_response(r"\boxed{2^3}", "8", "deepscaler") == 0.0
    assert score_response(r"\boxed{2^3}", "8", "math_verify") == 1.0
    # The official training rule (require_think): no </think> is a format error.
    assert score_response(r"\boxed{8}", "8", "deepscaler", require_think=True) == 0.0
    assert score_response(r"<think>x</think>\boxed{8}", "8", "deepscaler", require_think=True) == 1.0
    assert score_response(r"\boxed{8}", "8", "deepscaler") == 1.0
    # The LAST boxed answer counts; a list of golds matches any.
    assert score_response(r"\boxed{7} no wait \boxed{8}", ["9", "8"], "deepscaler") == 1.0
    assert score_response(r"\boxed{8} no wait \boxed{7}", "8", "deepscaler") == 0.0


@pytest.mark.parametrize("grader", GRADERS)
def test_score_response_never_raises(grader):
    weird = [
        "",
        "}",
        "{{{",
        "\\boxed{}",
        "\\boxed{\\frac{1}{0}}",
        "\\boxed{\x00\x01}",
        "\\boxed{∞ ≠ ∅}",
        "\\boxed{\\begin{pmatrix}1&2\\end{pmatrix}}",
        "</think>",
        "</think></think>\\boxed{",
        "$$$$",
        "\\" * 50,
        "\\boxed{\\sqrt{-1}}",
        "\\boxed{1,,,2}",
        "\\boxed{(}",
    ]
    for text in weird:
        assert score_response(text, "2", grader) == 0.0
    assert score_response(None, "2", grader) == 0.0  # type: ignore[arg-type]
    assert score_response("\\boxed{2}", [], grader) == 0.0
    with pytest.raises(ValueError, match="unknown grader"):
        score_response("x", "2", "exact")


# ----------------------------------------------------------------------------------------------------------------------
# reward.function: any verifier as the reward

USER_REWARDS = '''
import time


def exact(response, answer, *, problem, **fields):
    """1 when the response is the answer; the row's field `scale` multiplies it (shows row fields arrive)."""
    return float(response.strip() == answer) * fields.get("scale", 1.0)


def picky(response, answer, *, problem, **fields):
    if response == "boom":
        raise KeyError("no such thing")
    if response == "slow":
        time.sleep(30)
    if response == "text":
        return "yes"
    return 0.25


def odd(response, answer, *, problem, **fields):
    """A reward that is not a finite number for some responses."""
    return {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "big": 10**400}.get(response, 1.0)


def hangs(response, answer, *, problem, **fields):
    time.sleep(30)
    return 1.0


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A reward module in the current folder (where users put theirs)."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.chdir(tmp_path)
    yield "user_rewards"
    sys.modules.pop("user_rewards", None)


def test_a_user_reward_function_scores_with_the_problem_and_the_row_fields(user_module):
    with GraderPool(timeout_s=5.0, workers=2, function=f"{user_module}:exact") as pool:
        scores, metrics = pool.score(
            ["7", " 12 ", "5", "7"], ["7", "12", "6", "7"], ["3+4", "5+7", "2+4", "3+4"], [{}, {"scale": 0.5}, {}, {}]
        )
    assert scores == [1.0, 0.5, 0.0, 1.0]
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0


def test_a_raising_or_hanging_user_function_scores_0_counted_and_logged_once(user_module, caplog):
    with GraderPool(timeout_s=1.0, workers=1, kill_grace_s=0.5, function=f"{user_module}:picky") as pool:
        with caplog.at_level("WARNING", logger="nemo_disco.rewards"):
            scores, metrics = pool.score(["boom", "ok", "boom", "text", "slow"], ["1"] * 5)
    assert scores == [0.0, 0.25, 0.0, 0.0, 0.0]
    assert metrics["reward/errors"] == 3  # two KeyErrors and a str returned instead of a float
    assert metrics["reward/timeouts"] == 1
    logged = [r.getMessage() for r in caplog.records if "reward.function" in r.getMessage()]
    assert len(logged) == 2 and "KeyError: 'no such thing'" in logged[0] and "Traceback" in logged[0]
    assert "ran past reward.timeout_s=1 s" in logged[1]  # the first timeout, logged once too
    assert pool.first_error == f"reward.function {user_module}:picky failed on an item: KeyError: 'no such thing'"


def test_a_non_finite_reward_is_an_error_that_scores_0(user_module):
    # NaN made every rollout a negative and inf every one a positive (validation pass@1 1.000): now errors.
    with GraderPool(timeout_s=5.0, workers=1, function=f"{user_module}:odd") as pool:
        scores, metrics = pool.score(["ok", "nan", "inf", "-inf", "big", "ok"], ["1"] * 6)
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert metrics["reward/errors"] == 4 and metrics["reward/timeouts"] == 0
        assert pool.first_error == (
            f"reward.function {user_module}:odd failed on an item: ValueError: the reward function returned nan, "
            "expected a finite float"
        )
        pool.score(["ok"], ["1"])
        assert pool.first_error is None  # per call


def test_a_hanging_user_function_is_logged_at_its_first_timeout(user_module, caplog):
    with GraderPool(timeout_s=0.5, workers=1, kill_grace_s=0.5, function=f"{user_module}:hangs") as pool:
        with caplog.at_level("WARNING", logger="nemo_disco.rewards"):
            scores, metrics = pool.score(["a", "b"], ["1", "1"])
    assert scores == [0.0, 0.0] and metrics["reward/timeouts"] == 2 and metrics["reward/errors"] == 0
    assert pool.first_error == f"reward.function {user_module}:hangs ran past reward.timeout_s=0.5 s on an item"
    logged = [r.getMessage() for r in caplog.records if "reward.function" in r.getMessage()]
    assert logged == [
        f"reward.function {user_module}:hangs ran past reward.timeout_s=0.5 s on an item (scored 0, counted in "
        "reward/timeouts; logged once)"
    ]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("user_rewards.exact", "expected 'package.module:function'"),
        ("no_such_module:fn", "module 'no_such_module' does not import (ModuleNotFoundError"),
        ("user_rewards:missing", "has no attribute 'missing'"),
        ("user_rewards:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable"),
    ],
)
def test_a_bad_reward_function_path_fails_in_one_line(user_module, path, message):
    from nemo_disco.rewards import load_reward_function

    with pytest.raises(ValueError, match=re.escape(message)) as err:
        load_reward_function(path)
    assert str(err.value).startswith(f"reward.function={path!r}") and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        GraderPool(timeout_s=5.0, workers=1, function=path)


def test_the_config_checks_the_reward_function_path():
    from nemo_disco import config

    raw = config.RunConfig().model_dump(mode="json")
    raw["reward"]["function"] = "my_rewards:fmt"
    assert config.validate(raw).reward.function == "my_rewards:fmt"
    raw["reward"]["function"] = "my rewards.py"
    with pytest.raises(config.ConfigError, match="reward.function"):
        config.validate(raw)


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_the_config_checks_the_tolerated_share_of_failed_rewards(share):
    from nemo_disco import config

    raw = config.RunConfig().model_dump(mode="json")
    assert raw["reward"]["max_error_share"] == 1.0
    raw["reward"]["max_error_share"] = share
    with pytest.raises(config.ConfigError, match=r"reward\.max_error_share"):
        config.validate(raw)
