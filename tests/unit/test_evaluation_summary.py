"""One result's table: the k reported, pass@k with standard errors and seeded intervals, response lengths."""

from __future__ import annotations

import csv
import json

import pytest
from graded_records import LENGTHS_A, graded, timed

from nemo_disco.evaluation.records import write_results
from nemo_disco.evaluation.summary import ks_for, summarize


def test_ks_for():
    assert ks_for(16) == [1, 2, 4, 8, 16]
    assert ks_for(6) == [1, 2, 4, 6]
    assert ks_for(1) == [1]


def test_summarize_rejects_bad_records():
    rec = {"benchmark": "a", "problem_index": 0, "sample_index": 0, "response": "", "score": 1.0}
    with pytest.raises(ValueError, match="appears twice"):
        summarize([rec, dict(rec)])
    with pytest.raises(ValueError, match="has no score"):
        summarize([{**rec, "score": None}])
    with pytest.raises(ValueError, match="no records"):
        summarize([])


# ----------------------------------------------------------------------------------------------------------------------
# Intervals


def test_intervals_are_seeded_and_per_benchmark():
    records = graded({("alpha", p): [p % 2, 1, 0, p % 3 == 0] for p in range(12)} | {("beta", 0): [1, 0, 1, 1]})
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
# Response length beside accuracy


def test_summary_reports_response_lengths(tmp_path):
    summary = write_results(timed(LENGTHS_A), tmp_path / "res", replicates=0)
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
    plain = summarize(graded({("alpha", 0): [1, 0]}), replicates=0)
    assert plain.row("alpha").lengths == {} and "length" not in plain.to_markdown() and "length" not in plain.to_csv()
