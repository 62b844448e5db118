"""Grading one response (:func:`score_response`) and user reward functions (:func:`load_reward_function`)."""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from nemo_disco.rewards.answers import gold_answers
from nemo_disco.rewards.registry import get_grader

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------------
# Public scoring


def grade(response: str, ground_truth: Any, grader: str, params: Mapping[str, Any] | None = None) -> float:
    """Score one response with the registered grader ``grader`` and its ``params``; exceptions propagate.

    (The worker counts them as errors.) ``params`` are passed as given: :meth:`Grader.bind` validates them.
    """
    fn = get_grader(grader).fn
    truths = gold_answers(ground_truth)
    if not isinstance(response, str) or not truths:
        return 0.0
    return float(fn(response, truths, **(params or {})))


def score_response(response: str, ground_truth: str | list[str], grader: str = "math_verify", **params: Any) -> float:
    """Score one response in this process: 1.0 if it matches any gold answer, else 0.0. Never raises on input.

    No time limit applies here: grade untrusted model output with :class:`GraderPool` / :func:`score_batch`.

    Args:
        response: the decoded model response (reasoning and answer).
        ground_truth: one gold answer or several (any of them counts).
        grader: a registered grader (:data:`~nemo_disco.rewards.registry.GRADERS`).
        **params: the grader's parameters (deepscaler's ``require_think=True``: a response without ``</think>``
            scores 0, the official rule).

    Raises:
        ValueError: an unknown grader or a parameter it does not take (a programming error, not an input).
    """
    bound = get_grader(grader).bind(params).model_dump()
    try:
        return grade(response, ground_truth, grader, bound)
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
