"""nemo_disco.losses.reduce: padding, clamps, empty rows and the weighted group helpers."""

from __future__ import annotations

import math

import pytest
import torch
from loss_reference import CASE_A_GIDS, CASE_A_REWARDS, DT, VARIANTS, case_a, grad_of, random_case, token_rows

from nemo_disco import losses


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


def test_lratio_clamp_is_counted_and_finite() -> None:
    lp, old, mask = case_a(same_old=True)
    lp = lp.detach().clone()
    lp[1, 0] = old[1, 0] + 50.0  # exp(50) would dominate; the clamp at 20 keeps it finite and counts it
    lp.requires_grad_(True)
    for kl in ("k1", "k3"):
        loss, m = losses.get_loss("disco")(lp, old, mask, CASE_A_GIDS, CASE_A_REWARDS, score="lratio", kl=kl)
        assert math.isfinite(loss.item()) and m["lratio_clamped"] == 1.0
        g = grad_of(loss, lp)
        assert torch.isfinite(g).all() and g[1, 0] == 0.0  # a clamped token has no gradient


def test_empty_rows_are_safe() -> None:
    lp, mask = token_rows([-1.0, -2.0], [], [-0.5], [])
    old = lp.clone()
    lp.requires_grad_(True)
    gids, rewards = torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=DT)
    for name, hp in VARIANTS:
        fn = losses.get_loss(name, **hp)
        entropy = torch.zeros_like(old)
        loss, _ = fn(lp, old, mask, gids, rewards, entropy=entropy, ref_logprobs=old, **hp)
        assert math.isfinite(loss.item()) and torch.isfinite(grad_of(loss, lp)).all()


def test_weighted_group_helpers_direct() -> None:
    values = torch.tensor([1.0, 3.0, 10.0, -2.0, 7.0], dtype=DT)
    index = torch.tensor([0, 0, 1, 1, 2])
    select = torch.tensor([True, True, True, True, False])
    w = torch.tensor([1.0, 3.0, 0.5, 0.5, 9.0], dtype=DT)
    mean, den = losses.weighted_group_mean(values, index, 3, select, w)
    # group 0: (1 + 9) / 4 = 2.5; group 1: (5 - 1) / 1 = 4; group 2: nothing selected -> 0 with weight sum 0.
    torch.testing.assert_close(mean, torch.tensor([2.5, 4.0, 0.0], dtype=DT))
    torch.testing.assert_close(den, torch.tensor([4.0, 1.0, 0.0], dtype=DT))
    lme, _ = losses.weighted_group_logmeanexp(values * 100, index, 3, select, w)
    # Max subtraction keeps exp(1000) finite: group 1 = log(0.5 e^1000 + 0.5 e^-200) = 1000 + log 0.5.
    assert lme[1].item() == pytest.approx(1000 + math.log(0.5), abs=1e-9)
    assert lme[0].item() == pytest.approx(300 + math.log(0.75 + 0.25 * math.exp(-200)), abs=1e-9)
    assert lme[2].item() == 0.0
