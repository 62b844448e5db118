"""The plan's micro-batch peaks (activations, logits, log-prob chunks) within 15% of the peaks measured on the CPU.

``plan_memory_worker.py`` runs the real Megatron policy (mcore's local layer spec on gloo, bf16) on a tiny and a small
model, one micro-batch per call, at several micro-batch shapes and recomputation settings, and measures each call's
peak with torch's memory profiler. ``nemo_disco.plan.micro_batch_bytes`` with the ``local`` kernels (the layers the
CPU runs) must predict each within 15%. ``python tests/distributed/test_plan_memory.py`` prints the table that
docs/planning.md shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import plan

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("plan_memory_worker.py")
TOLERANCE = 0.15

#: The models: the default tiny one (2 layers, hidden 64, vocabulary 128) and a small one with a real-sized
#: vocabulary share (4 layers, hidden 256, 8 heads / 2 KV heads, SwiGLU 768, vocabulary 4096).
MODELS = {
    "tiny": ({}, {}),
    "small": (
        {
            "num_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 768,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
        },
        {"vocab_size": 4096},
    ),
    # Qwen3's layout: q / k norms, head_dim 64 != hidden 256 / 8 heads, tied embeddings.
    "small_qwen3": (
        {
            "architecture": "qwen3",
            "num_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 768,
            "max_position_embeddings": 1024,
        },
        {"vocab_size": 4096},
    ),
}
#: (model, rows, prompt tokens, response tokens, recompute): micro-batches of 1,024 to 2,048 tokens.
CASES = [
    ("tiny", 8, 64, 192, False),
    ("tiny", 8, 64, 192, "full"),
    ("tiny", 32, 16, 48, False),
    ("small", 4, 64, 192, False),
    ("small", 4, 64, 192, "selective"),
    ("small", 4, 64, 192, "full"),
    ("small", 16, 16, 48, False),
    ("small", 16, 16, 48, "full"),
    ("small", 2, 128, 384, False),
    ("small_qwen3", 4, 64, 192, False),
    ("small_qwen3", 4, 64, 192, "full"),
]


def build(root: Path) -> dict[str, Path]:
    """The model folders (random weights; nothing from a hub)."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    return {
        name: build_model(TinyModelConfig(**tiny), root / name, hf_overrides=hf) for name, (tiny, hf) in MODELS.items()
    }


def predicted(model_dir: Path, rows: int, prompt: int, response: int, recompute) -> dict[str, int]:  # noqa: ANN001
    """The plan's bytes of one micro-batch per phase (local kernels, TP 1, one stage, bf16)."""
    shapes = plan.Shapes.from_hf_config(json.loads((model_dir / "config.json").read_text()), str(model_dir))
    mb = plan.MicroBatch(
        tokens=rows * (prompt + response),
        seq=prompt + response,
        dtype_bytes=2,
        recompute=recompute,
        chunk=64,
        kernels="local",
        layers=shapes.layers,
    )
    m = plan.micro_batch_bytes(shapes, plan.padded_vocab(shapes.vocab, 1), mb)
    return {phase: sum(m[phase].values()) for phase in ("training", "logprobs")}


def measure(root: Path) -> list[dict]:
    """Run the worker over every case; each with the plan's prediction and the relative error."""
    models = build(root)
    cases = [
        {"model": str(models[m]), "rows": r, "prompt": p, "response": n, "recompute": rc, "dtype": "bfloat16"}
        for m, r, p, n, rc in CASES
    ]
    path = root / "cases.json"
    path.write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(path)], capture_output=True, text=True, timeout=900, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for (name, *_), res in zip(CASES, out, strict=True):
        pred = predicted(Path(res["model"]), res["rows"], res["prompt"], res["response"], res["recompute"])
        res["name"] = name
        for phase in ("training", "logprobs"):
            res[f"{phase}_predicted"] = pred[phase]
            res[f"{phase}_error"] = pred[phase] / res[phase] - 1
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return measure(tmp_path_factory.mktemp("plan_memory"))


@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
@pytest.mark.parametrize("phase", ["training", "logprobs"])
def test_predicted_peak_within_15_percent_of_measured(results, i, phase):
    r = results[i]
    assert abs(r[f"{phase}_error"]) <= TOLERANCE, (r[phase], r[f"{phase}_predicted"])


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(Path(tmp))
    print("| model | rows x tokens | recompute | phase | predicted MB | measured MB | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for phase in ("training", "logprobs"):
            print(
                f"| {r['name']} | {r['rows']} x {r['prompt'] + r['response']} | {r['recompute'] or 'none'} | {phase} "
                f"| {r[f'{phase}_predicted'] / 1e6:.1f} | {r[phase] / 1e6:.1f} | {100 * r[f'{phase}_error']:+.1f}% |"
            )
