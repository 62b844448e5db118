"""nemo_disco.rewards.deepscaler: the Hendrycks-MATH normalisation."""

from __future__ import annotations

from nemo_disco.rewards import hendrycks_normalize


def test_hendrycks_normalize():
    assert hendrycks_normalize(r"\dfrac12") == r"\frac{1}{2}"
    assert hendrycks_normalize(r"\left( 3, \frac{\pi}{2} \right)") == r"(3,\frac{\pi}{2})"
    assert hendrycks_normalize(r"x = 0.5") == r"\frac{1}{2}"
    assert hendrycks_normalize(r"10\text{ cm}") == "10"
    assert hendrycks_normalize(r"3/4") == r"\frac{3}{4}"
