"""pass@k estimator, tables, writers, re-grading a responses file, and a tiny end-to-end evaluation."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import pytest

from nemo_disco.evaluate import (
    RESPONSES_FILE,
    evaluate_model,
    grade_responses_file,
    ks_for,
    pass_at_k,
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


def _assert_table(summary) -> None:
    got = {r.benchmark: r.metrics for r in summary.rows}
    assert got.keys() == EXPECTED.keys()
    for bench, metrics in EXPECTED.items():
        assert got[bench] == pytest.approx(metrics, abs=1e-12), bench
    assert summary.average == pytest.approx(EXPECTED_AVERAGE, abs=1e-12)
    assert [(r.problems, r.samples) for r in summary.rows] == [(3, 4), (2, 4)]


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
    with (tmp_path / "res" / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["benchmark"], float(r["pass@1"]), float(r["pass@2"])) for r in rows] == [
        ("alpha", 0.25, 0.5),
        ("beta", 1.0, 1.0),
        ("average", 0.625, 0.75),
    ]
    assert json.loads((tmp_path / "res" / "summary.json").read_text()) == summary.to_dict()
    md = (tmp_path / "res" / "summary.md").read_text()
    assert "| alpha | 2 | 2 | 25.00 | 50.00 |" in md and "| average | | | 62.50 | 75.00 |" in md
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
    with pytest.raises(FileNotFoundError, match="responses file not found"):
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
