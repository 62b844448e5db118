"""nemo_disco.losses.grpo: GRPO, GRPO_RW, Dr. GRPO, DAPO and GRPO-ER hand values."""

from __future__ import annotations

import math

import pytest
from loss_reference import A1, CASE_C_GIDS, CASE_C_REWARDS, LN2, case_c, random_case, token_rows

from nemo_disco import losses


def test_grpo_hand_values() -> None:
    lp, old, mask = case_c()
    loss, m = losses.get_loss("grpo")(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS)
    # clip range [0.8, 1.2]. r1 (A > 0): min(1.5, 1.2) + min(0.5, 0.8) = 1.7 -> token mean 0.85 -> 0.85 A1.
    # r2 (A < 0): max(1.5, 1.2) = 1.5 -> -1.5 A1. r3, r4: A = 0.  J = (0.85 - 1.5) A1 / 4 = -0.1625 A1.
    assert loss.item() == pytest.approx(0.1625 * A1, abs=1e-12)
    assert m["objective"] == pytest.approx(-0.1625 * A1, abs=1e-12)
    # Clipped tokens: r1's rho 1.5 > 1.2 (A > 0); r2's 1.5 is not below 0.8 -> 1 of 6 tokens.
    assert m["clip_frac"] == pytest.approx(1 / 6, abs=1e-12)
    # k1 KL to old: -(ln 1.5 + ln 0.5 + ln 1.5) / 6 = -ln(1.125) / 6.
    assert m["kl"] == pytest.approx(-math.log(1.125) / 6, abs=1e-12)
    assert m["constraint_active"] == 0.0 and m["penalty"] == 0.0
    # f+ of positives: r1 0.85, r3 1, r4 1 -> mean 0.95; f- of the negative r2: 1.5.
    assert m["score_pos_mean"] == pytest.approx(0.95, abs=1e-12)
    assert m["score_neg_mean"] == pytest.approx(1.5, abs=1e-12)


def test_grpo_kl_regulariser_hand_value() -> None:
    lp, old, mask = case_c()
    # Reference: log(pi_ref / pi_theta) = ln 2 on r1's first token, 0 elsewhere.
    # k3 = e^x - x - 1 = 2 - ln 2 - 1 = 0.3068528194; token mean of r1 = 0.1534264097; mean over 4 rollouts.
    # reg = 0.1 * 0.1534264097 / 4.
    ref = lp.detach().clone()
    ref[0, 0] += LN2
    fn = losses.get_loss("grpo", kl_coef=0.1)
    assert fn.needs_reference
    loss, m = fn(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS, ref_logprobs=ref, kl_coef=0.1)
    reg = 0.1 * (1 - LN2) / 2 / 4
    assert m["penalty"] == pytest.approx(reg, abs=1e-12)
    assert m["ref_kl"] == pytest.approx((1 - LN2) / 6, abs=1e-12)
    assert loss.item() == pytest.approx(0.1625 * A1 + reg, abs=1e-12)


def test_grpo_rw_hand_value() -> None:
    lp, old, mask = case_c()
    loss, m = losses.get_loss("grpo_rw")(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS)
    # Question 0: f+(r1) = (1.2 + 0.5) / 2 = 0.85, f-(r2) = 1.5 -> term -0.65; question 1 has no negative.
    # J = -0.65 / 2 = -0.325.
    assert loss.item() == pytest.approx(0.325, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 6, abs=1e-12)


def test_dr_grpo_hand_value() -> None:
    lp, old, mask = case_c()
    loss, _ = losses.get_loss("dr_grpo")(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS, max_response_tokens=4)
    # A = r - mean: +-0.5 in question 0, 0 in question 1. Token sums: r1 0.5 (1.2 + 0.5) = 0.85, r2 -0.5 * 1.5 = -0.75.
    # J = (0.85 - 0.75) / max_response_tokens(4) / N(4) = 0.1 / 16 = 0.00625.
    assert loss.item() == pytest.approx(-0.00625, abs=1e-12)


def test_dapo_hand_value() -> None:
    lp, old, mask = case_c()
    loss, m = losses.get_loss("dapo")(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS)
    # Clip-higher [0.8, 1.28]: r1 min(1.5, 1.28) + 0.5 = 1.78 (x A1); r2 max(1.5, 0.8) = 1.5 (x -A1).
    # Token level: J = A1 (1.78 - 1.5) / 6 tokens = 0.28 A1 / 6.
    assert loss.item() == pytest.approx(-0.28 * A1 / 6, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 6, abs=1e-12)


def test_grpo_er_hand_value() -> None:
    lp, old, mask = case_c()
    entropy, _ = token_rows([1.0, 2.0], [3.0], [0.5], [0.25, 0.25])
    fn = losses.get_loss("grpo_er")
    assert fn.needs_entropy
    loss, m = fn(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS, entropy=entropy, entropy_coef=0.01)
    # Entropy token mean: (1 + 2 + 3 + 0.5 + 0.25 + 0.25) / 6 = 7 / 6; loss = GRPO's 0.1625 A1 - 0.01 * 7/6.
    assert m["entropy"] == pytest.approx(7 / 6, abs=1e-12)
    assert loss.item() == pytest.approx(0.1625 * A1 - 0.01 * 7 / 6, abs=1e-12)


def test_grpo_equals_question_weighted_grpo_rw() -> None:
    # eq. 4: with binary rewards GRPO's objective is sum_q (n_q / N) * p(1-p) / (std_q + 1e-6) * term_q(GRPO_RW),
    # std_q = sqrt(p(1-p)) (population std), i.e. GRPO_RW with the question weight sqrt(p(1-p)) put back.
    c = random_case(3)
    lp, old, mask, gids, rewards = c["lp"].detach(), c["old"], c["mask"], c["gids"], c["rewards"]
    grpo_loss, _ = losses.get_loss("grpo")(lp, old, mask, gids, rewards)
    weighted = 0.0
    for q in gids.unique():
        rows = gids == q
        p = float(rewards[rows].mean())
        # GRPO_RW on one question: J = term_q (Q = 1).
        rw_loss, _ = losses.get_loss("grpo_rw")(lp[rows], old[rows], mask[rows], gids[rows], rewards[rows])
        weighted += int(rows.sum()) / len(gids) * p * (1 - p) / (math.sqrt(p * (1 - p)) + 1e-6) * -rw_loss.item()
    assert -grpo_loss.item() == pytest.approx(weighted, abs=1e-12)
