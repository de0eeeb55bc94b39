"""Megatron-Core's local linear layers under flexible-zb (l3plugin/megatron/split_linears.py): a middle stage of a
real GPTModel, its backward split into B and W with and without the swap, against Megatron's own fused backward.
With Megatron's Function B does every weight product; with the swap B does none of them and W all, and every
gradient is bit-identical to Megatron's. On 1 rank and on TP 2 (the input gradient's all-reduce). Sequence
parallelism: tests/schedule/test_split_linear.py (a GPTModel with it needs CUDA's RNG tracker and Megatron's
sequence-parallel backward a CUDA device)."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tiny_gpt as gpt

SEQ, MBS, LAYERS = 8, 2, 2


class MatmulCount(TorchDispatchMode):
    """Counts the matrix products (mm, bmm, addmm, baddbmm) run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "bmm", "addmm", "baddbmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def middle_stage_split(tp):
    """A GPTModel chunk without embedding and output layer (a middle pipeline stage), fed hidden states: Megatron's
    fused backward, then the split (B then W) with Megatron's Function and with the swap. Returns the
    gradients of each and the matrix products counted in B and W."""
    from l3plugin.megatron.split_linears import splittable_linears
    from l3plugin.mesh.groups import init_mesh
    from l3plugin.schedule.split_backward import backward_input

    mesh = init_mesh(tp=tp)
    config = gpt.gpt_config(LAYERS, tensor_model_parallel_size=tp)
    model = gpt.build_gpt(config, pre_process=False, post_process=False, seq_len=SEQ, tp_size=tp,
                          tp_rank=mesh.coords["tp"])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SEQ, MBS, config.hidden_size, generator=gen)
    g = torch.randn(SEQ, MBS, config.hidden_size, generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(how):
        for p in params:
            p.grad = None
        inp = x.clone().requires_grad_(True)
        model.set_input_tensor(inp)
        b, w = MatmulCount(), MatmulCount()
        if how == "fused":
            out = model(None, None, None)
            with b:
                out.backward(g)
            dx = inp.grad
        else:
            with splittable_linears(model) if how == "swap" else contextlib.nullcontext():
                out = model(None, None, None)
            with b:
                dx, step = backward_input(out, g, inp, params)
            untouched = all(p.grad is None for p in params)
            with w:
                step.run()
            assert untouched or how == "megatron", "B accumulated a weight gradient"
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return {"dx": dx.clone(), "grads": grads, "b_matmuls": b.count, "w_matmuls": w.count}

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    linears = sum(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules())
    out = {"linears": linears, "swapped": None}
    out["fused"], out["megatron"] = run("fused"), run("megatron")
    with splittable_linears(model) as swapped:
        out["swapped"] = swapped
    out["swap"] = run("swap")
    return out


def same(a, b):
    return torch.equal(a["dx"], b["dx"]) and a["grads"].keys() == b["grads"].keys() and all(
        torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


@pytest.mark.parametrize("tp", [1, 2])
def test_swapped_linears_leave_every_weight_product_to_w_bit_identically(ranks, tp):
    for r in ranks.run(tp, middle_stage_split, tp, timeout=120):
        linears = r["linears"]
        assert linears == 4 * LAYERS and r["swapped"] == linears  # qkv, proj, fc1, fc2 per layer
        assert same(r["megatron"], r["fused"]) and same(r["swap"], r["fused"])
        # Megatron's Function: B does the input and the weight product of every linear, W nothing of them.
        assert r["megatron"]["w_matmuls"] == 0
        # Swapped: B keeps one product per linear (plus attention's), W has exactly the weight products.
        assert r["swap"]["w_matmuls"] == linears
        assert r["swap"]["b_matmuls"] == r["megatron"]["b_matmuls"] - linears


def swap_and_restore():
    from l3plugin.megatron.split_linears import splittable_linears
    from l3plugin.mesh.groups import init_mesh

    import gc

    from l3plugin.megatron import split_linears

    init_mesh()
    model = gpt.build_gpt(gpt.gpt_config(1), seq_len=SEQ)
    counts = []
    for _ in range(2):  # the second step takes the linears found at the first
        with splittable_linears([model]) as n:
            counts.append((n, sum("_forward_impl" in vars(m) for m in model.modules())))
    after = sum("_forward_impl" in vars(m) for m in model.modules())
    cached = len(split_linears._LINEARS)
    del model
    gc.collect()
    return counts, after, cached, len(split_linears._LINEARS)


def test_linears_outside_the_step_are_megatrons_again(ranks):
    counts, after, cached, left = ranks.run(1, swap_and_restore, timeout=60)[0]
    assert counts == [(5, 5), (5, 5)] and after == 0  # qkv, proj, fc1, fc2 and the output layer
    assert cached - left == 1  # the cache does not keep a model alive
