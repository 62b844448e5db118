"""The registries of pluggable parts: names registered once, looked up in one line."""

import pytest

from nemo_disco import generators, rewards
from nemo_disco.registry import Registry


def test_a_part_registers_once_under_an_identifier_and_is_found_by_name():
    parts = Registry("widget")
    assert parts.register("a", 1) == 1 and parts.register("b", 2) == 2
    assert parts.find("b") == 2 and list(parts) == ["a", "b"]
    with pytest.raises(ValueError, match=r"^widget 'a' is already registered$"):
        parts.register("a", 3)
    with pytest.raises(ValueError, match=r"^widget name 'a-b' must be an identifier$"):
        parts.register("a-b", 3)
    with pytest.raises(ValueError, match=r"^unknown widget 'c'; registered: a, b$"):
        parts.find("c")
    assert parts == {"a": 1, "b": 2}


def test_the_backends_and_the_graders_are_registries():
    assert isinstance(generators.BACKENDS, Registry) and generators.BACKENDS.kind == "generator backend"
    assert isinstance(rewards.GRADERS, Registry) and rewards.GRADERS.kind == "grader"
    with pytest.raises(ValueError, match="reserved"):
        generators.register_backend(generators.Backend("auto", generators.HFParams, "x:Y", "auto"))
