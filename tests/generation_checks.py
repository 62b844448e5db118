"""Checks every Generator must pass (the transformers one in tests/unit, vLLM in tests/vllm)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from nemo_disco import config
from nemo_disco.batch import collate
from nemo_disco.generation.base import Generator, SamplingParams
from nemo_disco.policy.hf import HFPolicy

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[2, 35, 33, 19, 32, 101], [20, 21, 22], [40, 41, 42, 43, 44]]


def policy_for(model_dir: Path, temperature: float = 1.0) -> HFPolicy:
    cfg = config.load(
        ROOT / "recipes" / "tiny-cpu.yaml",
        [f"generation.temperature={temperature}", "policy.lr=0.05", "policy.grad_clip=0", "logging.tensorboard=false"],
    )
    return HFPolicy.from_run_config(cfg, model_dir)


def _collate(prompts, rollouts, n):
    flat = [r for rs in rollouts for r in rs]
    return collate(
        [p for p in prompts for _ in range(n)],
        [r.token_ids for r in flat],
        [r.logprobs for r in flat],
        list(range(len(flat))),
        [0.0] * len(flat),
        pad_id=0,
    )


def check_refit_changes_outputs_and_logprobs_match(make: Callable[[Path], Generator], model_dir: Path) -> None:
    """(a) outputs change after a refit; (b) sampled-token log-probs equal the policy's within 1e-4."""
    gen = make(model_dir)
    policy = policy_for(model_dir)
    gen.update_weights(policy.export_weights())  # vLLM may start from dummy weights
    sampling = SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=(1,), seed=7)
    before = gen.generate(PROMPTS, 4, sampling)
    assert [len(rs) for rs in before] == [4, 4, 4]
    batch = _collate(PROMPTS, before, 4)
    lp, _ = policy.logprobs(batch)
    torch.testing.assert_close(lp[batch.response_mask], batch.gen_logprobs[batch.response_mask], atol=1e-4, rtol=0)

    # New weights: two large updates that push up the log-probs of the sampled responses.
    for _ in range(2):
        policy.train_minibatch(batch, lambda rows, lp_, ent: -(lp_ * batch.response_mask[rows]).sum())
    gen.update_weights(policy.export_weights())
    after = gen.generate(PROMPTS, 4, sampling)
    assert [r.token_ids for rs in after for r in rs] != [r.token_ids for rs in before for r in rs]
    batch = _collate(PROMPTS, after, 4)
    lp, _ = policy.logprobs(batch)
    torch.testing.assert_close(lp[batch.response_mask], batch.gen_logprobs[batch.response_mask], atol=1e-4, rtol=0)
    for rs in after:
        for r in rs:
            assert r.finish_reason in ("stop", "length")
            assert len(r.logprobs) == len(r.token_ids) <= 10
            assert r.finish_reason == "length" or r.token_ids[-1] == 1
            assert 1 not in r.token_ids[:-1]


def check_greedy_equals_transformers(make: Callable[[Path], Generator], model_dir: Path) -> None:
    """(c) greedy generations equal transformers' greedy generations token for token (after a refit)."""
    gen = make(model_dir)
    policy = policy_for(model_dir)
    with torch.no_grad():  # weights unlike the folder's, so the refit really matters
        g = torch.Generator().manual_seed(3)
        for _, p in policy.model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    gen.update_weights(policy.export_weights())
    ours = gen.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(1,)))
    for prompt, (r,) in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = policy.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=1,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        if 1 in ref:
            ref = ref[: ref.index(1) + 1]
        assert r.token_ids == ref


def check_bad_refit_names_the_tensor(make: Callable[[Path], Generator], model_dir: Path) -> None:
    gen = make(model_dir)
    try:
        gen.update_weights([("model.layers.0.mlp.not_a_weight", torch.zeros(4, 4))])
    except ValueError as err:
        assert "model.layers.0.mlp.not_a_weight" in str(err)
    else:
        raise AssertionError("an unknown tensor name must be refused")
