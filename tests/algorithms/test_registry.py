"""The name -> function registry used for losses, advantages, KL estimators and aggregation modes."""

from __future__ import annotations

import pytest

from megatron_rl.algorithms.registry import Registry


def test_register_get_and_names():
    reg: Registry = Registry("widget")

    @reg.register("b")
    def b() -> int:
        return 2

    @reg.register("a")
    def a() -> int:
        return 1

    assert reg.get("a") is a and reg.get("b")() == 2
    assert reg.names() == ("a", "b")
    assert "a" in reg and "c" not in reg


def test_unknown_and_duplicate_names():
    reg: Registry = Registry("widget")
    reg.register("x")(lambda: None)
    with pytest.raises(ValueError, match=r"unknown widget 'y'; valid names: x"):
        reg.get("y")
    with pytest.raises(ValueError, match=r"unknown widget \['x'\]"):
        reg.get(["x"])
    with pytest.raises(ValueError, match="widget 'x' is already registered"):
        reg.register("x")(lambda: None)
