"""pass@k estimator, tables with uncertainty, writers, re-grading, several runs, paired comparison, plots, CLI."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import cli
from nemo_disco.data import BENCHMARK_DIR_ENV, load_problems
from nemo_disco.evaluate import (
    RESPONSES_FILE,
    aggregate_runs,
    compare_results,
    evaluate_model,
    grade_responses_file,
    ks_for,
    load_results,
    pass_at_k,
    plot_length_accuracy,
    plot_pass_at_k,
    summarize,
    write_results,
)

ROOT = Path(__file__).resolve().parents[2]


def _brute_force(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)  # pass@1 = c / n
    # Large n stays finite and exact where binomials would overflow floats: c = 1 of 10,000, k = 1.
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4)
    assert math.isfinite(pass_at_k(5000, 2500, 2000))
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_ks_for():
    assert ks_for(16) == [1, 2, 4, 8, 16]
    assert ks_for(6) == [1, 2, 4, 6]
    assert ks_for(1) == [1]


# ----------------------------------------------------------------------------------------------------------------------
# A hand-made responses file

# Two benchmarks, 4 samples per problem. Correct counts c per problem:
#   alpha: p0 c=2, p1 c=0, p2 c=4        beta: p0 c=1, p1 c=3
ALPHA = [{"problem": "2+2?", "answer": "4"}, {"problem": "half?", "answer": "\\frac{1}{2}"},
         {"problem": "point?", "answer": "(1, 2)"}]  # fmt: skip
BETA = [{"problem": "7?", "answer": 7}, {"problem": "ten?", "answer": 10.0}]
RESPONSES = {
    ("alpha", 0): ["so \\boxed{4}", "</think> it is $\\boxed{4.0}$", "\\boxed{5}", "no idea"],
    ("alpha", 1): ["\\boxed{\\frac{1}{3}}", "\\boxed{2}", "\\boxed{0.25}", "\\boxed{"],
    ("alpha", 2): [
        "\\boxed{(1,2)}",
        "\\boxed{\\left(1, 2\\right)}",
        "\\boxed{( 1 , 2 )}",
        "<think></think>\\boxed{(1,2)}",
    ],
    ("beta", 0): ["\\boxed{7}", "\\boxed{8}", "\\boxed{6}", "\\boxed{-7}"],
    ("beta", 1): ["\\boxed{10}", "\\boxed{10.0}", "\\boxed{11}", "The answer is $\\boxed{10}$."],
}
# pass@1 = mean over problems of c / 4:
#   alpha (2/4 + 0/4 + 4/4) / 3 = 1/2;  beta (1/4 + 3/4) / 2 = 1/2
# pass@2 = mean of 1 - C(4-c, 2) / C(4, 2), C(4, 2) = 6:
#   c=2: 1 - 1/6 = 5/6; c=0: 0; c=4: 1  -> alpha (5/6 + 0 + 1) / 3 = 11/18
#   c=1: 1 - 3/6 = 1/2; c=3: 1 - 0 = 1  -> beta (1/2 + 1) / 2 = 3/4
# pass@4 = share of problems with any correct sample: alpha 2/3, beta 1
# average over the two benchmarks: pass@1 1/2, pass@2 (11/18 + 3/4) / 2 = 49/72, pass@4 (2/3 + 1) / 2 = 5/6
EXPECTED = {
    "alpha": {"pass@1": 1 / 2, "pass@2": 11 / 18, "pass@4": 2 / 3},
    "beta": {"pass@1": 1 / 2, "pass@2": 3 / 4, "pass@4": 1.0},
}
EXPECTED_AVERAGE = {"pass@1": 1 / 2, "pass@2": 49 / 72, "pass@4": 5 / 6}


@pytest.fixture
def responses_file(tmp_path) -> tuple[Path, list[str]]:
    benchmarks = []
    for name, rows in (("alpha", ALPHA), ("beta", BETA)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rows))
        benchmarks.append(str(path))
    lines = [
        json.dumps({"benchmark": b, "problem_index": p, "sample_index": j, "response": r})
        for (b, p), rs in RESPONSES.items()
        for j, r in enumerate(rs)
    ]
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(reversed(lines)) + "\n")  # any order
    return path, benchmarks


# Standard errors over problems of pass@1 (per-problem values c / 4, sample sd with ddof 1):
#   alpha: values 1/2, 0, 1; mean 1/2; variance (0 + 1/4 + 1/4) / 2 = 1/4; se = sqrt(1/4 / 3) = 0.288675
#   beta:  values 1/4, 3/4; mean 1/2; variance (1/16 + 1/16) / 1 = 1/8; se = sqrt(1/8 / 2) = 1/4
#   average: sqrt(se_alpha^2 + se_beta^2) / 2 = sqrt(1/12 + 1/16) / 2 = 0.190941
EXPECTED_SE1 = {"alpha": math.sqrt(1 / 12), "beta": 0.25}
EXPECTED_AVERAGE_SE1 = math.sqrt(1 / 12 + 1 / 16) / 2


def _assert_table(summary) -> None:
    got = {r.benchmark: r.metrics for r in summary.rows}
    assert got.keys() == EXPECTED.keys()
    for bench, metrics in EXPECTED.items():
        assert got[bench] == pytest.approx(metrics, abs=1e-12), bench
    assert summary.average == pytest.approx(EXPECTED_AVERAGE, abs=1e-12)
    assert [(r.problems, r.samples) for r in summary.rows] == [(3, 4), (2, 4)]
    assert {r.benchmark: r.se["pass@1"] for r in summary.rows} == pytest.approx(EXPECTED_SE1, abs=1e-12)
    assert summary.average_se["pass@1"] == pytest.approx(EXPECTED_AVERAGE_SE1, abs=1e-12)


@pytest.mark.parametrize("grader", ["math_verify", "deepscaler"])
def test_grade_responses_file_gives_exact_pass_at_k(responses_file, tmp_path, grader):
    path, benchmarks = responses_file
    out = tmp_path / f"out_{grader}"
    summary = grade_responses_file(path, benchmarks, grader, out_dir=out, workers=1)
    _assert_table(summary)
    records = [json.loads(line) for line in (out / RESPONSES_FILE).read_text().splitlines()]
    assert len(records) == 20 and all(r["score"] in (0.0, 1.0) for r in records)
    # Re-reading the graded file (scores present) gives the same table without grading.
    _assert_table(grade_responses_file(out / RESPONSES_FILE, None))


def test_stored_scores_are_kept_unless_regrade(responses_file, tmp_path):
    path, benchmarks = responses_file
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["score"] = 1.0  # claimed correct everywhere
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert grade_responses_file(path, benchmarks).average["pass@1"] == 1.0
    _assert_table(grade_responses_file(path, benchmarks, regrade=True, workers=1))


def test_write_results_files(tmp_path):
    records = [
        {"benchmark": b, "problem_index": p, "sample_index": j, "response": "", "score": s}
        for b, p, scores in (("alpha", 0, [1, 0]), ("alpha", 1, [0, 0]), ("beta", 5, [1, 1]))
        for j, s in enumerate(scores)
    ]
    summary = write_results(records, tmp_path / "res")
    # alpha: pass@1 (1/2 + 0) / 2 = 1/4, pass@2 (1 + 0) / 2 = 1/2; beta: 1, 1; average 5/8, 3/4
    # se of alpha's pass@1: values 1/2, 0 -> variance 1/8 -> se sqrt(1/8 / 2) = 1/4; beta: 0 (both 1)
    # average se: sqrt(1/16 + 0) / 2 = 1/8
    with (tmp_path / "res" / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["benchmark"], float(r["pass@1"]), float(r["pass@2"]), float(r["pass@1_se"])) for r in rows] == [
        ("alpha", 0.25, 0.5, 0.25),
        ("beta", 1.0, 1.0, 0.0),
        ("average", 0.625, 0.75, 0.125),
    ]
    for r in rows:  # every interval lies in [0, 1]
        assert 0.0 <= float(r["pass@1_ci_low"]) <= float(r["pass@1_ci_high"]) <= 1.0
    # beta solves every sample: every bootstrap replicate is 1, so its interval is [1, 1].
    assert (float(rows[1]["pass@1_ci_low"]), float(rows[1]["pass@1_ci_high"])) == (1.0, 1.0)
    assert json.loads((tmp_path / "res" / "summary.json").read_text()) == summary.to_dict()
    md = (tmp_path / "res" / "summary.md").read_text()
    alpha = summary.row("alpha").ci["pass@1"]
    assert f"| alpha | 2 | 2 | 25.00 ± 25.00 [{100 * alpha[0]:.2f}, {100 * alpha[1]:.2f}] |" in md
    assert "| average | | | 62.50 ± 12.50 [" in md
    assert "95% bootstrap interval" in md and "2000 replicates, seed 0" in md
    assert str(summary) == md
    assert len((tmp_path / "res" / RESPONSES_FILE).read_text().splitlines()) == 6


def test_summarize_rejects_bad_records():
    rec = {"benchmark": "a", "problem_index": 0, "sample_index": 0, "response": "", "score": 1.0}
    with pytest.raises(ValueError, match="appears twice"):
        summarize([rec, dict(rec)])
    with pytest.raises(ValueError, match="has no score"):
        summarize([{**rec, "score": None}])
    with pytest.raises(ValueError, match="no records"):
        summarize([])


def test_bad_lines_name_file_and_line(responses_file, tmp_path):
    path, benchmarks = responses_file
    good = path.read_text().splitlines()
    cases = [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"benchmark": "alpha", "problem_index": 0, "sample_index": 9}), "field 'response' missing"),
        (json.dumps({"benchmark": "alpha", "problem_index": "0", "sample_index": 9, "response": ""}),
         "field 'problem_index' missing or not of type int"),
        (json.dumps({"benchmark": "alpha", "problem_index": 0, "sample_index": 9, "response": "", "score": "1"}),
         "field 'score' is not a number"),
    ]  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    for line, what in cases:
        bad.write_text("\n".join([good[0], good[1], line]) + "\n")
        with pytest.raises(ValueError, match=f"^{bad}:3: {what}"):
            grade_responses_file(bad, benchmarks)
    bad.write_text(json.dumps({"benchmark": "alpha", "problem_index": 7, "sample_index": 0, "response": ""}) + "\n")
    with pytest.raises(ValueError, match=rf"^{bad}:1: problem_index 7 is not in benchmark 'alpha' \(3 problems\)"):
        grade_responses_file(bad, benchmarks)
    with pytest.raises(FileNotFoundError, match="results not found: .*none.jsonl"):
        grade_responses_file(tmp_path / "none.jsonl", benchmarks)
    with pytest.raises(ValueError, match="no records of benchmarks aime"):
        grade_responses_file(path, ["aime"])


# ----------------------------------------------------------------------------------------------------------------------
# End to end with the transformers generator


@pytest.mark.skipif(not (ROOT / "nemo_disco" / "generation" / "hf.py").is_file(), reason="HF generator not present")
def test_evaluate_model_tiny_hf(tiny_qwen2, tmp_path):
    bench = tmp_path / "arith.json"
    bench.write_text(json.dumps([{"problem": "1+1", "answer": 2}, {"problem": "2+5", "answer": 7},
                                 {"problem": "3+3", "answer": 6}]))  # fmt: skip
    out = tmp_path / "eval"
    summary = evaluate_model(
        tiny_qwen2,
        [str(bench)],
        samples=2,
        temperature=1.0,
        top_p=1.0,
        max_tokens=6,
        backend="hf",
        out_dir=out,
        grader="math_verify",
        seed=0,
        max_problems=2,
        template="{problem}=",
        use_chat_template=True,
        workers=1,
    )
    records = [json.loads(line) for line in (out / RESPONSES_FILE).read_text().splitlines()]
    assert [(r["problem_index"], r["sample_index"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["benchmark"] == "arith" and 1 <= r["response_tokens"] <= 6 for r in records)
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}
    assert [(r.benchmark, r.problems, r.samples) for r in summary.rows] == [("arith", 2, 2)]
    # The table on disk is the one re-grading the written file gives.
    assert grade_responses_file(out / RESPONSES_FILE, [str(bench)], regrade=True, workers=1).to_dict() == (
        summary.to_dict()
    )


# ----------------------------------------------------------------------------------------------------------------------
# Intervals


def _records(table: dict[tuple[str, int], list[int]]) -> list[dict]:
    """Graded records from {(benchmark, problem): [score of each sample]}."""
    return [
        {"benchmark": b, "problem_index": p, "sample_index": j, "response": "", "score": float(s)}
        for (b, p), scores in table.items()
        for j, s in enumerate(scores)
    ]


def test_intervals_are_seeded_and_per_benchmark():
    records = _records({("alpha", p): [p % 2, 1, 0, p % 3 == 0] for p in range(12)} | {("beta", 0): [1, 0, 1, 1]})
    a, b = summarize(records), summarize(records)
    assert [r.ci for r in a.rows] == [r.ci for r in b.rows] and a.average_ci == b.average_ci
    assert summarize(records, seed=1).row("alpha").ci != a.row("alpha").ci
    # Each benchmark draws from its own stream (seed, name): its interval does not depend on the other rows.
    alone = summarize([r for r in records if r["benchmark"] == "alpha"])
    assert alone.row("alpha").ci == a.row("alpha").ci
    for r in a.rows:
        for key, (low, high) in r.ci.items():
            assert 0.0 <= low <= r.metrics[key] <= high <= 1.0, (r.benchmark, key)
    plain = summarize(records, replicates=0)
    assert plain.row("alpha").ci == {} and plain.average_ci == {} and plain.row("alpha").se == a.row("alpha").se
    assert "bootstrap" not in plain.to_markdown()


# ----------------------------------------------------------------------------------------------------------------------
# Several runs of one setting


# Three runs on one benchmark, 2 problems x 2 samples:
#   run a: p0 [1, 1], p1 [0, 0] -> pass@1 (1 + 0) / 2 = 0.5,          pass@2 (1 + 0) / 2 = 0.5
#   run b: p0 [1, 0], p1 [0, 0] -> pass@1 (1/2 + 0) / 2 = 0.25,       pass@2 (1 + 0) / 2 = 0.5
#   run c: p0 [1, 1], p1 [1, 0] -> pass@1 (1 + 1/2) / 2 = 0.75,       pass@2 (1 + 1) / 2 = 1.0
# pass@1 over runs: mean 0.5; deviations 0, -1/4, 1/4 -> variance (1/16 + 1/16) / 2 = 1/16 -> sd 1/4
# pass@2 over runs: mean 2/3; deviations -1/6, -1/6, 1/3 -> variance (1/36 + 1/36 + 4/36) / 2 = 1/12
RUNS = {
    "a": {("alpha", 0): [1, 1], ("alpha", 1): [0, 0]},
    "b": {("alpha", 0): [1, 0], ("alpha", 1): [0, 0]},
    "c": {("alpha", 0): [1, 1], ("alpha", 1): [1, 0]},
}


def test_aggregate_runs_hand_computed():
    runs = aggregate_runs([summarize(_records(t)) for t in RUNS.values()], list(RUNS))
    s1 = runs.stats("alpha", "pass@1")
    assert s1 == pytest.approx({"mean": 0.5, "sd": 0.25, "se": 0.25 / math.sqrt(3), "min": 0.25, "max": 0.75})
    s2 = runs.stats("alpha", "pass@2")
    assert s2 == pytest.approx({"mean": 2 / 3, "sd": math.sqrt(1 / 12), "se": math.sqrt(1 / 36), "min": 0.5, "max": 1})
    assert runs.rows["average"]["pass@1"] == [0.5, 0.25, 0.75]  # one benchmark: the average is that benchmark
    md = runs.to_markdown()
    assert "| alpha | 50.00 ± 25.00 [25.00, 75.00] | 66.67 ± 28.87 [50.00, 100.00] |" in md
    assert "| alpha | 50.00 ± 50.00 | 25.00 ± 25.00 | 75.00 ± 25.00 |" in md  # each run's pass@1 ± its own se
    rows = list(csv.DictReader(io.StringIO(runs.to_csv())))
    first = rows[0]
    assert (first["benchmark"], first["metric"], first["runs"], first["a"], first["b"], first["c"]) == (
        "alpha", "pass@1", "3", "0.5", "0.25", "0.75",
    )  # fmt: skip
    assert json.loads(json.dumps(runs.to_dict()))["labels"] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="one label per run"):
        aggregate_runs([summarize(_records(RUNS["a"]))], ["a", "b"])


# ----------------------------------------------------------------------------------------------------------------------
# Two results, paired by problem

# alpha, 2 samples per problem; correct counts A [2, 1, 1, 0], B [1, 1, 0, 0]
#   pass@1 A: (1 + 1/2 + 1/2 + 0) / 4 = 1/2; B: (1/2 + 1/2 + 0 + 0) / 4 = 1/4
#   per-problem differences 1/2, 0, 1/2, 0: mean 1/4; variance 4 * (1/4)^2 / 3 = 1/12; se sqrt(1/12 / 4)
#   A better on 2 problems, B on none. pass@2: A [1, 1, 1, 0] -> 3/4, B [1, 1, 0, 0] -> 1/2, diff 1/4
# beta, correct counts A [2, 2], B [0, 2]: differences 1, 0: mean 1/2; variance 1/2; se sqrt(1/2 / 2) = 1/2
# average of pass@1: diff (1/4 + 1/2) / 2 = 3/8; se sqrt(1/48 + 1/4) / 2
COUNTS_A = {("alpha", 0): [1, 1], ("alpha", 1): [1, 0], ("alpha", 2): [0, 1], ("alpha", 3): [0, 0],
            ("beta", 0): [1, 1], ("beta", 1): [1, 1], ("alpha", 9): [1, 1]}  # fmt: skip
COUNTS_B = {("alpha", 0): [0, 1], ("alpha", 1): [1, 0], ("alpha", 2): [0, 0], ("alpha", 3): [0, 0],
            ("beta", 0): [0, 0], ("beta", 1): [1, 1]}  # fmt: skip


def test_compare_results_hand_computed():
    cmp = compare_results(_records(COUNTS_A), _records(COUNTS_B), ks=[1, 2], labels=("disco", "grpo"))
    rows = {(r.benchmark, r.metric): r for r in cmp.rows}
    alpha = rows[("alpha", "pass@1")]
    assert alpha.problems == 4  # problem 9 is only in A: left out of the pairing
    assert (alpha.a, alpha.b, alpha.diff) == (pytest.approx(0.5), pytest.approx(0.25), pytest.approx(0.25))
    assert alpha.se == pytest.approx(math.sqrt(1 / 48))
    assert (alpha.a_better, alpha.b_better) == (2, 0)
    # Problems only (the default): replicate differences are means of 4 draws from {1/2, 0, 1/2, 0}.
    assert 0.0 <= alpha.ci[0] <= 0.25 <= alpha.ci[1] <= 0.5
    assert rows[("alpha", "pass@2")].diff == pytest.approx(0.25)
    beta = rows[("beta", "pass@1")]
    assert (beta.diff, beta.se) == (pytest.approx(0.5), pytest.approx(0.5))
    avg = rows[("average", "pass@1")]
    assert (avg.diff, avg.se) == (pytest.approx(3 / 8), pytest.approx(math.sqrt(1 / 48 + 1 / 4) / 2))
    md = cmp.to_markdown()
    assert "A = disco, B = grpo" in md and "| alpha | pass@1 | 4 | 50.00 | 25.00 | +25.00 | 14.43 | [" in md
    parsed = list(csv.DictReader(io.StringIO(cmp.to_csv())))
    assert [(r["benchmark"], r["metric"]) for r in parsed] == [
        ("alpha", "pass@1"), ("alpha", "pass@2"), ("beta", "pass@1"), ("beta", "pass@2"),
        ("average", "pass@1"), ("average", "pass@2"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="k=4 needs that many samples"):
        compare_results(_records(COUNTS_A), _records(COUNTS_B), ks=[4])
    with pytest.raises(ValueError, match="share no benchmark"):
        compare_results(_records({("x", 0): [1]}), _records({("y", 0): [1]}))


def test_load_results_needs_graded_records(responses_file, tmp_path):
    path, _ = responses_file
    with pytest.raises(ValueError, match=r"record has no score; grade it first: nemo-disco eval --responses"):
        load_results(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no responses.jsonl"):
        load_results(tmp_path / "empty")


def test_plot_pass_at_k(tmp_path):
    summaries = [summarize(_records(RUNS[k])) for k in ("a", "c")]
    out = plot_pass_at_k(summaries, ["a", "c"], tmp_path / "p" / "passk.png")
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no result has benchmark"):
        plot_pass_at_k(summaries, ["a", "c"], tmp_path / "x.png", benchmarks=["aime"])


# ----------------------------------------------------------------------------------------------------------------------
# Response length beside accuracy


def _timed(table: dict[tuple[str, int], list[tuple[int, int]]]) -> list[dict]:
    """Graded records with token counts from {(benchmark, problem): [(tokens, score) of each sample]}."""
    return [
        {"benchmark": b, "problem_index": p, "sample_index": j, "response": "", "score": float(s), "response_tokens": t}
        for (b, p), samples in table.items()
        for j, (t, s) in enumerate(samples)
    ]


# alpha: problem 0 samples (10 tokens, right), (20, wrong); problem 1 (30, wrong), (50, wrong).
# beta: (4, right), (6, right).
LENGTHS_A = {("alpha", 0): [(10, 1), (20, 0)], ("alpha", 1): [(30, 0), (50, 0)], ("beta", 5): [(4, 1), (6, 1)]}
# B on alpha: problem 0 (12, right), (14, right); problem 1 (40, wrong), (40, right).
LENGTHS_B = {("alpha", 0): [(12, 1), (14, 1)], ("alpha", 1): [(40, 0), (40, 1)]}


def test_summary_reports_response_lengths(tmp_path):
    summary = write_results(_timed(LENGTHS_A), tmp_path / "res", replicates=0)
    alpha, beta = summary.row("alpha"), summary.row("beta")
    # alpha, all samples: per-problem means 15 and 40 -> 27.5, se = sd(15, 40) / sqrt(2) = 12.5.
    # correct: one sample of 10 (problem 1 has none and counts 0) -> 10 +- 0.
    # wrong: 20 | 30, 50 -> 100 / 3, clustered se 80 / 9 (tests/unit/test_stats.py works it out).
    assert alpha.lengths == pytest.approx({"length": 27.5, "length_correct": 10.0, "length_wrong": 100 / 3})
    assert alpha.lengths_se == pytest.approx({"length": 12.5, "length_correct": 0.0, "length_wrong": 80 / 9})
    # beta: all right, (4 + 6) / 2 = 5; no wrong sample -> no wrong length.
    assert beta.lengths == {"length": 5.0, "length_correct": 5.0} and beta.lengths_se["length"] == 0.0
    # Average over benchmarks: (27.5 + 5) / 2 = 16.25, se sqrt(12.5^2 + 0) / 2 = 6.25; correct (10 + 5) / 2 = 7.5;
    # wrong: not every benchmark has it -> left out.
    assert summary.average_lengths == {"length": 16.25, "length_correct": 7.5}
    assert summary.average_lengths_se == {"length": 6.25, "length_correct": 0.0}
    md = (tmp_path / "res" / "summary.md").read_text()
    assert "length (tokens) | correct length (tokens) | wrong length (tokens) |" in md
    # One decimal; three where the standard error is below 0.1 (the CPU demo's responses are ~11 tokens).
    assert "| 27.5 ± 12.5 | 10.000 ± 0.000 | 33.3 ± 8.9 |" in md and "| 5.000 ± 0.000 | 5.000 ± 0.000 | - |" in md
    assert "| 16.2 ± 6.2 | 7.500 ± 0.000 | - |" in md
    rows = {r["benchmark"]: r for r in csv.DictReader((tmp_path / "res" / "summary.csv").open())}
    assert float(rows["alpha"]["length_wrong_se"]) == pytest.approx(80 / 9) and rows["beta"]["length_wrong"] == ""
    assert float(rows["average"]["length"]) == 16.25
    saved = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert saved["benchmarks"][0]["length_correct"] == 10.0 and saved["average"]["length_se"] == 6.25
    # Records without token counts (older results): no length anywhere.
    plain = summarize(_records({("alpha", 0): [1, 0]}), replicates=0)
    assert plain.row("alpha").lengths == {} and "length" not in plain.to_markdown() and "length" not in plain.to_csv()


def test_compare_results_pairs_lengths_by_problem(tmp_path):
    cmp = compare_results(_timed(LENGTHS_A), _timed(LENGTHS_B), replicates=0, labels=("drpo", "disco"))
    (alpha,) = cmp.rows  # beta is only in A
    # All samples: 27.5 vs (13 + 40) / 2 = 26.5; per-problem differences 2, 0 -> +1 +- 1.
    # Correct: 10 vs (12 + 14 + 40) / 3 = 22 -> -12, se 12; wrong: 100/3 vs 40 -> -20/3, se 80/9 (B's z are 0).
    assert alpha.lengths["length"] == pytest.approx({"a": 27.5, "b": 26.5, "diff": 1.0, "se": 1.0})
    assert alpha.lengths["length_correct"] == pytest.approx({"a": 10.0, "b": 22.0, "diff": -12.0, "se": 12.0})
    assert alpha.lengths["length_wrong"] == pytest.approx({"a": 100 / 3, "b": 40.0, "diff": -20 / 3, "se": 80 / 9})
    md = cmp.to_markdown()
    assert "| length A / B, A - B ± se (tokens) |" in md
    assert "| 27.5 / 26.5, +1.0 ± 1.0 | 10.0 / 22.0, -12.0 ± 12.0 | 33.3 / 40.0, -6.7 ± 8.9 |" in md
    parsed = next(csv.DictReader(io.StringIO(cmp.to_csv())))
    assert float(parsed["length_correct_diff"]) == -12.0 and float(parsed["length_se"]) == 1.0
    # Two benchmarks: the average row averages the differences (standard errors combined as independent).
    b2 = {("beta", 5): [(8, 1), (6, 0)]}
    cmp2 = compare_results(_timed(LENGTHS_A), _timed(LENGTHS_B | b2), replicates=0)
    avg = next(r for r in cmp2.rows if r.benchmark == "average")
    # beta: 5 vs 7 -> -2 +- 0 (one problem); average (1 - 2) / 2 = -0.5, se sqrt(1 + 0) / 2 = 0.5.
    assert avg.lengths["length"] == pytest.approx({"a": 16.25, "b": 16.75, "diff": -0.5, "se": 0.5})
    assert "length_wrong" not in avg.lengths  # A has no wrong sample on beta
    assert compare_results(_records(COUNTS_A), _records(COUNTS_B), replicates=0).rows[0].lengths == {}


def test_aggregate_runs_reports_lengths_across_runs():
    # Two runs of alpha (LENGTHS_A's and LENGTHS_B's): lengths 27.5 and 26.5 -> mean 27, sd sqrt(0.5) = 0.7071;
    # correct 10 and 22 -> 16 +- sqrt(72) = 8.4853; wrong 100/3 and 40.
    runs = aggregate_runs([summarize(_timed(t), replicates=0) for t in (LENGTHS_A, LENGTHS_B)], ["a", "b"])
    assert runs.rows["alpha"]["length"] == [27.5, 26.5]
    assert runs.stats("alpha", "length_correct") == pytest.approx(
        {"mean": 16.0, "sd": math.sqrt(72), "se": 6.0, "min": 10.0, "max": 22.0}
    )
    assert "average" not in runs.rows  # beta is in run a only
    md = runs.to_markdown()
    assert "| length (tokens) | correct length (tokens) | wrong length (tokens) |" in md
    assert "| 27.0 ± 0.7 [26.5, 27.5] | 16.0 ± 8.5 [10.0, 22.0] | 36.7 ± 4.7 [33.3, 40.0] |" in md
    metrics = [(r["benchmark"], r["metric"]) for r in csv.DictReader(io.StringIO(runs.to_csv()))]
    assert metrics[-3:] == [("alpha", "length"), ("alpha", "length_correct"), ("alpha", "length_wrong")]


def test_plot_length_accuracy(tmp_path):
    summaries = [summarize(_timed(t), replicates=0) for t in (LENGTHS_A, LENGTHS_B)]
    out = plot_length_accuracy(summaries, ["drpo", "disco"], tmp_path / "p" / "len.png")
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no response lengths"):
        plot_length_accuracy([summarize(_records(COUNTS_A), replicates=0)], ["old"], tmp_path / "x.png")
    write_results(_timed(LENGTHS_A), tmp_path / "a", replicates=0)
    write_results(_timed(LENGTHS_B), tmp_path / "b", replicates=0)
    assert cli.main(["plot", "--length-accuracy", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    write_results(_records(COUNTS_A), tmp_path / "old", replicates=0)
    assert cli.main(["plot", "--length-accuracy", str(tmp_path / "old"), "--out", str(tmp_path / "y.png")]) == 2


# ----------------------------------------------------------------------------------------------------------------------
# The CLI on the shipped benchmark files


def _shipped_responses(path: Path, correct: dict[str, int]) -> None:
    """Responses to the first problems of shipped benchmarks: sample 0 right (the gold answer), sample 1 wrong."""
    lines = []
    for bench, count in correct.items():
        for p in load_problems(bench)[0][:count]:
            gold = p.answer if isinstance(p.answer, str) else p.answer[0]
            for j, resp in enumerate([f"So the answer is $\\boxed{{{gold}}}$.", "\\boxed{-987654}"]):
                lines.append(
                    json.dumps({"benchmark": bench, "problem_index": p.index, "sample_index": j, "response": resp})
                )
    path.write_text("\n".join(lines) + "\n")


def test_cli_eval_runs_compare_and_plot_on_shipped_benchmarks(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(BENCHMARK_DIR_ENV, raising=False)  # the copies shipped in the package
    _shipped_responses(tmp_path / "r1.jsonl", {"aime": 4, "math": 4})
    args = ["eval", "--benchmarks", "aime,math", "--workers", "1", "--bootstrap", "200"]
    assert cli.main([*args, "--responses", str(tmp_path / "r1.jsonl"), "--out", str(tmp_path / "one")]) == 0
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    # 4 problems per benchmark, 1 of 2 samples right each: pass@1 = 1/2 and pass@2 = 1 on both.
    assert [(b["benchmark"], b["problems"], b["pass@1"], b["pass@2"]) for b in summary["benchmarks"]] == [
        ("aime", 4, 0.5, 1.0),
        ("math", 4, 0.5, 1.0),
    ]
    assert summary["uncertainty"]["replicates"] == 200
    assert "| aime | 4 | 2 | 50.00 ± 0.00 [" in capsys.readouterr().out

    # A second run that gets the first aime problem wrong on both samples.
    rows = [json.loads(line) for line in (tmp_path / "r1.jsonl").read_text().splitlines()]
    rows[0]["response"] = "\\boxed{-1}"
    (tmp_path / "r2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main([*args, "--responses", str(tmp_path / "r2.jsonl"), "--out", str(tmp_path / "two")]) == 0
    capsys.readouterr()

    # Both as runs of one setting: aime pass@1 0.5 and 3/8 -> mean 7/16.
    both = [str(tmp_path / "one"), str(tmp_path / "two")]
    assert cli.main([*args, "--responses", *both, "--out", str(tmp_path / "both")]) == 0
    assert "Across 2 runs (one, two)" in capsys.readouterr().out
    across = json.loads((tmp_path / "both" / "runs.json").read_text())
    aime = next(b for b in across["benchmarks"] if b["benchmark"] == "aime")
    assert aime["pass@1"]["values"] == [0.5, 0.375] and aime["pass@1"]["mean"] == pytest.approx(7 / 16)
    assert (tmp_path / "both" / "one" / "summary.md").is_file()

    # Paired comparison: aime differs on one problem (pass@1 1/2 vs 0), math not at all.
    assert cli.main(["compare", *both, "--out", str(tmp_path / "cmp"), "--bootstrap", "200"]) == 0
    assert "A = one, B = two" in capsys.readouterr().out
    parsed = list(csv.DictReader((tmp_path / "cmp" / "comparison.csv").open()))
    diffs = {r["benchmark"]: (float(r["diff"]), int(r["a_better"]), int(r["b_better"])) for r in parsed}
    assert diffs == {"aime": (0.125, 1, 0), "math": (0.0, 0, 0), "average": (0.0625, 1, 0)}

    assert cli.main(["plot", "--pass-at-k", *both, "--out", str(tmp_path / "k.png"), "--bootstrap", "100"]) == 0
    assert (tmp_path / "k.png").read_bytes().startswith(b"\x89PNG")


def test_eval_from_a_copy_of_the_package_without_shared_data(tmp_path):
    # The package copied alone (as a clone or an install has it, with nothing beside it) grades against the
    # benchmark files it ships.
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "nemo_disco", clone / "nemo_disco", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    _shipped_responses(work / "r.jsonl", {"aime": 2, "math": 2})
    env = {k: v for k, v in os.environ.items() if k != BENCHMARK_DIR_ENV} | {"PYTHONPATH": str(clone)}
    cmd = [sys.executable, "-m", "nemo_disco.cli", "eval", "--responses", "r.jsonl", "--benchmarks", "aime,math"]
    proc = subprocess.run([*cmd, "--workers", "1", "--out", "res"], cwd=work, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((work / "res" / "summary.json").read_text())
    assert [(b["benchmark"], b["pass@1"]) for b in summary["benchmarks"]] == [("aime", 0.5), ("math", 0.5)]
    where = subprocess.run(
        [sys.executable, "-c", "import nemo_disco.data as d; print(d.resolve_benchmark('aime'))"],
        cwd=work, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert where.stdout.strip() == str(clone / "nemo_disco" / "benchmark_data" / "aime.json")


# ----------------------------------------------------------------------------------------------------------------------
# Written as it goes: an interrupted evaluation continues; output errors are one line


class _StopAfter:
    """The real HFGenerator, with Ctrl-C arriving during its generate call number ``stop_at`` (1-based)."""

    def __init__(self, inner, stop_at: int | None = None) -> None:
        self.inner, self.stop_at, self.calls = inner, stop_at, 0

    def generate(self, prompt_token_ids, n, sampling):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return self.inner.generate(prompt_token_ids, n, sampling)

    def shutdown(self) -> None:
        pass


def _arith_bench(tmp_path):
    bench = tmp_path / "arith.json"
    rows = [{"problem": f"{a}+{b}", "answer": a + b} for a in range(1, 4) for b in range(1, 3)]  # 6 problems
    bench.write_text(json.dumps(rows))
    return bench


def test_interrupted_evaluation_continues_to_the_uninterrupted_result(tiny_qwen2, tmp_path, capsys):
    from nemo_disco.generation.hf import HFGenerator

    bench = _arith_bench(tmp_path)
    kwargs = dict(samples=2, temperature=1.0, top_p=1.0, max_tokens=6, backend="hf", template="{problem}=",
                  workers=1, chunk_problems=2, replicates=50)  # fmt: skip
    generator = HFGenerator(tiny_qwen2)
    # 2 benchmarks x 3 chunks of 2 problems; Ctrl-C during the 4th chunk (the first of the second benchmark).
    stopped = _StopAfter(generator, stop_at=4)
    with pytest.raises(KeyboardInterrupt):
        evaluate_model(tiny_qwen2, [str(bench), "aime"], out_dir=tmp_path / "resumed", generator=stopped,
                       max_problems=6, **kwargs)  # fmt: skip
    assert "interrupted: the responses written so far are kept in" in capsys.readouterr().err
    partial = tmp_path / "resumed" / "partial"
    written = [json.loads(line) for f in partial.glob("part-*.jsonl") for line in f.read_text().splitlines()]
    assert len(written) == 3 * 2 * 2  # three whole chunks (2 problems x 2 samples each), nothing of the 4th
    assert not (tmp_path / "resumed" / RESPONSES_FILE).exists()
    # A cut-short last line (a kill in the middle of a write) is skipped, not fatal.
    with (partial / "part-0.jsonl").open("a") as f:
        f.write('{"benchmark": "aime", "problem_in')
    # A rerun with other settings is refused in one line, naming the setting.
    with pytest.raises(ValueError, match=r"holds an interrupted evaluation with samples=2 \(this command: 3\)"):
        evaluate_model(tiny_qwen2, [str(bench), "aime"], out_dir=tmp_path / "resumed", generator=stopped,
                       max_problems=6, **{**kwargs, "samples": 3})  # fmt: skip
    counted = _StopAfter(generator)
    resumed = evaluate_model(tiny_qwen2, [str(bench), "aime"], out_dir=tmp_path / "resumed", generator=counted,
                             max_problems=6, **kwargs)  # fmt: skip
    assert "resuming the evaluation in" in capsys.readouterr().err
    assert counted.calls == 3  # only the 3 chunks not written before
    plain = evaluate_model(tiny_qwen2, [str(bench), "aime"], out_dir=tmp_path / "plain",
                           generator=_StopAfter(generator), max_problems=6, **kwargs)  # fmt: skip
    assert (tmp_path / "resumed" / RESPONSES_FILE).read_text() == (tmp_path / "plain" / RESPONSES_FILE).read_text()
    assert resumed.to_dict() == plain.to_dict()
    assert not partial.exists()  # merged into responses.jsonl
    # A finished result is not overwritten silently.
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'plain'} already holds an evaluation .*--overwrite"):
        evaluate_model(tiny_qwen2, [str(bench)], out_dir=tmp_path / "plain", generator=counted, **kwargs)
    again = evaluate_model(tiny_qwen2, [str(bench), "aime"], out_dir=tmp_path / "plain",
                           generator=_StopAfter(generator), max_problems=6, overwrite=True, **kwargs)  # fmt: skip
    assert again.to_dict() == plain.to_dict()  # seeded per chunk: the same responses


def test_chunk_seeds_depend_on_benchmark_and_chunk_only():
    from nemo_disco.evaluate import chunk_seed

    seeds = {chunk_seed(0, b, k) for b in ("aime", "math") for k in range(50)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert chunk_seed(0, "math", 3) == chunk_seed(0, "math", 3) != chunk_seed(1, "math", 3)


def test_output_folders_that_cannot_be_written_fail_in_one_line(tiny_qwen2, tmp_path, capsys):
    """Every command that writes: exit code 2 and one line naming the path, before any work.

    Root ignores permission bits, so the unwritable place is below a regular file (ENOTDIR for everyone).
    """
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    bad = blocker / "out"
    recipe = str(ROOT / "recipes" / "tiny-cpu.yaml")
    commands = {
        "train": ["train", "--config", recipe, f"logging.run_dir={bad}"],
        "convert": ["convert", "--from-hf", str(tiny_qwen2), "--out", str(bad)],
        "eval": ["eval", "--model", str(tiny_qwen2), "--backend", "hf", "--benchmarks", "aime", "--out", str(bad)],
        "data prepare": ["data", "prepare", "deepscaler", "--out", str(bad / "d.jsonl")],
        "plot": ["plot", str(tmp_path), "--out", str(bad / "curves.png")],
    }
    for name, argv in commands.items():
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"nemo-disco {name}: error: cannot write"), (name, err)
        assert str(bad) in err[0] and str(blocker) in err[0], (name, err)


def test_benchmark_lists_accept_spaces_and_version(tmp_path, capsys):
    assert cli._names(" aime, math ,,amc") == ["aime", "math", "amc"]
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("nemo-disco 0.")
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    for flag in ("--samples", "--temperature", "--top-p", "--max-tokens", "--backend", "--grader", "--seed", "--out"):
        assert flag in help_text
    assert help_text.count("default:") >= 12
