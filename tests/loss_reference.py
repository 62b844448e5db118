"""The loss tests' naive reference, cases and tiny policy (test_losses_*.py, test_update.py, test_losses_dp.py).

Everything runs in float64 on CPU. The naive reference below is written from the paper's formulas (eq. 5-10,
alg. 1) and the GRPO / Dr. GRPO / DAPO definitions with python loops over questions and tokens; it shares no
code with the library.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from nemo_disco import losses

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


def token_rows(*token_lists: list[float], width: int = 2, pad: float = math.nan) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, width] values and mask from ragged per-row token lists."""
    values = torch.full((len(token_lists), width), pad, dtype=DT)
    mask = torch.zeros(len(token_lists), width, dtype=torch.bool)
    for i, toks in enumerate(token_lists):
        values[i, : len(toks)] = torch.tensor(toks, dtype=DT)
        mask[i, : len(toks)] = True
    return values, mask


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
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


def case_a(same_old: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lp, mask = token_rows(*CASE_A_LP)
    old, _ = token_rows(*(CASE_A_LP if same_old else CASE_A_OLD))
    return lp.requires_grad_(True), old, mask


# Case B (L-ratio), same rows and questions, log-ratios logp - old_logp:
#   a: [ln 2, 0] -> ratios [2, 1], s_a = 1.5;  b: [ln 0.5] -> s_b = 0.5;  c: [0, 0] -> s_c = 1;  d, e: 0 -> 1.
CASE_B_DIFF = ([0.0], [LN2, 0.0], [LN05], [0.0, 0.0], [0.0, 0.0])


def case_b() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old, mask = token_rows(*CASE_A_LP)
    diff, _ = token_rows(*CASE_B_DIFF)
    return torch.where(mask, old + diff, math.nan).requires_grad_(True), old, mask


# Case C (GRPO family). Question 0: r1 positive, r2 negative; question 1: r3, r4 both positive (A = 0).
#   log-ratios: r1 [ln 1.5, ln 0.5] -> rho [1.5, 0.5];  r2 [ln 1.5];  r3 [0];  r4 [0, 0].   6 valid tokens.
# Question 0 rewards {1, 0}: mean 0.5, population std 0.5 -> A = +-0.5 / (0.5 + 1e-6) = +-A1.
A1 = 0.5 / (0.5 + 1e-6)


CASE_C_OLD = ([-1.0, -2.0], [-0.7], [-1.5], [-0.2, -0.3])


CASE_C_DIFF = ([LN15, LN05], [LN15], [0.0], [0.0, 0.0])


CASE_C_GIDS = torch.tensor([0, 0, 1, 1])


CASE_C_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=DT)


def case_c() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old, mask = token_rows(*CASE_C_OLD)
    diff, _ = token_rows(*CASE_C_DIFF)
    return torch.where(mask, old + diff, -math.inf).requires_grad_(True), old, mask


# TRPA on case A with a reference: log pi - log pi_ref per token a [1, 1], b [0], c [-1, -1], d, e 0
# -> h_a = 1, h_b = 0, h_c = -1. Question 7's pairs: (a, b), (a, c), both won by a correct rollout, so
# beta_w = 0.1 x 2.5 = 0.25; question 3 (all correct) has none: P = 2.
CASE_A_REF = ([-1.0], [-2.0, -2.0], [-2.0], [-0.5, -0.5], [-2.0, -4.0])


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# ----------------------------------------------------------------------------------------------------------------------
# Gradients against the naive loop.


def loss_inputs(fn: losses.Loss, c: dict) -> dict:
    return {
        "entropy": c["entropy"] if fn.needs_entropy else None,
        "ref_logprobs": c["ref"] if fn.needs_reference else None,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Micro-batch invariance (pass 1 / pass 2 with shared parameters).


def full_batch_grad(pol: TinyPolicy, c: dict, fn: losses.Loss, hp: dict, weights=None) -> tuple[torch.Tensor, float]:
    """Gradient w.r.t. the shared parameters of the full-batch loss, and its value."""
    lp, ent = pol.forward(slice(None), T_MAX)
    loss, _ = fn(
        lp, pol.old, c["mask"], c["gids"], c["rewards"], entropy=ent, ref_logprobs=pol.ref, weights=weights, **hp
    )
    return grad_of(loss, pol.w), loss.item()


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
        grad += grad_of(losses.surrogate(coeffs[rows], st), pol.w)
    return grad, value, metrics


# ----------------------------------------------------------------------------------------------------------------------
# A loss of the user's own: the worked example of docs/losses.md, written into a folder as the module my_losses.


def write_docs_loss_example(folder: Path) -> str:
    """Write docs/losses.md's example loss to ``folder/my_losses.py``; returns its ``loss.name``."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "losses.md").read_text()
    section = doc[doc.index("## A loss of your own") :]
    (folder / "my_losses.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    return "my_losses:MeanBaselinePG"
