"""split_linear (l3plugin/schedule/split_linear.py): the same numbers as one fused backward, B without a weight
product, W with exactly the weight products; tensor-parallel (all-reduce) and sequence-parallel (all-gather,
reduce-scatter) layouts on 2 gloo ranks against an unsharded fp64 reference."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from l3plugin.schedule.split_backward import backward_input
from l3plugin.schedule.split_linear import split_linear


class Products(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


def two_layers(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.nn.Parameter(torch.randn(8, 6, generator=gen, dtype=dtype))
    b1 = torch.nn.Parameter(torch.randn(8, generator=gen, dtype=dtype))
    w2 = torch.nn.Parameter(torch.randn(6, 8, generator=gen, dtype=dtype))
    return [w1, b1, w2], lambda x: split_linear(torch.tanh(split_linear(x, w1, b1)), w2)


def test_split_leaves_the_weight_products_to_w_and_matches_the_fused_backward_bitwise():
    params, f = two_layers()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 2, 6, generator=gen) for _ in range(3)]
    gs = [torch.randn(5, 2, 6, generator=gen) for _ in range(3)]
    fused_dx = []
    for x, g in zip(xs, gs):  # fused, micro-batch after micro-batch
        x = x.clone().requires_grad_(True)
        f(x).backward(g)
        fused_dx.append(x.grad)
    fused = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    steps, split_dx = [], []
    for x, g in zip(xs, gs):  # every B, then the W steps in B order
        x = x.clone().requires_grad_(True)
        out = f(x)
        with Products() as b:
            dx, step = backward_input(out, g, x, params)
        assert b.count == 2 and all(p.grad is None for p in params)  # the two input products only
        split_dx.append(dx)
        steps.append(step)
    for step in steps:
        with Products() as w:
            step.run()
        assert w.count == 2  # the two weight products
    assert all(torch.equal(a, b) for a, b in zip(split_dx, fused_dx))
    assert all(torch.equal(p.grad, ref) for p, ref in zip(params, fused))


def test_forward_and_gradients_are_the_linear_layers():
    params, f = two_layers(dtype=torch.float64)
    w1, b1, w2 = params
    x = torch.randn(5, 2, 6, dtype=torch.float64, requires_grad=True)
    out = f(x)
    assert torch.equal(out, torch.matmul(torch.tanh(torch.matmul(x, w1.t()) + b1), w2.t()))
    ref = torch.autograd.grad((torch.tanh(x @ w1.t() + b1) @ w2.t()).sum(), [x, *params])
    got = torch.autograd.grad(out.sum(), [x, *params])
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, ref))


def test_bad_arguments_name_the_fix():
    w = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="cannot both be True"):
        split_linear(torch.randn(2, 4), w, allreduce_dgrad=True, sequence_parallel=True, group=object())
    with pytest.raises(ValueError, match="need the tensor-parallel group"):
        split_linear(torch.randn(2, 4), w, allreduce_dgrad=True)


def tp_column_then_row(sequence_parallel):
    """TP 2: a column-parallel layer (input replicated: its gradient all-reduced; or a sequence shard: gathered,
    its gradient reduce-scattered), tanh, a row-parallel layer (output summed over TP by the caller, as Megatron
    does outside the linear). fp64. Returns this rank's pieces, the split's and the fused backward's."""
    import torch.distributed as dist

    rank, group = dist.get_rank(), dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    seq, hidden, ffn = 6, 4, 10
    x = torch.randn(seq, 2, hidden, generator=gen, dtype=torch.float64)
    g = torch.randn(seq, 2, hidden, generator=gen, dtype=torch.float64)
    w1 = torch.randn(ffn, hidden, generator=gen, dtype=torch.float64)
    b1 = torch.randn(ffn, generator=gen, dtype=torch.float64)
    w2 = torch.randn(hidden, ffn, generator=gen, dtype=torch.float64)
    rows = slice(rank * seq // 2, (rank + 1) * seq // 2)
    cols = slice(rank * ffn // 2, (rank + 1) * ffn // 2)
    params = [torch.nn.Parameter(w1[cols].clone()), torch.nn.Parameter(b1[cols].clone()),
              torch.nn.Parameter(w2[:, cols].clone())]
    local_x = x[rows].clone() if sequence_parallel else x.clone()

    def forward(inp):
        h = torch.tanh(split_linear(inp, params[0], params[1], allreduce_dgrad=not sequence_parallel,
                                    sequence_parallel=sequence_parallel, group=group))
        partial = split_linear(h, params[2])
        return partial  # the caller sums over TP (all-reduce, or reduce-scatter with sequence parallelism)

    out = {}
    for how in ("fused", "split"):
        for p in params:
            p.grad = None
        inp = local_x.clone().requires_grad_(True)
        partial = forward(inp)
        if how == "fused":
            partial.backward(g)
            dx = inp.grad
        else:
            dx, step = backward_input(partial, g, inp, params)
            step.run()
        out[how] = [dx, *(p.grad.clone() for p in params)]
    # The unsharded reference: the full layers in one piece, the same output gradient.
    ref_x = x.clone().requires_grad_(True)
    full = [w1.clone().requires_grad_(True), b1.clone().requires_grad_(True), w2.clone().requires_grad_(True)]
    (torch.tanh(ref_x @ full[0].t() + full[1]) @ full[2].t()).backward(g)
    out["reference"] = [ref_x.grad[rows] if sequence_parallel else ref_x.grad, full[0].grad[cols],
                        full[1].grad[cols], full[2].grad[:, cols]]
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["allreduce", "sequence-parallel"])
def test_tensor_parallel_layouts_match_the_unsharded_layers(ranks, sequence_parallel):
    for r in ranks.run(2, tp_column_then_row, sequence_parallel, timeout=60):
        assert all(torch.equal(a, b) for a, b in zip(r["split"], r["fused"]))
        assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(r["split"], r["reference"]))


def test_an_input_without_gradient_costs_no_input_product():
    params, f = two_layers()
    x = torch.randn(5, 2, 6)  # e.g. a frozen embedding's output
    out = f(x)
    with Products() as count:
        out.backward(torch.ones_like(out))
    assert count.count == 3  # the second layer's input product and both weight products; not the first's input
    assert all(p.grad is not None for p in params)
