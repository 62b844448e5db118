"""nemo_disco.losses.disco: DisCO, DisCO-b and DRPO hand values, the authors' code (official_compat), the KL hinge."""

from __future__ import annotations

import math

import pytest
import torch
from loss_reference import (
    CASE_A_GIDS,
    CASE_A_K,
    CASE_A_REWARDS,
    DT,
    LN2,
    case_a,
    case_b,
    grad_of,
    random_case,
    token_rows,
)

from nemo_disco import losses


def test_disco_logl_hand_values() -> None:
    lp, old, mask = case_a(same_old=True)
    loss, m = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, tau=1.0)
    # term_7 = s_a - tau log((e^{s_b/tau} + e^{s_c/tau}) / 2) = -1 - log((e^-2 + e^-4) / 2) = 1.5662191695
    # J = (term_7 + 0) / Q = 1.5662191695 / 2; KL = 0 -> no penalty; loss = -J.
    term = -1 - math.log((math.exp(-2) + math.exp(-4)) / 2)
    assert term == pytest.approx(1.5662191695169727, abs=1e-12)
    assert loss.item() == pytest.approx(-term / 2, abs=1e-12)
    assert m["objective"] == pytest.approx(term / 2, abs=1e-12)
    assert m["kl"] == 0.0 and m["penalty"] == 0.0 and m["constraint_active"] == 0.0
    # Question metrics: 2 questions; question 3 has no negative; p = (1/3 + 2/2) / 2 = 2/3.
    assert m["questions"] == 2 and m["no_positive"] == 0 and m["no_negative"] == 1
    assert m["no_negative_share"] == 0.5 and m["zero_variance_share"] == 0.5
    assert m["p_mean"] == pytest.approx(2 / 3, abs=1e-12)
    # Positive scores -1 (d), -1 (a), -0.5 (e): mean -5/6; negatives -2, -4: mean -3.
    assert m["score_pos_mean"] == pytest.approx(-5 / 6, abs=1e-12)
    assert m["score_neg_mean"] == pytest.approx(-3.0, abs=1e-12)
    # Gradient: dJ/ds_a = 1/Q = 0.5, ds_a/dlp_a,t = 1/2 -> dloss/dlp_a,t = -0.25.
    # dJ/ds_b = -(1/Q) softmax_b = -0.5 e^-2 / (e^-2 + e^-4) (1 token) -> dloss/dlp_b = +0.5 * 0.8807970780.
    # s_c: softmax_c = e^-4 / (e^-2 + e^-4) = 0.1192029220, 2 tokens -> dloss/dlp_c,t = 0.5 * 0.1192029220 / 2.
    g = grad_of(loss, lp)
    soft_b = math.exp(-2) / (math.exp(-2) + math.exp(-4))
    assert soft_b == pytest.approx(0.8807970779778823, abs=1e-12)
    expected = torch.tensor(
        [[0, 0], [-0.25, -0.25], [0.5 * soft_b, 0], [0, 0], [0.25 * (1 - soft_b), 0.25 * (1 - soft_b)]], dtype=DT
    )
    torch.testing.assert_close(g, expected, atol=1e-12, rtol=0)


def test_disco_logl_default_tau_with_active_constraint() -> None:
    lp, old, mask = case_a()
    loss, m = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS)
    # tau = 10: term_7 = -1 - 10 log((e^-0.2 + e^-0.4) / 2) = 1.9500831118; J = 0.9750415559.
    # K = 0.0625 > delta: penalty = 1e3 (0.0625 - 1e-4)^2 = 1e3 * 0.0624^2 = 3.89376.
    J = (-1 - 10 * math.log((math.exp(-0.2) + math.exp(-0.4)) / 2)) / 2
    assert J == pytest.approx(0.9750415558917671, abs=1e-12)
    assert m["kl"] == pytest.approx(CASE_A_K, abs=1e-15)
    assert m["penalty"] == pytest.approx(3.89376, abs=1e-10)
    assert m["constraint_active"] == 1.0
    assert loss.item() == pytest.approx(-J + 3.89376, abs=1e-10)


def test_disco_official_compat_hand_values() -> None:
    lp, old, mask = case_a()
    loss, m = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, tau=1.0, official_compat=True)
    # log-SUM-exp: term_7 = -1 - log(e^-2 + e^-4) = 1.5662191695 - log 2 = 0.8730719889; J = term / 2.
    # penalty as the code computes it: max(beta (K - delta), 0) * K = 1e3 * 0.0624 * 0.0625 = 3.9.
    term = -1 - math.log(math.exp(-2) + math.exp(-4))
    assert term == pytest.approx(1.5662191695169727 - LN2, abs=1e-12)
    assert m["penalty"] == pytest.approx(3.9, abs=1e-10)
    assert loss.item() == pytest.approx(-term / 2 + 3.9, abs=1e-10)


def test_disco_divisor_valid_hand_value() -> None:
    lp, old, mask = case_a(same_old=True)
    loss, _ = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, tau=1.0, divisor="valid")
    # Only question 7 has a positive and a negative: J = term_7 / 1 = 1.5662191695.
    assert loss.item() == pytest.approx(-1.5662191695169727, abs=1e-12)


def test_discob_logl_hand_values() -> None:
    lp, old, mask = case_a()
    fn = losses.get_loss("discob")
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS)
    # term_7 = s_a - mean(s_b, s_c) = -1 - (-2 - 4) / 2 = 2; J = 2 / Q = 1; penalty 3.89376 (as above).
    assert m["objective"] == pytest.approx(1.0, abs=1e-12)
    assert loss.item() == pytest.approx(-1.0 + 3.89376, abs=1e-10)
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, official_compat=True, divisor="valid")
    # divisor "valid": J = 2 / 1; penalty as the code: 1e3 * 0.0624 * 0.0625 = 3.9.
    assert loss.item() == pytest.approx(-2.0 + 3.9, abs=1e-10)


# Case D (DRPO): one question, positives p1 [-1] (L = 1, s = -1) and p2 [-2, -2] (L = 2, s = -2), negative n [-3]
# (s = -3); old = new; tau = 1, L_max = 4, lambda = 0.5:
#   u_1 = exp((1 - 1/4) / 0.5) = e^1.5,  u_2 = exp((1 - 2/4) / 0.5) = e^1
#   -> a_1 = u_1 / (u_1 + u_2) = 1 / (1 + e^-0.5)
#   term = a_1 s_1 + (1 - a_1) s_2 - tau log(exp(s_n / tau)) = -2 + a_1 + 3 = 1 + a_1;  Q = 1.


def test_drpo_hand_values() -> None:
    lp, mask = token_rows([-1.0], [-2.0, -2.0], [-3.0])
    lp.requires_grad_(True)
    gids, rewards = torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 0.0], dtype=DT)
    fn = losses.get_loss("drpo", tau=1.0, drpo_lambda=0.5, max_response_tokens=4)
    loss, m = fn(lp, lp.detach(), mask, gids, rewards)
    a1 = 1 / (1 + math.exp(-0.5))
    assert a1 == pytest.approx(0.6224593312018546, abs=1e-15)
    assert loss.item() == pytest.approx(-(1 + a1), abs=1e-12)
    assert m["objective"] == pytest.approx(1 + a1, abs=1e-12) and m["kl"] == 0.0 and m["penalty"] == 0.0
    # dloss/dlp: p1 -a_1 (1 token); p2 -(1 - a_1) / 2 on each of its 2 tokens; n: -(-1) x softmax 1 = +1.
    expected = torch.tensor([[-a1, 0.0], [-(1 - a1) / 2, -(1 - a1) / 2], [1.0, 0.0]], dtype=DT)
    torch.testing.assert_close(grad_of(loss, lp), expected, atol=1e-12, rtol=0)
    # DisCO weights the two positives equally: term = (-1 - 2) / 2 + 3 = 1.5.
    disco, _ = losses.get_loss("disco", tau=1.0)(lp, lp.detach(), mask, gids, rewards)
    assert disco.item() == pytest.approx(-1.5, abs=1e-12)


@pytest.mark.parametrize("hp", [{}, {"score": "lratio", "tau": 1.0, "kl": "k3"}, {"official_compat": True}])
@pytest.mark.parametrize("weighted", [False, True])
def test_drpo_with_large_lambda_is_disco(hp: dict, weighted: bool) -> None:
    c = random_case(4)
    w = torch.rand(len(c["gids"]), generator=torch.Generator().manual_seed(5), dtype=DT) + 0.5 if weighted else None
    args = (c["lp"], c["old"], c["mask"], c["gids"], c["rewards"])
    disco, dm = losses.get_loss("disco", **hp)(*args, weights=w)
    drpo, rm = losses.get_loss("drpo", drpo_lambda=1e12, max_response_tokens=8, **hp)(*args, weights=w)
    assert drpo.item() == pytest.approx(disco.item(), abs=1e-10) and rm["objective"] == pytest.approx(dm["objective"])
    torch.testing.assert_close(grad_of(drpo, c["lp"]), grad_of(disco, c["lp"]), atol=1e-10, rtol=0)
    # At the default lambda the lengths (1 to 7 tokens of a budget of 8) change the objective.
    short, _ = losses.get_loss("drpo", max_response_tokens=8, **hp)(*args, weights=w)
    assert abs(short.item() - disco.item()) > 1e-3


def test_drpo_small_lambda_stays_finite() -> None:
    # lambda = 1e-4: exp((1 - L / L_max) / lambda) overflows float64 unshifted; the shortest positive takes all.
    c = random_case(6)
    loss, _ = losses.get_loss("drpo", drpo_lambda=1e-4, max_response_tokens=8)(
        c["lp"], c["old"], c["mask"], c["gids"], c["rewards"]
    )
    assert math.isfinite(loss.item()) and torch.isfinite(grad_of(loss, c["lp"])).all()


def test_disco_lratio_hand_values() -> None:
    lp, old, mask = case_b()
    fn = losses.get_loss("disco")
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, score="lratio", tau=1.0)
    # term_7 = 1.5 - log((e^0.5 + e^1) / 2) = 0.7190701964; J = term / 2.
    # k1 KL: old - new = -ln 2 (a) + ln 2 (b) = 0 -> K = 0, no penalty.
    term = 1.5 - math.log((math.exp(0.5) + math.exp(1.0)) / 2)
    assert term == pytest.approx(0.7190701963798386, abs=1e-12)
    assert m["kl"] == pytest.approx(0.0, abs=1e-15)
    assert loss.item() == pytest.approx(-term / 2, abs=1e-12)
    assert m["lratio_clamped"] == 0.0
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, score="lratio", tau=1.0, kl="k3")
    # k3 = rho - 1 - log rho: a: 2 - 1 - ln 2 = 0.3068528194, b: 0.5 - 1 + ln 2 = 0.1931471806; sum = 0.5
    # -> K = 0.5 / 8 = 0.0625, penalty 3.89376.
    assert m["kl"] == pytest.approx(0.0625, abs=1e-15)
    assert loss.item() == pytest.approx(-term / 2 + 3.89376, abs=1e-10)


def test_discob_lratio_hand_value() -> None:
    lp, old, mask = case_b()
    loss, m = losses.get_loss("discob")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, score="lratio")
    # term_7 = 1.5 - (0.5 + 1) / 2 = 0.75; J = 0.75 / 2 = 0.375; K = 0.
    assert loss.item() == pytest.approx(-0.375, abs=1e-12)
    assert m["score_pos_mean"] == pytest.approx((1 + 1.5 + 1) / 3, abs=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# The authors' code and the constraint.


def _authors_loss(score: str, lp, old, mask, gids, rewards, *, tau: float, beta: float, delta: float, basic: bool):
    """The authors' core_algos.py loss (docs/departures.md): k1 KL, reward == 1 / == 0, divisor = all ids."""
    m = mask.to(DT)
    lp0, old0 = torch.where(mask, lp, 0.0), torch.where(mask, old, 0.0)
    K = ((old0 - lp0) * m).sum() / m.sum()
    if score == "logl":
        s = (lp0 * m).sum(1) / m.sum(1)
    else:
        s = (torch.exp(lp0 - old0) * m).sum(1) / m.sum(1)
    ids = sorted({int(g) for g in gids})
    total = lp.new_zeros(())
    for q in ids:
        rows = gids == q
        pos, neg = s[rows & (rewards == 1)], s[rows & (rewards == 0)]
        if len(pos) == 0 or len(neg) == 0:
            continue  # masked out of the sum, still counted in Q
        if basic:
            total = total + (pos - neg.mean()).mean()
        else:
            S = torch.exp(neg / tau).sum()
            total = total + pos.mean() - tau * S / S.detach()  # value ~ 1; gradient = that of tau log S
    J = total / len(ids)
    return -J + torch.clamp(beta * (K - delta), min=0).detach() * K, K


@pytest.mark.parametrize("name", ["disco", "discob"])
@pytest.mark.parametrize("score", ["logl", "lratio"])
def test_official_compat_gradient_matches_authors_code(name: str, score: str) -> None:
    c = random_case(11)
    tau = 10.0 if score == "logl" else 1.0
    hp = {"score": score, "official_compat": True, **({"tau": tau} if name == "disco" else {})}
    loss, m = losses.get_loss(name)(c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], **hp)
    code_loss, K = _authors_loss(
        score,
        c["lp"],
        c["old"],
        c["mask"],
        c["gids"],
        c["rewards"],
        tau=tau,
        beta=1e3,
        delta=1e-4,
        basic=name == "discob",
    )
    assert m["constraint_active"] == 1.0
    torch.testing.assert_close(grad_of(loss, c["lp"]), grad_of(code_loss, c["lp"]), atol=1e-10, rtol=0)
    # Values: the penalty is the code's; the objective is the TRUE log-sum-exp value, not the code's ~1 surrogate.
    assert m["penalty"] == pytest.approx((torch.clamp(1e3 * (K - 1e-4), min=0) * K).item(), abs=1e-10)
    if name == "discob":
        assert loss.item() == pytest.approx(code_loss.item(), abs=1e-10)


@pytest.mark.parametrize("official", [False, True])
@pytest.mark.parametrize("kl", ["k1", "k3"])
@pytest.mark.parametrize("regime", ["active", "inactive"])
def test_penalty_gradient(regime: str, kl: str, official: bool) -> None:
    c = random_case(4, regime=regime)
    fn = losses.get_loss("disco")
    args = (c["lp"], c["old"], c["mask"], c["gids"], c["rewards"])
    loss, m = fn(*args, kl=kl, official_compat=official)
    objective_only, _ = fn(*args, kl=kl, official_compat=official, beta=0.0)
    g_penalty = grad_of(loss, c["lp"]) - grad_of(objective_only, c["lp"])
    # K written out: token mean over the valid tokens of k1 = old - new or k3 = rho - 1 - log rho.
    d = torch.where(c["mask"], c["lp"] - c["old"], 0.0)
    per_token = -d if kl == "k1" else torch.expm1(d) - d
    K = per_token.sum() / c["mask"].sum()
    assert m["kl"] == pytest.approx(K.item(), abs=1e-12)
    if regime == "inactive":
        assert K.item() <= 1e-4 and m["constraint_active"] == 0.0 and m["penalty"] == 0.0
        assert g_penalty.abs().max() == 0.0
    else:
        assert K.item() > 1e-4 and m["constraint_active"] == 1.0
        factor = (1.0 if official else 2.0) * 1e3 * (K.item() - 1e-4)  # eq. 9 / alg. 1: G2 = 2 beta [K - delta]+ dK
        torch.testing.assert_close(g_penalty, factor * grad_of(K, c["lp"]), atol=1e-10, rtol=0)
