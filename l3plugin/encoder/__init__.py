"""Where the image encoder of a multimodal model runs under pipeline parallelism (Llama 3 paper, section 3.2,
figure 6).

- ``pipeline``: the encoder is part of the first stage and runs per micro-batch; its image tokens travel
  down the pipeline with the text activations (what Megatron-Core's LLaVA, NeMo's mllama and torchtitan do).
- ``broadcast``: the first pipeline rank encodes the step's images before the pipeline, every stage gets the
  image tokens, their gradients come back to it after the pipeline, then it runs the encoder's backward.
- ``replicated`` (the paper's choice, the default): every pipeline rank encodes its share of the step's
  images, an all-gather over the pipeline group gives every stage all image tokens; after the pipeline the
  image-token gradients are reduce-scattered back to the shares' owners, each runs its encoder backward, and
  the encoder's gradients are summed over the pipeline group (every replica saw different images).

``placement.py`` is the plan (who encodes which images), ``image_tokens.py`` the execution and its
communication. The Megatron-Core wiring (cross-attention layers, the chunk that carries image tokens) is
``l3plugin/megatron/multimodal.py``.
"""

from .image_tokens import BroadcastEncoder, ReplicatedEncoder, image_context
from .placement import PLACEMENTS, check_placement, image_shares

__all__ = ["PLACEMENTS", "BroadcastEncoder", "ReplicatedEncoder", "check_placement", "image_context", "image_shares"]
