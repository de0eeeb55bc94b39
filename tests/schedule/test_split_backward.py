"""The generic B / W split (l3plugin/schedule/split_backward.py) against one fused backward: the same input
gradient and the same accumulated parameter gradients, bit for bit, and nothing on the input side run twice."""

import pytest
import torch
from torch import nn

from l3plugin.schedule.split_backward import backward_input


class MatmulFunction(torch.autograd.Function):
    """A custom autograd Function that computes both gradients whatever is asked (as Megatron's linear does)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        MatmulFunction.calls += 1
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2)


class Block(nn.Module):
    """Linear, LayerNorm, a custom Function, a weight used twice, a residual: the shapes an autograd split meets."""

    def __init__(self, hidden, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.custom = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)
        self.shared = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)
        self.scale = nn.Parameter(torch.ones(hidden))  # used on the weight side only (a cast-like branch)

    def forward(self, x):
        h = torch.tanh(self.linear(self.norm(x)))
        h = MatmulFunction.apply(h, self.custom) + x
        h = torch.relu(h @ self.shared) @ (self.shared * self.scale)
        return h


def make(hidden=6, frozen=()):
    model = nn.Sequential(Block(hidden, 0), Block(hidden, 1))
    for name, param in model.named_parameters():
        param.requires_grad_(not any(name.startswith(prefix) for prefix in frozen))
    return model


def fused(model, inputs, grads):
    """Megatron's backward per micro-batch: input gradients, parameter gradients accumulated in order."""
    input_grads = []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_(True)
        model(x).backward(g)
        input_grads.append(x.grad)
    return input_grads, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def split(model, inputs, grads, w_late=True):
    input_grads, weights = [], []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_(True)
        out = model(x)
        out.data = torch.empty(1)  # as Megatron's deallocate_pipeline_outputs leaves a sent output
        dx, w = backward_input(out, g, x, model.parameters())
        input_grads.append(dx)
        if w_late:
            weights.append(w)
        else:
            w.run()
    for w in weights:  # every B first, then the W steps in B order
        w.run()
    return input_grads, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def data(m=3, hidden=6):
    gen = torch.Generator().manual_seed(5)
    return ([torch.randn(4, 2, hidden, generator=gen) for _ in range(m)],
            [torch.randn(4, 2, hidden, generator=gen) for _ in range(m)])


@pytest.mark.parametrize("frozen", [(), ("0.",), ("1.linear", "1.norm")], ids=["all", "first-block", "middle"])
def test_split_equals_fused_bitwise(frozen):
    inputs, grads = data()
    ref_dx, ref = fused(make(frozen=frozen), inputs, grads)
    MatmulFunction.calls = 0
    dx, got = split(make(frozen=frozen), inputs, grads)
    assert MatmulFunction.calls == 2 * len(inputs)  # once per use per micro-batch: W hands on what B computed
    assert all(torch.equal(a, b) for a, b in zip(dx, ref_dx))
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref), [
        n for n in ref if not torch.equal(got[n], ref[n])]


def test_w_recomputes_no_input_gradient_and_fires_accumulation_hooks():
    model = make()
    inputs, grads = data(m=1)
    x = inputs[0].clone().requires_grad_(True)
    out = model(x)
    dx, w = backward_input(out, grads[0], x, model.parameters())
    assert all(p.grad is None for p in model.parameters()) and x.grad is None
    fired = []
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    w.run()
    assert sorted(fired) == sorted(n for n, _ in model.named_parameters())
    assert x.grad is None  # W put nothing into the input
    with pytest.raises(RuntimeError, match="has run already"):
        w.run()


def test_without_an_input_gradient_w_is_the_whole_backward():
    model = make()
    inputs, grads = data(m=1)
    out = model(inputs[0])  # the first stage: its input needs no gradient
    dx, w = backward_input(out, grads[0], inputs[0], model.parameters())
    assert dx is None and all(p.grad is None for p in model.parameters())
    w.run()
    _, ref = fused(make(), inputs, grads)
    assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters())
    loss = make()(inputs[0]).sum()  # a scalar loss: gradient 1 when none is given
    assert backward_input(loss, None, None, [])[0] is None
    assert backward_input(torch.ones(2), None, None, []) == (None, None)  # nothing needs a gradient


def test_a_w_step_names_the_gradients_it_keeps_until_it_runs():
    model = make()
    inputs, grads = data(m=1)
    x = inputs[0].clone().requires_grad_(True)
    _, w = backward_input(model(x), grads[0], x, model.parameters())
    kept = w.kept_tensors()
    assert kept and all(isinstance(t, torch.Tensor) for t in kept)
    w.run()
    assert w.kept_tensors() == []
