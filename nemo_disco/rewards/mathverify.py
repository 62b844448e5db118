"""The ``math_verify`` grader: Hugging Face math-verify with its own timeouts off (the pool enforces them)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from nemo_disco.rewards.answers import after_think, gold_latex
from nemo_disco.rewards.registry import Grader, GraderParams, register_grader

# ----------------------------------------------------------------------------------------------------------------------
# math_verify grader


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns that its own timeouts are off; the pool enforces them, so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.cache
def _math_verify() -> Any:
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
    return math_verify


@functools.lru_cache(maxsize=4096)
def parsed_gold(answer: str) -> list:
    """Parsed gold answer (cached: every rollout of a question shares it)."""
    mv = _math_verify()
    latex = gold_latex(answer)
    if "\\boxed" not in latex:
        latex = f"\\boxed{{{latex}}}"
    return mv.parse(latex, parsing_timeout=None)


def math_verify_correct(response: str, truths: list[str]) -> bool:
    """Whether math-verify finds the response (after the last ``</think>``) equal to any gold answer."""
    mv = _math_verify()
    after = after_think(response)
    pred = mv.parse(response if after is None else after, parsing_timeout=None)
    if not pred:
        return False
    return any(mv.verify(parsed_gold(g), pred, timeout_seconds=None) for g in truths)


class MathVerifyParams(GraderParams):
    """math_verify takes no parameters."""


def grade_math_verify(response: str, ground_truth: list[str]) -> float:
    """1.0 if math-verify finds the response equal to any gold answer, else 0.0 (the ``math_verify`` grader)."""
    return 1.0 if math_verify_correct(response, ground_truth) else 0.0


register_grader(
    Grader(
        "math_verify",
        grade_math_verify,
        MathVerifyParams,
        "Hugging Face math-verify: LaTeX and expression extraction, symbolic equivalence",
    )
)
