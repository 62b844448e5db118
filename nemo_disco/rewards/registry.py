"""The registry of graders: each declares itself once, beside its code (:func:`register_grader`).

A grader is a name (``reward.grader``), a function ``fn(response, ground_truth, **params) -> float`` (1.0 correct,
0.0 not; ``ground_truth`` is the gold answers, a non-empty list of strings: any of them counts), a parameter model
(the keys of the ``reward`` section that are its own: their types, ranges and defaults) and a one-line description.
:func:`nemo_disco.rewards.score_response` and the :class:`~nemo_disco.rewards.GraderPool` workers grade through
:func:`get_grader`; :mod:`nemo_disco.parts` checks the run's ``reward`` section against the chosen grader's model.

This module imports nothing of the graders (they import it to register): importing :mod:`nemo_disco.rewards`
registers the built-in ones, ``math_verify`` (:mod:`~nemo_disco.rewards.mathverify`) and ``deepscaler``
(:mod:`~nemo_disco.rewards.deepscaler`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from nemo_disco.registry import Registry


class GraderParams(BaseModel):
    """The base of a grader's parameter model: frozen, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


@dataclass(frozen=True)
class Grader:
    """One grader's declaration."""

    name: str
    #: ``fn(response, ground_truth, **params) -> float``; exceptions propagate (the pool counts them as errors).
    fn: Callable[..., float]
    params: type[GraderParams]
    #: One line for ``--help`` and the docs.
    description: str

    def bind(self, params: Mapping[str, Any] | None = None) -> GraderParams:
        """``params`` validated by the grader's model (defaults for those left out).

        Raises:
            ValueError: one line naming the grader, the key and what is wrong with it.
        """
        try:
            return self.params(**(params or {}))
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"grader {self.name} parameter {key}: {first['msg']}") from None


#: The registered graders by name, in the order of declaration.
GRADERS: Registry[Grader] = Registry("grader")


def register_grader(grader: Grader) -> Grader:
    """Declare a grader (its name must be a new identifier).

    Raises:
        ValueError: the name is taken or is not an identifier.
    """
    return GRADERS.register(grader.name, grader)


def get_grader(name: str) -> Grader:
    """The grader called ``name``.

    Raises:
        ValueError: an unknown name, in one line listing the registered ones.
    """
    return GRADERS.find(name)
