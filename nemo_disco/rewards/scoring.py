"""Grading one response (:func:`score_response`) and user reward functions (:func:`load_reward_function`)."""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from nemo_disco.rewards.answers import gold_answers
from nemo_disco.rewards.deepscaler import deepscaler_correct
from nemo_disco.rewards.mathverify import math_verify_correct

logger = logging.getLogger(__name__)

GRADERS = ("math_verify", "deepscaler")


# ----------------------------------------------------------------------------------------------------------------------
# Public scoring


def check_grader(grader: str) -> None:
    """Raise ValueError unless ``grader`` is one of :data:`GRADERS`."""
    if grader not in GRADERS:
        raise ValueError(f"unknown grader {grader!r}; valid graders: {', '.join(GRADERS)}")


def grade(response: str, ground_truth: Any, grader: str, require_think: bool) -> float:
    """Score one response; exceptions propagate (the worker counts them as errors)."""
    truths = gold_answers(ground_truth)
    if not isinstance(response, str) or not truths:
        return 0.0
    if grader == "math_verify":
        return 1.0 if math_verify_correct(response, truths) else 0.0
    return 1.0 if deepscaler_correct(response, truths, require_think) else 0.0


def score_response(
    response: str, ground_truth: str | list[str], grader: str = "math_verify", *, require_think: bool = False
) -> float:
    """Score one response in this process: 1.0 if it matches any gold answer, else 0.0. Never raises on input.

    No time limit applies here: grade untrusted model output with :class:`GraderPool` / :func:`score_batch`.

    Args:
        response: the decoded model response (reasoning and answer).
        ground_truth: one gold answer or several (any of them counts).
        grader: "math_verify" or "deepscaler".
        require_think: deepscaler only: score 0 when the response has no ``</think>`` (the official rule).

    Raises:
        ValueError: unknown grader name (a programming error, not an input).
    """
    check_grader(grader)
    try:
        return grade(response, ground_truth, grader, require_think)
    except Exception:  # Model output can trip any parser error; a wrong answer scores 0.
        logger.debug("grading raised", exc_info=True)
        return 0.0


# ----------------------------------------------------------------------------------------------------------------------
# User reward functions

_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_reward_function(path: str) -> Callable[..., Any]:
    """The callable named ``"package.module:function"`` (the current folder is importable too).

    Raises:
        ValueError: one line naming ``reward.function``: a malformed path, a module that does not import (its
            error), a missing attribute or an attribute that is not callable.
    """
    if not _FUNCTION_PATH.match(path):
        raise ValueError(f"reward.function={path!r}: expected 'package.module:function'")
    module_name, attr = path.split(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001  (any import-time error of user code)
        raise ValueError(
            f"reward.function={path!r}: module {module_name!r} does not import ({type(err).__name__}: {err}); is "
            "its folder the current one or on PYTHONPATH?"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward.function={path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward.function={path!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


def call_reward(fn: Callable[..., Any], response: str, truth: Any, problem: str, fields: dict[str, Any]) -> float:
    """Call a user reward function; its value as a float.

    Raises:
        TypeError: it returned something other than a number (a string, None, a bool).
        ValueError: it returned NaN or an infinity (an error like any other: such a reward would make every rollout
            a negative, or a positive).
    """
    value = fn(response, truth, problem=problem, **fields)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the reward function returned a {type(value).__name__}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"the reward function returned {value}, expected a finite float")
    return value
