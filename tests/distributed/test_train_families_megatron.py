"""Three DisCO steps per model family with the Megatron policy and the transformers generator (CPU, gloo).

Every registered family (``nemo_disco.families``): a dense one runs in one process; one with routed experts (Qwen3-MoE)
under torchrun with 2 processes at expert parallelism 2 (each rank two of the four experts, data-parallel over the
rollouts). Qwen2 at TP 2 is tests/distributed/test_train_torchrun.py. Checked: metrics finite, parameters changed,
and for an MoE model the (frozen, by default) router unchanged and its load-balancing loss reported. Then: a model
the Megatron policy does not build stops the run at start-up with one line naming the config key (exit code 2).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import FAST_TINY, THREADS, free_port, run_group
from safetensors.torch import load_file

from nemo_disco import families

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
TORCHRUN = Path(sys.executable).with_name("torchrun")
MEGATRON = ["policy.backend=megatron", "policy.dtype=float32", "algorithm.steps=3", "checkpoint.save_every=3"]
# A longer warm-up and 8 rollouts per question than FAST_TINY's, so that some questions have both correct and
# wrong rollouts (after 40 warm-up steps a tiny model answers nothing: no gradient, only weight decay moves).
SIGNAL = ["algorithm.warmup_sft_steps=300", "algorithm.rollouts_per_prompt=8"]
#: Families trained in another test: Qwen2 at TP 2 in tests/distributed/test_train_torchrun.py.
ELSEWHERE = {"qwen2"}
#: A family's tiny model shaped like a real model of it (a family without an entry trains the tiny defaults).
LAYOUTS = {
    "llama": ["policy.tiny.tie_word_embeddings=false"],
    # head_dim 32 != hidden 64 / 4 heads, as Qwen3-4B's 128 != 2560 / 32.
    "qwen3": ["policy.tiny.head_dim=32"],
    "qwen3_moe": ["policy.tiny.tie_word_embeddings=false"],
}
#: Routed experts: two processes at expert parallelism 2.
EXPERT_PARALLEL = ["policy.expert_parallel_size=2", "cluster.gpus_per_node=2"]


def _train(run_dir: Path, overrides: list[str], nproc: int) -> subprocess.CompletedProcess:
    cli = ["-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run_dir}"]
    if nproc == 1:
        cmd = [sys.executable, *cli]
    else:
        cmd = [str(TORCHRUN), "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *cli]
    return run_group([*cmd, *FAST_TINY, *MEGATRON, *overrides], cwd=ROOT, env={**os.environ, **THREADS}, timeout=900)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_every_layout_is_of_a_registered_family():
    assert set(LAYOUTS) | ELSEWHERE <= set(families.FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(families.FAMILIES) - ELSEWHERE))
def test_three_disco_steps_with_the_megatron_policy(family, tmp_path):
    run = tmp_path / family
    moe = families.FAMILIES[family].moe
    nproc = 2 if moe else 1
    overrides = [f"policy.tiny.architecture={family}", *LAYOUTS.get(family, []), *(EXPERT_PARALLEL if moe else [])]
    res = _train(run, [*overrides, *SIGNAL], nproc)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("train/reward_mean", "train/kl", "train/objective", "train/entropy", "train/grad_norm"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r[key])
        # fp32 transformers generator and fp32 Megatron policy on the same weights: rounding only.
        assert r["mismatch/max_abs_logprob_diff"] < 1e-3
    assert any(r["train/zero_variance_share"] < 1 and r["train/grad_norm"] > 0 for r in records), "no signal"
    # The CLI converts in a process of its own (in this one it would leave a process group behind).
    cmd = [sys.executable, "-m", "nemo_disco.cli", "convert", "--checkpoint", str(run / "checkpoints" / "step_3")]
    converted = run_group([*cmd, "--out", str(tmp_path / "hf")], cwd=ROOT, env={**os.environ, **THREADS}, timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    init, final = _weights(run / "init_model"), _weights(tmp_path / "hf")
    assert set(final) == set(init) - ({"lm_head.weight"} if "lm_head.weight" not in final else set())
    changed = {k for k in final if not torch.equal(init[k], final[k])}
    routers = {k for k in final if k.endswith(".mlp.gate.weight")}
    if moe:
        assert len(routers) == 2 and not routers & changed  # frozen: bit for bit the initial router
        assert changed == set(final) - routers  # everything else moved (every expert of both EP ranks included)
        for r in records:
            assert 1.0 <= r["train/router_balance_loss"] <= 2.0 and 1.0 <= r["train/router_max_load"] <= 2.0
    else:
        assert changed == set(final)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": "qwen3_next"}, "model_type='qwen3_next' is not supported (linear attention"),
        ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=true is not supported"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types has ['sliding_attention'] layers"),
    ],
)
def test_an_unsupported_architecture_stops_the_run_at_start_up_in_one_line(edit, message, tmp_path, tiny_qwen3):
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    res = _train(tmp_path / "run", [f"policy.model_path={model}", "algorithm.warmup_sft_steps=0"], 1)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    # Log lines of the imports may come first; the error is one line, the last.
    errors = [line for line in res.stderr.splitlines() if line.startswith("nemo-disco train: error:")]
    assert len(errors) == 1 and errors[0] == res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
    assert message in errors[0] and f"{model / 'config.json'}" in errors[0]
