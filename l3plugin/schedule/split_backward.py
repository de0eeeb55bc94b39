"""A backward split into B (the input gradient) and W (the weight gradients), for any module, with autograd.

The zero-bubble plan (zero_bubble.py) runs a virtual stage's backward as two steps: B computes the gradient of
the stage's input (the previous stage waits for it) and W, later, the gradients of its parameters. Plain torch,
no framework: :func:`backward_input` is B and returns a :class:`WeightStep` whose ``run()`` is W.

How the work is divided, on the stage's autograd graph (from its output back to its input and parameters):

- The *input side* is every node from which the input's gradient accumulator is reachable. B runs
  ``torch.autograd.grad(output, input, retain_graph=True)``: autograd runs only the input side, and a node
  there computes only the outputs the input needs (an ``AddmmBackward`` skips its weight product).
- A parameter's *intermediates* are the input-side nodes nearest to it: walking from the parameter towards the
  output, the first nodes that are on the input side (for a linear layer, its ``AddmmBackward``). Parameters
  that share an intermediate form one group. During B a pre-hook on every intermediate keeps the gradient it
  received, and a post-hook what it computed.
- W, per group, calls ``torch.autograd.backward(..., inputs=the group's parameters)``: where the intermediate
  already computed its parameter-side outputs in B (custom autograd Functions compute every output, e.g.
  Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``), those are handed on from the next nodes,
  so nothing runs twice (one autograd call for all of those); otherwise the intermediate runs again from the
  gradient kept in B, for its parameter-side outputs only (a call per group). Nothing on the input side runs
  again. A group with several intermediates that
  are run again gets pre-hooks that pin each to its kept gradient (one may lie on another's way to a shared
  parameter).
- Gradients reach ``.grad`` through the parameters' own ``AccumulateGrad`` nodes, as in one backward: gradient
  hooks (DDP, ZeRO) fire in W, and each parameter's gradient of a micro-batch is the same number, so running
  a chunk's W steps in its B order accumulates bit for bit as the fused backward does.
- Without an input needing a gradient (the first stage, the first trainable stage) B computes nothing and W is
  the whole backward (the same call as a fused backward).

B keeps the graph (``retain_graph``) until W: the stage's activations stay alive from its forward to its W,
which is what the plan counts as in flight.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class WeightStep:
    """What a B step leaves for its W step: ``run()`` it once (it accumulates the weight gradients)."""

    def __init__(self, calls, retain_graph=True):
        self._calls = calls  # [(roots, gradients, inputs or None, [(node, kept gradients)] to pin, or None)]
        self._retain = retain_graph

    def kept_tensors(self) -> list:
        """The gradients this W step will start from, kept since its B (empty once it has run)."""
        return [grad for _, grads, _, _ in self._calls or () for grad in grads if grad is not None]

    def run(self) -> None:
        calls, self._calls = self._calls, None
        if calls is None:
            raise RuntimeError("this W step has run already: each B step's weight gradients run once")
        for roots, grads, inputs, pins in calls:
            handles = [node.register_prehook(lambda _grads, kept=kept: kept) for node, kept in pins or ()]
            try:
                torch.autograd.backward(roots, grad_tensors=grads, inputs=inputs, retain_graph=self._retain)
            finally:
                for handle in handles:
                    handle.remove()


def _consumers(root) -> dict:
    """{node: the nodes whose backward feeds it} for every node reachable from ``root`` (root included)."""
    users = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in users:
                users[child] = []
                stack.append(child)
            users[child].append(node)
    return users


def _upwards(start, users, stop=frozenset()) -> tuple[set, set]:
    """(nodes reached from ``start`` walking towards the output without entering ``stop``, the ``stop`` nodes
    met)."""
    seen, met, stack = {start}, set(), [start]
    while stack:
        for user in users[stack.pop()]:
            if user in stop:
                met.add(user)
            elif user not in seen:
                seen.add(user)
                stack.append(user)
    return seen, met


def _groups(params, users, input_side):
    """[(parameters, their intermediates, their parameter-side nodes)]: parameters sharing an intermediate in
    one group (module docstring)."""
    found = []  # (param, intermediates, parameter-side nodes)
    for param in params:
        node = get_gradient_edge(param).node
        if node in users:  # else unused by this micro-batch
            side, met = _upwards(node, users, input_side)
            found.append(([param], met, side))
    merged = []
    for group in found:  # union by shared intermediates
        keep = []
        for other in merged:
            if other[1] & group[1]:
                group = (other[0] + group[0], other[1] | group[1], other[2] | group[2])
            else:
                keep.append(other)
        merged = keep + [group]
    return merged


def _full_backward(root, grad) -> WeightStep:
    return WeightStep([([root], [grad], None, [])], retain_graph=False)


def backward_input(output: torch.Tensor, output_grad, input_tensor, params) -> tuple[torch.Tensor | None,
                                                                                      WeightStep | None]:
    """B: the gradient of ``input_tensor`` (a leaf the stage's forward read) given ``output_grad``, the gradient
    of ``output`` (None: ``output`` is a scalar loss, gradient 1), and the W step that accumulates the
    gradients of ``params`` (those with ``requires_grad``) later. Returns (input gradient, W step); the input
    gradient is None where the input needs none (W is then the whole backward), and the W step None where
    ``output`` needs no gradient (nothing to do, as a fused backward would skip it)."""
    if not output.requires_grad:
        return None, None
    root = get_gradient_edge(output)
    grad = torch.ones_like(output) if output_grad is None else output_grad
    if input_tensor is None or not input_tensor.requires_grad:
        return None, _full_backward(root, grad)
    users = _consumers(root.node)
    input_node = get_gradient_edge(input_tensor).node
    if input_node not in users:  # the output does not depend on the input
        return None, _full_backward(root, grad)
    input_side, _ = _upwards(input_node, users)
    groups = _groups([p for p in params if p.requires_grad], users, input_side)

    kept: dict = {}  # intermediate -> [gradients it received, gradients it computed]
    handles = []
    try:
        for node in {node for _, met, _ in groups for node in met}:
            kept[node] = [None, None]
            handles.append(node.register_prehook(lambda grads, node=node: kept[node].__setitem__(0, grads)))
            handles.append(node.register_hook(lambda outs, _grads, node=node: kept[node].__setitem__(1, outs)))
        (input_grad,) = torch.autograd.grad([root], [input_tensor], grad_outputs=[grad], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    calls = [call for group in groups if (call := _weight_call(group, kept)) is not None]
    # Calls starting on the parameter side never reach the input side: one autograd call runs them all.
    handed = [call for call in calls if call[3] is None]
    merged = [([root for call in handed for root in call[0]], [grad for call in handed for grad in call[1]],
               [param for call in handed for param in call[2]], [])] if handed else []
    return input_grad, WeightStep(merged + [call for call in calls if call[3] is not None])


def _weight_call(group, kept):
    """One ``torch.autograd.backward`` call's arguments for a group (module docstring), None if no gradient
    reached it in B."""
    params, intermediates, side = group
    reached = [node for node in intermediates if kept[node][0] is not None]
    handed = []  # (next node, its input number, gradient) computed in B on the parameter side
    complete = True
    for node in reached:
        if kept[node][1] is None:  # its outputs were not seen: run it again
            complete = False
            continue
        for (child, number), out in zip(node.next_functions, kept[node][1]):
            if child in side:
                if out is None:
                    complete = False
                else:
                    handed.append((child, number, out))
    if not reached:
        return None
    if complete:
        if not handed:
            return None
        return ([GradientEdge(child, number) for child, number, _ in handed], [out for *_, out in handed],
                params, None)  # None: no pins, and it starts on the parameter side
    roots, grads = [], []
    for node in reached:
        for number, received in enumerate(kept[node][0]):
            if received is not None:
                roots.append(GradientEdge(node, number))
                grads.append(received)
    pins = [(node, kept[node][0]) for node in reached] if len(reached) > 1 else []
    return roots, grads, params, pins
