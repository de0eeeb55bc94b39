"""Per-layer costs of a model whose layers differ: self-attention ("S") and cross-attention ("X") layers,
each trainable or frozen, plus the embedding ("E") and the output head with its loss ("H").

Forward cost is FLOPs per micro-batch (2 per weight per token, plus attention); text tokens T pass through
every layer, a cross-attention layer also projects the I image tokens to K and V and attends from T to I
(Llama 3's multimodal layers, paper section 3.2: I = 1.2K-3K image tokens against T < 200 text tokens, so
one X layer costs several S layers). Backward: a trainable layer computes input and weight gradients (2x
its forward); a frozen layer computes only its input gradient (1x its forward), and only if something
trainable comes before it: a frozen prefix needs no backward at all, nor the activations for one.
Activation bytes saved for backward are bf16 tensors per micro-batch, as planner/costs.py counts them.
"""

from __future__ import annotations

from l3plugin.schedule.balance import LayerCost

from .costs import BF16, FP32
from .models import ModelSpec

KINDS = {"S": "self-attention layer", "X": "cross-attention layer"}
FREEZABLE = {"S": "self-attention layers", "X": "cross-attention layers", "E": "the embedding",
             "H": "the output head"}


def check_kinds(kinds: str, frozen: str = "") -> None:
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"--kinds={kinds!r} is invalid: one letter per layer in model order, "
                         + ", ".join(f"{k} = {v}" for k, v in KINDS.items()) + " (e.g. SSSSXSSSSX)")
    if set(frozen) - set(FREEZABLE):
        raise ValueError(f"--frozen={frozen!r} is invalid: letters among "
                         + ", ".join(f"{k} ({v})" for k, v in FREEZABLE.items()))


def model_layer_costs(model: ModelSpec, kinds: str, *, text_seq: int, image_tokens: int = 0, frozen: str = "",
                      micro_batch: int = 1) -> tuple[LayerCost, list[LayerCost], LayerCost]:
    """(embedding, [layer costs in model order], head) in FLOPs and bytes per micro-batch."""
    check_kinds(kinds, frozen)
    if "X" in kinds and image_tokens < 1:
        raise ValueError(f"--image-tokens={image_tokens} is out of range: cross-attention layers (X) need >= 1")
    h, f, kv, heads = model.hidden_size, model.ffn_hidden_size, model.kv_dim, model.num_attention_heads
    t, i = micro_batch * text_seq, micro_batch * image_tokens
    mlp = 2.0 * t * 3 * h * f
    forward = {
        "S": model.layer_forward_flops(text_seq) * micro_batch,
        "X": 2.0 * t * 2 * h * h + 2.0 * i * 2 * h * kv + 4.0 * t * i * h / micro_batch + mlp,
    }
    # Norm inputs/outputs and the MLP's (4h + 3f per text token), Q and the attention output (2h), K and V
    # (2 kv per key token: text for S, image for X), fp32 softmax statistics per head.
    saved = {
        "S": BF16 * t * (4 * h + 3 * f + 2 * h + 2 * kv) + FP32 * t * heads,
        "X": BF16 * (t * (4 * h + 3 * f + 2 * h) + i * 2 * kv) + FP32 * t * heads,
    }
    trainable_before = "E" not in frozen
    layers = []
    for kind in kinds:
        layers.append(_cost(forward[kind], saved[kind], kind not in frozen, trainable_before))
        trainable_before = trainable_before or kind not in frozen
    embedding = LayerCost(0.0, 0.0, 0.0)  # a lookup; its backward needs only the token ids
    head = _cost(2.0 * t * h * model.vocab_size, BF16 * t * 2 * h + (BF16 + FP32) * t * model.vocab_size,
                 "H" not in frozen, trainable_before)
    return embedding, layers, head


def _cost(forward: float, saved: float, trainable: bool, trainable_before: bool) -> LayerCost:
    if trainable:
        return LayerCost(forward, 2.0 * forward, saved)
    if trainable_before:
        return LayerCost(forward, forward, saved)
    return LayerCost(forward, 0.0, 0.0)
