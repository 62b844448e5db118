"""Results on disk: re-grading a responses file, the written tables, bad lines, loading; the CLI on shipped files."""

from __future__ import annotations

import csv
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
from nemo_disco.evaluation.records import RESPONSES_FILE, grade_responses_file, load_results, write_results

ROOT = Path(__file__).resolve().parents[2]


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


def test_load_results_needs_graded_records(responses_file, tmp_path):
    path, _ = responses_file
    with pytest.raises(ValueError, match=r"record has no score; grade it first: nemo-disco eval --responses"):
        load_results(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no responses.jsonl"):
        load_results(tmp_path / "empty")


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
