"""The memory census (bench/zero.py live_tensors) counts what is held, not what it holds itself.

gc.get_objects() hands every tensor a Python reference. A tensor that only C++ held at that moment (a gloo worker
about to drop a finished all-reduce's buffer) was then kept alive by the census and counted: stock ZeRO-2 read
4.00 instead of 2.00 B/param in about one census of ten (tests/zero/test_zero_carry_memory.py). Here a
torch.futures.Future stands for the C++ holder and a thread drops it shortly after the census starts.
"""

import sys
import threading
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import zero  # noqa: E402
from zero import live_tensors, python_held  # noqa: E402


def held_by_cpp_only(numel):
    """A tensor whose only holder is a Future (C++), the Future in a one-element list, and the storage's pointer."""
    future = torch.futures.Future()
    tensor = torch.ones(numel)
    future.set_result(tensor)
    return [future], tensor.untyped_storage().data_ptr()


def test_a_tensor_whose_cpp_holder_lets_go_during_the_census_is_not_counted(monkeypatch):
    holder, ptr = held_by_cpp_only(4096)
    release = threading.Timer(0.02, holder.clear)

    def python_held_then_release(tensors):  # the census has seen the tensor: its holder lets go a moment later
        held = python_held(tensors)
        release.start()
        return held

    monkeypatch.setattr(zero, "python_held", python_held_then_release)
    try:
        census = zero.live_tensors(settle_s=10.0)
    finally:
        release.join()
    assert ptr not in census


def test_a_tensor_cpp_keeps_holding_is_counted_after_the_wait():
    holder, ptr = held_by_cpp_only(4096)
    census = live_tensors(settle_s=0.05)
    assert census[ptr][0] == 4096 * 4
    holder.clear()


def test_python_held_sees_containers_grads_and_bases_not_cpp_only_tensors():
    base = torch.zeros(8, requires_grad=True)
    base.grad = torch.ones(8)  # autograd keeps .grad on the C++ side: held through its tensor
    param = torch.zeros(8, requires_grad=True)
    param.grad = torch.ones(8)
    kept = {"view": base.detach()[:4], "param": param}  # held by a dict; the view's ._base through C++ only
    holder, _ = held_by_cpp_only(16)
    tensors = [base, base.grad, param, param.grad, kept["view"], kept["view"]._base, holder[0].value()]
    ids = [id(t) for t in tensors]
    del base, param
    held = python_held(tensors)  # base is held by this list only, which the census leaves out
    assert [i in held for i in ids] == [False, False, True, True, True, True, False]
