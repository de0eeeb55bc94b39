"""The planner's layers when they differ (``l3plugin plan --kinds ... [--frozen ...] [--image-tokens I]``):
the per-layer costs of ``l3plugin balance`` (layer_costs.py) and the cost-balanced split of
``StageSplitter``, for each (p, v, m, k) the search visits.

``LayerProfile`` holds each layer's forward and backward FLOPs and the activation bytes it keeps for
backward, per micro-batch of the whole sequence (costs.py divides them by TP x CP), plus which parameters
are trainable: a frozen layer (or embedding, or head) keeps its bf16 weights but has no fp32 gradient,
no optimizer state and no data-parallel traffic.

The balanced split is ``StageSplitter.balance()``'s choice on the layout's schedule. Choosing it times a few
hundred candidate splits, so it is cached per (profile, p, v, m, k), and a schedule of more than
``SPLIT_ROUNDS`` rounds of k micro-batches is cut to that many rounds with the same final group (warm-up,
steady state and cool-down are those of the full one; many micro-batch counts then share one answer). The
split chosen is then priced on the full schedule like every other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from l3plugin.arguments.checks import check_int
from l3plugin.schedule.balance import LayerCost, StageSplitter
from l3plugin.schedule.plan import build_schedule

from .layer_costs import check_kinds, model_layer_costs
from .models import ModelSpec

SPLIT_ROUNDS = 5  # rounds of k micro-batches the balanced split is chosen on (at most)


@dataclass(frozen=True)
class LayerProfile:
    kinds: str
    frozen: str
    layers: tuple[LayerCost, ...]  # FLOPs and activation bytes per micro-batch, model order
    embedding: LayerCost
    head: LayerCost

    @classmethod
    def build(cls, model: ModelSpec, kinds: str, frozen: str, image_tokens: int, seq_len: int,
              micro_batch_size: int) -> "LayerProfile":
        embedding, layers, head = model_layer_costs(model, kinds, text_seq=seq_len, image_tokens=image_tokens,
                                                    frozen=frozen, micro_batch=micro_batch_size)
        return cls(kinds, frozen, tuple(layers), embedding, head)

    def trainable(self, letter: str) -> bool:
        """Whether the layers of kind ``letter`` (or "E" the embedding, "H" the head) are trained."""
        return letter not in self.frozen

    @property
    def uniform(self) -> bool:
        """Every layer costs the same, runs a backward, and the head is trained: the planner's count splits
        and its uniform-stage bubble apply as they do without --kinds."""
        return (len(set(self.layers)) == 1 and self.layers[0].backward > 0
                and self.head.backward == 2 * self.head.forward)

    def flops(self) -> float:
        """Forward and backward FLOPs of one micro-batch through the whole model."""
        parts = self.layers + (self.embedding, self.head)
        return sum(c.forward + c.backward for c in parts)


def check_layer_flags(kinds: str | None, frozen: str, image_tokens) -> None:
    """--kinds / --frozen / --image-tokens of ``l3plugin plan``, each refused by name."""
    check_int("--image-tokens", image_tokens, low=0)
    if kinds is None:
        if frozen or image_tokens:
            given = "--frozen" if frozen else "--image-tokens"
            raise ValueError(f"{given} needs --kinds (one letter per layer, e.g. SSSSX...): without it every "
                             f"layer is a trainable self-attention layer")
        return
    check_kinds(kinds, frozen)
    if set(kinds) | {"E", "H"} <= set(frozen):
        raise ValueError(f"--frozen={frozen!r} freezes every parameter of --kinds={kinds!r} and the embedding "
                         f"and head: nothing is trained, there is no step to plan")
    if "X" in kinds and image_tokens < 1:
        raise ValueError(f"--image-tokens={image_tokens} is out of range: cross-attention layers (X in --kinds) "
                         f"need >= 1 image tokens per sample")


def split_microbatches(p: int, m: int, k: int) -> int:
    """Micro-batches of the schedule the balanced split is chosen on: m, or at most SPLIT_ROUNDS rounds."""
    rounds = math.ceil(m / k)
    if rounds <= SPLIT_ROUNDS or k < p:
        return m
    return m - (rounds - SPLIT_ROUNDS) * k


def balanced_counts(profile: LayerProfile, p: int, v: int, m: int, k: int) -> tuple[int, ...]:
    """Layers per virtual stage of StageSplitter's best split for this schedule."""
    if v == 1 and k >= p:  # with one chunk per rank any k >= p is the same plan
        k = min(p, m)
    return _balanced(profile, p, v, split_microbatches(p, m, k), k)


@lru_cache(maxsize=4096)
def _balanced(profile: LayerProfile, p: int, v: int, m: int, k: int) -> tuple[int, ...]:
    splitter = StageSplitter(list(profile.layers), build_schedule(p, v, m, k), embedding=profile.embedding,
                             head=profile.head, kinds=profile.kinds)
    return splitter.balance()[0].counts
