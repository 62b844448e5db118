"""nemo_disco.losses.base: each loss against the naive loop, micro-batch invariance, coefficients, metrics.

The naive reference lives in tests/loss_reference.py and shares no code with the library.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_reference import (
    CASE_C_GIDS,
    CASE_C_REWARDS,
    DT,
    VARIANT_IDS,
    VARIANTS,
    case_c,
    full_batch_grad,
    grad_of,
    loss_inputs,
    microbatch_grad,
    naive,
    policy_case,
    random_case,
)

from nemo_disco import losses


@pytest.mark.parametrize("regime", ["active", "inactive"])
@pytest.mark.parametrize("reward_kind", ["01", "pm1"])
@pytest.mark.parametrize(("name", "hp"), VARIANTS, ids=VARIANT_IDS)
def test_gradient_matches_naive_loop(name: str, hp: dict, reward_kind: str, regime: str) -> None:
    c = random_case(seed=len(name) + len(hp), reward_kind=reward_kind, regime=regime)
    hp = {**hp, "positive_threshold": c["threshold"]}
    fn = losses.get_loss(name, **hp)
    loss, m = fn(c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], **loss_inputs(fn, c), **hp)
    ref_loss, J, K = naive(
        name, c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], entropy=c["entropy"], ref=c["ref"], **hp
    )
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-10)
    assert m["objective"] == pytest.approx(J.item(), abs=1e-10)
    assert m["kl"] == pytest.approx(K.item(), abs=1e-12)
    if name in ("disco", "discob", "drpo"):
        assert m["constraint_active"] == (1.0 if regime == "active" else 0.0)
    # The case has questions without a positive (42) and without a negative (5, 3).
    assert m["no_positive"] == 1 and m["no_negative"] == 2 and m["questions"] == 6
    g = grad_of(loss, c["lp"])
    assert torch.isfinite(g).all()
    assert (g[~c["mask"]] == 0).all()
    torch.testing.assert_close(g, grad_of(ref_loss, c["lp"]), atol=1e-10, rtol=0)
    if name.startswith(("grpo", "dr_grpo", "dapo")) and regime == "active":
        assert 0 < m["clip_frac"] < 1


@pytest.mark.parametrize(("name", "hp"), [v for v in VARIANTS if v[0] in ("gpg", "trpa")])
def test_graded_rewards_match_naive_loop(name: str, hp: dict) -> None:
    """Four reward levels (1, 0, -0.5, -1, as TRPA's rules would grade): TRPA pairs across every two levels, the
    anisotropic beta only for pairs won by a correct rollout; GPG's advantage on non-binary rewards."""
    c = random_case(seed=17)
    levels = torch.tensor([1.0, 0.0, -0.5, -1.0], dtype=DT)
    rewards = levels[torch.randint(4, (len(c["gids"]),), generator=torch.Generator().manual_seed(18))]
    fn = losses.get_loss(name, **hp)
    loss, m = fn(c["lp"], c["old"], c["mask"], c["gids"], rewards, **loss_inputs(fn, c), **hp)
    ref_loss, J, _ = naive(name, c["lp"], c["old"], c["mask"], c["gids"], rewards, ref=c["ref"], **hp)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-10)
    assert m["objective"] == pytest.approx(J.item(), abs=1e-10)
    torch.testing.assert_close(grad_of(loss, c["lp"]), grad_of(ref_loss, c["lp"]), atol=1e-10, rtol=0)
    if name == "trpa":
        # Some pairs are won by a wrong rollout (0 > -0.5, ...): the plain-beta path is exercised too.
        wrong_winner = [
            (i, j)
            for i in range(len(rewards))
            for j in range(len(rewards))
            if c["gids"][i] == c["gids"][j] and 0.5 >= rewards[i] > rewards[j]
        ]
        assert wrong_winner and m["pairs"] > len(wrong_winner)


@pytest.mark.parametrize(("name", "hp"), VARIANTS, ids=VARIANT_IDS)
def test_microbatch_invariance(name: str, hp: dict) -> None:
    pol, c = policy_case(seed=5)
    hp = {**hp, "positive_threshold": c["threshold"]}
    fn = losses.get_loss(name, **hp)
    full, value = full_batch_grad(pol, c, fn, hp)
    assert full.abs().max() > 1e-3
    N = len(c["gids"])
    for size in (1, 2, 3, N):
        grad, mb_value, metrics = microbatch_grad(pol, c, fn, hp, size, seed=size)
        torch.testing.assert_close(grad, full, atol=1e-10, rtol=0)
        assert mb_value == pytest.approx(value, abs=1e-12)
    if name in ("disco", "discob", "drpo"):
        assert metrics["constraint_active"] == 1.0  # the penalty's gradient is part of what is checked


def test_microbatch_invariance_pm1_rewards() -> None:
    pol, c = policy_case(seed=6, reward_kind="pm1")
    hp = {"positive_threshold": c["threshold"], "score": "lratio", "tau": 1.0}
    fn = losses.get_loss("disco")
    full, _ = full_batch_grad(pol, c, fn, hp)
    grad, _, _ = microbatch_grad(pol, c, fn, hp, 4, seed=1)
    torch.testing.assert_close(grad, full, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------------------------------------------------
# API, validation, config.

REQUIRED_METRICS = {
    "objective",
    "loss",
    "kl",
    "constraint_active",
    "penalty",
    "score_pos_mean",
    "score_neg_mean",
    "questions",
    "no_positive",
    "no_negative",
    "no_positive_share",
    "no_negative_share",
    "zero_variance_share",
    "p_mean",
    "lratio_clamped",
}


@pytest.mark.parametrize(("name", "hp"), VARIANTS, ids=VARIANT_IDS)
def test_metrics_are_flat_floats(name: str, hp: dict) -> None:
    c = random_case(1)
    fn = losses.get_loss(name, **hp)
    _, m = fn(c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], **loss_inputs(fn, c), **hp)
    clipped = fn.stat_names[: len(losses.CLIP_STATS)] == losses.CLIP_STATS
    wanted = REQUIRED_METRICS | ({"clip_frac"} if clipped else set())
    wanted |= {"gpg": {"alpha", "valid_share"}, "trpa": {"tr_kl", "pairs", "pair_accuracy"}}.get(name, set())
    assert wanted <= set(m)
    assert all(type(v) is float and math.isfinite(v) and "/" not in k for k, v in m.items())


def test_coefficients_equal_autograd_of_objective() -> None:
    c = random_case(8)
    fn = losses.get_loss("disco")
    stats = fn.stats(c["lp"].detach(), c["old"], c["mask"], tau=2.0)
    coeffs, value, metrics = losses.coefficients(fn, stats, c["gids"], c["rewards"], tau=2.0)
    leaf = stats.clone().requires_grad_(True)
    loss, _ = fn.objective(leaf, c["gids"], c["rewards"], tau=2.0)
    torch.testing.assert_close(coeffs, grad_of(loss, leaf), atol=1e-14, rtol=0)
    assert value == metrics["loss"] == pytest.approx(loss.item(), abs=1e-14)
    # Constant columns (token counts, clamp counts) carry no gradient into the model; the score column does.
    assert coeffs[:, 0].abs().sum() > 0


def test_reference_and_entropy_requirements() -> None:
    assert not losses.get_loss("grpo").needs_reference
    assert not losses.get_loss("grpo", kl_coef=0.0).needs_reference
    assert losses.get_loss("grpo_er", kl_coef=1e-3).needs_reference
    assert not losses.get_loss("disco", tau=1.0).needs_reference
    assert not losses.get_loss("gpg").needs_reference and not losses.get_loss("gpg", token_norm="batch").needs_reference
    # TRPA's preference term is a log-ratio to the reference: needed at the registry defaults and after binding.
    assert losses.get_loss("trpa").needs_reference and losses.get_loss("trpa", trpa_beta=0.2).needs_reference
    lp, old, mask = case_c()
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        losses.get_loss("grpo").stats(lp, old, mask, kl_coef=0.001)
    with pytest.raises(ValueError, match=r"loss 'trpa' \(a log-ratio to the reference\) needs ref_logprobs"):
        losses.get_loss("trpa").stats(lp, old, mask)
    with pytest.raises(ValueError, match="needs entropy"):
        losses.get_loss("grpo_er").stats(lp, old, mask)
    with pytest.raises(ValueError, match=r"mask must be \[4, 2\]"):
        losses.get_loss("disco").stats(lp, old, mask[:, :1])
    stats = losses.get_loss("disco").stats(lp.detach(), old, mask)
    with pytest.raises(ValueError, match=r"rewards must be \[4\]"):
        losses.get_loss("disco").objective(stats, CASE_C_GIDS, CASE_C_REWARDS[:3])
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        losses.get_loss("disco").objective(stats, CASE_C_GIDS, CASE_C_REWARDS, weights=-torch.ones(4, dtype=DT))
    with pytest.raises(ValueError, match="differ"):
        losses.surrogate(torch.zeros(3, 4), stats)
