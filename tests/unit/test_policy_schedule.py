"""The learning-rate schedule shared by the policies (policy/schedule.py)."""

from __future__ import annotations

import pytest

from nemo_disco.config import PolicyConfig
from nemo_disco.policy.schedule import lr_at

LR = 1e-3


def test_update_zero_never_has_a_zero_learning_rate():
    # The authors' constant schedule with warm-up 0 gives update 0 a factor of 0; here it gets the full lr.
    assert lr_at(0, PolicyConfig(lr=LR, warmup_updates=0), 100) == LR


def test_linear_warmup_reaches_lr_at_update_warmup_minus_one():
    pc = PolicyConfig(lr=LR, warmup_updates=4)
    # lr x (u + 1) / 4 for u < 4, then constant.
    assert [lr_at(u, pc, 100) for u in range(6)] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR])


def test_cosine_decays_to_the_floor_at_total_updates_and_stays_there():
    pc = PolicyConfig(lr=LR, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, pc, 100) == pytest.approx(LR)
    # Half way: floor + (lr - floor) x (1 + cos(pi / 2)) / 2 = 0.1 lr + 0.9 lr x 0.5.
    assert lr_at(50, pc, 100) == pytest.approx(LR * (0.1 + 0.9 * 0.5))
    assert lr_at(100, pc, 100) == pytest.approx(LR * 0.1)
    assert lr_at(150, pc, 100) == pytest.approx(LR * 0.1)  # past the end: the floor, never a rising lr


def test_cosine_starts_decaying_after_the_warmup():
    pc = PolicyConfig(lr=LR, lr_schedule="cosine", warmup_updates=10, min_lr_ratio=0.0)
    assert lr_at(9, pc, 110) == pytest.approx(LR)
    assert lr_at(10, pc, 110) == pytest.approx(LR)  # decay progress 0 at the first update after warm-up
    # 100 decay updates: at update 60 progress is 0.5, lr = lr x (1 + cos(pi / 2)) / 2.
    assert lr_at(60, pc, 110) == pytest.approx(LR * 0.5)
    assert lr_at(110, pc, 110) == pytest.approx(0.0, abs=1e-15)


def test_cosine_with_no_update_after_the_warmup_does_not_divide_by_zero():
    pc = PolicyConfig(lr=LR, lr_schedule="cosine", warmup_updates=5, min_lr_ratio=0.2)
    # total_updates == warmup_updates: the decay span is clamped to 1 update.
    assert lr_at(5, pc, 5) == pytest.approx(LR)
    assert lr_at(6, pc, 5) == pytest.approx(LR * 0.2)
