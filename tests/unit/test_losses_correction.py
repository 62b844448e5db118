"""nemo_disco.losses.correction: rollout weights for the generator / trainer mismatch, and their effect on each loss.

Weights enter every DisCO-family mean over a question's positives or negatives as self-normalised weights
(the DRO term becomes tau log(sum_j w_j exp(s_j / tau) / sum_j w_j)), and multiply each rollout's loss in the
GRPO family (each token's, for DAPO).
"""

from __future__ import annotations

import math

import loss_reference as ref
import pytest
import torch

from nemo_disco import losses

DT = torch.float64
LN2 = math.log(2.0)


def _truncated_weights(c: dict, seed: int, cap: float = 1.5) -> tuple[torch.Tensor, dict[str, float]]:
    """seq_tis weights from a perturbed generator: some truncated at cap, some far below 1."""
    g = torch.Generator().manual_seed(seed)
    gen = c["old"] + 0.4 * torch.randn(c["old"].shape, generator=g, dtype=DT)
    w, metrics = losses.rollout_weights(c["old"], gen, c["mask"], mode="seq_tis", cap=cap)
    assert 0 < metrics["mismatch/truncated_share"] < 1 and float(w.min()) < 0.5
    return w, metrics


# ----------------------------------------------------------------------------------------------------------------------
# rollout_weights / mismatch_metrics by hand.


def test_seq_tis_weights_hand_values() -> None:
    # Per-token old - gen: row 0 [ln 3, 0] -> ratio 3 -> truncated to cap 2; row 1 [ln 0.5] -> 0.5; row 2 [0, 0] -> 1.
    old, mask = ref.token_rows([0.0, -1.0], [-2.0], [-0.5, -0.5])
    diff, _ = ref.token_rows([math.log(3.0), 0.0], [math.log(0.5)], [0.0, 0.0])
    gen = torch.where(mask, old - diff, 0.0)
    w, m = losses.rollout_weights(old, gen, mask, mode="seq_tis", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 1.0], dtype=DT), atol=1e-12, rtol=0)
    assert not w.requires_grad
    assert m["mismatch/truncated_share"] == pytest.approx(1 / 3)
    assert m["mismatch/weight_mean"] == pytest.approx(3.5 / 3)  # (2 + 0.5 + 1) / 3
    assert m["mismatch/weight_max"] == pytest.approx(2.0) and m["mismatch/weight_min"] == pytest.approx(0.5)
    # ESS share = (sum w)^2 / (N sum w^2) = 3.5^2 / (3 * 5.25) = 12.25 / 15.75.
    assert m["mismatch/weight_ess_share"] == pytest.approx(12.25 / 15.75)
    assert losses.rollout_weights(old, gen, mask, mode="none") == (None, {})
    with pytest.raises(ValueError, match="must be 'none' or 'seq_tis'"):
        losses.rollout_weights(old, gen, mask, mode="token_tis")


def test_mismatch_metrics_hand_values() -> None:
    # d = old - gen per token: row 0 [ln 2, 0], row 1 [-ln 2].
    old, mask = ref.token_rows([-1.0, -2.0], [-0.3])
    diff, _ = ref.token_rows([LN2, 0.0], [-LN2])
    gen = torch.where(mask, old - diff, 0.0)
    m = losses.mismatch_metrics(old, gen, mask)
    # k3 = e^d - 1 - d: (2 - 1 - ln 2) + 0 + (0.5 - 1 + ln 2) = 0.5 over 3 tokens -> 1/6.
    assert m["mismatch/kl_k3"] == pytest.approx(1 / 6, abs=1e-12)
    assert m["mismatch/max_abs_logprob_diff"] == pytest.approx(LN2, abs=1e-12)
    # Sequence sums ln 2 and -ln 2: mean 0, population std ln 2.
    assert m["mismatch/seq_logratio_mean"] == pytest.approx(0.0, abs=1e-12)
    assert m["mismatch/seq_logratio_std"] == pytest.approx(LN2, abs=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# Weighted objectives by hand.

# Question 0: positives a (s = -1, w = 2), a2 (s = -2, w = 1); negatives b (s = -2, w = 1), c (s = -4, w = 3).
# Question 1: one positive d (s = -1, w = 5), no negative -> adds 0, counts in Q = 2.  old = new (K = 0).
WEIGHTED_LP = ([-1.0, -1.0], [-2.0], [-2.0], [-3.0, -5.0], [-1.0])
WEIGHTED_GIDS = torch.tensor([0, 0, 0, 0, 1])
WEIGHTED_REWARDS = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0], dtype=DT)
WEIGHTS = torch.tensor([2.0, 1.0, 1.0, 3.0, 5.0], dtype=DT)


def _weighted_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lp, mask = ref.token_rows(*WEIGHTED_LP)
    return lp.clone().requires_grad_(True), lp.clone(), mask


def test_weighted_dro_term_hand_value() -> None:
    lp, old, mask = _weighted_case()
    loss, m = losses.get_loss("disco")(
        lp, old, mask, WEIGHTED_GIDS, WEIGHTED_REWARDS, weights=WEIGHTS, tau=1.0, score="logl"
    )
    # Weighted positive mean: (2 * -1 + 1 * -2) / 3 = -4/3.
    # DRO term: tau log((1 * e^-2 + 3 * e^-4) / (1 + 3)) = log(0.1902821999 / 4) = -3.0455414072
    # term_0 = -4/3 - log((e^-2 + 3 e^-4) / 4) = -1.3333333333 + 3.0455414072 = 1.7122080739; J = term_0 / 2.
    term = -4 / 3 - math.log((math.exp(-2) + 3 * math.exp(-4)) / 4)
    assert term == pytest.approx(1.7122080739, abs=1e-9)
    assert m["objective"] == pytest.approx(term / 2, abs=1e-12)
    assert loss.item() == pytest.approx(-term / 2, abs=1e-12)


def test_weighted_discob_term_hand_value() -> None:
    lp, old, mask = _weighted_case()
    loss, _ = losses.get_loss("discob")(lp, old, mask, WEIGHTED_GIDS, WEIGHTED_REWARDS, weights=WEIGHTS)
    # term_0 = -4/3 - (1 * -2 + 3 * -4) / 4 = -4/3 + 3.5 = 13/6; J = 13/12.
    assert loss.item() == pytest.approx(-13 / 12, abs=1e-12)


def test_weighted_grpo_and_dapo_hand_values() -> None:
    lp, old, mask = ref.case_c()
    w = torch.tensor([2.0, 0.5, 1.0, 1.0], dtype=DT)
    loss, _ = losses.get_loss("grpo")(lp, old, mask, ref.CASE_C_GIDS, ref.CASE_C_REWARDS, weights=w)
    # Each rollout's loss times w_i: J = (2 * 0.85 A1 + 0.5 * -1.5 A1) / 4 = 0.95 A1 / 4.
    assert loss.item() == pytest.approx(-0.95 * ref.A1 / 4, abs=1e-12)
    loss, _ = losses.get_loss("dapo")(lp, old, mask, ref.CASE_C_GIDS, ref.CASE_C_REWARDS, weights=w)
    # Each token of rollout i weighted by w_i, unweighted token denominator: (2 * 1.78 - 0.5 * 1.5) A1 / 6.
    assert loss.item() == pytest.approx(-(2 * 1.78 - 0.5 * 1.5) * ref.A1 / 6, abs=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# Weights all 1 == no weights; gradients against the naive loop; micro-batch invariance.


@pytest.mark.parametrize(("name", "hp"), ref.VARIANTS, ids=ref.VARIANT_IDS)
def test_unit_weights_equal_no_correction(name: str, hp: dict) -> None:
    c = ref.random_case(21)
    w, m = losses.rollout_weights(c["old"], c["old"], c["mask"], mode="seq_tis", cap=2.0)  # gen == old
    assert torch.equal(w, torch.ones_like(w)) and m["mismatch/truncated_share"] == 0.0
    fn = losses.get_loss(name, **hp)
    args = (c["lp"], c["old"], c["mask"], c["gids"], c["rewards"])
    plain, _ = fn(*args, **ref.loss_inputs(fn, c), **hp)
    weighted, _ = fn(*args, **ref.loss_inputs(fn, c), weights=w, **hp)
    assert weighted.item() == pytest.approx(plain.item(), abs=1e-12)
    torch.testing.assert_close(ref.grad_of(weighted, c["lp"]), ref.grad_of(plain, c["lp"]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("reward_kind", ["01", "pm1"])
@pytest.mark.parametrize(("name", "hp"), ref.VARIANTS, ids=ref.VARIANT_IDS)
def test_weighted_gradient_matches_naive_loop(name: str, hp: dict, reward_kind: str) -> None:
    c = ref.random_case(31, reward_kind=reward_kind)
    w, _ = _truncated_weights(c, seed=32)
    hp = {**hp, "positive_threshold": c["threshold"]}
    fn = losses.get_loss(name, **hp)
    loss, m = fn(c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], **ref.loss_inputs(fn, c), weights=w, **hp)
    naive_loss, J, _ = ref.naive(
        name, c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], entropy=c["entropy"], ref=c["ref"], weights=w, **hp
    )
    assert loss.item() == pytest.approx(naive_loss.item(), abs=1e-10)
    assert m["objective"] == pytest.approx(J.item(), abs=1e-10)
    torch.testing.assert_close(ref.grad_of(loss, c["lp"]), ref.grad_of(naive_loss, c["lp"]), atol=1e-10, rtol=0)
    # The weights change the objective (they are not silently dropped).
    plain, _ = fn(c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], **ref.loss_inputs(fn, c), **hp)
    assert abs(plain.item() - loss.item()) > 1e-6


@pytest.mark.parametrize(("name", "hp"), ref.VARIANTS, ids=ref.VARIANT_IDS)
def test_weighted_microbatch_invariance(name: str, hp: dict) -> None:
    pol, c = ref.policy_case(seed=9)
    with torch.no_grad():
        c["old"] = pol.old
    w, _ = _truncated_weights(c, seed=10)
    hp = {**hp, "positive_threshold": c["threshold"]}
    fn = losses.get_loss(name, **hp)
    full, value = ref.full_batch_grad(pol, c, fn, hp, weights=w)
    for size in (1, 2, 3, len(w)):
        grad, mb_value, _ = ref.microbatch_grad(pol, c, fn, hp, size, weights=w, seed=size + 100)
        torch.testing.assert_close(grad, full, atol=1e-10, rtol=0)
        assert mb_value == pytest.approx(value, abs=1e-12)
