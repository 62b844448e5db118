"""nemo_disco.losses.gpg: GPG hand values."""

from __future__ import annotations

import math

import pytest
import torch
from loss_reference import CASE_A_GIDS, CASE_A_REWARDS, DT, case_a, grad_of

from nemo_disco import losses

# GPG on case A (old = new). Question 7: a (r 1, log-probs [-1, -1]), b (r 0, [-2]), c (r 0, [-3, -5]); mean 1/3
# -> A_a = 2/3, A_b = A_c = -1/3; summed log-probs -2, -2, -8; T_7 = 5 tokens.
#   sum_i A_i logp_sum_i = (2/3)(-2) + (-1/3)(-2) + (-1/3)(-8) = (-4 + 2 + 8) / 3 = 2.
# Question 3: d, e both correct -> A = 0 (and they are the M = 2 rollouts of equal-reward questions).
# B = 5 rollouts -> alpha = 5 / (5 - 2) = 5/3; Q = 2; all 8 tokens T_tot = 8.


def test_gpg_hand_values() -> None:
    lp, old, mask = case_a(same_old=True)
    fn = losses.get_loss("gpg")
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS)
    # eq. 5 per question: (2 / 5 + 0) / Q = 0.2; eq. 8: J = alpha 0.2 = (5/3)(0.2) = 1/3.
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-12)
    assert m["objective"] == pytest.approx(1 / 3, abs=1e-12)
    assert m["alpha"] == pytest.approx(5 / 3, abs=1e-15) and m["valid_share"] == pytest.approx(3 / 5, abs=1e-15)
    assert m["penalty"] == 0.0 and m["kl"] == 0.0
    # dloss/dlp_{i,t} = -(alpha / Q) A_i / T_7: a -(5/3)(1/2)(2/3)/5 = -1/9; b, c -(5/3)(1/2)(-1/3)/5 = +1/18.
    expected = torch.tensor([[0, 0], [-1 / 9, -1 / 9], [1 / 18, 0], [0, 0], [1 / 18, 1 / 18]], dtype=DT)
    torch.testing.assert_close(grad_of(loss, lp), expected, atol=1e-12, rtol=0)
    # token_norm "batch": alpha x 2 / T_tot = (5/3)(2/8) = 5/12; without alpha 1/4 and 1/5.
    assert fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, token_norm="batch")[0].item() == pytest.approx(-5 / 12)
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, token_norm="batch", alpha_correction=False)
    assert loss.item() == pytest.approx(-0.25, abs=1e-12) and m["alpha"] == 1.0
    loss, _ = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, alpha_correction=False)
    assert loss.item() == pytest.approx(-0.2, abs=1e-12)
    # F_norm = std (population std of {1, 0, 0} = sqrt(2/9) = 0.4714045208): J = (1/3) / (sqrt(2/9) + 1e-6).
    loss, _ = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, adv_std_norm=True)
    assert math.sqrt(2 / 9) == pytest.approx(0.4714045207910317, abs=1e-15)
    assert loss.item() == pytest.approx(-(1 / 3) / (math.sqrt(2 / 9) + 1e-6), abs=1e-12)


def test_gpg_equal_rewards_everywhere_gives_zero() -> None:
    lp, old, mask = case_a(same_old=True)
    loss, m = losses.get_loss("gpg")(lp, old, mask, CASE_A_GIDS, torch.ones(5, dtype=DT))
    # Every A is 0; M = B, so alpha stays 1 rather than B / 0.
    assert loss.item() == 0.0 and m["alpha"] == 1.0 and m["valid_share"] == 0.0
    assert (grad_of(loss, lp) == 0).all()
