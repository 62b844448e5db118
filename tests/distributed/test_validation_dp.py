"""Validation under torchrun at data-parallel size 2: per-problem pass@1 comes back whole and in problem order."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from procs import FAST_TINY, THREADS, free_port, run_group

from nemo_disco.data import load_problems
from nemo_disco.rewards import score_response

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
TORCHRUN = Path(sys.executable).with_name("torchrun")
VAL = 33  # odd: rank 0 validates problems 0, 2, ..., 32 (17 of them), rank 1 problems 1, 3, ..., 31 (16)


def _greedy_scores(model_dir: Path, problems: list) -> list[float]:
    """1.0 / 0.0 per problem: transformers' generate() decoding greedily, one problem at a time, graded here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    out = []
    for p in problems:
        ids = torch.tensor([tok.encode(f"{p.problem}=", add_special_tokens=False)])
        seq = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, eos_token_id=stops
        )
        out.append(score_response(tok.decode(seq[0, ids.shape[1] :], skip_special_tokens=True), p.answer))
    return out


def test_validation_gathers_every_problem_in_order_across_two_ranks(tmp_path):
    run = tmp_path / "dp2"
    overrides = [
        *FAST_TINY,
        "cluster.gpus_per_node=2",
        "algorithm.steps=1",
        "checkpoint.save_every=0",
        "data.synthetic_size=2000",
        "data.val=synthetic:arithmetic-heldout",
        "data.val_every=1",
        f"data.val_max_problems={VAL}",
        "data.val_samples=2",
        # top_k 1: every sample is the greedy answer whatever the rank's seed, so the expected values are known.
        "generation.top_k=1",
        # Warm up until greedy accuracy >= 0.2, so that the per-problem values are a pattern, not all zeros.
        "algorithm.warmup_target=[0.2,1.0]",
        "algorithm.warmup_sft_steps=1500",
        "algorithm.warmup_eval_every=50",
        "algorithm.warmup_eval_problems=64",
    ]
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "nemo_disco.cli"]
    cmd += ["train", "--config", str(RECIPE), f"logging.run_dir={run}", *overrides]
    res = run_group(cmd, cwd=ROOT, env={**os.environ, **THREADS}, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]

    step0 = json.loads((run / "validation.jsonl").read_text().splitlines()[0])
    assert step0["step"] == 0
    problems = load_problems("synthetic:arithmetic-heldout", synthetic_size=2000, seed=42)[0][:VAL]  # data.seed 42
    expected = _greedy_scores(run / "init_model", problems)
    assert 0 < sum(expected) < VAL  # a pattern that an out-of-order gather would not reproduce
    assert step0["per_problem"] == expected
