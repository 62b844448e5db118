"""nemo_disco.losses.trpa: TRPA hand values, preference levels, the trust region."""

from __future__ import annotations

import math

import pytest
import torch
from loss_reference import (
    CASE_A_GIDS,
    CASE_A_K,
    CASE_A_REF,
    CASE_A_REWARDS,
    DT,
    case_a,
    grad_of,
    log_sigmoid,
    token_rows,
)

from nemo_disco import losses


def test_trpa_hand_values() -> None:
    lp, old, mask = case_a()
    ref, _ = token_rows(*CASE_A_REF)
    fn = losses.get_loss("trpa")
    assert fn.needs_reference
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, ref_logprobs=ref)
    # J = (log s(0.25 (1 - 0)) + log s(0.25 (1 + 1))) / 2 = (-0.5759394199 - 0.4740769842) / 2 = -0.5250082020.
    J = (log_sigmoid(0.25) + log_sigmoid(0.5)) / 2
    assert log_sigmoid(0.25) == pytest.approx(-0.5759394199, abs=1e-10)
    assert log_sigmoid(0.5) == pytest.approx(-0.4740769842, abs=1e-10)
    assert J == pytest.approx(-0.5250082020, abs=1e-10)
    # Trust region: only a's first token moved, x = old - new = -0.5 - (-1) = 0.5 -> e^0.5 - 0.5 - 1
    # = 0.1487212707 over 8 tokens; penalty 0.001 x 0.1487212707 / 8.
    k_tr = (math.exp(0.5) - 1.5) / 8
    assert m["objective"] == pytest.approx(J, abs=1e-12)
    assert m["tr_kl"] == pytest.approx(k_tr, abs=1e-12)
    assert m["penalty"] == pytest.approx(1e-3 * k_tr, abs=1e-15)
    assert loss.item() == pytest.approx(-J + 1e-3 * k_tr, abs=1e-12)
    assert m["pairs"] == 2.0 and m["pair_accuracy"] == 1.0
    # k1 KL(old || new) monitored as for every loss: 0.5 / 8.
    assert m["kl"] == pytest.approx(CASE_A_K, abs=1e-15)
    # Gradient of the preference term: dJ/dh_a = 0.25 (s(-0.25) + s(-0.5)) / 2, spread over a's 2 tokens.
    no_tr, _ = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, ref_logprobs=ref, tr_kl_coef=0.0)
    sig = [1 / (1 + math.exp(x)) for x in (0.25, 0.5)]  # s(-0.25), s(-0.5)
    g_a = -0.25 * (sig[0] + sig[1]) / 2 / 2
    g_b, g_c = 0.25 * sig[0] / 2, 0.25 * sig[1] / 2 / 2
    expected = torch.tensor([[0, 0], [g_a, g_a], [g_b, 0], [0, 0], [g_c, g_c]], dtype=DT)
    torch.testing.assert_close(grad_of(no_tr, lp), expected, atol=1e-12, rtol=0)


def test_trpa_three_levels_and_anisotropy() -> None:
    # One question, rewards 1 > 0 > -1 (three preference levels), h = 1, 0, -1 (one token each, old = new).
    lp, mask = token_rows([0.0], [0.0], [0.0])
    ref, _ = token_rows([-1.0], [0.0], [1.0])
    lp.requires_grad_(True)
    gids, rewards = torch.tensor([4, 4, 4]), torch.tensor([1.0, 0.0, -1.0], dtype=DT)
    loss, m = losses.get_loss("trpa")(lp, lp.detach(), mask, gids, rewards, ref_logprobs=ref)
    # Pairs: (1 > 0) and (1 > -1) won by the correct rollout: beta 0.25, margins 1 and 2; (0 > -1) won by a wrong
    # one: beta 0.1, margin 1. J = (log s(0.25) + log s(0.5) + log s(0.1)) / 3.
    J = (log_sigmoid(0.25) + log_sigmoid(0.5) + log_sigmoid(0.1)) / 3
    assert m["pairs"] == 3.0
    assert loss.item() == pytest.approx(-J, abs=1e-12)
    # With threshold 0.5 the middle rollout (reward 0) is a negative; with threshold -0.5 it counts as correct,
    # so the (0 > -1) pair gets the anisotropic beta too: log s(0.25 x 1).
    loss, _ = losses.get_loss("trpa")(lp, lp.detach(), mask, gids, rewards, ref_logprobs=ref, positive_threshold=-0.5)
    assert loss.item() == pytest.approx(-(log_sigmoid(0.25) * 2 + log_sigmoid(0.5)) / 3, abs=1e-12)


def test_trpa_without_pairs_keeps_only_the_trust_region() -> None:
    lp, old, mask = case_a()
    ref, _ = token_rows(*CASE_A_REF)
    loss, m = losses.get_loss("trpa")(lp, old, mask, CASE_A_GIDS, torch.ones(5, dtype=DT), ref_logprobs=ref)
    # Every rollout correct: no pair, J = 0; the trust-region term remains (as in test_trpa_hand_values).
    assert m["pairs"] == 0.0 and m["objective"] == 0.0
    assert loss.item() == pytest.approx(1e-3 * (math.exp(0.5) - 1.5) / 8, abs=1e-15)
