"""Bitwise parity helper and the fp64 relative-error helpers."""

import copy

import pytest
import torch

from l3plugin.debug.numerics import (accumulation_error, accumulation_error_table, assert_bitwise_equal,
                                     compare_bitwise, grads_snapshot, relative_error_vs_fp64)


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"loss": torch.tensor(2.5), "embed.weight.grad": torch.randn(8, 4, generator=g),
            "layers.0.weight.grad": torch.randn(4, 4, generator=g),
            "layers.1.weight.grad": torch.randn(4, 4, generator=g, dtype=torch.float64),
            "head.weight.grad": torch.randn(4, 2, generator=g).to(torch.bfloat16)}


def test_identical_dicts_pass():
    a, b = _grads(), _grads()
    assert_bitwise_equal(a, b, step=3)
    report = compare_bitwise(a, b, step=3)
    assert report.equal and report.compared == 5 and str(report) == "bitwise equal at step 3: 5 tensors"


@pytest.mark.parametrize("name", ["layers.0.weight.grad", "layers.1.weight.grad", "head.weight.grad", "loss"])
def test_single_ulp_difference_is_named(name):
    expected, actual = _grads(), _grads()
    flat = actual[name].view(-1)
    flat[-1] = torch.nextafter(flat[-1], torch.tensor(float("inf"), dtype=flat.dtype))
    with pytest.raises(AssertionError) as err:
        assert_bitwise_equal(actual, expected, step=7)
    msg = str(err.value)
    assert f"bitwise mismatch at step 7: first diverging tensor {name!r}" in msg
    assert "1 of" in msg and "max 1 ulp" in msg
    m = compare_bitwise(actual, expected).first
    assert m.name == name and m.count == 1 and m.max_ulp == 1.0 and 0 < m.max_rel_diff < 1e-2
    assert m.first_index == tuple(s - 1 for s in expected[name].shape)


def test_first_divergence_follows_reference_order():
    expected, actual = _grads(), _grads()
    actual["head.weight.grad"] += 1
    actual["embed.weight.grad"][0, 0] *= 2  # earlier in module order: reported first
    report = compare_bitwise(actual, expected, step=1)
    assert report.first.name == "embed.weight.grad" and report.first.first_index == (0, 0)
    assert report.mismatched == ["embed.weight.grad", "head.weight.grad"]


def test_bitwise_means_bits():
    zero, neg_zero = {"x": torch.tensor([0.0])}, {"x": torch.tensor([-0.0])}
    assert not compare_bitwise(zero, neg_zero).equal  # torch.equal would call these equal
    nan = {"x": torch.tensor([float("nan")])}
    assert compare_bitwise(nan, {"x": torch.tensor([float("nan")])}).equal  # same NaN bits


@pytest.mark.parametrize("change,kind", [
    (lambda d: d.pop("layers.0.weight.grad"), "missing"),
    (lambda d: d.__setitem__("extra.grad", torch.zeros(1)), "unexpected"),
    (lambda d: d.__setitem__("loss", torch.tensor([2.5])), "shape"),
    (lambda d: d.__setitem__("loss", torch.tensor(2.5, dtype=torch.float64)), "dtype"),
])
def test_structural_mismatches(change, kind):
    expected, actual = _grads(), _grads()
    change(actual)
    report = compare_bitwise(actual, expected)
    assert not report.equal and report.first.kind == kind


def test_same_order_reference_matches_and_full_batch_does_not():
    """The paper's method: a microbatched run vs (a) a reference accumulating the same microbatches in
    the same order -- bit for bit equal -- and (b) one full-batch backward -- differs only by rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    micro = list(zip(x.chunk(4), y.chunk(4)))

    def microbatched(m):
        total = torch.zeros(())
        for mx, my in micro:
            loss = torch.nn.functional.mse_loss(m(mx), my) / len(micro)
            loss.backward()
            total = total + loss.detach()
        return grads_snapshot(m, total)

    run, same_order, full = (copy.deepcopy(model) for _ in range(3))
    actual = microbatched(run)
    assert list(actual) == ["loss", "0.weight.grad", "0.bias.grad", "2.weight.grad", "2.bias.grad"]
    assert_bitwise_equal(actual, microbatched(same_order), step=0)
    loss = torch.nn.functional.mse_loss(full(x), y)
    loss.backward()
    report = compare_bitwise(actual, grads_snapshot(full, loss), step=0)
    assert not report.equal and report.first.max_rel_diff < 1e-4  # accumulation order, not a bug


def test_relative_error_against_fp64():
    exact = torch.arange(1, 101, dtype=torch.float64) / 3
    assert relative_error_vs_fp64(exact, exact) == 0.0
    err32 = relative_error_vs_fp64(exact.float(), exact)
    err16 = relative_error_vs_fp64(exact.to(torch.bfloat16), exact)
    assert 0 < err32 <= 2.0 ** -24 and 2.0 ** -12 < err16 <= 2.0 ** -8
    with pytest.raises(ValueError, match="shape"):
        relative_error_vs_fp64(exact[:3], exact)


def test_accumulation_error_shows_which_buffers_need_fp32():
    g = torch.Generator().manual_seed(0)
    many_small = [torch.full((64,), 1e-3) + 1e-5 * torch.randn(64, generator=g) for _ in range(512)]
    few = [torch.randn(64, generator=g) for _ in range(2)]
    bf16, fp32 = accumulation_error(many_small, torch.bfloat16), accumulation_error(many_small, torch.float32)
    assert bf16 > 1e-2 and fp32 < 1e-5  # 512 bf16 additions of 1e-3 stall long before 0.512
    table = accumulation_error_table({"two_parts": few, "pp_microbatches": many_small})
    assert [row["name"] for row in table] == ["pp_microbatches", "two_parts"]
    assert set(table[0]) == {"name", "bfloat16", "float32"}
