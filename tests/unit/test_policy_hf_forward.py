"""The transformers policy's forward over the model's modules against the model's own forward, bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from generation_checks import policy_for

from nemo_disco.batch import RolloutBatch
from nemo_disco.policy import hf_forward

torch.set_num_threads(1)
ARCHS = ["tiny_qwen2", "tiny_llama", "tiny_qwen3", "tiny_qwen3_moe"]


def _model(path):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def _inputs(padded: bool, vocab: int, rows: int = 5, length: int = 17, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:  # left padding of 0, 3, 6, ... tokens; the last row is all padding but one token
        for i in range(rows):
            mask[i, : min(3 * i, length - 1)] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, positions


def _logits_and_grads(model, fn, mask, upstream):  # noqa: ANN001, ANN202
    model.zero_grad(set_to_none=True)
    logits = fn()
    # Only real tokens carry a gradient, as in training (padding's logits are never read).
    (logits * upstream * mask.unsqueeze(-1)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logits.detach() * mask.unsqueeze(-1)), grads


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_every_gradient_equal_the_models_own_forward_bit_for_bit(arch, padded, request):
    model = _model(request.getfixturevalue(arch))
    assert hf_forward.supports(model)
    ids, mask, positions = _inputs(padded, model.config.vocab_size)
    upstream = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _logits_and_grads(
        model,
        lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits,
        mask,
        upstream,
    )
    logits, grads = _logits_and_grads(model, lambda: hf_forward.logits(model, ids, mask, positions), mask, upstream)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    assert len(grads) == len([p for p in model.parameters() if p.requires_grad])
    unequal = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
    assert not unequal, f"gradients differ from the model's own forward: {unequal}"


def test_activation_checkpointing_recomputes_the_same_gradients(tiny_qwen3):
    model = _model(tiny_qwen3)
    ids, mask, positions = _inputs(True, model.config.vocab_size)
    upstream = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    plain = _logits_and_grads(model, lambda: hf_forward.logits(model, ids, mask, positions), mask, upstream)
    ckpt = _logits_and_grads(
        model,
        lambda: hf_forward.logits(model, ids, mask, positions, activation_checkpointing=True),
        mask,
        upstream,
    )
    assert torch.equal(plain[0], ckpt[0])
    assert all(torch.equal(plain[1][n], ckpt[1][n]) for n in plain[1])


def test_the_rotary_embeddings_backward_is_the_derivative_of_its_forward():
    """gradcheck in float64 against finite differences, on a transposed (non-contiguous) input as the model has."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()  # [B, H, S, D]
    angles = torch.rand(2, 5, 4, dtype=torch.float64, generator=g) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    assert torch.autograd.gradcheck(lambda t: hf_forward.rope(t, cos, sin), (x,))
    half_rotated = torch.cat([-x[..., 4:], x[..., :4]], -1)
    expected = x * cos.unsqueeze(1) + half_rotated * sin.unsqueeze(1)
    assert torch.equal(hf_forward.rope(x, cos, sin), expected)


def test_the_mask_is_causal_over_real_keys_and_absent_without_padding():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    m = hf_forward.causal_padding_mask(mask)
    assert m.shape == (2, 1, 3, 3) and m.dtype == torch.float32
    inf = float("-inf")
    assert m[0, 0].tolist() == [[inf, inf, inf], [inf, 0.0, inf], [inf, 0.0, 0.0]]
    assert m[1, 0].tolist() == [[0.0, inf, inf], [0.0, 0.0, inf], [0.0, 0.0, 0.0]]
    assert hf_forward.causal_padding_mask(torch.ones(2, 3, dtype=torch.long)) is None


def test_the_policy_runs_the_modules_path_and_falls_back_for_models_it_does_not_support(tiny_qwen2, tmp_path):
    assert policy_for(tiny_qwen2).forward_path == "modules"
    cfg = json.loads((tiny_qwen2 / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    for f in tiny_qwen2.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    policy = policy_for(tmp_path)
    assert not hf_forward.supports(policy.model)
    assert policy.forward_path == "model"
    lp, _ = policy.logprobs(_batch())  # runs through the model's own forward
    assert torch.isfinite(lp).all()


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(3)
    n, p, r = 6, 5, 7
    prompt_mask = torch.ones(n, p, dtype=torch.bool)
    prompt_mask[::2, :2] = False
    response_mask = torch.ones(n, r, dtype=torch.bool)
    response_mask[1::3, 4:] = False
    return RolloutBatch(
        prompt_ids=torch.randint(2, 100, (n, p), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(2, 100, (n, r), generator=g) * response_mask,
        response_mask=response_mask,
        group_ids=torch.arange(n) // 3,
        rewards=torch.rand(n, generator=g),
        gen_logprobs=torch.zeros(n, r),
    )


def test_a_policy_update_is_the_same_on_both_paths(tiny_qwen2):
    """A whole update (forward, surrogate, backward, clip, AdamW) leaves the same weights either way."""
    batch = _batch()
    n, r = batch.response_ids.shape
    weights = torch.randn(n, r, generator=torch.Generator().manual_seed(4))
    results = []
    for path in ("modules", "model"):
        policy = policy_for(tiny_qwen2)
        policy.forward_path = path
        lp, _ = policy.logprobs(batch)
        policy.train_minibatch(batch, lambda rows, logp, ent: (logp * weights[rows]).sum())
        results.append((lp, [t.clone() for _, t in policy.export_weights()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
