"""SavedTensorCensus.hold: tensors kept outside autograd counted with the saved ones, each storage once."""

import torch

from l3plugin.debug.saved_tensors import SavedTensorCensus


def test_held_tensors_count_once_with_the_saved_ones_until_released():
    census = SavedTensorCensus()
    x = torch.randn(256, requires_grad=True)  # 1 KiB
    with census.hooks:
        y = (x * x).sum()  # saves x (twice: one storage)
    assert census.live == 1024
    kept = torch.randn(512)  # 2 KiB, held outside autograd
    release = census.hold([kept, kept[:10], x])  # x's storage is already counted
    assert census.live == 1024 + 2048 and census.peak == 3072
    y.backward()  # the saved x leaves; the held one stays counted
    assert census.live == 3072
    release()
    assert census.live == 0 and census.peak == 3072
