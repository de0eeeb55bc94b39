import pytest

from l3plugin.schedule.layers import layer_ranges, layers_per_virtual_stage


def test_even_and_uneven_splits():
    assert layers_per_virtual_stage(8, 2, 2) == [2, 2, 2, 2]
    assert layers_per_virtual_stage(14, 4, 2, first_stage=1, last_stage=1) == [1, 2, 2, 2, 2, 2, 2, 1]
    assert layers_per_virtual_stage(5, 1, 1) == [5]
    assert layers_per_virtual_stage(3, 2, 1, first_stage=1, last_stage=2) == [1, 2]
    assert [list(r) for r in layer_ranges([1, 2, 1])] == [[0], [1, 2], [3]]


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_layers=6, pp_size=2, vpp_size=2), r"num_layers = 6 is not divisible by the 4 remaining virtual stages"),
    (dict(num_layers=0, pp_size=2), r"num_layers=0 is out of range: must be an integer >= 1"),
    (dict(num_layers=8, pp_size=2, vpp_size=0), r"vpp_size=0 is out of range"),
    (dict(num_layers=8, pp_size=4, first_stage=9), r"first_stage=9 is out of range: must be an integer in 0..num_layers \(=8\)"),
    (dict(num_layers=8, pp_size=4, vpp_size=2, first_stage=1, last_stage=2),
     r"num_layers - first_stage - last_stage = 5 is not divisible"),
])
def test_bad_splits_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layers_per_virtual_stage(**kwargs)
