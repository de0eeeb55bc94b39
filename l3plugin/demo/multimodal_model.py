"""A tiny mllama-like model for the multimodal demo, tests and bench: a small ViT image encoder and a Megatron-Core
text model whose self-attention layers ("S") are frozen and whose gated cross-attention layers ("X",
``l3plugin/megatron/multimodal.py``) read the image tokens. Weights depend only on each parameter's name, so a
pipeline-split run starts from exactly the numbers of a single-process run.
"""

from __future__ import annotations

import zlib

import torch

VOCAB = 64


class TinyViT(torch.nn.Module):
    """Pre-patchified images [n, patches, patch_dim] -> image tokens [n, patches, hidden]: a linear patch
    embedding, ``depth`` pre-norm transformer blocks of width ``width`` and a bias-free projector to the text
    model's ``hidden`` size (mllama's multi-modal projector)."""

    def __init__(self, *, patches=8, patch_dim=12, width=16, depth=2, heads=2, hidden=32):
        super().__init__()
        self.heads = heads
        self.patch = torch.nn.Linear(patch_dim, width)
        self.position = torch.nn.Parameter(torch.zeros(patches, width))
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"norm1": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width),
                                 "proj": torch.nn.Linear(width, width), "norm2": torch.nn.LayerNorm(width),
                                 "fc1": torch.nn.Linear(width, 4 * width), "fc2": torch.nn.Linear(4 * width, width)})
            for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.projector = torch.nn.Linear(width, hidden, bias=False)
        name_keyed_init(self, "vision.")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images) + self.position
        n, s, w = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).view(n, s, 3, self.heads, w // self.heads).unbind(2)
            attn = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                    v.transpose(1, 2))
            x = x + block["proj"](attn.transpose(1, 2).reshape(n, s, w))
            x = x + block["fc2"](torch.nn.functional.gelu(block["fc1"](block["norm2"](x))))
        return self.projector(self.norm(x))


def name_keyed_init(module, prefix="", scale=0.05):
    """Every parameter from a generator seeded by its name; norms' weights near 1."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32((prefix + name).encode()))
            full = torch.randn(param.shape, generator=gen, dtype=torch.float64) * scale
            if "norm" in name and name.endswith("weight"):
                full += 1.0
            param.copy_(full)


def mllama_config(kinds: str, *, hidden=32, heads=4, pp=1, vpp=None, k=None, layout=None, dtype=torch.float32):
    """A tiny text model config: one layer per letter of ``kinds``; no GQA and no linear biases (Megatron's
    cross-attention supports neither)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=len(kinds), hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        microbatch_group_size_per_vp_stage=k, pipeline_model_parallel_layout=layout, batch_p2p_comm=False,
        deallocate_pipeline_outputs=True)


def build_text_chunk(config, kinds: str, *, pre_process=True, post_process=True, vp_stage=None, pp_rank=0,
                     seq_len=16, carry_image_tokens=0, encoder=None):
    """One pipeline chunk of the text model (a ``MultimodalChunk``) with the text frozen: the embedding, the
    self-attention layers, the final norm and the output layer; the cross-attention layers train."""
    from l3plugin.demo.model import build_chunk
    from l3plugin.megatron.multimodal import MultimodalChunk, multimodal_block_spec

    spec = multimodal_block_spec(config, kinds, vp_stage=vp_stage, pp_rank=pp_rank)
    gpt = build_chunk(config, vocab=VOCAB, seq_len=seq_len, pre_process=pre_process, post_process=post_process,
                      vp_stage=vp_stage, position_embedding_type="learned_absolute", spec=spec)
    freeze_text(gpt)
    return MultimodalChunk(gpt, carry_image_tokens=carry_image_tokens, encoder=encoder)


def freeze_text(gpt) -> None:
    """requires_grad only for the cross-attention layers' parameters."""
    for name, param in gpt.named_parameters():
        layer = gpt.decoder.layers[int(name.split(".")[2])] if name.startswith("decoder.layers.") else None
        param.requires_grad_(layer is not None and _is_cross_attention_layer(layer))


def _is_cross_attention_layer(layer) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return not isinstance(layer.cross_attention, IdentityOp)


def multimodal_batches(m, micro_batch_size, seq_len, *, images_per_microbatch, patches=8, patch_dim=12, seed=5):
    """The step's images [num_images, patches, patch_dim] and m micro-batches; micro-batch j gives an image to
    its first ``images_per_microbatch[j]`` samples (0: a micro-batch without images). ``image_index``: the
    step's image each sample reads, -1 for none."""
    gen = torch.Generator().manual_seed(seed)
    batches, next_image = [], 0
    for j in range(m):
        tokens = torch.randint(0, VOCAB, (micro_batch_size, seq_len + 1), generator=gen)
        mask = (torch.rand(micro_batch_size, seq_len, generator=gen) > 0.2).float()
        count = images_per_microbatch[j]
        index = [next_image + i if i < count else -1 for i in range(micro_batch_size)]
        next_image += count
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                        "position_ids": torch.arange(seq_len).expand(micro_batch_size, seq_len),
                        "image_index": torch.tensor(index)})
    images = torch.randn(next_image, patches, patch_dim, generator=gen)
    return images, batches


def microbatch_images(images, image_index):
    """The pipeline placement's view of a micro-batch: its own images and each sample's index among them."""
    used = [int(i) for i in image_index if int(i) >= 0]
    local = torch.tensor([used.index(int(i)) if int(i) >= 0 else -1 for i in image_index])
    return images[used], local


def loss_func(loss_mask, per_token_loss):
    loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}
