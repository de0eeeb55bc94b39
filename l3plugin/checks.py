"""Argument checks shared by every room, so a bad value reads the same everywhere: ``name=value is out of
range: must be ...``."""

from __future__ import annotations


def check_int(name: str, value, low: int = 1) -> int:
    """``value`` if it is an int (not a bool) >= ``low``; else a ValueError naming it and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is out of range: must be an integer >= {low}")
    return value
