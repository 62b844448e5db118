"""Graders on real benchmark answers, adversarial model output, and the worker pool's hard timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_disco.data import SHIPPED_BENCHMARK_DIR
from nemo_disco.rewards import GRADERS, GraderPool, hendrycks_normalize, last_boxed, score_batch, score_response

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = SHIPPED_BENCHMARK_DIR  # the benchmark files shipped with the package
TIMEOUT_S = 2.0


@pytest.fixture(scope="module", params=GRADERS)
def pool(request):
    with GraderPool(request.param, timeout_s=TIMEOUT_S, workers=2) as p:
        yield p


def test_last_boxed():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert last_boxed(r"x \fbox{7} y") == "7"
    assert last_boxed(r"\boxed 5$ more") == "5"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced
    assert last_boxed("no answer") is None


def test_hendrycks_normalize():
    assert hendrycks_normalize(r"\dfrac12") == r"\frac{1}{2}"
    assert hendrycks_normalize(r"\left( 3, \frac{\pi}{2} \right)") == r"(3,\frac{\pi}{2})"
    assert hendrycks_normalize(r"x = 0.5") == r"\frac{1}{2}"
    assert hendrycks_normalize(r"10\text{ cm}") == "10"
    assert hendrycks_normalize(r"3/4") == r"\frac{3}{4}"


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
# Adversarial output, hard timeouts, worker replacement


def test_adversarial_responses_score_zero_in_time_and_run_nothing(pool, tmp_path):
    marker = tmp_path / "pwned"
    code = f"__import__('os').system('touch {marker}')"
    bad = [
        r"\boxed{9^{9^{9^{9}}}}",
        "x" * 100_000,
        "7 " * 50_000 + r"\boxed{8}",
        r"\boxed{" * 200 + "1",
        "}" * 1000 + r"\boxed{1}}}}",
        f"\\boxed{{{code}}}",
        f"The answer is {code}",
        f'\\boxed{{eval("{code}")}}',
    ]
    start = time.monotonic()
    scores, metrics = pool.score(bad, ["2"] * len(bad))
    elapsed = time.monotonic() - start
    assert scores == [0.0] * len(bad)
    # At most one item per worker at a time can hang for timeout_s (+0.5 s kill grace); the rest are fast.
    assert elapsed < TIMEOUT_S + 0.5 + 3.0, elapsed
    assert not marker.exists()
    assert metrics["reward/errors"] == 0
    # The tower times out under math-verify; the deepscaler grader refuses it before parsing.
    assert metrics["reward/timeouts"] == (1 if pool.grader == "math_verify" else 0)


def test_order_preserved_and_workers_reused(pool):
    responses = [_boxed(str(i if i % 3 else i + 1)) for i in range(60)]
    truths = [str(i) for i in range(60)]
    pids = pool.worker_pids
    scores, _ = pool.score(responses, truths)
    assert scores == [0.0 if i % 3 == 0 else 1.0 for i in range(60)]
    assert pool.worker_pids == pids
    assert pool.score([], []) == ([], {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/restarts": 0.0})
    with pytest.raises(ValueError, match="2 responses but 1"):
        pool.score(["a", "b"], ["1"])


def test_parent_kills_and_replaces_a_stuck_worker():
    # Without the worker's own alarm, only the parent's kill at timeout_s + kill_grace_s stops the tower.
    with GraderPool("math_verify", timeout_s=1.0, workers=1, soft_timeout=False, kill_grace_s=0.2) as pool:
        pool.score(["\\boxed{1}"], ["1"])  # wait for the worker to start
        before = pool.worker_pids
        start = time.monotonic()
        scores, metrics = pool.score([r"\boxed{9^{9^{9^{9}}}}", r"so \boxed{2}", r"\boxed{3}"], ["1", "2", "4"])
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 0.0]
        assert metrics == {"reward/timeouts": 1.0, "reward/errors": 0.0, "reward/restarts": 1.0}
        assert pool.worker_pids != before
        # 1.2 s until the kill, then a fresh worker starts (~0.6 s) and grades the other two.
        assert 1.2 <= elapsed < 1.2 + 6.0, elapsed


# Grading this takes ~5 s on one core (9^(9^7) has 4.5 million digits): a kill 0.5 s in lands mid-item.
SLOW = r"\boxed{9^{9^{7}}}"


def test_worker_killed_mid_item_is_replaced_and_the_item_graded_again():
    with GraderPool("math_verify", timeout_s=60.0, workers=1, soft_timeout=False) as pool:
        pool.score(["\\boxed{1}"], ["1"])
        (pid,) = pool.worker_pids
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))  # e.g. the kernel's OOM killer
        killer.start()
        scores, metrics = pool.score([SLOW, r"\boxed{2}"], ["1", "2"])
        killer.join()
        # The slow item was graded to the end on the fresh worker (0: 9^(9^7) != 1), not scored 0 as an error.
        assert scores == [0.0, 1.0]
        assert metrics == {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/restarts": 1.0}
        assert pool.worker_pids != [pid]


def test_an_item_whose_worker_dies_twice_counts_as_an_error():
    with GraderPool("math_verify", timeout_s=60.0, workers=1, soft_timeout=False) as pool:
        pool.score(["\\boxed{1}"], ["1"])
        (first,) = pool.worker_pids

        def kill_twice() -> None:
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while pool.worker_pids == [first] and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)  # the fresh worker starts (~0.6 s) and is grading the slow item again
            os.kill(pool.worker_pids[0], signal.SIGKILL)

        killer = threading.Timer(0.5, kill_twice)
        killer.start()
        scores, metrics = pool.score([SLOW, r"\boxed{2}"], ["1", "2"])
        killer.join()
        assert scores == [0.0, 1.0]
        assert metrics == {"reward/timeouts": 0.0, "reward/errors": 1.0, "reward/restarts": 2.0}


def test_interrupted_call_leaves_no_stale_answer():
    with GraderPool("math_verify", timeout_s=3.0, workers=1) as pool:
        pool.score(["\\boxed{1}"], ["1"])
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            pool.score([r"\boxed{9^{9^{9^{9}}}}"], ["1"])
        # The busy worker was replaced: its late verdict cannot be taken for this call's answers.
        assert pool.score([r"\boxed{2}", r"\boxed{3}"], ["2", "2"])[0] == [1.0, 0.0]
        assert pool.restarts == 1


def test_worker_startup_failure_is_reported():
    with GraderPool("math_verify", workers=1, memory_limit_mb=16) as pool:  # too little memory to import
        with pytest.raises(RuntimeError, match="exited during start-up"):
            pool.score(["\\boxed{1}"], ["1"])


def test_bad_pool_settings():
    with pytest.raises(ValueError, match="unknown grader"):
        GraderPool("exact")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        GraderPool("math_verify", timeout_s=0)


def test_score_batch_works_when_main_program_is_read_from_stdin(tmp_path):
    script = (
        "from nemo_disco.rewards import score_batch\n"
        "scores, m = score_batch(['\\\\boxed{2}', '\\\\boxed{9^{9^{9^{9}}}}', 'no'], ['2', '1', '3'], timeout_s=1.0)\n"
        "print(scores, m['reward/timeouts'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 0.0, 0.0] 1.0"


def test_score_batch_temporary_pool():
    scores, metrics = score_batch([r"\boxed{\frac{1}{2}}", r"\boxed{0.5}"], ["0.5", r"\frac12"], grader="deepscaler")
    assert scores == [1.0, 1.0]
    assert metrics["reward/timeouts"] == 0


def test_workers_survive_the_job_signals_meant_for_the_trainer():
    """Slurm signals every process of a step: USR1 / TERM / INT must not kill a grading worker."""
    import os
    import signal

    from nemo_disco.rewards import GraderPool

    with GraderPool("math_verify", timeout_s=5.0, workers=1) as pool:
        pool.score(["\\boxed{1}"], ["1"])  # workers ready
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(pool.worker_pids[0], sig)
        scores, metrics = pool.score(["\\boxed{2}", "\\boxed{3}"], ["2", "4"])
    assert scores == [1.0, 0.0]
    assert metrics["reward/errors"] == 0 and metrics["reward/restarts"] == 0


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
    assert len(logged) == 1 and "KeyError: 'no such thing'" in logged[0] and "Traceback" in logged[0]


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
        GraderPool(workers=1, function=path)


def test_the_config_checks_the_reward_function_path():
    from nemo_disco import config

    raw = config.RunConfig().model_dump(mode="json")
    raw["reward"]["function"] = "my_rewards:fmt"
    assert config.validate(raw).reward.function == "my_rewards:fmt"
    raw["reward"]["function"] = "my rewards.py"
    with pytest.raises(config.ConfigError, match="reward.function"):
        config.validate(raw)
