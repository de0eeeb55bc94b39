"""l3plugin/arguments/checks.py: the shared argument checks give one wording everywhere (name, value, valid range)."""

import math

import pytest

from l3plugin.arguments.checks import check_number


@pytest.mark.parametrize("value, bounds, message", [
    (0, dict(low=0, low_open=True, unit="seconds"), "t=0 is invalid: must be a finite number of seconds > 0"),
    (math.nan, dict(low=0), "t=nan is invalid: must be a finite number >= 0"),
    (math.inf, dict(low=0, low_open=True, note="GiB per GPU"), "t=inf is invalid: must be a finite number > 0 "
                                                              "(GiB per GPU)"),
    (1.5, dict(low=0, high=1, low_open=True), r"t=1.5 is invalid: must be a finite number in (0, 1]"),
    (0.0, dict(low=0, high=1, low_open=True), r"t=0.0 is invalid: must be a finite number in (0, 1]"),
    (1, dict(low=0, high=1, high_open=True), r"t=1 is invalid: must be a finite number in [0, 1)"),
    (3, dict(high=2.5), "t=3 is invalid: must be a finite number <= 2.5"),
    (True, {}, "t=True is invalid: must be a finite number"),
    ("2", dict(low=0), "t='2' is invalid: must be a finite number >= 0"),
    (-math.inf, {}, "t=-inf is invalid: must be a finite number"),
])
def test_a_bad_number_names_the_parameter_value_and_range(value, bounds, message):
    with pytest.raises(ValueError) as err:
        check_number("t", value, **bounds)
    assert str(err.value) == message


def test_a_good_number_comes_back_as_a_float():
    assert check_number("t", 3, 0, low_open=True) == 3.0 and isinstance(check_number("t", 3), float)
    assert check_number("t", 0, 0) == 0.0
    assert check_number("t", 1.0, 0, 1, low_open=True) == 1.0
    assert check_number("t", -2.5) == -2.5  # no bounds: any finite number
