"""Who encodes which images (pure Python): the placements and each pipeline rank's share of a step's images."""

from __future__ import annotations

from l3plugin.arguments.checks import check_int

PLACEMENTS = {
    "pipeline": "the encoder in the first stage, per micro-batch; image tokens travel with the activations",
    "broadcast": "the first pipeline rank encodes every image before the pipeline; tokens broadcast",
    "replicated": "every pipeline rank encodes its share; tokens all-gathered over the pipeline group",
}
DEFAULT_PLACEMENT = "replicated"  # the paper's: the encoder's time divided by the pipeline size


def check_placement(name: str) -> str:
    if name not in PLACEMENTS:
        raise ValueError(f"encoder placement {name!r} is invalid: one of "
                         + "; ".join(f"{k} ({v})" for k, v in PLACEMENTS.items()))
    return name


def image_shares(num_images: int, pp_size: int) -> tuple[range, ...]:
    """The images (indices into the step's batch of images) each pipeline rank encodes: contiguous blocks of
    ceil(num_images / pp_size), the last ones shorter or empty. Every rank pads its tokens to the block size so
    the all-gather moves equal pieces (``share_size``)."""
    check_int("num_images", num_images, low=0)
    check_int("pp_size", pp_size)
    size = share_size(num_images, pp_size)
    return tuple(range(min(r * size, num_images), min((r + 1) * size, num_images)) for r in range(pp_size))


def share_size(num_images: int, pp_size: int) -> int:
    """Images per rank in the all-gather (the largest share)."""
    return -(-num_images // pp_size)
