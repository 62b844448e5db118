import math

import pytest

from nemo_disco.stats import mean_se, paired_difference


def test_mean_se_hand_computed():
    # values 0, 0.5, 1: mean 0.5; sample variance ((0.25 + 0 + 0.25) / 2) = 0.25; se = sqrt(0.25 / 3)
    mean, se = mean_se([0.0, 0.5, 1.0])
    assert mean == 0.5
    assert se == pytest.approx(math.sqrt(0.25 / 3), abs=1e-15)


def test_mean_se_single_value_and_empty():
    assert mean_se([0.75]) == (0.75, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        mean_se([])


def test_paired_difference_removes_shared_problem_variance():
    before = [0.0, 0.25, 1.0, 0.5]
    after = [0.25, 0.5, 1.0, 0.75]  # differences 0.25, 0.25, 0, 0.25: mean 0.1875
    mean, se = paired_difference(after, before)
    assert mean == pytest.approx(0.1875)
    # sample variance of the differences: (3 * 0.0625^2 + 0.1875^2) / 3 = 0.015625; se = sqrt(0.015625 / 4)
    assert se == pytest.approx(math.sqrt(0.015625 / 4))
    assert se < mean_se(after)[1]  # pairing removes the between-problem spread
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([1.0], [1.0, 0.0])
