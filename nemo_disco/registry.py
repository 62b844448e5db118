"""Named declarations of one kind of pluggable part: a dict in declaration order, with one-line errors.

The generator backends (:data:`nemo_disco.generators.BACKENDS`) and the graders
(:data:`nemo_disco.rewards.GRADERS`) are each a :class:`Registry`: a part registers under its name once, beside its
code, and is looked up by that name (the ``backend`` / ``grader`` key of its config section).
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """The registered parts of one kind by name, in order of declaration.

    Args:
        kind: the parts' kind in messages ("grader", "generator backend").
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str, part: T) -> T:
        """Add ``part`` under ``name``.

        Raises:
            ValueError: ``name`` is not an identifier or is taken.
        """
        if not name.isidentifier():
            raise ValueError(f"{self.kind} name {name!r} must be an identifier")
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = part
        return part

    def find(self, name: str) -> T:
        """The part called ``name``.

        Raises:
            ValueError: an unknown name, in one line listing the registered ones.
        """
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self)}")
        return self[name]
