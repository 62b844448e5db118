"""Data-parallel evaluation: torchrun with 2 processes (gloo, transformers backend) = one process, record for record.

Each process runs an engine of its own on every other chunk of problems; chunks are seeded by (seed, benchmark,
chunk index), so the merged result is the single-engine one. The same command as on a GPU node
(``slurm/eval.sbatch`` starts one process per GPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from procs import FAST_TINY, THREADS, free_port, run_group

ROOT = Path(__file__).resolve().parents[2]


def _eval(model: Path, bench: Path, out: Path, nproc: int) -> str:
    args = ["eval", "--model", str(model), "--backend", "hf", "--benchmarks", f"{bench}, aime", "--samples", "3",
            "--temperature", "1.0", "--top-p", "1.0", "--max-tokens", "6", "--max-problems", "5",
            "--chunk-problems", "2", "--workers", "1", "--bootstrap", "100", "--out", str(out)]  # fmt: skip
    return _cli(args, nproc)


def _cli(args: list[str], nproc: int) -> str:
    if nproc == 1:
        cmd = [sys.executable, "-m", "nemo_disco.cli", *args]
    else:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1"]
        cmd += ["--master-port", str(free_port()), "-m", "nemo_disco.cli", *args]
    env = {**os.environ, **THREADS, "HF_HUB_OFFLINE": "1"}
    proc = run_group(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def test_two_engines_give_the_one_engine_result(tiny_qwen2, tmp_path):
    bench = tmp_path / "arith.json"
    bench.write_text(json.dumps([{"problem": f"{a}+{a}", "answer": 2 * a} for a in range(1, 7)]))
    one = _eval(tiny_qwen2, bench, tmp_path / "one", 1)
    two = _eval(tiny_qwen2, bench, tmp_path / "two", 2)
    # Both engines worked: 3 + 3 chunks (arith 0-1, 2-3, 4; aime 0-1, 2-3, 4), every other one each.
    assert "engine 1/2: " in two and "engine 2/2: " in two and "engine 1/" not in one
    assert two.count("responses graded and written") == 6
    lines = (tmp_path / "one" / "responses.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 5 * 3 and len({json.loads(x)["response"] for x in lines}) > 3  # sampled, not constant
    assert (tmp_path / "two" / "responses.jsonl").read_text() == (tmp_path / "one" / "responses.jsonl").read_text()
    for name in ("summary.json", "summary.md"):
        assert (tmp_path / "two" / name).read_text() == (tmp_path / "one" / name).read_text()
    assert not (tmp_path / "two" / "partial").exists()


def test_two_engines_evaluate_a_runs_checkpoint_as_one(tmp_path):
    """``eval run=RUN``: every process takes part in converting the checkpoint (process 0 writes it), then the two
    engines share the chunks; one process afterwards (``--run RUN``) reuses the converted folder, the same records.

    Under torchrun the key, not the flag: torchrun reads ``--run`` as an abbreviation of its own ``--run-path``.
    """
    run = tmp_path / "run"
    train = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", "recipes/tiny-cpu.yaml",
             f"logging.run_dir={run}", *FAST_TINY, "algorithm.steps=1", "checkpoint.save_every=1"]  # fmt: skip
    proc = run_group(train, env={**os.environ, **THREADS}, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = ["eval", "--config", "recipes/eval/demo.yaml", "--samples", "2", "--max-problems", "4",
            "--chunk-problems", "1", "--workers", "1", "--bootstrap", "0"]  # fmt: skip
    two = _cli([*args, f"run={run}", "--out", str(tmp_path / "two")], 2)
    assert f"converted {run / 'checkpoints' / 'step_1'} to {run / 'hf' / 'step_1'}" in two
    assert "engine 1/2: " in two and "engine 2/2: " in two and not list((run / "hf").glob(".*"))
    one = _cli([*args, "--run", str(run), "--out", str(tmp_path / "one")], 1)
    assert "(converted from " in one and "converted " + str(run) not in one
    lines = (tmp_path / "one" / "responses.jsonl").read_text()
    assert len(lines.splitlines()) == 4 * 2 and lines == (tmp_path / "two" / "responses.jsonl").read_text()
