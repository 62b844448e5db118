"""``nemo-disco data prepare`` on local files in the hub layouts of DeepScaleR-Preview and DAPO-Math-17k."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nemo_disco import cli
from nemo_disco.data import SHIPPED_BENCHMARK_DIR, load_problems
from nemo_disco.prepare import PRESETS, prepare, report_path

ROOT = Path(__file__).resolve().parents[2]
AIME_0 = json.loads((SHIPPED_BENCHMARK_DIR / "aime.json").read_text())[0]["problem"]
AMC_0 = json.loads((SHIPPED_BENCHMARK_DIR / "amc.json").read_text())[0]["problem"]
# A MATH-500 problem with one number changed: the same template, a near (not exact) copy.
MATH_0 = json.loads((SHIPPED_BENCHMARK_DIR / "math.json").read_text())[0]["problem"]
MATH_0_VARIANT = MATH_0.replace("(0,3)", "(0,5)")

# DeepScaleR-Preview layout (agentica-org/DeepScaleR-Preview-Dataset: problem, answer, solution).
DEEPSCALER_ROWS = [
    {"problem": "What is $1+1$?", "answer": "2", "solution": "1+1=2"},  # 0 kept
    {"problem": AIME_0, "answer": "204", "solution": "..."},  # 1 kept; exact copy of aime #0
    {"problem": MATH_0_VARIANT, "answer": "(3, \\frac{\\pi}{2})", "solution": "..."},  # 2 kept; near math #0
    {"problem": "Find $x$.", "answer": None, "solution": "..."},  # 3 no answer
    {"problem": "Find $y$.", "answer": "  ", "solution": "..."},  # 4 no answer (blank)
    {"problem": " ", "answer": "5", "solution": "..."},  # 5 no problem text
    {"problem": "what is  $1+1$?", "answer": "2", "solution": "..."},  # 6 duplicate of 0 (case, spaces)
    {"problem": "What is $1+1$?", "answer": "3", "solution": "..."},  # 7 duplicate of 0, another answer
    {"problem": "Evaluate the sum.", "answer": "}", "solution": "..."},  # 8 answer no grader can verify
    {"problem": "Compute $3 \\times 4$.", "answer": "12", "solution": "..."},  # 9 kept
]
DEEPSCALER_SKIPS = {
    "no answer": 2,
    "no problem text": 1,
    "duplicate problem": 2,
    "answer not verifiable by the grader": 1,
}

# DAPO-Math-17k layout (BytedTsinghua-SIA/DAPO-Math-17k): a chat prompt that wraps the problem in the set's
# instruction, the answer in reward_model.ground_truth; every problem repeated many times.
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_A = "Let $a_1 = 3$ and $a_{n+1} = 2a_n + 1$. Find $a_5$."
DAPO_B = "How many positive divisors does $360$ have?"


def _dapo_row(problem: str, answer: str, i: int) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"id-{i}"},
    }


DAPO_ROWS = [
    _dapo_row(DAPO_A, "63", 0),  # 0 kept
    _dapo_row(DAPO_A, "63", 1),  # 1 duplicate
    _dapo_row(DAPO_B, "24", 2),  # 2 kept
    _dapo_row(AMC_0, "5", 3),  # 3 kept; exact copy of amc #0
    _dapo_row(DAPO_A, "63", 4),  # 4 duplicate
    _dapo_row(DAPO_B, "24", 5),  # 5 duplicate
    _dapo_row("Find the least prime above 100.", "", 6),  # 6 no answer
    _dapo_row(AMC_0, "5", 7),  # 7 duplicate
]
DAPO_SKIPS = {"duplicate problem": 4, "no answer": 1}


def _write(rows: list[dict], path: Path) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows, indent=1))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("suffix", [".parquet", ".json"])
def test_deepscaler_layout(tmp_path, suffix):
    src = _write(DEEPSCALER_ROWS, tmp_path / f"deepscaler{suffix}")
    out = tmp_path / "out" / "train.jsonl"
    report = prepare(str(src), out, workers=1)
    assert (report.problem_key, report.answer_key) == ("problem", "answer")
    assert (report.rows, report.kept) == (10, 4)
    assert dict(report.skipped) == DEEPSCALER_SKIPS
    assert report.first_skipped == {
        "no answer": 3, "no problem text": 5, "duplicate problem": 6, "answer not verifiable by the grader": 8,
    }  # fmt: skip
    assert report.conflicting_duplicates == 1
    rows = _lines(out)
    assert [r["row"] for r in rows] == [0, 1, 2, 9]
    assert rows[0] == {"problem": "What is $1+1$?", "answer": "2", "source": str(src), "row": 0}
    # Contamination: row 1 is AIME 2024 #0 verbatim, row 2 a one-number variant of MATH-500 #0.
    counts = report.overlap_counts()
    assert counts["aime"] == {"exact_rows": 1, "near_rows": 0, "benchmark_problems_hit": 1, "benchmark_problems": 30}
    assert counts["math"] == {"exact_rows": 0, "near_rows": 1, "benchmark_problems_hit": 1, "benchmark_problems": 500}
    assert all(c["exact_rows"] + c["near_rows"] == 0 for b, c in counts.items() if b not in ("aime", "math"))
    pairs = {(o["row"], o["benchmark"], o["problem_index"], o["kind"]) for o in report.overlaps}
    assert pairs == {(1, "aime", 0, "exact"), (2, "math", 0, "near")}
    saved = json.loads(report_path(out).read_text())
    assert saved["kept"] == 4 and saved["skipped"] == DEEPSCALER_SKIPS and saved["overlap"]["aime"]["exact_rows"] == 1
    # The written file is what the recipes read.
    problems, skipped = load_problems(out)
    assert (len(problems), skipped) == (4, 0)


@pytest.mark.parametrize("suffix", [".parquet", ".json", ".jsonl"])
def test_dapo_layout(tmp_path, suffix):
    src = _write(DAPO_ROWS, tmp_path / f"dapo{suffix}")
    out = tmp_path / "dapo.jsonl"
    report = prepare(str(src), out, workers=1)
    assert (report.problem_key, report.answer_key) == ("prompt", "reward_model.ground_truth")
    assert (report.rows, report.kept) == (8, 3)
    assert dict(report.skipped) == DAPO_SKIPS
    assert report.conflicting_duplicates == 0
    rows = _lines(out)
    # The DAPO instruction around the problem is removed (the recipe's template adds its own).
    assert [(r["problem"], r["answer"], r["row"]) for r in rows] == [
        (DAPO_A, "63", 0),
        (DAPO_B, "24", 2),
        (AMC_0, "5", 3),
    ]
    assert report.overlap_counts()["amc"]["exact_rows"] == 1


def test_drop_overlap_strict_and_grader(tmp_path):
    src = _write(DEEPSCALER_ROWS, tmp_path / "d.json")
    report = prepare(str(src), tmp_path / "clean.jsonl", drop_overlap=True, workers=1)
    assert [r["row"] for r in _lines(tmp_path / "clean.jsonl")] == [0, 9]
    assert report.skipped["overlaps a benchmark (dropped)"] == 2 and report.kept == 2
    with pytest.raises(ValueError, match=rf"^{src}: row 3: no answer$"):
        prepare(str(src), tmp_path / "strict.jsonl", strict=True, check_answers=False)
    # The DeepScaleR grader refuses an unbalanced fraction that math-verify accepts.
    rows = [{"problem": "p", "answer": "\\frac{1}{2"}, {"problem": "q", "answer": "\\frac{1}{2}"}]
    src = _write(rows, tmp_path / "g.json")
    assert prepare(str(src), tmp_path / "g1.jsonl", grader="math_verify", workers=1).kept == 2
    report = prepare(str(src), tmp_path / "g2.jsonl", grader="deepscaler", workers=1)
    assert report.kept == 1 and report.skipped["answer not verifiable by the grader"] == 1
    # Without the check and deduplication every row with a problem and an answer is kept.
    src = _write(DEEPSCALER_ROWS, tmp_path / "d2.json")
    report = prepare(str(src), tmp_path / "all.jsonl", dedup=False, check_answers=False)
    assert report.kept == 7 and report.grader is None


def test_what_each_grader_does_with_unbalanced_braces(tmp_path):
    r"""docs/data.md's table, pinned: math-verify 0.9.0 keeps answers with unbalanced braces (it repairs some and
    compares others as strings); only a lone ``}`` fails its check. The DeepScaleR grader refuses them all."""
    from nemo_disco.rewards import score_response

    answers = ["x}", "{{", "\\frac{1}{2", "\\sqrt{", "}", "2"]
    src = _write([{"problem": f"p{i}", "answer": a} for i, a in enumerate(answers)], tmp_path / "b.json")
    kept = prepare(str(src), tmp_path / "mv.jsonl", grader="math_verify", workers=1)
    assert [r["answer"] for r in _lines(tmp_path / "mv.jsonl")] == [*answers[:4], "2"] and kept.kept == 5
    refused = prepare(str(src), tmp_path / "ds.jsonl", grader="deepscaler", workers=1)
    assert refused.kept == 1 and refused.skipped["answer not verifiable by the grader"] == 5
    # Repaired: the stray brace is dropped, the fraction closed; a response with the intended answer is right.
    assert score_response("\\boxed{x}", "x}") == 1.0
    assert score_response("\\boxed{0.5}", "\\frac{1}{2") == 1.0
    # Compared as strings: only a response repeating the broken text matches, so the question never has a positive.
    assert (
        score_response("\\boxed{\\sqrt{2}}", "\\sqrt{") == 0.0 and score_response("\\boxed{\\sqrt{}", "\\sqrt{") == 1.0
    )


def test_custom_columns(tmp_path):
    rows = [{"question": "What is 6*7?", "final": 42}, {"question": "Half of 3?", "final": 1.5}]
    src = _write(rows, tmp_path / "custom.parquet")
    with pytest.raises(ValueError, match=r"row 0: no 'problem' or 'prompt' column \(columns: question, final\)"):
        prepare(str(src), tmp_path / "x.jsonl")
    report = prepare(str(src), tmp_path / "x.jsonl", problem_key="question", answer_key="final", workers=1)
    assert [(r["problem"], r["answer"]) for r in _lines(tmp_path / "x.jsonl")] == [
        ("What is 6*7?", "42"),
        ("Half of 3?", "1.5"),
    ]
    assert report.kept == 2


def test_a_bad_file_names_row_and_column(tmp_path, capsys):
    rows = [dict(r) for r in DEEPSCALER_ROWS[:5]]
    rows[3]["answer"] = {"value": 3}
    src = _write(rows, tmp_path / "bad.json")
    args = ["data", "prepare", str(src), "--out", str(tmp_path / "o.jsonl"), "--no-answer-check"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        f"nemo-disco data prepare: error: {src}: row 3, column 'answer': expected text, a number or a list of "
        "them, got dict\n"
    )
    assert not (tmp_path / "o.jsonl").exists()
    del rows[3]["answer"]
    _write(rows, src)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"{src}: row 3, column 'answer': missing (columns: problem, solution)\n")
    bad = [_dapo_row(DAPO_A, "1", 0), {**_dapo_row(DAPO_B, "2", 1), "prompt": [{"role": "system", "content": "x"}]}]
    _write(bad, src)
    assert cli.main(args) == 2
    assert capsys.readouterr().err.endswith(
        f"{src}: row 1, column 'prompt': a list without a user message with text content\n"
    )
    (tmp_path / "broken.jsonl").write_text('{"problem": "a", "answer": "1"}\n{"problem": \n')
    assert cli.main(["data", "prepare", str(tmp_path / "broken.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err.endswith("broken.jsonl:line 2: invalid JSON: Expecting value\n")


def test_cli_prints_the_counts(tmp_path, capsys):
    src = _write(DEEPSCALER_ROWS, tmp_path / "d.parquet")
    out = tmp_path / "train.jsonl"
    assert cli.main(["data", "prepare", str(src), "--out", str(out), "--workers", "1"]) == 0
    text = capsys.readouterr().out
    words = [" ".join(line.split()) for line in text.splitlines()]  # column alignment aside
    assert words == [
        f"{src} (split train; problem from 'problem', answer from 'answer')",
        "rows read 10",
        f"kept 4 -> {out}",
        "skipped 6",
        "no answer 2 (first: row 3)",
        "duplicate problem 2 (first: row 6); 1 with a different answer",
        "no problem text 1 (first: row 5)",
        "answer not verifiable by math_verify 1 (first: row 8)",
        "overlap with the benchmarks (kept rows: exact + near; benchmark problems hit):",
        "aime 1 + 0 (1 of 30)",
        "aime25 0 + 0 (0 of 30)",
        "math 0 + 1 (1 of 500)",
        "amc 0 + 0 (0 of 83)",
        "minerva 0 + 0 (0 of 272)",
        "olympiad_bench 0 + 0 (0 of 675)",
        f"report: {tmp_path / 'train.report.json'}",
    ]


def test_hub_unreachable_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for source, hub_id in (
        ("nemo-disco-test/no-such-set", "nemo-disco-test/no-such-set"),
        ("deepscaler", PRESETS["deepscaler"]),
    ):
        assert cli.main(["data", "prepare", source, "--out", str(tmp_path / "x.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert err.startswith(
            f"nemo-disco data prepare: error: cannot load dataset '{hub_id}' (split 'train'): no local file or folder "
            "of that name; tried the Hugging Face hub through the local Hugging Face cache only (HF_HUB_OFFLINE is set)"
        )
    assert cli.main(["data", "prepare", "/no/such/file.parquet", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "training set not found: /no/such/file.parquet" in capsys.readouterr().err


def test_dataset_folders(tmp_path, monkeypatch):
    # A save_to_disk folder, and a folder of data files as a hub download leaves it (read by datasets).
    import datasets

    datasets.Dataset.from_list(DAPO_ROWS).save_to_disk(str(tmp_path / "saved"))
    report = prepare(str(tmp_path / "saved"), tmp_path / "a.jsonl", check_answers=False)
    assert (report.rows, report.kept) == (8, 3)
    # A folder named like a preset is read, not the hub.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "saved").rename(tmp_path / "dapo-math-17k")
    report = prepare("dapo-math-17k", tmp_path / "local.jsonl", check_answers=False)
    assert (report.source, report.rows) == ("dapo-math-17k", 8)
    (tmp_path / "download" / "data").mkdir(parents=True)
    _write(DEEPSCALER_ROWS, tmp_path / "download" / "data" / "train-00000-of-00001.parquet")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "nemo_disco.cli", "data", "prepare", str(tmp_path / "download")]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path / "b.jsonl"), "--no-answer-check"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["row"] for r in _lines(tmp_path / "b.jsonl")] == [0, 1, 2, 8, 9]
