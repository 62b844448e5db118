"""The DisCO paper's view of the baselines (arXiv 2505.12366 §4, app. B.1-B.3, tab. 6) checked on our losses.

With binary rewards, a question q with success rate p = p(q) contributes ``omega(p) * (E+[s+] - E-[s-])`` to each
group-relative objective: a question-level weight times the difference between the mean score of its positive
and of its negative rollouts (eq. 4 for GRPO). Questions with p in {0, 1} contribute 0. For a mini-batch of Q
questions with G rollouts each, every objective below is ``J = (1/Q) sum_q omega(p_q) (mean_pos s+ - mean_neg s-)``:

==========  ================================  ======================================================
loss        omega(p)                          s+ / s- of a rollout o (rho_t = pi_theta / pi_old)
==========  ================================  ======================================================
grpo        sqrt(p(1-p))                      token MEAN of min(rho, clip(rho)) / of max(rho, clip(rho))
dr_grpo     p(1-p)                            token SUM of the same, / max_response_tokens
dapo        sqrt(p(1-p))                      token SUM with clip-higher, / mean length of the mini-batch
gpg         alpha p(1-p), alpha = B / (B-M)   token SUM of log pi_theta, / mean length of q's rollouts
                                              (``token_norm="batch"``: of the mini-batch's rollouts)
grpo_rw     1                                 as grpo (eq. 6)
discob      1                                 token mean of log pi_theta (log-L, eq. 7; identity surrogate)
==========  ================================  ======================================================

GRPO's weight carries its advantage epsilon: ``p(1-p) / (sqrt(p(1-p)) + 1e-6)``. The weights of GRPO, GRPO_RW and
Dr. GRPO are the ones the paper states (§4, eq. 4 and 6; app. B.3); DAPO keeps GRPO's std normalisation, hence its
weight. Table 6's own typography was not at hand when this was written: its DAPO and GPG rows are derived here
the same way from their definitions (DAPO paper eq. 8, token-level sum; GPG eq. 5-8: F_norm = 1 gives Dr. GRPO's
p(1-p), eq. 8 multiplies the whole batch by alpha), and the score normalisers are those our implementations use.
Every check below computes the scores with python loops from these formulas and compares with the library's
objective.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_disco import losses

DT = torch.float64
G = 4  # rollouts per question
EPS = 1e-6


def _omega(name: str, p: float, alpha: float) -> float:
    v = p * (1 - p)
    return {
        "grpo": v / (math.sqrt(v) + EPS),
        "dapo": v / (math.sqrt(v) + EPS),
        "dr_grpo": v,
        "gpg": alpha * v,
        "grpo_rw": 1.0 if 0 < p < 1 else 0.0,
        "discob": 1.0 if 0 < p < 1 else 0.0,
    }[name]


def _score(name: str, lp, old, mask, i: int, sign: int, norm: float, hp: dict) -> torch.Tensor:
    """s+ (sign 1) or s- (sign -1) of rollout i as tab. 6 defines it, with python loops over its tokens."""
    toks = [t for t in range(mask.shape[1]) if bool(mask[i, t])]
    if name in ("gpg", "discob"):
        total = sum(lp[i, t] for t in toks)
        return total / len(toks) if name == "discob" else total / norm
    lo = 1 - hp.get("clip_eps", 0.2)
    hi = 1 + hp.get("clip_eps_high", 0.28 if name == "dapo" else hp.get("clip_eps", 0.2))
    vals = []
    for t in toks:
        rho = torch.exp(lp[i, t] - old[i, t])
        clipped = torch.clamp(rho, lo, hi)
        vals.append(torch.minimum(rho, clipped) if sign > 0 else torch.maximum(rho, clipped))
    if name in ("grpo", "grpo_rw"):
        return sum(vals) / len(vals)
    return sum(vals) / norm  # dr_grpo: max_response_tokens; dapo: the mini-batch's mean length


def tab6_objective(name: str, lp, old, mask, gids, rewards, hp: dict) -> float:
    """J = (1/Q) sum_q omega(p_q) (mean_pos s+ - mean_neg s-) for equal group sizes."""
    questions = sorted({int(g) for g in gids})
    lengths = mask.sum(1).to(DT)
    N = len(gids)
    members = {q: [i for i in range(N) if int(gids[i]) == q] for q in questions}
    M = sum(len(r) for r in members.values() if len({float(rewards[i]) for i in r}) == 1)
    alpha = N / (N - M) if M < N else 1.0
    total = 0.0
    for rows in members.values():
        pos = [i for i in rows if float(rewards[i]) > 0.5]
        neg = [i for i in rows if float(rewards[i]) <= 0.5]
        if not pos or not neg:
            continue  # p in {0, 1}: omega = 0 for the GRPO family; no positive/negative mean otherwise
        p = len(pos) / len(rows)
        if name == "dr_grpo":
            norm = float(hp["max_response_tokens"])
        elif name == "dapo" or (name == "gpg" and hp.get("token_norm") == "batch"):
            norm = float(lengths.sum()) / N  # mean response length of the mini-batch
        else:
            norm = float(lengths[rows].sum()) / len(rows)  # GPG: mean response length of q's rollouts
        s_pos = sum(_score(name, lp, old, mask, i, 1, norm, hp) for i in pos) / len(pos)
        s_neg = sum(_score(name, lp, old, mask, i, -1, norm, hp) for i in neg) / len(neg)
        total += _omega(name, p, alpha) * float(s_pos - s_neg)
    return total / len(questions)


def _batch(seed: int, correct: list[int], t_max: int = 6):
    """len(correct) questions of G rollouts with correct[q] positives each, random lengths and log-probs."""
    g = torch.Generator().manual_seed(seed)
    gids = torch.tensor([q for q in range(len(correct)) for _ in range(G)])
    rewards = torch.tensor([float(k < c) for c in correct for k in range(G)], dtype=DT)
    perm = torch.randperm(len(gids), generator=g)
    gids, rewards = gids[perm], rewards[perm]
    lengths = torch.randint(1, t_max + 1, (len(gids),), generator=g)
    mask = torch.arange(t_max)[None, :] < lengths[:, None]
    old = -(torch.rand(len(gids), t_max, generator=g, dtype=DT) * 2 + 0.05)
    lp = old + 0.3 * torch.randn(len(gids), t_max, generator=g, dtype=DT)  # ratios on both sides of the clip range
    return torch.where(mask, lp, -math.inf), torch.where(mask, old, math.nan), mask, gids, rewards


CASES = [
    ("grpo", {}),
    ("grpo", {"clip_eps_high": 0.28}),
    ("dr_grpo", {"max_response_tokens": 16}),
    ("dapo", {}),
    ("gpg", {}),
    ("gpg", {"token_norm": "batch"}),
    ("grpo_rw", {}),
    ("discob", {}),
]


@pytest.mark.parametrize(("name", "hp"), CASES, ids=[f"{n}-{hp}" for n, hp in CASES])
@pytest.mark.parametrize("correct", [[1, 2, 3, 0, 4, 2], [1, 1, 3], [2, 4, 4, 0]])
def test_objective_is_the_question_weighted_score_difference(name: str, hp: dict, correct: list[int]) -> None:
    lp, old, mask, gids, rewards = _batch(seed=sum(correct) + len(name), correct=correct)
    _, m = losses.get_loss(name, **hp)(lp, old, mask, gids, rewards, **hp)
    expected = tab6_objective(name, lp, old, mask, gids, rewards, hp)
    assert m["objective"] == pytest.approx(expected, abs=1e-12)
    assert abs(expected) > 1e-4  # the case exercises the weights


def test_weights_by_hand() -> None:
    # p = 1/4: sqrt(3/16) = 0.4330127019, p(1 - p) = 3/16 = 0.1875; p = 1/2: 0.5 and 0.25; p in {0, 1}: 0.
    assert _omega("grpo", 0.25, 1.0) == pytest.approx(0.4330127019, abs=1e-5)
    assert _omega("dr_grpo", 0.25, 1.0) == 0.1875 and _omega("dr_grpo", 0.5, 1.0) == 0.25
    assert _omega("gpg", 0.5, 5 / 3) == pytest.approx(0.25 * 5 / 3)
    # GRPO's weight is largest at p = 1/2 and vanishes at 0 and 1 (the difficulty bias, §4).
    ps = [k / 8 for k in range(9)]
    w = [_omega("grpo", p, 1.0) for p in ps]
    assert max(w) == w[4] and w[0] == w[8] == 0.0


# One question, G = 4 one-token rollouts, 1 correct (p = 1/4): a (correct) rho 1.5, b 0.5, c 1.0, d 1.1
# (wrong); log pi_theta = -1, -2, -3, -4.
HAND_LP = torch.tensor([[-1.0], [-2.0], [-3.0], [-4.0]], dtype=DT)
HAND_RHO = torch.tensor([[1.5], [0.5], [1.0], [1.1]], dtype=DT)
HAND_GIDS = torch.zeros(4, dtype=torch.long)
HAND_REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=DT)
SIGMA = math.sqrt(3 / 16)  # population std of {1, 0, 0, 0}


@pytest.mark.parametrize(
    ("name", "hp", "value"),
    [
        # GRPO, clip [0.8, 1.2]: s+(a) = min(1.5, 1.2) = 1.2; s-: max(0.5, 0.8) = 0.8, 1.0, 1.1 -> mean 2.9/3.
        # omega = 0.1875 / (0.4330127019 + 1e-6); J = omega (1.2 - 2.9/3) = omega x 0.2333333333.
        ("grpo", {}, 0.1875 / (SIGMA + EPS) * (1.2 - 2.9 / 3)),
        # Dr. GRPO with max_response_tokens 4: omega 0.1875, scores / 4 -> 0.1875 x 0.2333333333 / 4 = 0.0109375.
        ("dr_grpo", {"max_response_tokens": 4}, 0.0109375),
        # DAPO, clip [0.8, 1.28]: s+(a) = 1.28; s- as GRPO; mean length 1 -> omega (1.28 - 2.9/3).
        ("dapo", {}, 0.1875 / (SIGMA + EPS) * (1.28 - 2.9 / 3)),
        # GPG: M = 0 so alpha = 1; omega = 0.1875; s = log pi / 1: -1 vs mean(-2, -3, -4) = -3 -> 0.1875 x 2 = 0.375.
        ("gpg", {}, 0.375),
    ],
)
def test_single_question_by_hand(name: str, hp: dict, value: float) -> None:
    old = HAND_LP - torch.log(HAND_RHO)
    mask = torch.ones(4, 1, dtype=torch.bool)
    _, m = losses.get_loss(name, **hp)(HAND_LP, old, mask, HAND_GIDS, HAND_REWARDS, **hp)
    assert m["objective"] == pytest.approx(value, abs=1e-12)
    assert tab6_objective(name, HAND_LP, old, mask, HAND_GIDS, HAND_REWARDS, hp) == pytest.approx(value, abs=1e-12)
