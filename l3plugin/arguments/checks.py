"""Argument checks shared by every room, so a bad value reads the same everywhere: ``name=value is out of
range: must be an integer >= 1`` (or ``in 0..cp_size (=3)``); ``name=value is invalid: must be a finite number
> 0`` (or ``of seconds > 0``, ``in (0, 1]``)."""

from __future__ import annotations

import math


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


def check_number(name: str, value, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, unit: str = "", note: str = "") -> float:
    """``value`` as a float if it is a finite int or float (not a bool) in the range ``low``..``high`` (None: no
    end; ``low_open`` / ``high_open``: that end excluded); else a ValueError naming it, the value and the range
    (``unit``, e.g. "seconds", and ``note``, e.g. "GiB per GPU", say what the number is)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            span = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            span = f"{'>' if low_open else '>='} {low:g}"
        elif high is not None:
            span = f"{'<' if high_open else '<='} {high:g}"
        else:
            span = ""
        words = " ".join(part for part in ("must be a finite number", f"of {unit}" if unit else "", span) if part)
        raise ValueError(f"{name}={value!r} is invalid: {words}{f' ({note})' if note else ''}")
    return float(value)
