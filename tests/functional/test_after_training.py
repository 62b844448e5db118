"""After the demo: every checkpoint a tiny run writes converts with the README's command and evaluates.

A two-step run of ``recipes/tiny-cpu.yaml`` (the transformers policy, as ``make demo``), then
``nemo-disco convert --checkpoint .../step_2 --out hf`` and ``nemo-disco eval --model hf`` on a small subset,
all through the CLI, under umask 022 (every weight file written must be readable by the group and others).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from procs import FAST_TINY, THREADS

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **THREADS, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "nemo_disco.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
        preexec_fn=lambda: os.umask(0o022),
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("after") / "run"
    proc = _cli("train", "--config", str(RECIPE), f"logging.run_dir={run_dir}", *FAST_TINY, "algorithm.steps=2",
                "checkpoint.save_every=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_a_demo_checkpoint_converts_and_evaluates(run, tmp_path):
    step = run / "checkpoints" / "step_2"
    # The checkpoint is a complete model: tokenizer files saved with the weights, weights readable by all.
    assert (step / "policy" / "tokenizer.json").is_file()
    for weights in [*step.glob("policy/*.safetensors"), *run.glob("init_model/*.safetensors")]:
        assert _mode(weights) == 0o644, weights
    hf = tmp_path / "hf"
    proc = _cli("convert", "--checkpoint", str(step), "--out", str(hf))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"wrote {hf}"
    names = {p.name for p in hf.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= names
    assert "optimizer.pt" not in names and not list(tmp_path.glob(".hf*"))  # no optimizer, no leftover temporary
    assert _mode(hf / "model.safetensors") == 0o644
    assert (hf / "model.safetensors").read_bytes() == (step / "policy" / "model.safetensors").read_bytes()
    assert json.loads((hf / "generation_config.json").read_text())["temperature"] == 1.0  # the run's sampling
    # Into the same folder again: refused in one line, unless --overwrite.
    proc = _cli("convert", "--checkpoint", str(step), "--out", str(hf))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"nemo-disco convert: error: {hf} is not empty: pass --overwrite to replace it, or choose another --out"
    )
    assert _cli("convert", "--checkpoint", str(step), "--out", str(hf), "--overwrite").returncode == 0
    # The demo's evaluation settings (recipes/eval/demo.yaml) as flags, on a few problems, plus one shipped benchmark
    # (the list written with a space after the comma).
    out = tmp_path / "eval"
    proc = _cli("eval", "--model", str(hf), "--backend", "hf", "--benchmarks", "synthetic:arithmetic-heldout, aime",
                "--prompt-template", "{problem}=", "--no-chat-template", "--samples", "2", "--temperature", "1.0",
                "--top-p", "1.0", "--max-tokens", "12", "--max-problems", "3", "--chunk-problems", "2",
                "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 3 * 2 and {r["benchmark"] for r in records} == {"synthetic:arithmetic-heldout", "aime"}
    assert (
        "| synthetic:arithmetic-heldout | 3 | 2 |" in proc.stdout and f"results: {out}/responses.jsonl" in proc.stdout
    )
    assert "problems 2-2: 2 responses graded and written; 2/4 chunks" in proc.stderr  # progress, per chunk


def test_a_runs_checkpoint_evaluates_with_the_runs_prompt_and_lengths(run, tmp_path):
    """``eval --run RUN --checkpoint step_2``: converted on the way to RUN/hf/step_2, evaluated with the run's prompt
    template, chat-template setting and lengths over the recipe's, into RUN/eval/step_2; the responses are those of
    ``--model`` on the converted folder with the run's settings given by hand."""
    import yaml

    step, hf = run / "checkpoints" / "step_2", run / "hf" / "step_2"
    paper = ["eval", "--config", "recipes/eval/paper.yaml", "--run", str(run)]
    proc = _cli(*paper, "--checkpoint", "step_2", "--print-config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = yaml.safe_load(proc.stdout)
    assert (printed["data"]["prompt_template"], printed["data"]["use_chat_template"]) == ("{problem}=", False)
    assert (printed["generation"]["max_prompt_tokens"], printed["generation"]["max_response_tokens"]) == (32, 12)
    assert printed["generation"]["samples"] == 16 and printed["generation"]["top_p"] == 0.95  # the recipe's
    assert (printed["checkpoint"], printed["out"]) == ("step_2", str(run / "eval" / "step_2"))
    # The command line comes last; without --checkpoint, the newest complete one.
    proc = _cli(*paper, "generation.max_response_tokens=8", "--max-prompt-tokens", "20", "--print-config")
    printed = yaml.safe_load(proc.stdout)
    assert (printed["generation"]["max_prompt_tokens"], printed["generation"]["max_response_tokens"]) == (20, 8)
    assert printed["checkpoint"] == "step_2"
    assert not hf.exists()  # printing converts nothing

    small = ["--benchmarks", "synthetic:arithmetic-heldout", "--samples", "2", "--max-problems", "3", "--backend", "hf",
             "--temperature", "1.0", "--top-p", "1.0", "--workers", "1", "--bootstrap", "0"]  # fmt: skip
    proc = _cli(*paper, "--checkpoint", "2", *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"converted {step} to {hf}" in proc.stderr
    assert f"results: {run / 'eval' / 'step_2' / 'responses.jsonl'}" in proc.stdout
    assert json.loads((hf / "converted_from.json").read_text())["checkpoint"] == str(step.resolve())
    by_hand = _cli("eval", "--model", str(hf), *small, "--prompt-template", "{problem}=", "--no-chat-template",
                   "--max-tokens", "12", "--max-prompt-tokens", "32", "--out", str(tmp_path / "by-hand"))  # fmt: skip
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    responses = (run / "eval" / "step_2" / "responses.jsonl").read_text()
    assert responses == (tmp_path / "by-hand" / "responses.jsonl").read_text() and len(responses.splitlines()) == 6
    # Again: the converted folder is reused; the finished result is replaced only with --overwrite.
    again = _cli(*paper, "--checkpoint", "step_2", *small)
    assert again.returncode == 2 and "already holds an evaluation" in again.stderr
    again = _cli(*paper, "--checkpoint", "step_2", *small, "--overwrite")
    assert again.returncode == 0 and f"evaluating {hf} (converted from {step} before)" in again.stderr
    assert (run / "eval" / "step_2" / "responses.jsonl").read_text() == responses
    # A checkpoint the run does not hold: one line naming those it holds.
    proc = _cli("eval", "--run", str(run), "--checkpoint", "step_7", "--print-config")
    assert proc.returncode == 2
    assert proc.stderr == f"nemo-disco eval: error: run {run} has no checkpoint step_7 (it holds: step_2)\n"


def test_a_damaged_checkpoint_is_refused_in_one_line(run, tmp_path):
    step = run / "checkpoints" / "step_2"
    damaged = tmp_path / "step_2"
    subprocess.run(["cp", "-r", str(step), str(damaged)], check=True)
    weights = damaged / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = _cli("convert", "--checkpoint", str(damaged), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().startswith(f"nemo-disco convert: error: checkpoint {damaged} is damaged: ")
    assert "policy/model.safetensors" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))
    proc = _cli("convert", "--checkpoint", str(step), "--out", str(tmp_path / "hf"), "--tp", "2")
    assert proc.returncode == 2 and "--tp / --pp go with --from-hf only" in proc.stderr


def test_a_checkpoint_without_tokenizer_files_takes_the_runs_initial_model(run, tmp_path):
    """Checkpoints written before the tokenizer was saved with them: convert finds it where the run started."""
    from nemo_disco import checkpoint

    old = run / "checkpoints" / "step_1000"  # a step of this run, as an older version wrote it
    subprocess.run(["cp", "-r", str(run / "checkpoints" / "step_2"), str(old)], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (old / "policy" / name).unlink(missing_ok=True)
    checkpoint.write_manifest(old, 1000)
    try:
        proc = _cli("convert", "--checkpoint", str(old), "--out", str(tmp_path / "hf"))
    finally:
        subprocess.run(["rm", "-rf", str(old)], check=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (run / "init_model" / "tokenizer.json").read_bytes()


def test_a_sigterm_stops_the_evaluation_as_ctrl_c_does_saying_what_was_kept(tiny_qwen2, tmp_path):
    """SIGTERM (kill, scancel, a Slurm time limit) used to end the evaluation silently (killed by the signal)."""
    import signal

    args = _interruptible_eval(tiny_qwen2)
    out = tmp_path / "terminated"
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "nemo_disco.cli", *args, "--out", str(out)], cwd=ROOT,
                                env={**os.environ, **THREADS}, stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        try:
            _wait_for_two_chunks(proc, out)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = log.read_text()
    assert not (out / "responses.jsonl").exists(), "finished before it could be stopped: make the run longer"
    assert code == 143, stderr[-3000:]
    kept = f"interrupted: the responses written so far are kept in {out / 'partial'}; rerun the same command"
    assert kept in stderr, stderr[-3000:]
    assert stderr.rstrip().endswith("nemo-disco eval: interrupted (SIGTERM): stopped"), stderr[-3000:]
    assert "Traceback" not in stderr
    assert len((out / "partial" / "part-0.jsonl").read_text().splitlines()) >= 4


def test_a_killed_evaluation_continues_to_the_uninterrupted_result(tiny_qwen2, tmp_path):
    """SIGKILL part-way (nothing to clean up, a line may be cut short), rerun: the written chunks are reused."""
    import signal

    args = _interruptible_eval(tiny_qwen2)
    env = {**os.environ, **THREADS}
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "nemo_disco.cli", *args, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        _wait_for_two_chunks(proc, out)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / "responses.jsonl").exists(), "finished before it could be killed: make the run longer"
    written = len((out / "partial" / "part-0.jsonl").read_text().splitlines())
    assert 4 <= written < 2 * 15 * 2
    rerun = _cli(*args, "--out", str(out))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming the evaluation in {out}: " in rerun.stderr
    generated = rerun.stderr.count("responses graded and written")
    assert generated <= 30 - written // 2  # only the chunks not written before (2 records per chunk)
    plain = _cli(*args, "--out", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stderr.count("responses graded and written") == 30
    assert (out / "responses.jsonl").read_text() == (tmp_path / "plain" / "responses.jsonl").read_text()
    assert (out / "summary.json").read_text() == (tmp_path / "plain" / "summary.json").read_text()


def _interruptible_eval(model: Path) -> list[str]:
    """An evaluation long enough to interrupt part-way: 15 problems of two benchmarks in chunks of one problem."""
    return ["eval", "--model", str(model), "--backend", "hf", "--benchmarks", "math,aime", "--samples", "2",
            "--temperature", "1.0", "--max-tokens", "24", "--max-problems", "15", "--chunk-problems", "1",
            "--workers", "1", "--bootstrap", "100"]  # fmt: skip


def _wait_for_two_chunks(proc: subprocess.Popen, out: Path, limit_s: float = 300) -> None:
    """Until the evaluation writing into ``out`` has written two chunks (4 records), or ends, or ``limit_s`` passes."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        parts = list((out / "partial").glob("part-*.jsonl"))
        if parts and len(parts[0].read_text().splitlines()) >= 4:
            break
        time.sleep(0.02)
