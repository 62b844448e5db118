"""A call recorder for tests that check the order in which objects are used."""

from __future__ import annotations


class Recorder:
    """Forwards every call to the real object and writes it into a shared log."""

    def __init__(self, name: str, obj: object, log: list[str]) -> None:
        self._name, self._obj, self._log = name, obj, log

    def __getattr__(self, attr: str):  # noqa: ANN204
        value = getattr(self._obj, attr)
        if not callable(value):
            return value

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            shown = [repr(a) for a in args if not hasattr(a, "__next__")] + [f"{k}={v!r}" for k, v in kwargs.items()]
            self._log.append(f"{self._name}.{attr}({', '.join(shown)})")
            return value(*args, **kwargs)

        return call
