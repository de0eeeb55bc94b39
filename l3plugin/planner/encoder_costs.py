"""Where the image encoder runs under pipeline parallelism (Llama 3 paper, section 3.2.1, figure 6): a cost
model of a ViT encoder and the simulated step of its three placements. Pure Python, FLOP-based: a model to
compare placements with, not a measurement.

Encoder (``EncoderSpec``): a ViT over the image's patches (one patch = one image token the cross-attention
layers read: the paper's 448x448 images give 1.2K tokens, 672x672 ones 3K), ``depth`` layers of width w
with a GELU MLP of ``mlp_ratio`` x w, bidirectional attention over the image's n tokens, a patch embedding
and a linear projector from w to the text model's hidden size h. Forward FLOPs per image:
    2 n 3 patch^2 w  +  depth x (2 n (4 + 2 mlp_ratio) w^2 + 4 n^2 w)  +  2 n w h
Backward: 2x forward if trainable (input and weight gradients), nothing if frozen (nothing before it needs
a gradient). Times are FLOPs / (peak x MFU) of ``Hardware``; communication is bytes / ``bandwidth_gbps``
(GB/s per GPU; 0 = communication is free, not modelled); image tokens move as ``token_bytes`` per element
(fp32 by default: their gradients accumulate in fp32).

Placements, each on the same text pipeline (a ``StageSplitter`` split, simulated with per-stage times):
  pipeline    the encoder inside virtual stage 0, per micro-batch: its forward and backward are added to
              stage 0's; the image tokens travel down the pipeline with the activations and their gradient
              back up, so every P2P message grows by the micro-batch's image tokens (a per-message latency
              = bytes / bandwidth) and stage 0 waits for gradients even when the text layers before the
              first cross-attention layer are frozen.
  broadcast   rank 0 encodes the whole step's B images before the pipeline (the other ranks idle), the image
              tokens are broadcast to every PP rank (bytes / bandwidth), the pipeline runs, the image-token
              gradients are reduced back to rank 0 (bytes / bandwidth), then rank 0 runs the encoder backward.
  replicated  every PP rank encodes ceil(B / P) images (padded), an all-gather over PP ((P-1) x share x bytes
              per image / bandwidth, ring) gives every rank all image tokens, the pipeline runs, the image-
              token gradients are reduce-scattered (same bytes), every rank runs its share's encoder backward
              and the encoder gradients (fp32) are all-reduced over PP (ring: 2 (P-1)/P x bytes / bandwidth;
              counted in full, as if there were no data-parallel reduction to merge it into).
Every collective is counted as exposed (none overlaps the pipeline). The encoder's time on the critical path
is the step minus the same step with the encoder's compute set to zero (same plan, same messages); its share
is that over the step. Data-parallel traffic is left out of every placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from l3plugin.arguments.checks import check_int, check_number
from l3plugin.schedule.balance import LayerCost, Split, StageSplitter
from l3plugin.schedule.plan import build_schedule
from l3plugin.schedule.simulate import Replay

from .costs import BF16, FP32
from .layer_costs import model_layer_costs
from .machine import Hardware
from .models import ModelSpec, load_model

PLACEMENTS = ("pipeline", "broadcast", "replicated")


@dataclass(frozen=True)
class EncoderSpec:
    """A ViT image encoder and its projector to the text model's hidden size. Defaults: ViT-H/14 (width
    1280, MLP 5120) with Llama 3's 40 layers (32 + 8 gated ones added for multimodal training)."""

    width: int = 1280
    depth: int = 40
    mlp_ratio: int = 4
    patch_size: int = 14
    trainable: bool = True

    def __post_init__(self):
        check_int("encoder width", self.width)
        check_int("encoder depth", self.depth, low=0)
        check_int("encoder mlp_ratio", self.mlp_ratio)
        check_int("encoder patch_size", self.patch_size)
        if not isinstance(self.trainable, bool):
            raise ValueError(f"encoder trainable={self.trainable!r} must be True or False")

    def params(self, text_hidden: int) -> int:
        w = self.width
        return 3 * self.patch_size ** 2 * w + self.depth * (4 + 2 * self.mlp_ratio) * w * w + w * text_hidden

    def forward_flops(self, tokens_per_image: int, text_hidden: int) -> float:
        n, w = tokens_per_image, self.width
        layer = 2.0 * n * (4 + 2 * self.mlp_ratio) * w * w + 4.0 * n * n * w
        return 2.0 * n * 3 * self.patch_size ** 2 * w + self.depth * layer + 2.0 * n * w * text_hidden


@dataclass(frozen=True)
class EncoderCost:
    """One image through the encoder: seconds of forward and backward, the bytes of its output tokens (their
    gradient has the same size) and of the encoder's gradient (what the replicated placement all-reduces)."""

    forward: float
    backward: float
    token_bytes: float
    grad_bytes: float = 0.0

    def __post_init__(self):
        for name in ("forward", "backward", "token_bytes", "grad_bytes"):
            check_number(f"encoder cost {name}", getattr(self, name), 0)


def encoder_cost(spec: EncoderSpec, tokens_per_image: int, text_hidden: int, flops_per_second: float,
                 token_bytes: int = FP32) -> EncoderCost:
    check_int("tokens_per_image", tokens_per_image)
    check_int("text_hidden", text_hidden)
    check_number("flops_per_second", flops_per_second, 0, low_open=True)
    forward = spec.forward_flops(tokens_per_image, text_hidden) / flops_per_second
    return EncoderCost(forward, 2.0 * forward if spec.trainable else 0.0,
                       float(tokens_per_image * text_hidden * token_bytes),
                       float(FP32 * spec.params(text_hidden)) if spec.trainable else 0.0)


@dataclass(frozen=True)
class PlacementStep:
    """One placement's simulated step (seconds) and what it is made of."""

    name: str
    step: float
    pipeline: float  # the text pipeline alone (simulated makespan, text-sized messages)
    encoder: float  # encoder compute on the critical path
    comm_parts: dict  # the rest, by name: encoder-related communication (and, for "pipeline", waits)
    bubble: float  # worst rank's idle / busy over the whole step, encoder compute counted as busy
    images_per_rank: tuple[int, ...]  # images each PP rank encodes per step

    @property
    def comm(self) -> float:
        return sum(self.comm_parts.values())

    @property
    def encoder_share(self) -> float:
        return self.encoder / self.step

    def to_dict(self) -> dict:
        return {"name": self.name, "step": self.step, "pipeline": self.pipeline, "encoder": self.encoder,
                "encoder_share": self.encoder_share, "comm": self.comm, "comm_parts": dict(self.comm_parts),
                "bubble": self.bubble, "images_per_rank": list(self.images_per_rank)}


def placements(splitter: StageSplitter, counts, encoder: EncoderCost, *, images_per_microbatch: int,
               bandwidth_gbps: float = 0.0) -> list[PlacementStep]:
    """The three placements (``PLACEMENTS`` order) of ``encoder`` beside the text pipeline cut as ``counts``
    (layers per virtual stage) over ``splitter``'s schedule, whose ``p2p_latency`` is the text pipeline's
    per-message time."""
    check_int("images_per_microbatch", images_per_microbatch, low=0)
    check_number("bandwidth_gbps", bandwidth_gbps, 0)
    per_byte = 1.0 / (bandwidth_gbps * 1e9) if bandwidth_gbps else 0.0
    schedule = splitter.schedule
    p, images = schedule.pp, schedule.microbatches * images_per_microbatch
    costs = splitter.stage_costs(counts)
    text_times = [(c.forward, c.backward) for c in costs]
    text_latency = splitter.p2p_latency
    text_runs, text_busy = Replay(splitter.schedule_for(costs)).run(text_times, text_latency)
    text_step = max(end for _, end in text_runs)

    # pipeline: stage 0 also encodes its micro-batch's images; image tokens ride on every message
    add_f, add_b = images_per_microbatch * encoder.forward, images_per_microbatch * encoder.backward
    with_encoder = [(f + add_f, b + add_b) if s == 0 else (f, b) for s, (f, b) in enumerate(text_times)]
    replay = Replay(splitter.schedule_for([LayerCost(f, b) for f, b in with_encoder]))
    latency = text_latency + images_per_microbatch * encoder.token_bytes * per_byte
    runs, busy = replay.run(with_encoder, latency)
    step = max(end for _, end in runs)
    without = replay.makespan(text_times, latency)
    # What is left once the encoder computes nothing: bigger messages, and stage 0 waiting for image gradients.
    out = [PlacementStep("pipeline", step, text_step, step - without,
                         {"image tokens on P2P, image-gradient waits": without - text_step}, _bubble(step, busy),
                         (images,) + (0,) * (p - 1))]

    # broadcast: rank 0 encodes everything before and after the pipeline
    tokens = images * encoder.token_bytes * per_byte if p > 1 else 0.0
    grads = tokens if encoder.backward else 0.0
    compute = images * (encoder.forward + encoder.backward)
    step = compute + tokens + text_step + grads
    out.append(PlacementStep("broadcast", step, text_step, compute, {"broadcast": tokens, "reduce": grads},
                             _bubble(step, [text_busy[0] + compute] + text_busy[1:]), (images,) + (0,) * (p - 1)))

    # replicated: each rank encodes ceil(B / P) images; all-gather before, reduce-scatter after
    share = math.ceil(images / p)
    gather = (p - 1) * share * encoder.token_bytes * per_byte
    scatter = gather if encoder.backward else 0.0
    allreduce = 2.0 * (p - 1) / p * encoder.grad_bytes * per_byte if images else 0.0
    compute = share * (encoder.forward + encoder.backward)
    step = compute + gather + text_step + scatter + allreduce
    out.append(PlacementStep("replicated", step, text_step, compute,
                             {"all-gather": gather, "reduce-scatter": scatter, "encoder all-reduce": allreduce},
                             _bubble(step, [b + compute for b in text_busy]),
                             tuple(min(share, max(0, images - r * share)) for r in range(p))))
    return out


@dataclass(frozen=True)
class MultimodalStep:
    """Every split candidate of the text pipeline (best first) and the placements on the chosen one."""

    splits: list[Split]
    placements: list[PlacementStep]
    encoder: EncoderCost
    text_message_bytes: float

    def split(self, name: str) -> Split | None:
        return next((s for s in self.splits if s.name == name), None)

    def placement(self, name: str) -> PlacementStep:
        return next(s for s in self.placements if s.name == name)


def multimodal_kinds(self_layers: int, self_per_cross: int) -> str:
    """Layer kinds of a text model of ``self_layers`` self-attention layers with a cross-attention layer after
    every ``self_per_cross`` of them (Llama 3.2 11B: 32 and 4 give SSSSX x 8)."""
    check_int("self_layers", self_layers)
    check_int("self_per_cross", self_per_cross)
    full, rest = divmod(self_layers, self_per_cross)
    return ("S" * self_per_cross + "X") * full + "S" * rest


def multimodal_step(model: "str | ModelSpec", kinds: str, *, pp: int, vpp: int = 1, microbatches: int,
                    group_size: int | None = None, text_seq: int, image_tokens: int, images_per_sample: int = 1,
                    frozen: str = "SEH", encoder: EncoderSpec = EncoderSpec(), hardware: Hardware = Hardware(),
                    bandwidth_gbps: float | None = None) -> MultimodalStep:
    """The text model (``kinds``, one sample of ``text_seq`` tokens and ``images_per_sample`` images of
    ``image_tokens`` tokens per micro-batch) split over pp x vpp stages by ``StageSplitter`` in seconds, and
    the encoder's placements on its chosen split. ``bandwidth_gbps`` defaults to the machine's network."""
    model = load_model(model)
    check_int("images_per_sample", images_per_sample)
    check_int("image_tokens", image_tokens)
    check_int("text_seq", text_seq)
    if bandwidth_gbps is None:
        bandwidth_gbps = hardware.inter_node_gbps
    check_number("bandwidth_gbps", bandwidth_gbps, 0)
    rate = hardware.peak_tflops * 1e12 * hardware.mfu
    schedule = build_schedule(pp, vpp, microbatches, group_size)
    embedding, layers, head = model_layer_costs(model, kinds, text_seq=text_seq, frozen=frozen,
                                                image_tokens=image_tokens * images_per_sample)

    def seconds(cost: LayerCost) -> LayerCost:
        return LayerCost(cost.forward / rate, cost.backward / rate, cost.activation)

    # One text P2P message: a bf16 activation (or its gradient) of the sample's text tokens.
    message = float(BF16 * text_seq * model.hidden_size)
    splitter = StageSplitter([seconds(c) for c in layers], schedule, embedding=seconds(embedding),
                             head=seconds(head), kinds=kinds,
                             p2p_latency=message / (bandwidth_gbps * 1e9) if bandwidth_gbps else 0.0)
    splits = splitter.balance()
    cost = encoder_cost(encoder, image_tokens, model.hidden_size, rate)
    return MultimodalStep(splits, placements(splitter, splits[0].counts, cost, images_per_microbatch=images_per_sample,
                                             bandwidth_gbps=bandwidth_gbps), cost, message)


def _bubble(step: float, busy) -> float:
    return max((step - b) / b for b in busy)
