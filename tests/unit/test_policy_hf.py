import math

import pytest
import torch

from nemo_disco import config, families
from nemo_disco.batch import collate
from nemo_disco.policy.hf import HFPolicy

torch.set_num_threads(1)


def _cfg(**over):
    overrides = [
        "policy.backend=hf",
        "policy.dtype=float32",
        "policy.lr=1e-3",
        "policy.grad_clip=0",
        "cluster.gpus_per_node=1",
        "algorithm.prompts_per_step=4",
        "algorithm.minibatch_prompts=2",
        "algorithm.rollouts_per_prompt=2",
        "generation.temperature=0.7",
    ] + [f"{k}={v}" for k, v in over.items()]
    return config.load(config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml", overrides)


def _batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(5, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    responses = [
        torch.randint(5, 100, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    return collate(prompts, responses, [[0.0] * len(r) for r in responses], list(range(n)), [1.0] * n, pad_id=0)


@pytest.mark.parametrize("tiny_family", sorted(families.FAMILIES), indirect=True)
def test_logprobs_match_unpadded_forward(tiny_family):
    """Left/right padding, positions and the temperature give the log-probs of each sequence run alone."""
    policy = HFPolicy.from_run_config(_cfg(), tiny_family)
    batch = _batch()
    lp, ent = policy.logprobs(batch, entropy=True)
    for i in range(len(batch)):
        p = batch.prompt_ids[i][batch.prompt_mask[i]]
        r = batch.response_ids[i][batch.response_mask[i]]
        ids = torch.cat([p, r]).unsqueeze(0)
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0] / 0.7
        ref = torch.log_softmax(logits[len(p) - 1 : -1], -1)
        expect = ref.gather(-1, r.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(lp[i, : len(r)], expect, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, : len(r)], -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
        assert torch.all(lp[i, len(r) :] == 0)


def _grads_after(policy, batch, fn):
    """The summed gradient train_minibatch hands to the optimizer (captured in place of the step)."""
    captured = {}
    orig_step = policy.optimizer.step

    def capture():
        for n, p in policy.model.named_parameters():
            captured[n] = p.grad.detach().clone()

    policy.optimizer.step = capture
    try:
        policy.train_minibatch(batch, fn)
    finally:
        policy.optimizer.step = orig_step
    return captured


def test_gradient_is_the_sum_over_microbatches(tiny_qwen2):
    """Any micro-batch size gives the gradient of the summed surrogate over the whole batch."""
    batch = _batch(seed=1, n=7)
    coef = torch.linspace(-1, 1, len(batch))

    def fn(rows, lp, ent):
        return (coef[rows].unsqueeze(1) * lp).sum()

    grads, counts = [], []
    for tokens in (1, 25, 10_000):
        policy = HFPolicy.from_run_config(_cfg(**{"policy.microbatch_tokens": tokens}), tiny_qwen2)
        grads.append(_grads_after(policy, batch, fn))
        counts.append(len(policy.microbatch_rows(batch)))
    width = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]  # every row runs at the batch's width
    assert counts == [7, math.ceil(7 / (25 // width)), 1]
    for g in grads[1:]:
        for name in g:
            torch.testing.assert_close(g[name], grads[0][name], atol=1e-6, rtol=1e-5)


def test_non_finite_surrogate_skips_the_update(tiny_qwen2):
    policy = HFPolicy.from_run_config(_cfg(), tiny_qwen2)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    out = policy.train_minibatch(_batch(), lambda rows, lp, ent: lp.sum() * float("nan"))
    assert out["skipped"] == 1.0
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, before[n]), n
    out = policy.train_minibatch(_batch(), lambda rows, lp, ent: -lp.sum())
    assert out["skipped"] == 0.0 and out["lr"] == pytest.approx(1e-3)
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())


def test_save_load_round_trip(tiny_qwen2, tmp_path):
    policy = HFPolicy.from_run_config(_cfg(), tiny_qwen2)
    policy.train_minibatch(_batch(), lambda rows, lp, ent: -lp.sum())
    policy.save(tmp_path / "p")
    other = HFPolicy.from_run_config(_cfg(), tiny_qwen2)
    other.load(tmp_path / "p")
    assert other.updates == 1
    for (n, a), (_, b) in zip(policy.export_weights(), other.export_weights(), strict=True):
        assert torch.equal(a, b), n
    # Same optimizer state: one more identical update keeps them identical.
    for p_ in (policy, other):
        p_.train_minibatch(_batch(seed=3), lambda rows, lp, ent: -lp.sum())
    for (n, a), (_, b) in zip(policy.export_weights(), other.export_weights(), strict=True):
        assert torch.equal(a, b), n


def test_selective_recomputation_is_refused_in_one_line_and_full_checkpoints_every_layer(tiny_qwen2):
    from nemo_disco.policy.base import RunValues

    run = RunValues.of(config.RunConfig())
    with pytest.raises(config.ConfigError, match=r"^policy.activation_checkpointing=selective needs policy.backend"):
        HFPolicy(config.PolicyConfig(backend="hf", activation_checkpointing="selective"), tiny_qwen2, run)
    full = HFPolicy(config.PolicyConfig(backend="hf", activation_checkpointing=True, dtype="float32"), tiny_qwen2, run)
    assert full.pc.activation_checkpointing == "full" and full.model.is_gradient_checkpointing


def test_full_activation_checkpointing_gives_the_same_logprobs_and_gradients(tiny_qwen3):
    """Recomputing every layer in the backward (transformers' gradient checkpointing) changes no bit."""
    batch = _batch(seed=2)
    coef = torch.linspace(-1, 1, len(batch))

    def fn(rows, lp, ent):
        return (coef[rows].unsqueeze(1) * lp).sum()

    results = []
    for ckpt in ("false", "full"):
        policy = HFPolicy.from_run_config(_cfg(**{"policy.activation_checkpointing": ckpt}), tiny_qwen3)
        assert policy.model.is_activation_checkpointing == (ckpt == "full")
        results.append((policy.logprobs(batch)[0], _grads_after(policy, batch, fn)))
    (lp0, g0), (lp1, g1) = results
    assert torch.equal(lp0, lp1)
    assert g0.keys() == g1.keys() and [n for n in g0 if not torch.equal(g0[n], g1[n])] == []
