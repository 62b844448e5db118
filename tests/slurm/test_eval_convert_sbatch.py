"""slurm/convert.sbatch and slurm/eval.sbatch submitted with the real sbatch to the test cluster (tiny model).

- convert: HF -> Megatron policy directory -> HF, two jobs; the round trip gives back the same tensors;
- eval: pass@k of the tiny model on a 3-problem benchmark file (transformers backend on CPU); the job writes the
  per-sample responses and the summary the CLI promises.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]


def _missing(module: str, what: str) -> pytest.MarkDecorator:
    try:
        importlib.import_module(module)
        reason = ""
    except ImportError as err:
        reason = f"{what} not available ({module} does not import: {err})"
    return pytest.mark.skipif(bool(reason), reason=reason)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _submit(cluster, job_dir: Path, script: str, *args: str) -> tuple[dict[str, str], str]:
    log = job_dir / "logs" / f"{script}-%j.out"
    job = cluster.sbatch([f"--output={log}", str(ROOT / "slurm" / f"{script}.sbatch"), *args], cwd=job_dir)
    path = job_dir / "logs" / f"{script}-{job}.out"
    info = cluster.wait_job(job, timeout=180, log=path)
    return info, path.read_text() if path.is_file() else ""


@_missing("nemo_disco.convert", "convert")
def test_convert_hf_to_megatron_and_back(slurm_cluster, job_dir, tiny_qwen2):
    mcore, back = job_dir / "mcore", job_dir / "hf"
    info, out = _submit(slurm_cluster, job_dir, "convert", "--from-hf", str(tiny_qwen2), "--out", str(mcore))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    info, out = _submit(slurm_cluster, job_dir, "convert", "--checkpoint", str(mcore), "--out", str(back))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    original, converted = _weights(tiny_qwen2), _weights(back)
    # Tied embeddings: the HF folder may or may not store lm_head.weight separately.
    shared = set(original) & set(converted)
    assert shared >= set(original) - {"lm_head.weight"}
    assert all(torch.equal(original[k], converted[k]) for k in shared)


@_missing("nemo_disco.evaluation.run", "eval")
def test_eval_tiny_model_on_a_benchmark_file(slurm_cluster, job_dir, tiny_qwen2):
    bench = job_dir / "tinybench.json"
    bench.write_text(json.dumps([{"problem": f"{a}+{b}", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6)]]))
    out_dir = job_dir / "eval"
    args = ["--model", str(tiny_qwen2), "--benchmarks", str(bench), "--samples", "2", "--backend", "hf"]
    args += ["--max-tokens", "8", "--out", str(out_dir)]
    info, out = _submit(slurm_cluster, job_dir, "eval", *args)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    records = [json.loads(line) for line in (out_dir / "responses.jsonl").read_text().splitlines()]
    # 3 problems x 2 samples, each graded 0 or 1.
    pairs = sorted((r["problem_index"], r["sample_index"]) for r in records)
    assert pairs == [(p, s) for p in range(3) for s in range(2)]
    assert all(r["benchmark"] == "tinybench" and r["score"] in (0.0, 1.0) for r in records)
    summary = json.loads((out_dir / "summary.json").read_text())
    row = summary["benchmarks"][0]
    assert (row["benchmark"], row["problems"], row["samples"]) == ("tinybench", 3, 2)
