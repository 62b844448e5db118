"""nemo_disco.rewards.mathverify: the math-verify grader on its own (the graders side by side: test_rewards_scoring)."""

from __future__ import annotations

from nemo_disco.rewards.mathverify import math_verify_correct, parsed_gold


def test_math_verify_grades_the_text_after_think_against_any_gold():
    assert math_verify_correct(r"so \boxed{0.5}", [r"\frac{1}{2}"])
    assert math_verify_correct(r"\boxed{2}</think> \boxed{3}", ["3"])
    assert not math_verify_correct(r"\boxed{2}</think> \boxed{3}", ["2"])
    assert math_verify_correct(r"\boxed{7}", ["9", "7"])
    # Scientific notation in the gold is rewritten as LaTeX before parsing.
    assert parsed_gold("3.3e12")
    assert math_verify_correct(r"\boxed{3.3 \times 10^{12}}", ["3.3e12"])
