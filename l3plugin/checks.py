"""Argument checks shared by every room, so a bad value reads the same everywhere: ``name=value is out of
range: must be an integer >= 1`` (or ``in 0..cp_size (=3)``)."""

from __future__ import annotations


def check_int(name: str, value, low: int = 1, high: int | None = None, high_name: str = "") -> int:
    """``value`` if it is an int (not a bool) in ``low``..``high`` (``high`` None: no upper end); else a
    ValueError naming it and the range (``high_name``: what the upper end is, e.g. "num_microbatches")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        if high is None:
            span = f">= {low}"
        else:
            span = f"in {low}..{f'{high_name} (={high})' if high_name else high}"
        raise ValueError(f"{name}={value!r} is out of range: must be an integer {span}")
    return value
