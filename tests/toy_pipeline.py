"""A tiny pipeline-parallel model for schedule tests, with a serial reference that accumulates identically.

The model is a stack of ``num_layers`` Linear+tanh layers whose weights depend only on (seed, layer id),
so a pipelined run (any p, v, split) and the serial run hold exactly the same numbers. ``frozen``: ids of
layers whose parameters do not train (requires_grad False), the same in both runs. Each microbatch's
loss is mean squared error, scaled as Megatron scales it (divided by the number of microbatches).
Gradients of every layer are accumulated over microbatches in increasing microbatch order in both runs,
so a correct schedule matches the serial reference bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn


def layer_weights(layer_id: int, hidden: int, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed * 100_003 + layer_id)
    weight = torch.randn(hidden, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    bias = torch.randn(hidden, generator=gen, dtype=torch.float64) * 0.1
    return weight.to(dtype), bias.to(dtype)


def make_microbatches(num_microbatches: int, seq_length: int, micro_batch_size: int, hidden: int,
                      seed: int = 0, dtype=torch.float32) -> list[dict]:
    gen = torch.Generator().manual_seed(seed + 7)
    shape = (seq_length, micro_batch_size, hidden)  # Megatron's [s, b, h]
    return [{"x": torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype),
             "y": torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)}
            for _ in range(num_microbatches)]


def split_layers(num_layers: int, num_stages: int, layers_per_stage: list[int] | None = None):
    """Layer ids of each virtual stage; even split unless ``layers_per_stage`` is given."""
    from l3plugin.schedule.layers import layer_ranges, layers_per_virtual_stage

    if layers_per_stage is None:
        layers_per_stage = layers_per_virtual_stage(num_layers, num_stages)
    if len(layers_per_stage) != num_stages or sum(layers_per_stage) != num_layers:
        raise ValueError(f"layers_per_stage={layers_per_stage} must have {num_stages} entries "
                         f"summing to num_layers={num_layers}")
    return [list(r) for r in layer_ranges(layers_per_stage)]


class ToyChunk(nn.Module):
    """One model chunk (virtual stage). Speaks the protocol Megatron's schedules expect of a model."""

    def __init__(self, config, layer_ids, hidden, *, is_first, is_last, seed=0, dtype=torch.float32, frozen=()):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.layer_ids = list(layer_ids)
        self.is_first, self.is_last = is_first, is_last
        self.layers = nn.ModuleList()
        for lid in self.layer_ids:
            layer = nn.Linear(hidden, hidden, dtype=dtype)
            w, b = layer_weights(lid, hidden, seed, dtype)
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.copy_(b)
            layer.requires_grad_(lid not in frozen)
            self.layers.append(layer)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x):
        h = x if self.is_first else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h

    def grads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Gradients of the trainable layers."""
        return {lid: (layer.weight.grad.clone(), layer.bias.grad.clone())
                for lid, layer in zip(self.layer_ids, self.layers) if layer.weight.requires_grad}


def mse_loss_func(target, output):
    loss = ((output - target) ** 2).mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """Megatron forward_step_func: every chunk consumes its microbatches in order."""
    import functools

    batch = next(data_iterator)
    output = model(batch["x"])
    return output, functools.partial(mse_loss_func, batch["y"])


def flexible_step(chunks, batches, *, seq_length, micro_batch_size, forward_step_func=forward_step,
                  **options) -> dict:
    """One step of l3plugin's flexible schedule over ``batches`` on this rank's ``chunks`` (``options``: its
    own keywords, e.g. receive_posting, waits): {"losses": the last stage's losses (empty elsewhere), "grads":
    {layer id: (dW, db)}}."""
    from l3plugin.megatron import forward_backward_pipelining_flexible

    out = forward_backward_pipelining_flexible(
        forward_step_func=forward_step_func, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch_size, **options)
    return {"losses": [d["loss"] for d in out],
            "grads": {lid: g for chunk in chunks for lid, g in chunk.grads().items()}}


def build_chunks(config, *, num_layers, hidden, pp_rank, pp_size, vpp_size=1, layers_per_stage=None,
                 seed=0, dtype=torch.float32, frozen=()) -> list[ToyChunk]:
    """This pipeline rank's model chunks: chunk c is virtual stage c*pp_size + pp_rank."""
    stages = split_layers(num_layers, pp_size * vpp_size, layers_per_stage)
    chunks = []
    for c in range(vpp_size):
        s = c * pp_size + pp_rank
        chunks.append(ToyChunk(config, stages[s], hidden, is_first=s == 0,
                               is_last=s == len(stages) - 1, seed=seed, dtype=dtype, frozen=frozen))
    return chunks


def serial_reference(microbatches, *, num_layers, hidden, seed=0, dtype=torch.float32, loss_divisor=None,
                     frozen=()):
    """Losses and per-layer gradients of the whole model run microbatch by microbatch in one process.

    ``loss_divisor`` (default: the number of microbatches) lets a prefix of a step be reproduced.
    """
    chunk = ToyChunk(None, range(num_layers), hidden, is_first=True, is_last=True, seed=seed, dtype=dtype,
                     frozen=frozen)
    losses = []
    m = loss_divisor or len(microbatches)
    for batch in microbatches:
        loss, _ = mse_loss_func(batch["y"], chunk(batch["x"]))
        losses.append(loss.detach().clone())
        loss = loss / m  # as Megatron's forward_step_calc_loss does (times cp size 1, over microbatches)
        if loss.requires_grad:  # else every layer is frozen
            loss.backward()
    return losses, chunk.grads()


def assert_matches_serial(results, microbatches, *, num_layers, hidden, frozen=()):
    """Ranks' results ({"grads": {layer: (dW, db)}, "losses": [...]}, last stage last) equal the serial
    reference bit for bit (l3plugin.debug.numerics names the first diverging tensor otherwise)."""
    from l3plugin.debug.numerics import assert_bitwise_equal

    ref_losses, ref_grads = serial_reference(microbatches, num_layers=num_layers, hidden=hidden, frozen=frozen)
    grads = {}
    for r in results:
        grads.update(r["grads"])

    def flat(losses, per_layer):
        out = {f"loss[{i}]": loss for i, loss in enumerate(losses)}
        for lid in sorted(per_layer):
            out[f"layers.{lid}.weight.grad"], out[f"layers.{lid}.bias.grad"] = per_layer[lid]
        return out

    assert_bitwise_equal(flat(results[-1]["losses"], grads), flat(ref_losses, ref_grads))
