"""Named points of a run where code from outside the package may act: fault injection, tracing, profiling.

A hook is a function ``hook(point: str, **info) -> None``. Hooks are installed in every process of a run
(trainer ranks and generator ranks alike) by the environment variable ``NEMO_DISCO_HOOKS``, a comma-separated list
of ``module:function`` (the modules must be importable, e.g. on ``PYTHONPATH``), loaded the first time a point is
reached; :func:`register` installs one from Python. The hooks run in order, in the thread that reached the point;
an exception in a hook propagates into the run (a hook may stop it), so a hook that only observes should not raise.

The points (keyword arguments in brackets):

- ``"rollouts"`` (``step``): the rollouts of training step ``step`` (1-based) begin, in the process that samples
  them (a trainer rank, or a generator rank with ``algorithm.async_rollouts``);
- ``"grader_send"`` (``process``): an answer is about to be sent to a grading worker, ``process`` (a
  :class:`subprocess.Popen`);
- ``"old_logprobs"`` (``step``): pi_old's log-probs of step ``step`` are made on this rank, before the ranks gather
  them and before the first update;
- ``"checkpoint_written"`` (``step``, ``directory``): this rank has written its part of checkpoint ``step`` into
  the temporary folder ``directory``, before the ranks agree that the checkpoint is complete and it is renamed.

A point without hooks costs a list lookup. tests/faults/inject/faults.py is a complete example: it kills, stops or
hangs a chosen rank at a chosen point to test the run's fault handling.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

#: The environment variable that lists the hooks to install: ``module:function[,module:function...]``.
HOOKS_ENV = "NEMO_DISCO_HOOKS"

#: The points the package reaches (see the module docstring).
POINTS = ("rollouts", "grader_send", "old_logprobs", "checkpoint_written")

Hook = Callable[..., None]

_registered: list[Hook] = []
_from_env: tuple[str, list[Hook]] = ("", [])  # NEMO_DISCO_HOOKS as last read, and its hooks


def load(spec: str) -> Hook:
    """The function named by ``module:function``.

    Raises:
        ValueError: ``spec`` is not ``module:function``, the module cannot be imported or has no such function
            (the message names ``spec`` and the environment variable).
    """
    module_name, sep, function = spec.strip().partition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"{HOOKS_ENV}: {spec!r} is not module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{HOOKS_ENV}: cannot import {module_name!r} of {spec!r}: {err}") from err
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"{HOOKS_ENV}: {module_name!r} has no function {function!r}")
    return fn


def register(hook: Hook) -> None:
    """Install ``hook`` in this process (it runs after those of ``NEMO_DISCO_HOOKS``)."""
    _registered.append(hook)


def clear() -> None:
    """Remove the hooks installed by :func:`register`."""
    _registered.clear()


def _env_hooks() -> list[Hook]:
    global _from_env
    spec = os.environ.get(HOOKS_ENV, "")
    if spec != _from_env[0]:
        _from_env = (spec, [load(s) for s in spec.split(",") if s.strip()])
    return _from_env[1]


def installed() -> list[Hook]:
    """The hooks of this process, in the order they run (loads ``NEMO_DISCO_HOOKS``: call it early to check it).

    Raises:
        ValueError: a hook of ``NEMO_DISCO_HOOKS`` cannot be loaded (see :func:`load`).
    """
    return [*_env_hooks(), *_registered]


def point(name: str, **info: Any) -> None:
    """The run reached point ``name`` (one of :data:`POINTS`): call every hook with ``(name, **info)``."""
    for hook in installed():
        hook(name, **info)
