"""Across results: several runs of one setting aggregated, two results paired by problem (hand-computed)."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
from graded_records import COUNTS_A, COUNTS_B, LENGTHS_A, LENGTHS_B, RUNS, graded, timed

from nemo_disco.evaluation.compare import aggregate_runs, compare_results
from nemo_disco.evaluation.summary import summarize

# ----------------------------------------------------------------------------------------------------------------------
# Several runs of one setting


def test_aggregate_runs_hand_computed():
    runs = aggregate_runs([summarize(graded(t)) for t in RUNS.values()], list(RUNS))
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
        aggregate_runs([summarize(graded(RUNS["a"]))], ["a", "b"])


def test_aggregate_runs_reports_lengths_across_runs():
    # Two runs of alpha (LENGTHS_A's and LENGTHS_B's): lengths 27.5 and 26.5 -> mean 27, sd sqrt(0.5) = 0.7071;
    # correct 10 and 22 -> 16 +- sqrt(72) = 8.4853; wrong 100/3 and 40.
    runs = aggregate_runs([summarize(timed(t), replicates=0) for t in (LENGTHS_A, LENGTHS_B)], ["a", "b"])
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


# ----------------------------------------------------------------------------------------------------------------------
# Two results, paired by problem


def test_compare_results_hand_computed():
    cmp = compare_results(graded(COUNTS_A), graded(COUNTS_B), ks=[1, 2], labels=("disco", "grpo"))
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
        compare_results(graded(COUNTS_A), graded(COUNTS_B), ks=[4])
    with pytest.raises(ValueError, match="share no benchmark"):
        compare_results(graded({("x", 0): [1]}), graded({("y", 0): [1]}))


def test_compare_results_pairs_lengths_by_problem(tmp_path):
    cmp = compare_results(timed(LENGTHS_A), timed(LENGTHS_B), replicates=0, labels=("drpo", "disco"))
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
    cmp2 = compare_results(timed(LENGTHS_A), timed(LENGTHS_B | b2), replicates=0)
    avg = next(r for r in cmp2.rows if r.benchmark == "average")
    # beta: 5 vs 7 -> -2 +- 0 (one problem); average (1 - 2) / 2 = -0.5, se sqrt(1 + 0) / 2 = 0.5.
    assert avg.lengths["length"] == pytest.approx({"a": 16.25, "b": 16.75, "diff": -0.5, "se": 0.5})
    assert "length_wrong" not in avg.lengths  # A has no wrong sample on beta
    assert compare_results(graded(COUNTS_A), graded(COUNTS_B), replicates=0).rows[0].lengths == {}
