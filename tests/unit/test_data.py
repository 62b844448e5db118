"""Loaders (json / jsonl / parquet / verl parquet / saved datasets / benchmarks), prompts, sampler, synthetic task."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nemo_disco import cli
from nemo_disco import config as config_lib
from nemo_disco.data import (
    BENCHMARK_DIR_ENV,
    BENCHMARKS,
    SHIPPED_BENCHMARK_DIR,
    Problem,
    PromptSampler,
    encode_prompts,
    format_prompt,
    load_problems,
    resolve_benchmark,
    synthetic_arithmetic,
)

ROOT = Path(__file__).resolve().parents[2]
# Real DeepScaleR training files, present in the development setup only (the benchmarks ship in the package).
SHARED_TRAIN = ROOT.parent / "shared" / "data" / "train"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

ROWS = [
    {"problem": "What is 2+2?", "answer": "4", "extra": 1},
    {"problem": "AMC-style float answer", "answer": 142.0},
    {"problem": "AIME25-style int answer", "answer": 70},
    {"problem": "Non-integral float", "answer": 0.25},
    {"problem": "OlympiadBench-style list", "answer": ["$\\frac{2}{3}$", 5]},
    {"problem": "  padded  ", "answer": " \\frac{1}{2}\n"},
]
EXPECTED = [
    ("What is 2+2?", "4"),
    ("AMC-style float answer", "142"),
    ("AIME25-style int answer", "70"),
    ("Non-integral float", "0.25"),
    ("OlympiadBench-style list", ["$\\frac{2}{3}$", "5"]),
    ("padded", "\\frac{1}{2}"),
]


def _check(problems: list[Problem], source: str) -> None:
    assert [(p.problem, p.answer) for p in problems] == EXPECTED
    assert [p.index for p in problems] == list(range(len(EXPECTED)))
    assert all(p.source == source for p in problems)


def test_json_and_jsonl(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    problems, skipped = load_problems(path)
    _check(problems, str(path))
    assert skipped == 0
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")  # a trailing blank line is fine
    _check(load_problems(path)[0], str(path))


def test_parquet_plain_and_verl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Parquet columns need one type: answers as strings (lists in their own file below).
    plain = [{"problem": "What is 2+2?", "answer": "4"}, {"problem": "x", "answer": "7"}]
    pq.write_table(pa.Table.from_pylist(plain), tmp_path / "plain.parquet")
    assert [(p.problem, p.answer) for p in load_problems(tmp_path / "plain.parquet")[0]] == [
        ("What is 2+2?", "4"),
        ("x", "7"),
    ]
    verl = [
        {
            "data_source": "deepscaler",
            "prompt": [{"role": "user", "content": f"Find $x$ if $x+1=3$. {INSTRUCTION}"}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
        },
        {
            "data_source": "deepscaler",
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Compute 3*3."}],
            "reward_model": {"style": "rule", "ground_truth": "9"},
        },
    ]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "verl.parquet")
    problems, _ = load_problems(tmp_path / "verl.parquet")
    # The DeepScaleR instruction already in the prompt is removed (format_prompt adds it back once).
    assert [(p.problem, p.answer) for p in problems] == [("Find $x$ if $x+1=3$.", "2"), ("Compute 3*3.", "9")]
    assert format_prompt(problems[0]) == f"Find $x$ if $x+1=3$. {INSTRUCTION}"


def test_saved_dataset_folder(tmp_path):
    import datasets

    rows = [{"problem": "What is 2+2?", "answer": "4"}, {"problem": "And 3+3?", "answer": "6"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert [p.answer for p in load_problems(tmp_path / "ds")[0]] == ["4", "6"]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows[1:])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert [p.answer for p in load_problems(tmp_path / "dd", split="test")[0]] == ["6"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        load_problems(tmp_path / "dd", split="validation")


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ({"problem": "p"}, "answer is missing"),
        ({"problem": "p", "answer": None}, "answer is missing"),
        ({"problem": "p", "answer": ""}, "answer is empty"),
        ({"problem": "", "answer": "1"}, "problem is empty"),
        ({"answer": "1"}, "row has neither 'problem' nor 'prompt'"),
        ({"problem": 3, "answer": "1"}, "problem has type int"),
        ({"problem": "p", "answer": {"a": 1}}, "answer has type dict"),
        ({"problem": "p", "answer": True}, "answer is a boolean (True)"),
        ({"problem": "p", "answer": []}, "answer list is empty or holds an empty answer"),
        ("just a string", "row is a str, expected an object"),
    ],
)
def test_bad_row_error_names_file_and_row(tmp_path, row, what):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([ROWS[0], ROWS[1], row]))
    with pytest.raises(ValueError) as err:
        load_problems(path)
    assert str(err.value) == f"{path}:row 2: {what}"


def test_skip_bad_rows_counts_and_warns_once(tmp_path, caplog):
    path = tmp_path / "some_bad.jsonl"
    rows = [ROWS[0], {"problem": "p"}, ROWS[1], {"problem": "", "answer": "3"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level(logging.WARNING, logger="nemo_disco.data"):
        problems, skipped = load_problems(path, on_bad_row="skip")
    assert skipped == 2
    assert [p.index for p in problems] == [0, 2]  # rows keep their source numbers
    warnings = [r.getMessage() for r in caplog.records if r.name == "nemo_disco.data"]
    assert warnings == [f"{path}: skipped 2 bad row(s); first: row 1: answer is missing"]


@pytest.mark.skipif(not (SHARED_TRAIN / "math.json").is_file(), reason="DeepScaleR training file absent")
def test_real_training_file_has_four_bad_rows():
    path = SHARED_TRAIN / "math.json"
    with pytest.raises(ValueError, match=re.escape(f"{path}:row 886: answer is missing")):
        load_problems(path)
    problems, skipped = load_problems(path, on_bad_row="skip")
    # 7474 rows: two with a null answer (rows 886, 1009) and two with an empty one.
    assert (len(problems), skipped) == (7470, 4)


def test_file_errors_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found: .*missing.json"):
        load_problems(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text('[{"problem": "a", "answer": "1"},\n oops]')
    with pytest.raises(ValueError, match=r"broken.json:2: invalid JSON"):
        load_problems(tmp_path / "broken.json")
    (tmp_path / "broken.jsonl").write_text('{"problem": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:line 2: invalid JSON"):
        load_problems(tmp_path / "broken.jsonl")
    (tmp_path / "obj.json").write_text('{"problem": "a"}')
    with pytest.raises(ValueError, match="expected a JSON list of rows"):
        load_problems(tmp_path / "obj.json")
    (tmp_path / "rows.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match="unsupported data file type '.csv'"):
        load_problems(tmp_path / "rows.csv")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no usable rows"):
        load_problems(tmp_path / "empty.json")
    with pytest.raises(ValueError, match="unknown synthetic task"):
        load_problems("synthetic:geometry")


def test_hub_dataset_error_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: the loader must fail clearly, not hang
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError) as err:
        load_problems("nemo-disco-test/no-such-dataset")
    msg = str(err.value)
    assert msg.startswith(
        "cannot load dataset 'nemo-disco-test/no-such-dataset' (split 'train'): no local file or folder of that "
        "name; tried the Hugging Face hub through the local Hugging Face cache only (HF_HUB_OFFLINE is set): "
    )
    assert "\n" not in msg


def test_resolve_benchmark(tmp_path, monkeypatch):
    monkeypatch.delenv(BENCHMARK_DIR_ENV, raising=False)
    assert resolve_benchmark("aime") == SHIPPED_BENCHMARK_DIR / "aime.json"  # shipped with the package
    # $NEMO_DISCO_BENCHMARK_DIR wins, and a file missing there is an error (no silent fall-back).
    monkeypatch.setenv(BENCHMARK_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"benchmark 'aime': .*aime.json not found .*NEMO_DISCO_BENCHMARK_DIR"):
        resolve_benchmark("aime")
    (tmp_path / "aime.json").write_text(json.dumps([{"problem": "p", "answer": 5}]))
    assert resolve_benchmark("aime") == tmp_path / "aime.json"
    assert load_problems("aime")[0][0].answer == "5"
    # An explicit path wins over both.
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"problem": "q", "answer": 6}]))
    assert resolve_benchmark(other) == other
    with pytest.raises(FileNotFoundError, match="neither a file nor a benchmark name"):
        resolve_benchmark("gsm8k")


def test_shipped_benchmarks_load(monkeypatch):
    monkeypatch.delenv(BENCHMARK_DIR_ENV, raising=False)
    sizes = {name: len(load_problems(name)[0]) for name in BENCHMARKS}
    assert sizes == {"aime": 30, "aime25": 30, "math": 500, "amc": 83, "minerva": 272, "olympiad_bench": 675}
    amc, _ = load_problems("amc")
    assert all(re.fullmatch(r"-?\d+", p.answer) for p in amc)  # JSON floats 142.0 -> "142"
    olympiad, _ = load_problems("olympiad_bench")
    assert all(isinstance(p.answer, list) for p in olympiad)
    readme = (SHIPPED_BENCHMARK_DIR / "README.md").read_text()
    assert all(f"{name}.json" in readme for name in BENCHMARKS) and "MIT License" in readme
    assert (SHIPPED_BENCHMARK_DIR / "LICENSE-deepscaler").is_file()


def test_the_wheel_ships_the_benchmarks(tmp_path):
    # Build the wheel from a copy of the project (setuptools writes build/ and *.egg-info beside the sources).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "nemo_disco", src / "nemo_disco", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."]
    proc = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("nemo_disco-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"nemo_disco/benchmark_data/{b}.json" for b in BENCHMARKS}
    assert shipped | {"nemo_disco/benchmark_data/README.md", "nemo_disco/benchmark_data/LICENSE-deepscaler"} <= names


def test_data_val_and_train_accept_benchmark_names(monkeypatch):
    # data.val: aime (validation on a shipped benchmark) and data.train: a benchmark name both resolve through
    # the loader; the start-up check of `nemo-disco train` loads them the same way.
    monkeypatch.delenv(BENCHMARK_DIR_ENV, raising=False)
    cfg = config_lib.load(ROOT / "recipes" / "tiny-cpu.yaml", ["data.val=aime", "data.train=math"])
    cli._check_sources(cfg)
    val, _ = load_problems(cfg.data.val, on_bad_row="skip")
    assert len(val) == 30 and all(p.source == str(SHIPPED_BENCHMARK_DIR / "aime.json") for p in val)
    assert len(load_problems(cfg.data.train)[0]) == 500


def test_train_with_a_missing_data_file_fails_before_building_a_model(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [f"data.train={tmp_path / 'missing.jsonl'}", f"logging.run_dir={run_dir}"]
    assert cli.main(["train", "--config", str(ROOT / "recipes" / "tiny-cpu.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nemo-disco train: error: data file not found: {tmp_path / 'missing.jsonl'} (nor a ")
    assert err.count("\n") == 1
    assert not run_dir.exists()  # nothing was built or warmed up


# ----------------------------------------------------------------------------------------------------------------------
# Prompts


def test_format_prompt_default_is_deepscaler():
    assert format_prompt("What is $1+1$?") == f"What is $1+1$? {INSTRUCTION}"
    assert format_prompt("Set {a, b}", "{problem}=") == "Set {a, b}="  # braces in the problem are not fields
    with pytest.raises(ValueError, match="no {problem} placeholder"):
        format_prompt("x", "no field")
    with pytest.raises(ValueError, match="invalid"):
        format_prompt("x", "{problem} \\boxed{}")  # braces must be doubled


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from nemo_disco.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_encode_prompts_chat_template(tokenizer):
    problems = [Problem("1+1", "2", 0, "t"), Problem("12+30", "42", 1, "t")]
    ids, kept, dropped = encode_prompts(tokenizer, problems, template="{problem}=", use_chat_template=True)
    assert (kept, dropped) == ([0, 1], 0)
    # One user turn, no system prompt, then the generation prompt; one token per character.
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0].count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    plain, _, _ = encode_prompts(tokenizer, problems, template="{problem}=", use_chat_template=False)
    assert [tokenizer.decode(p) for p in plain] == ["1+1=", "12+30="]


def test_encode_prompts_drops_long_prompts_never_truncates(tokenizer):
    problems = ["1+1", "123456789+1", "2+2"]
    # Plain prompts "1+1=" (4 tokens), "123456789+1=" (12), "2+2=" (4); limit 4 drops the middle one.
    ids, kept, dropped = encode_prompts(
        tokenizer, problems, template="{problem}=", use_chat_template=False, max_prompt_tokens=4
    )
    assert (kept, dropped) == ([0, 2], 1)
    assert [len(p) for p in ids] == [4, 4]
    assert encode_prompts(tokenizer, [], template="{problem}", use_chat_template=True) == ([], [], 0)


# ----------------------------------------------------------------------------------------------------------------------
# Sampler


def test_sampler_resume_continues_exactly():
    reference = PromptSampler(10, 3, seed=7)
    uninterrupted = [reference.next_batch() for _ in range(8)]
    first = PromptSampler(10, 3, seed=7)
    head = [first.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))  # survives the JSON trainer state
    resumed = PromptSampler(10, 3, seed=7)
    resumed.load_state_dict(state)
    assert head + [resumed.next_batch() for _ in range(3)] == uninterrupted


def test_sampler_epochs():
    s = PromptSampler(10, 3, seed=0)
    # 10 // 3 = 3 batches per epoch; each epoch's 9 indices are distinct, 1 is left out.
    epochs = [[s.next_batch() for _ in range(3)] for _ in range(3)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat)) == 9 and set(flat) <= set(range(10))
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    assert s.state_dict()["epoch"] == 2
    assert [PromptSampler(10, 3, seed=0).next_batch() for _ in range(1)] == [epochs[0][0]]  # deterministic
    assert PromptSampler(10, 3, seed=1).next_batch() != epochs[0][0]
    ordered = PromptSampler(5, 2, seed=0, shuffle=False)
    assert [ordered.next_batch() for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]


def test_sampler_rejects_mismatched_state():
    s = PromptSampler(10, 3, seed=0)
    with pytest.raises(ValueError, match="num_problems=12 but this run has num_problems=10"):
        s.load_state_dict({**s.state_dict(), "num_problems": 12})
    with pytest.raises(ValueError, match="must be between 1 and the 2 problems"):
        PromptSampler(2, 3, seed=0)


# ----------------------------------------------------------------------------------------------------------------------
# Synthetic task


def _solve(text: str) -> int:
    a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)", text).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_synthetic_arithmetic():
    train = synthetic_arithmetic(500, seed=3)
    assert len({p.problem for p in train}) == 500
    assert all(p.answer == str(_solve(p.problem)) for p in train)
    assert all(len(p.problem) <= 5 and int(p.answer) >= 0 for p in train)  # "99+99" at most; no negatives
    assert synthetic_arithmetic(500, seed=3) == train
    assert synthetic_arithmetic(500, seed=4) != train
    heldout = synthetic_arithmetic(500, seed=3, split="heldout")
    # Disjoint for any seeds / sizes: the split is a property of the problem text.
    assert not {p.problem for p in synthetic_arithmetic(2000, seed=9)} & {p.problem for p in heldout}
    one = synthetic_arithmetic(50, seed=0, digits=1, operators="*-", allow_negative=True)
    assert all(p.answer == str(_solve(p.problem)) and len(p.problem) == 3 for p in one)


def test_synthetic_via_load_problems():
    problems, skipped = load_problems("synthetic:arithmetic", synthetic_size=64, seed=1)
    assert (len(problems), skipped) == (64, 0)
    assert problems == synthetic_arithmetic(64, 1)
    heldout, _ = load_problems("synthetic:arithmetic-heldout", synthetic_size=2000, seed=1)
    assert heldout[0].source == "synthetic:arithmetic-heldout"
    assert not {p.problem for p in problems} & {p.problem for p in heldout}
    with pytest.raises(ValueError, match="has 34 problems; asked for 100"):
        synthetic_arithmetic(100, 0, digits=1, split="heldout")


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """data.chat_template_kwargs (Qwen3's enable_thinking) are variables of the chat template."""
    from nemo_disco.data import encode_prompts
    from nemo_disco.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}#{% else %}T{% endif %}"
    )
    thinking, _, _ = encode_prompts(tok, ["1+1"], template="{problem}")
    plain, _, _ = encode_prompts(tok, ["1+1"], template="{problem}", chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(thinking[0]) == "1+1T" and tok.decode(plain[0]) == "1+1#"


def test_a_rows_other_columns_travel_as_fields_for_a_reward_function(tmp_path):
    import json

    path = tmp_path / "rows.json"
    rows = [
        {"problem": "2+2", "answer": "4", "tests": ["assert f() == 4"], "level": 3, "bad key": 1},
        {"prompt": [{"role": "user", "content": "1+1"}], "reward_model": {"ground_truth": "2"}, "task": "add"},
    ]
    path.write_text(json.dumps(rows))
    problems, _ = load_problems(path)
    assert problems[0].fields == {"tests": ["assert f() == 4"], "level": 3}  # not problem / answer / "bad key"
    assert problems[1].fields == {"reward_model": {"ground_truth": "2"}, "task": "add"}
    assert problems[0] == type(problems[0])("2+2", "4", 0, str(path))  # fields take no part in equality


def test_a_runs_data_is_loaded_with_one_keyword_set(tokenizer):
    from nemo_disco.config import ConfigError, DataConfig
    from nemo_disco.data import data_kwargs, new_sampler, train_problems, val_problems

    data = DataConfig(
        train="synthetic:arithmetic", val="synthetic:arithmetic-heldout", synthetic_size=12, seed=3, val_max_problems=5
    )
    assert data_kwargs(data) == {"split": "train", "on_bad_row": "error", "synthetic_size": 12, "seed": 3}
    assert data_kwargs(data, val=True)["on_bad_row"] == "skip"  # validation skips bad rows whatever on_bad_row says
    problems, ids, skipped, dropped = train_problems(data, tokenizer, max_prompt_tokens=1024, prompts_per_step=4)
    assert (len(problems), len(ids), skipped, dropped) == (12, 12, 0, 0)
    assert problems == load_problems("synthetic:arithmetic", synthetic_size=12, seed=3)[0]
    val, val_ids = val_problems(data, tokenizer, max_prompt_tokens=1024)
    assert len(val) == len(val_ids) == 5  # data.val_max_problems
    assert val_problems(DataConfig(val=None), tokenizer, max_prompt_tokens=1024) is None
    with pytest.raises(ConfigError, match="12 usable problems, fewer than algorithm.prompts_per_step=13"):
        train_problems(data, tokenizer, max_prompt_tokens=1024, prompts_per_step=13)
    sampler = new_sampler(data, 12, 4)
    assert sampler.next_batch() == PromptSampler(12, 4, seed=3).next_batch()
    assert not new_sampler(data.model_copy(update={"shuffle": False}), 12, 4).shuffle
