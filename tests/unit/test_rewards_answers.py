"""nemo_disco.rewards.answers: answer extraction."""

from __future__ import annotations

from nemo_disco.rewards import last_boxed


def test_last_boxed():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert last_boxed(r"x \fbox{7} y") == "7"
    assert last_boxed(r"\boxed 5$ more") == "5"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced
    assert last_boxed("no answer") is None


def test_gold_answers_after_think_and_gold_latex():
    from nemo_disco.rewards.answers import after_think, gold_answers, gold_latex

    assert gold_answers([142.0, " ", "x"]) == ["142", "x"]
    assert gold_answers("7") == ["7"]
    assert after_think("a</think>b</think>c") == "c"
    assert after_think("no think") is None
    assert gold_latex("3.3e12") == r"3.3\times 10^{12}"
    assert gold_latex("5") == "5"
