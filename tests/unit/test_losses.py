"""nemo_disco.losses: hand-computed values, gradients against a naive per-question loop, micro-batch invariance.

Everything runs in float64 on CPU. The naive reference below is written from the paper's formulas (eq. 5-10,
alg. 1) and the GRPO / Dr. GRPO / DAPO definitions with python loops over questions and tokens; it shares no
code with the library.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from nemo_disco import config as config_lib
from nemo_disco import losses
from nemo_disco.config import ConfigError, LossConfig

DT = torch.float64
LN2, LN15, LN05 = math.log(2.0), math.log(1.5), math.log(0.5)

# ----------------------------------------------------------------------------------------------------------------------
# Naive reference (python loops; per-positive / pairwise forms of the paper's equations).

NAIVE_DEFAULTS = {
    "positive_threshold": 0.5,
    "kl": "k1",
    "max_log_ratio": 20.0,
    "score": "logl",
    "tau": 10.0,
    "delta": 1e-4,
    "beta": 1e3,
    "official_compat": False,
    "divisor": "all",
    "clip_eps": 0.2,
    "clip_eps_high": None,
    "kl_coef": 0.0,
    "entropy_coef": 1e-3,
    "max_response_tokens": 8192,
    "adv_std_norm": False,
    "alpha_correction": True,
    "token_norm": "question",
    "trpa_beta": 0.1,
    "trpa_anisotropy": 2.5,
    "tr_kl_coef": 1e-3,
    "drpo_lambda": 0.1,
}


def _tokens(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


def _clamp(x: torch.Tensor, bound: float) -> torch.Tensor:
    return torch.clamp(x, -bound, bound)


def naive(name, lp, old, mask, gids, rewards, *, entropy=None, ref=None, weights=None, **hp):
    """(loss, objective J, KL K) by loops over questions, rollouts and tokens."""
    h = {**NAIVE_DEFAULTS, **({"clip_eps_high": 0.28} if name == "dapo" else {}), **hp}
    N = lp.shape[0]
    M = h["max_log_ratio"]
    w = [1.0 if weights is None else weights[i] for i in range(N)]
    toks = [_tokens(mask, i) for i in range(N)]
    total_tokens = sum(len(t) for t in toks)
    questions = sorted({int(g) for g in gids})
    members = {q: [i for i in range(N) if int(gids[i]) == q] for q in questions}
    positive = [float(rewards[i]) > h["positive_threshold"] for i in range(N)]

    # KL(pi_old || pi_theta), token mean over the whole mini-batch.
    kl_terms = []
    for i in range(N):
        for t in toks[i]:
            if h["kl"] == "k1":
                kl_terms.append(old[i, t] - lp[i, t])
            else:
                d = _clamp(lp[i, t] - old[i, t], M)
                kl_terms.append(torch.exp(d) - 1 - d)
    K = sum(kl_terms) / total_tokens if kl_terms else lp.new_zeros(())

    if name in ("disco", "discob", "drpo"):
        s = []
        for i in range(N):
            if not toks[i]:
                s.append(lp.new_zeros(()))
            elif h["score"] == "logl":
                s.append(sum(lp[i, t] for t in toks[i]) / len(toks[i]))
            else:
                s.append(sum(torch.exp(_clamp(lp[i, t] - old[i, t], M)) for t in toks[i]) / len(toks[i]))
        total, n_valid = lp.new_zeros(()), 0
        tau = h.get("tau")
        for q in questions:
            P = [i for i in members[q] if positive[i]]
            Ng = [j for j in members[q] if not positive[j]]
            if not P or not Ng:
                continue
            n_valid += 1
            wp, wn = sum(w[i] for i in P), sum(w[j] for j in Ng)
            if name in ("disco", "drpo"):
                # eq. 10 per positive: -tau log mean_j exp((s_j - s_i) / tau), weighted means. DRPO: each positive
                # also weighted by exp((1 - L_i / L_max) / lambda), normalised over the question's positives.
                u = {i: w[i] for i in P}
                if name == "drpo":
                    L_max, lam = h["max_response_tokens"], h["drpo_lambda"]
                    u = {i: w[i] * math.exp((1 - len(toks[i]) / L_max) / lam) for i in P}
                term = lp.new_zeros(())
                for i in P:
                    inner = sum(w[j] * torch.exp((s[j] - s[i]) / tau) for j in Ng) / wn
                    if h["official_compat"]:
                        inner = inner * len(Ng)  # log-SUM-exp
                    term = term + u[i] * (-tau * torch.log(inner))
                total = total + term / sum(u.values())
            else:
                # eq. 7 with the identity surrogate: pairwise mean of s_i - s_j.
                pair = sum(w[i] * w[j] * (s[i] - s[j]) for i in P for j in Ng)
                total = total + pair / (wp * wn)
        div = len(questions) if h["divisor"] == "all" else max(n_valid, 1)
        J = total / div
        if h["official_compat"]:
            penalty = torch.clamp(h["beta"] * (K - h["delta"]), min=0).detach() * K
        else:
            penalty = h["beta"] * torch.clamp(K - h["delta"], min=0) ** 2
        return -J + penalty, J, K

    if name == "gpg":
        # eq. 6: A_i = (r_i - mean_q r) / F_norm; eq. 5: sum_i A_i sum_t log pi / (the question's tokens), mean over
        # questions (or / all tokens); eq. 7-8: times B / (B - M), M = rollouts of questions with equal rewards.
        adv, zero_var = {}, 0
        for q in questions:
            r = [float(rewards[i]) for i in members[q]]
            mean = sum(r) / len(r)
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
            zero_var += len(r) if max(r) == min(r) else 0
            for i in members[q]:
                adv[i] = (float(rewards[i]) - mean) / ((std + 1e-6) if h["adv_std_norm"] else 1.0)
        logp_sum = [sum((lp[i, t] for t in toks[i]), lp.new_zeros(())) for i in range(N)]
        if h["token_norm"] == "question":
            J = lp.new_zeros(())
            for q in questions:
                t_q = max(sum(len(toks[i]) for i in members[q]), 1)
                J = J + sum(w[i] * adv[i] * logp_sum[i] for i in members[q]) / t_q
            J = J / len(questions)
        else:
            J = sum(w[i] * adv[i] * logp_sum[i] for i in range(N)) / total_tokens
        if h["alpha_correction"] and zero_var < N:
            J = J * N / (N - zero_var)
        return -J, J, K

    if name == "trpa":
        # Pairs (winner, loser) of one question with a higher / lower reward; h = token mean of log pi - log pi_ref;
        # beta x anisotropy when the winner is correct. Trust region: token mean of e^x - x - 1, x = old - new.
        hv = [sum(lp[i, t] - ref[i, t] for t in toks[i]) / max(len(toks[i]), 1) for i in range(N)]
        total, pairs = lp.new_zeros(()), 0
        for q in questions:
            for i in members[q]:
                for j in members[q]:
                    if float(rewards[i]) > float(rewards[j]):
                        b = h["trpa_beta"] * (h["trpa_anisotropy"] if positive[i] else 1.0)
                        total = total + w[i] * w[j] * -torch.log1p(torch.exp(-b * (hv[i] - hv[j])))
                        pairs += 1
        J = total / max(pairs, 1)
        tr = lp.new_zeros(())
        for i in range(N):
            for t in toks[i]:
                x = _clamp(old[i, t] - lp[i, t], M)
                tr = tr + torch.exp(x) - x - 1
        return -J + h["tr_kl_coef"] * tr / total_tokens, J, K

    lo = 1 - h["clip_eps"]
    hi = 1 + (h["clip_eps"] if h["clip_eps_high"] is None else h["clip_eps_high"])

    def rho(i, t):
        return torch.exp(_clamp(lp[i, t] - old[i, t], M))

    def ref_k3(i, t):
        x = _clamp(ref[i, t] - lp[i, t], M)
        return torch.exp(x) - x - 1

    if name == "grpo_rw":
        total, n_valid = lp.new_zeros(()), 0
        for q in questions:
            P = [i for i in members[q] if positive[i]]
            Ng = [j for j in members[q] if not positive[j]]
            if not P or not Ng:
                continue
            n_valid += 1

            def fmean(i, fn):
                return sum(fn(rho(i, t), torch.clamp(rho(i, t), lo, hi)) for t in toks[i]) / max(len(toks[i]), 1)

            f_pos = sum(w[i] * fmean(i, torch.minimum) for i in P) / sum(w[i] for i in P)
            f_neg = sum(w[j] * fmean(j, torch.maximum) for j in Ng) / sum(w[j] for j in Ng)
            total = total + f_pos - f_neg
        J = total / (len(questions) if h["divisor"] == "all" else max(n_valid, 1))
        reg = lp.new_zeros(())
        if h["kl_coef"] > 0:
            for i in range(N):
                if toks[i]:
                    reg = reg + w[i] * sum(ref_k3(i, t) for t in toks[i]) / len(toks[i])
            reg = h["kl_coef"] * reg / N
        return -J + reg, J, K

    # Advantages: GRPO / DAPO normalise by the population std, Dr. GRPO only centres.
    adv = [0.0] * N
    for q in questions:
        r = [float(rewards[i]) for i in members[q]]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
        for i in members[q]:
            a = float(rewards[i]) - mean
            adv[i] = a if name == "dr_grpo" else a / (std + 1e-6)
    token_terms = [
        [torch.minimum(rho(i, t) * adv[i], torch.clamp(rho(i, t), lo, hi) * adv[i]) for t in toks[i]] for i in range(N)
    ]
    reg = lp.new_zeros(())
    if name == "dapo":
        J = sum(w[i] * x for i in range(N) for x in token_terms[i]) / total_tokens
    elif name == "dr_grpo":
        L = h["max_response_tokens"]
        J = sum(w[i] * sum(token_terms[i]) / L for i in range(N) if toks[i]) / N
        if h["kl_coef"] > 0:
            reg = h["kl_coef"] * sum(w[i] * sum(ref_k3(i, t) for t in toks[i]) / L for i in range(N) if toks[i]) / N
    else:  # grpo, grpo_er
        J = sum(w[i] * sum(token_terms[i]) / len(toks[i]) for i in range(N) if toks[i]) / N
        if h["kl_coef"] > 0:
            reg = (
                h["kl_coef"]
                * sum(w[i] * sum(ref_k3(i, t) for t in toks[i]) / len(toks[i]) for i in range(N) if toks[i])
                / N
            )
    loss = -J + reg
    if name == "grpo_er":
        H = sum(entropy[i, t] for i in range(N) for t in toks[i]) / total_tokens
        loss = loss - h["entropy_coef"] * H
    return loss, J, K


# ----------------------------------------------------------------------------------------------------------------------
# Cases.

# (question id, rewards in {0, 1}) - uneven sizes, a singleton, all-correct and all-wrong questions.
GROUPS = [(11, [1, 0, 0]), (5, [1, 1]), (42, [0, 0, 0, 0]), (7, [1, 0, 1, 1, 0]), (3, [1]), (19, [0, 1, 0, 0])]
T_MAX = 7


def _layout(seed: int, reward_kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Shuffled group ids, rewards and a right-padded mask with two 1-token rows."""
    g = torch.Generator().manual_seed(seed)
    gids = torch.tensor([q for q, rs in GROUPS for _ in rs])
    r01 = torch.tensor([float(x) for _, rs in GROUPS for x in rs], dtype=DT)
    perm = torch.randperm(len(gids), generator=g)
    gids, r01 = gids[perm], r01[perm]
    rewards, threshold = (r01, 0.5) if reward_kind == "01" else (2 * r01 - 1, 0.0)
    lengths = torch.randint(1, T_MAX + 1, (len(gids),), generator=g)
    lengths[:2] = 1  # nearly empty rows
    mask = torch.arange(T_MAX)[None, :] < lengths[:, None]
    return gids, rewards, mask, threshold


# (spread, shift) of logp - old_logp: "active" puts KL(old || new) far above delta = 1e-4 for k1 and k3 and
# ratios on both sides of the clip range; "inactive" keeps it far below.
SPREADS = {"active": (0.3, -0.15), "inactive": (1e-4, 0.0)}


def random_case(seed: int, reward_kind: str = "01", regime: str = "active") -> dict:
    """Log-probs as free leaves; padding holds -inf / nan so any leak shows."""
    gids, rewards, mask, threshold = _layout(seed, reward_kind)
    g = torch.Generator().manual_seed(seed + 1000)
    N = len(gids)
    old = -(torch.rand(N, T_MAX, generator=g, dtype=DT) * 2 + 0.05)
    spread, shift = SPREADS[regime]
    lp = old + spread * torch.randn(N, T_MAX, generator=g, dtype=DT) + shift
    ref = old + 0.2 * torch.randn(N, T_MAX, generator=g, dtype=DT)
    entropy = torch.rand(N, T_MAX, generator=g, dtype=DT) * 2
    lp = torch.where(mask, lp, -math.inf).requires_grad_(True)
    nan = torch.tensor(math.nan, dtype=DT)
    return {
        "lp": lp,
        "old": torch.where(mask, old, nan),
        "ref": torch.where(mask, ref, nan),
        "entropy": torch.where(mask, entropy, nan),
        "mask": mask,
        "gids": gids,
        "rewards": rewards,
        "threshold": threshold,
    }


class TinyPolicy:
    """Shared parameters W [D, V]: every rollout's log-probs depend on all of W (like a real model)."""

    def __init__(self, seed: int, n: int, t: int, spread: float = 0.15, d: int = 5, v: int = 11) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, t, d, generator=g, dtype=DT)
        self.y = torch.randint(v, (n, t), generator=g)
        w0 = 0.5 * torch.randn(d, v, generator=g, dtype=DT)
        self.w = (w0 + spread * torch.randn(d, v, generator=g, dtype=DT)).requires_grad_(True)
        self.old = self._logits(w0, slice(None), t).log_softmax(-1).gather(-1, self.y[..., None]).squeeze(-1)
        w_ref = w0 + 0.1 * torch.randn(d, v, generator=g, dtype=DT)
        self.ref = self._logits(w_ref, slice(None), t).log_softmax(-1).gather(-1, self.y[..., None]).squeeze(-1)

    def _logits(self, w: torch.Tensor, rows, width: int) -> torch.Tensor:
        return self.x[rows, :width] @ w  # [n, width, V]

    def forward(self, rows, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [n, width], entropy [n, width]) at the current W, with grad."""
        logp = self._logits(self.w, rows, width).log_softmax(-1)
        lp = logp.gather(-1, self.y[rows, :width, None]).squeeze(-1)
        return lp, -(logp.exp() * logp).sum(-1)


def policy_case(seed: int, reward_kind: str = "01") -> tuple[TinyPolicy, dict]:
    gids, rewards, mask, threshold = _layout(seed, reward_kind)
    pol = TinyPolicy(seed, len(gids), T_MAX)
    return pol, {"gids": gids, "rewards": rewards, "mask": mask, "threshold": threshold}


VARIANTS = [
    ("disco", {"score": "logl"}),
    ("disco", {"score": "lratio", "tau": 1.0, "kl": "k3"}),
    ("disco", {"score": "logl", "divisor": "valid", "tau": 3.0}),
    ("disco", {"score": "lratio", "tau": 1.0, "official_compat": True}),
    ("discob", {"score": "logl", "kl": "k3"}),
    ("discob", {"score": "lratio", "divisor": "valid"}),
    ("discob", {"score": "logl", "official_compat": True}),
    ("drpo", {"max_response_tokens": 8}),
    ("drpo", {"max_response_tokens": 8, "drpo_lambda": 0.5, "kl": "k3", "divisor": "valid"}),
    ("drpo", {"max_response_tokens": 10, "drpo_lambda": 2.0, "official_compat": True}),
    ("drpo", {"max_response_tokens": 7, "drpo_lambda": 0.01, "score": "lratio", "tau": 1.0}),
    ("grpo", {}),
    ("grpo", {"kl_coef": 0.05, "clip_eps_high": 0.28, "kl": "k3"}),
    ("grpo_rw", {"kl_coef": 0.05}),
    ("grpo_rw", {"divisor": "valid"}),
    ("dr_grpo", {"max_response_tokens": 12, "kl_coef": 0.05}),
    ("dapo", {}),
    ("grpo_er", {"entropy_coef": 0.01, "kl_coef": 0.05}),
    ("gpg", {}),
    ("gpg", {"token_norm": "batch", "kl": "k3"}),
    ("gpg", {"adv_std_norm": True, "alpha_correction": False}),
    ("trpa", {}),
    ("trpa", {"trpa_anisotropy": 1.0, "tr_kl_coef": 0.05, "kl": "k3"}),
]
VARIANT_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in hp.items()) or 'default'}" for n, hp in VARIANTS]


def _rows(*token_lists: list[float], width: int = 2, pad: float = math.nan) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, width] values and mask from ragged per-row token lists."""
    values = torch.full((len(token_lists), width), pad, dtype=DT)
    mask = torch.zeros(len(token_lists), width, dtype=torch.bool)
    for i, toks in enumerate(token_lists):
        values[i, : len(toks)] = torch.tensor(toks, dtype=DT)
        mask[i, : len(toks)] = True
    return values, mask


def _grad(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, leaf)
    return g


# ----------------------------------------------------------------------------------------------------------------------
# Hand-computed values.

# Case A, rows in shuffled order d, a, b, e, c (question 7: a positive, b and c negative; question 3: d and e
# positive, no negative, so it adds 0 but counts in Q = 2):
#   a: log-probs [-1, -1] -> s_a = -1;  b: [-2] -> s_b = -2;  c: [-3, -5] -> s_c = -4
#   d: [-1] -> s_d = -1;  e: [-0.5, -0.5] -> s_e = -0.5.   old = new except a: old [-0.5, -1].
CASE_A_LP = ([-1.0], [-1.0, -1.0], [-2.0], [-0.5, -0.5], [-3.0, -5.0])
CASE_A_OLD = ([-1.0], [-0.5, -1.0], [-2.0], [-0.5, -0.5], [-3.0, -5.0])
CASE_A_GIDS = torch.tensor([3, 7, 7, 3, 7])
CASE_A_REWARDS = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0], dtype=DT)
# k1 KL: only a's first token differs: old - new = -0.5 - (-1) = 0.5; 8 valid tokens -> K = 0.5 / 8 = 0.0625.
CASE_A_K = 0.0625


def _case_a(same_old: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lp, mask = _rows(*CASE_A_LP)
    old, _ = _rows(*(CASE_A_LP if same_old else CASE_A_OLD))
    return lp.requires_grad_(True), old, mask


def test_disco_logl_hand_values() -> None:
    lp, old, mask = _case_a(same_old=True)
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
    g = _grad(loss, lp)
    soft_b = math.exp(-2) / (math.exp(-2) + math.exp(-4))
    assert soft_b == pytest.approx(0.8807970779778823, abs=1e-12)
    expected = torch.tensor(
        [[0, 0], [-0.25, -0.25], [0.5 * soft_b, 0], [0, 0], [0.25 * (1 - soft_b), 0.25 * (1 - soft_b)]], dtype=DT
    )
    torch.testing.assert_close(g, expected, atol=1e-12, rtol=0)


def test_disco_logl_default_tau_with_active_constraint() -> None:
    lp, old, mask = _case_a()
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
    lp, old, mask = _case_a()
    loss, m = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, tau=1.0, official_compat=True)
    # log-SUM-exp: term_7 = -1 - log(e^-2 + e^-4) = 1.5662191695 - log 2 = 0.8730719889; J = term / 2.
    # penalty as the code computes it: max(beta (K - delta), 0) * K = 1e3 * 0.0624 * 0.0625 = 3.9.
    term = -1 - math.log(math.exp(-2) + math.exp(-4))
    assert term == pytest.approx(1.5662191695169727 - LN2, abs=1e-12)
    assert m["penalty"] == pytest.approx(3.9, abs=1e-10)
    assert loss.item() == pytest.approx(-term / 2 + 3.9, abs=1e-10)


def test_disco_divisor_valid_hand_value() -> None:
    lp, old, mask = _case_a(same_old=True)
    loss, _ = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, tau=1.0, divisor="valid")
    # Only question 7 has a positive and a negative: J = term_7 / 1 = 1.5662191695.
    assert loss.item() == pytest.approx(-1.5662191695169727, abs=1e-12)


def test_discob_logl_hand_values() -> None:
    lp, old, mask = _case_a()
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
    lp, mask = _rows([-1.0], [-2.0, -2.0], [-3.0])
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
    torch.testing.assert_close(_grad(loss, lp), expected, atol=1e-12, rtol=0)
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
    torch.testing.assert_close(_grad(drpo, c["lp"]), _grad(disco, c["lp"]), atol=1e-10, rtol=0)
    # At the default lambda the lengths (1 to 7 tokens of a budget of 8) change the objective.
    short, _ = losses.get_loss("drpo", max_response_tokens=8, **hp)(*args, weights=w)
    assert abs(short.item() - disco.item()) > 1e-3


def test_drpo_small_lambda_stays_finite() -> None:
    # lambda = 1e-4: exp((1 - L / L_max) / lambda) overflows float64 unshifted; the shortest positive takes all.
    c = random_case(6)
    loss, _ = losses.get_loss("drpo", drpo_lambda=1e-4, max_response_tokens=8)(
        c["lp"], c["old"], c["mask"], c["gids"], c["rewards"]
    )
    assert math.isfinite(loss.item()) and torch.isfinite(_grad(loss, c["lp"])).all()


# Case B (L-ratio), same rows and questions, log-ratios logp - old_logp:
#   a: [ln 2, 0] -> ratios [2, 1], s_a = 1.5;  b: [ln 0.5] -> s_b = 0.5;  c: [0, 0] -> s_c = 1;  d, e: 0 -> 1.
CASE_B_DIFF = ([0.0], [LN2, 0.0], [LN05], [0.0, 0.0], [0.0, 0.0])


def _case_b() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old, mask = _rows(*CASE_A_LP)
    diff, _ = _rows(*CASE_B_DIFF)
    return torch.where(mask, old + diff, math.nan).requires_grad_(True), old, mask


def test_disco_lratio_hand_values() -> None:
    lp, old, mask = _case_b()
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
    lp, old, mask = _case_b()
    loss, m = losses.get_loss("discob")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, score="lratio")
    # term_7 = 1.5 - (0.5 + 1) / 2 = 0.75; J = 0.75 / 2 = 0.375; K = 0.
    assert loss.item() == pytest.approx(-0.375, abs=1e-12)
    assert m["score_pos_mean"] == pytest.approx((1 + 1.5 + 1) / 3, abs=1e-12)


# Case C (GRPO family). Question 0: r1 positive, r2 negative; question 1: r3, r4 both positive (A = 0).
#   log-ratios: r1 [ln 1.5, ln 0.5] -> rho [1.5, 0.5];  r2 [ln 1.5];  r3 [0];  r4 [0, 0].   6 valid tokens.
# Question 0 rewards {1, 0}: mean 0.5, population std 0.5 -> A = +-0.5 / (0.5 + 1e-6) = +-A1.
A1 = 0.5 / (0.5 + 1e-6)
CASE_C_OLD = ([-1.0, -2.0], [-0.7], [-1.5], [-0.2, -0.3])
CASE_C_DIFF = ([LN15, LN05], [LN15], [0.0], [0.0, 0.0])
CASE_C_GIDS = torch.tensor([0, 0, 1, 1])
CASE_C_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=DT)


def _case_c() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old, mask = _rows(*CASE_C_OLD)
    diff, _ = _rows(*CASE_C_DIFF)
    return torch.where(mask, old + diff, -math.inf).requires_grad_(True), old, mask


def test_grpo_hand_values() -> None:
    lp, old, mask = _case_c()
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
    lp, old, mask = _case_c()
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
    lp, old, mask = _case_c()
    loss, m = losses.get_loss("grpo_rw")(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS)
    # Question 0: f+(r1) = (1.2 + 0.5) / 2 = 0.85, f-(r2) = 1.5 -> term -0.65; question 1 has no negative.
    # J = -0.65 / 2 = -0.325.
    assert loss.item() == pytest.approx(0.325, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 6, abs=1e-12)


def test_dr_grpo_hand_value() -> None:
    lp, old, mask = _case_c()
    loss, _ = losses.get_loss("dr_grpo")(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS, max_response_tokens=4)
    # A = r - mean: +-0.5 in question 0, 0 in question 1. Token sums: r1 0.5 (1.2 + 0.5) = 0.85, r2 -0.5 * 1.5 = -0.75.
    # J = (0.85 - 0.75) / max_response_tokens(4) / N(4) = 0.1 / 16 = 0.00625.
    assert loss.item() == pytest.approx(-0.00625, abs=1e-12)


def test_dapo_hand_value() -> None:
    lp, old, mask = _case_c()
    loss, m = losses.get_loss("dapo")(lp, old, mask, CASE_C_GIDS, CASE_C_REWARDS)
    # Clip-higher [0.8, 1.28]: r1 min(1.5, 1.28) + 0.5 = 1.78 (x A1); r2 max(1.5, 0.8) = 1.5 (x -A1).
    # Token level: J = A1 (1.78 - 1.5) / 6 tokens = 0.28 A1 / 6.
    assert loss.item() == pytest.approx(-0.28 * A1 / 6, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 6, abs=1e-12)


def test_grpo_er_hand_value() -> None:
    lp, old, mask = _case_c()
    entropy, _ = _rows([1.0, 2.0], [3.0], [0.5], [0.25, 0.25])
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


# GPG on case A (old = new). Question 7: a (r 1, log-probs [-1, -1]), b (r 0, [-2]), c (r 0, [-3, -5]); mean 1/3
# -> A_a = 2/3, A_b = A_c = -1/3; summed log-probs -2, -2, -8; T_7 = 5 tokens.
#   sum_i A_i logp_sum_i = (2/3)(-2) + (-1/3)(-2) + (-1/3)(-8) = (-4 + 2 + 8) / 3 = 2.
# Question 3: d, e both correct -> A = 0 (and they are the M = 2 rollouts of equal-reward questions).
# B = 5 rollouts -> alpha = 5 / (5 - 2) = 5/3; Q = 2; all 8 tokens T_tot = 8.


def test_gpg_hand_values() -> None:
    lp, old, mask = _case_a(same_old=True)
    fn = losses.get_loss("gpg")
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS)
    # eq. 5 per question: (2 / 5 + 0) / Q = 0.2; eq. 8: J = alpha 0.2 = (5/3)(0.2) = 1/3.
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-12)
    assert m["objective"] == pytest.approx(1 / 3, abs=1e-12)
    assert m["alpha"] == pytest.approx(5 / 3, abs=1e-15) and m["valid_share"] == pytest.approx(3 / 5, abs=1e-15)
    assert m["penalty"] == 0.0 and m["kl"] == 0.0
    # dloss/dlp_{i,t} = -(alpha / Q) A_i / T_7: a -(5/3)(1/2)(2/3)/5 = -1/9; b, c -(5/3)(1/2)(-1/3)/5 = +1/18.
    expected = torch.tensor([[0, 0], [-1 / 9, -1 / 9], [1 / 18, 0], [0, 0], [1 / 18, 1 / 18]], dtype=DT)
    torch.testing.assert_close(_grad(loss, lp), expected, atol=1e-12, rtol=0)
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
    lp, old, mask = _case_a(same_old=True)
    loss, m = losses.get_loss("gpg")(lp, old, mask, CASE_A_GIDS, torch.ones(5, dtype=DT))
    # Every A is 0; M = B, so alpha stays 1 rather than B / 0.
    assert loss.item() == 0.0 and m["alpha"] == 1.0 and m["valid_share"] == 0.0
    assert (_grad(loss, lp) == 0).all()


# TRPA on case A with a reference: log pi - log pi_ref per token a [1, 1], b [0], c [-1, -1], d, e 0
# -> h_a = 1, h_b = 0, h_c = -1. Question 7's pairs: (a, b), (a, c), both won by a correct rollout, so
# beta_w = 0.1 x 2.5 = 0.25; question 3 (all correct) has none: P = 2.
CASE_A_REF = ([-1.0], [-2.0, -2.0], [-2.0], [-0.5, -0.5], [-2.0, -4.0])


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_trpa_hand_values() -> None:
    lp, old, mask = _case_a()
    ref, _ = _rows(*CASE_A_REF)
    fn = losses.get_loss("trpa")
    assert fn.needs_reference
    loss, m = fn(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, ref_logprobs=ref)
    # J = (log s(0.25 (1 - 0)) + log s(0.25 (1 + 1))) / 2 = (-0.5759394199 - 0.4740769842) / 2 = -0.5250082020.
    J = (_log_sigmoid(0.25) + _log_sigmoid(0.5)) / 2
    assert _log_sigmoid(0.25) == pytest.approx(-0.5759394199, abs=1e-10)
    assert _log_sigmoid(0.5) == pytest.approx(-0.4740769842, abs=1e-10)
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
    torch.testing.assert_close(_grad(no_tr, lp), expected, atol=1e-12, rtol=0)


def test_trpa_three_levels_and_anisotropy() -> None:
    # One question, rewards 1 > 0 > -1 (three preference levels), h = 1, 0, -1 (one token each, old = new).
    lp, mask = _rows([0.0], [0.0], [0.0])
    ref, _ = _rows([-1.0], [0.0], [1.0])
    lp.requires_grad_(True)
    gids, rewards = torch.tensor([4, 4, 4]), torch.tensor([1.0, 0.0, -1.0], dtype=DT)
    loss, m = losses.get_loss("trpa")(lp, lp.detach(), mask, gids, rewards, ref_logprobs=ref)
    # Pairs: (1 > 0) and (1 > -1) won by the correct rollout: beta 0.25, margins 1 and 2; (0 > -1) won by a wrong
    # one: beta 0.1, margin 1. J = (log s(0.25) + log s(0.5) + log s(0.1)) / 3.
    J = (_log_sigmoid(0.25) + _log_sigmoid(0.5) + _log_sigmoid(0.1)) / 3
    assert m["pairs"] == 3.0
    assert loss.item() == pytest.approx(-J, abs=1e-12)
    # With threshold 0.5 the middle rollout (reward 0) is a negative; with threshold -0.5 it counts as correct,
    # so the (0 > -1) pair gets the anisotropic beta too: log s(0.25 x 1).
    loss, _ = losses.get_loss("trpa")(lp, lp.detach(), mask, gids, rewards, ref_logprobs=ref, positive_threshold=-0.5)
    assert loss.item() == pytest.approx(-(_log_sigmoid(0.25) * 2 + _log_sigmoid(0.5)) / 3, abs=1e-12)


def test_trpa_without_pairs_keeps_only_the_trust_region() -> None:
    lp, old, mask = _case_a()
    ref, _ = _rows(*CASE_A_REF)
    loss, m = losses.get_loss("trpa")(lp, old, mask, CASE_A_GIDS, torch.ones(5, dtype=DT), ref_logprobs=ref)
    # Every rollout correct: no pair, J = 0; the trust-region term remains (as in test_trpa_hand_values).
    assert m["pairs"] == 0.0 and m["objective"] == 0.0
    assert loss.item() == pytest.approx(1e-3 * (math.exp(0.5) - 1.5) / 8, abs=1e-15)


# ----------------------------------------------------------------------------------------------------------------------
# Gradients against the naive loop.


def _inputs(fn: losses.Loss, c: dict) -> dict:
    return {
        "entropy": c["entropy"] if fn.needs_entropy else None,
        "ref_logprobs": c["ref"] if fn.needs_reference else None,
    }


@pytest.mark.parametrize("regime", ["active", "inactive"])
@pytest.mark.parametrize("reward_kind", ["01", "pm1"])
@pytest.mark.parametrize(("name", "hp"), VARIANTS, ids=VARIANT_IDS)
def test_gradient_matches_naive_loop(name: str, hp: dict, reward_kind: str, regime: str) -> None:
    c = random_case(seed=len(name) + len(hp), reward_kind=reward_kind, regime=regime)
    hp = {**hp, "positive_threshold": c["threshold"]}
    fn = losses.get_loss(name, **hp)
    loss, m = fn(c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], **_inputs(fn, c), **hp)
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
    g = _grad(loss, c["lp"])
    assert torch.isfinite(g).all()
    assert (g[~c["mask"]] == 0).all()
    torch.testing.assert_close(g, _grad(ref_loss, c["lp"]), atol=1e-10, rtol=0)
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
    loss, m = fn(c["lp"], c["old"], c["mask"], c["gids"], rewards, **_inputs(fn, c), **hp)
    ref_loss, J, _ = naive(name, c["lp"], c["old"], c["mask"], c["gids"], rewards, ref=c["ref"], **hp)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-10)
    assert m["objective"] == pytest.approx(J.item(), abs=1e-10)
    torch.testing.assert_close(_grad(loss, c["lp"]), _grad(ref_loss, c["lp"]), atol=1e-10, rtol=0)
    if name == "trpa":
        # Some pairs are won by a wrong rollout (0 > -0.5, ...): the plain-beta path is exercised too.
        wrong_winner = [
            (i, j)
            for i in range(len(rewards))
            for j in range(len(rewards))
            if c["gids"][i] == c["gids"][j] and 0.5 >= rewards[i] > rewards[j]
        ]
        assert wrong_winner and m["pairs"] > len(wrong_winner)


# ----------------------------------------------------------------------------------------------------------------------
# Micro-batch invariance (pass 1 / pass 2 with shared parameters).


def full_batch_grad(pol: TinyPolicy, c: dict, fn: losses.Loss, hp: dict, weights=None) -> tuple[torch.Tensor, float]:
    """Gradient w.r.t. the shared parameters of the full-batch loss, and its value."""
    lp, ent = pol.forward(slice(None), T_MAX)
    loss, _ = fn(
        lp, pol.old, c["mask"], c["gids"], c["rewards"], entropy=ent, ref_logprobs=pol.ref, weights=weights, **hp
    )
    return _grad(loss, pol.w), loss.item()


def microbatch_grad(
    pol: TinyPolicy, c: dict, fn: losses.Loss, hp: dict, size: int, *, weights=None, seed: int = 0
) -> tuple[torch.Tensor, float, dict]:
    """Pass 1 (no grad, whole batch) -> coefficients -> pass 2 over shuffled micro-batches of ``size`` rows,
    each trimmed to its own padding width; gradients summed."""
    mask = c["mask"]
    with torch.no_grad():
        lp, ent = pol.forward(slice(None), T_MAX)
        stats = fn.stats(lp, pol.old, mask, entropy=ent, ref_logprobs=pol.ref, **hp)
    coeffs, value, metrics = losses.coefficients(fn, stats, c["gids"], c["rewards"], weights=weights, **hp)
    assert not coeffs.requires_grad and coeffs.shape == stats.shape
    grad = torch.zeros_like(pol.w)
    perm = torch.randperm(len(mask), generator=torch.Generator().manual_seed(seed))
    for rows in perm.split(size):
        width = int(mask[rows].sum(1).max())
        lp_mb, ent_mb = pol.forward(rows, width)
        st = fn.stats(
            lp_mb, pol.old[rows, :width], mask[rows, :width], entropy=ent_mb, ref_logprobs=pol.ref[rows, :width], **hp
        )
        grad += _grad(losses.surrogate(coeffs[rows], st), pol.w)
    return grad, value, metrics


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


def test_stats_do_not_depend_on_padding_width() -> None:
    c = random_case(2)
    wide = {
        k: torch.cat([c[k].detach(), torch.full((len(c["gids"]), 5), math.nan, dtype=DT)], 1)
        for k in ("lp", "old", "ref", "entropy")
    }
    wide_mask = torch.cat([c["mask"], torch.zeros(len(c["gids"]), 5, dtype=torch.bool)], 1)
    for name, hp in VARIANTS:
        fn = losses.get_loss(name, **hp)
        narrow = fn.stats(c["lp"].detach(), c["old"], c["mask"], entropy=c["entropy"], ref_logprobs=c["ref"], **hp)
        padded = fn.stats(wide["lp"], wide["old"], wide_mask, entropy=wide["entropy"], ref_logprobs=wide["ref"], **hp)
        assert narrow.shape == (len(c["gids"]), len(fn.stat_names))
        torch.testing.assert_close(padded, narrow, atol=1e-13, rtol=0)


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
    torch.testing.assert_close(_grad(loss, c["lp"]), _grad(code_loss, c["lp"]), atol=1e-10, rtol=0)
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
    g_penalty = _grad(loss, c["lp"]) - _grad(objective_only, c["lp"])
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
        torch.testing.assert_close(g_penalty, factor * _grad(K, c["lp"]), atol=1e-10, rtol=0)


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
    _, m = fn(c["lp"], c["old"], c["mask"], c["gids"], c["rewards"], **_inputs(fn, c), **hp)
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
    torch.testing.assert_close(coeffs, _grad(loss, leaf), atol=1e-14, rtol=0)
    assert value == metrics["loss"] == pytest.approx(loss.item(), abs=1e-14)
    # Constant columns (token counts, clamp counts) carry no gradient into the model; the score column does.
    assert coeffs[:, 0].abs().sum() > 0


def test_lratio_clamp_is_counted_and_finite() -> None:
    lp, old, mask = _case_a(same_old=True)
    lp = lp.detach().clone()
    lp[1, 0] = old[1, 0] + 50.0  # exp(50) would dominate; the clamp at 20 keeps it finite and counts it
    lp.requires_grad_(True)
    for kl in ("k1", "k3"):
        loss, m = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, score="lratio", kl=kl)
        assert math.isfinite(loss.item()) and m["lratio_clamped"] == 1.0
        g = _grad(loss, lp)
        assert torch.isfinite(g).all() and g[1, 0] == 0.0  # a clamped token has no gradient


def test_empty_rows_are_safe() -> None:
    lp, mask = _rows([-1.0, -2.0], [], [-0.5], [])
    old = lp.clone()
    lp.requires_grad_(True)
    gids, rewards = torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=DT)
    for name, hp in VARIANTS:
        fn = losses.get_loss(name, **hp)
        entropy = torch.zeros_like(old)
        loss, _ = fn(lp, old, mask, gids, rewards, entropy=entropy, ref_logprobs=old, **hp)
        assert math.isfinite(loss.item()) and torch.isfinite(_grad(loss, lp)).all()


def test_registry_and_lookup_errors() -> None:
    names = ["disco", "discob", "drpo", "grpo", "grpo_rw", "dr_grpo", "dapo", "grpo_er", "gpg", "trpa"]
    assert list(losses.LOSSES) == names
    with pytest.raises(ValueError, match="valid names: " + ", ".join(names)):
        losses.get_loss("ppo")
    with pytest.raises(ValueError, match=r"loss 'disco' got unknown hyper-parameter\(s\) \['clip_eps'\]"):
        losses.get_loss("disco", clip_eps=0.2)
    with pytest.raises(ValueError, match="loss 'disco': tau=-1.0 must be > 0"):
        losses.get_loss("disco", tau=-1.0)
    with pytest.raises(ValueError, match="score='ratio' must be 'logl' or 'lratio'"):
        losses.get_loss("discob", score="ratio")


def test_reference_and_entropy_requirements() -> None:
    assert not losses.get_loss("grpo").needs_reference
    assert not losses.get_loss("grpo", kl_coef=0.0).needs_reference
    assert losses.get_loss("grpo_er", kl_coef=1e-3).needs_reference
    assert not losses.get_loss("disco", tau=1.0).needs_reference
    assert not losses.get_loss("gpg").needs_reference and not losses.get_loss("gpg", token_norm="batch").needs_reference
    # TRPA's preference term is a log-ratio to the reference: needed at the registry defaults and after binding.
    assert losses.get_loss("trpa").needs_reference and losses.get_loss("trpa", trpa_beta=0.2).needs_reference
    lp, old, mask = _case_c()
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


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_loss_kwargs_from_config(name: str) -> None:
    cfg = config_lib.validate(
        {
            "loss": {
                "name": name,
                "tau": 2.0,
                "entropy_coef": 0.01 if name == "grpo_er" else None,
                "drpo_lambda": 0.3 if name == "drpo" else None,
            },
            "reward": {"positive_threshold": 0.0},
            "generation": {"max_response_tokens": 4096},
        }
    )
    hp = config_lib.loss_kwargs(cfg)
    fn = losses.get_loss(name, **hp)
    assert hp["positive_threshold"] == 0.0
    assert set(hp) <= {f.name for f in dataclasses.fields(fn.hparams)}
    assert hp.get("tau") == (2.0 if name in ("disco", "drpo") else None)
    assert ("max_response_tokens" in hp) == (name in ("dr_grpo", "drpo"))
    if name in ("dr_grpo", "drpo"):
        assert hp["max_response_tokens"] == 4096
    assert hp.get("drpo_lambda") == (0.3 if name == "drpo" else None)
    if name == "grpo_er":
        assert hp["entropy_coef"] == 0.01
    fn.params(**hp)  # accepted as is


def test_loss_kwargs_rejects_terms_the_loss_lacks() -> None:
    with pytest.raises(ConfigError, match="loss.kl_coef=0.001 has no effect with loss.name=disco"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "disco", "kl_coef": 0.001}}))
    with pytest.raises(ConfigError, match="loss.kl_coef=0.001 has no effect with loss.name=dapo"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "dapo", "kl_coef": 0.001}}))
    with pytest.raises(ConfigError, match="loss.entropy_coef=0.01 has no effect with loss.name=grpo"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "grpo", "entropy_coef": 0.01}}))
    # GPG's and TRPA's keys, away from their defaults, for a loss without them.
    with pytest.raises(ConfigError, match="loss.alpha_correction=False has no effect with loss.name=dr_grpo"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "dr_grpo", "alpha_correction": False}}))
    with pytest.raises(ConfigError, match="loss.trpa_beta=0.2 has no effect with loss.name=gpg"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "gpg", "trpa_beta": 0.2}}))
    with pytest.raises(ConfigError, match="loss.kl_coef=0.001 has no effect with loss.name=trpa"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "trpa", "kl_coef": 0.001}}))
    # At their defaults they are no choice, so every loss accepts them.
    hp = config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "trpa", "trpa_beta": 0.2, "tr_kl_coef": 0.0}}))
    assert hp["trpa_beta"] == 0.2 and hp["tr_kl_coef"] == 0.0 and hp["trpa_anisotropy"] == 2.5
    assert config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "disco"}}))["tau"] == 10.0
    with pytest.raises(ConfigError, match="loss.drpo_lambda=0.5 has no effect with loss.name=disco"):
        config_lib.loss_kwargs(config_lib.validate({"loss": {"name": "disco", "drpo_lambda": 0.5}}))


def test_loss_defaults_live_beside_the_loss_only():
    # The schema holds no default of its own for a loss hyper-parameter: null means the loss's default, so
    # loss.name=dapo gets DAPO's clip-higher and grpo_er its entropy bonus without the recipe that sets them.
    from nemo_disco.config import AlgorithmConfig

    for key, f in LossConfig.model_fields.items():
        if key not in ("name", "rollout_correction", "rollout_correction_cap"):
            assert f.default is None, key
    assert "minibatch_prompts" in AlgorithmConfig.model_fields  # (the schema is still where other defaults live)
    exemplar = config_lib.load(Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml")
    for name, key, expected in (("dapo", "clip_eps_high", 0.28), ("grpo", "clip_eps_high", None),
                                ("grpo_er", "entropy_coef", 1e-3), ("disco", "tau", 10.0)):  # fmt: skip
        cfg = config_lib.validate({**exemplar.model_dump(mode="json"), "loss": {"name": name}})
        assert config_lib.loss_kwargs(cfg)[key] == expected, (name, key)
        cfg = config_lib.validate(
            {**exemplar.model_dump(mode="json"), "loss": {**exemplar.loss.model_dump(), "name": name}}
        )
        assert config_lib.loss_kwargs(cfg)[key] == expected, (name, key, "on the exemplar's loss section")
    assert losses.get_loss("dapo").hyperparameters["clip_eps_high"] == 0.28
