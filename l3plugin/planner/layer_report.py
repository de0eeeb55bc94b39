"""The part of `l3plugin plan`'s report that --kinds adds: the layers named in the header, each plan's layer
indices per virtual stage (--json "stages"), and the answer's stages with their kinds and Megatron's layout."""

from __future__ import annotations

from l3plugin.schedule.layers import layer_ranges

from .balance_cli import SPEC_HINT
from .layer_costs import KINDS


def stage_lists(layout) -> list[list[int]]:
    """Layer indices (0..L-1, model order) of each virtual stage s (chunk s // pp on rank s % pp)."""
    return [list(ids) for ids in layer_ranges(layout.layers)]


def layers_text(req) -> str:
    """The --kinds summary: '32 S + 8 X layers, frozen SEH, 1600 image tokens per sample'."""
    text = " + ".join(f"{req.kinds.count(k)} {k}" for k in KINDS if k in req.kinds) + " layers"
    text += f", frozen {req.frozen}" if req.frozen else ", all trainable"
    return text + (f", {req.image_tokens} image tokens per sample" if req.cross_attention else "")


def stage_lines(ev, megatron_layout: str) -> list[str]:
    """The answer's layers per virtual stage, by kind, and the Megatron-LM layout that places them."""
    L, req = ev.layout, ev.request
    out = [f"Layers per virtual stage ({L.split} split; stage s runs as chunk s // {L.pp} on PP rank s % {L.pp}):"]
    for s, ids in enumerate(stage_lists(L)):
        span = f"layers {ids[0]}-{ids[-1]} {''.join(req.kinds[i] for i in ids)}" if ids else "no layers"
        ends = " + embedding" * (s == 0) + " + output layer" * (s == len(L.layers) - 1)
        out.append(f"  virtual stage {s:<3} rank {s % L.pp:<3} chunk {s // L.pp}: {span}{ends}")
    if L.pp > 1:
        out.append(f"Megatron-LM: --pipeline-model-parallel-layout \"{megatron_layout}\"")
    if req.cross_attention:
        out.append(f"  ('t' is any decoder layer: build each chunk's block with {SPEC_HINT}, which gives layer i "
                   f"the kind --kinds[i]; or pass the layer lists above, --json \"stages\", to your own model builder)")
    return out

