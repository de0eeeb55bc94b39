"""The step's image tokens on every pipeline stage, encoded before the text pipeline and differentiated after it.

Both placements here follow one protocol around an unchanged pipeline step:

    tokens = placement.encode(images)      # [num_images, image_tokens, hidden] fp32 leaf on every PP rank
    ... the pipeline step; each micro-batch's cross-attention reads image_context(tokens, its image indices)
    placement.finish()                     # image-token gradients back to the encoder, encoder backward

The tokens are a float32 leaf whatever the encoder's dtype, so the gradients every cross-attention layer of
every micro-batch adds into them accumulate in fp32 (the paper, section 6.2). Rows of the batch are images;
which micro-batch reads which image is the data's business (``image_context``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.collective.waits import resolve_timeout

from .placement import image_shares, share_size


def image_context(tokens: torch.Tensor, image_index, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A micro-batch's cross-attention input [image_tokens, batch, hidden] (Megatron's [s, b, h]): sample i
    reads image ``image_index[i]`` of the step's ``tokens``; -1 means no image (a zero row: with bias-free K/V
    projections its cross-attention output is exactly zero, and no gradient flows anywhere). None when no
    sample has an image: the cross-attention layers then pass their input through."""
    index = [int(i) for i in image_index]
    if all(i < 0 for i in index):
        return None
    zero = tokens.new_zeros(tokens.shape[1:])
    rows = torch.stack([tokens[i] if i >= 0 else zero for i in index], dim=1)
    return rows if dtype is None else rows.to(dtype)


def _image_leaf(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.detach().float().requires_grad_(True)


def _reduce_encoder_grads(params, before, groups, timeout, what):
    """Sum the gradients this step added to ``params`` over each of ``groups`` (one flat fp32 all-reduce per
    group), leaving what ``params`` held before (``before``, e.g. accumulation over steps) unreduced."""
    if not params:
        return
    added = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in added])
    for group in groups:
        comm.all_reduce_sum(flat, group, timeout, what)
    offset = 0
    for p, g, old in zip(params, added, before):
        total = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
        p.grad = total if old is None else old + total
        offset += g.numel()


class _EncoderBeforePipeline:
    """Shared by both placements: the encoder's forward kept for its backward, gradients reduced after it."""

    def __init__(self, encoder, pp_group, grad_groups=(), timeout=None):
        self.encoder, self.pp_group, self.grad_groups = encoder, pp_group, tuple(grad_groups)
        self.timeout = resolve_timeout(timeout)
        self.tokens = None  # the step's fp32 leaf
        self._encoded = None  # this rank's encoder output, with its graph
        self._grads_before = None

    def _params(self):
        return [] if self.encoder is None else [p for p in self.encoder.parameters() if p.requires_grad]

    def _run_encoder(self, images):
        params = self._params()
        self._grads_before = [p.grad for p in params]
        for p in params:
            p.grad = None  # this step's gradients alone are reduced
        return self.encoder(images)

    def _encoder_backward(self, grad, groups, what):
        if self._encoded.requires_grad:
            self._encoded.backward(grad.to(self._encoded.dtype))
        _reduce_encoder_grads(self._params(), self._grads_before, groups, self.timeout, what)
        self._encoded = self._grads_before = None

    def _token_grad(self):
        grad = self.tokens.grad
        return torch.zeros_like(self.tokens) if grad is None else grad  # no cross-attention read them here


class ReplicatedEncoder(_EncoderBeforePipeline):
    """Every pipeline rank holds a replica of the encoder and encodes its share of the step's images
    (``image_shares``); one all-gather over the pipeline group gives every stage all image tokens. ``finish``
    reduce-scatters the image-token gradients in fp32 (each rank receives the sum over stages for its share),
    runs the encoder's backward on it and sums the encoder gradients over the pipeline group and
    ``grad_groups`` (data / context parallel: every replica saw different images)."""

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: the step's images (the same on every pipeline rank); returns the fp32 image tokens."""
        p, r = dist.get_world_size(self.pp_group), dist.get_rank(self.pp_group)
        n = images.shape[0]
        share = image_shares(n, p)[r]
        self._encoded = self._run_encoder(images[share.start:share.stop])
        size = share_size(n, p)
        local = self._encoded.detach()
        if size == 0:  # a step without images: nothing to gather
            self.tokens = _image_leaf(local)
            return self.tokens
        if len(share) < size:  # equal pieces for the all-gather; padding rows are dropped below
            local = torch.cat([local, local.new_zeros((size - len(share),) + tuple(local.shape[1:]))])
        gathered = comm.start_all_gather(local, self.pp_group, "image tokens over PP").wait(self.timeout)
        # Rank r's share starts at r * size, so the first n gathered rows are images 0..n-1 in order.
        self.tokens = _image_leaf(gathered.view((p * size,) + tuple(local.shape[1:]))[:n])
        return self.tokens

    def finish(self) -> None:
        """After the pipeline's last backward: the encoder's backward for this rank's share."""
        p, r = dist.get_world_size(self.pp_group), dist.get_rank(self.pp_group)
        n = self.tokens.shape[0]
        size, mine = share_size(n, p), len(image_shares(n, p)[r])
        if size:
            full = self.tokens.new_zeros((p * size,) + tuple(self.tokens.shape[1:]))
            full[:n] = self._token_grad()
            part = comm.start_reduce_scatter_sum(full.view(-1), self.pp_group, torch.float32,
                                                 "image-token gradients over PP").wait(self.timeout)
            grad = part.view((size,) + tuple(self.tokens.shape[1:]))[:mine]
        else:
            grad = self.tokens.new_zeros(self._encoded.shape)
        self._encoder_backward(grad, (self.pp_group,) + self.grad_groups, "encoder gradients")
        self.tokens = None


class BroadcastEncoder(_EncoderBeforePipeline):
    """The first pipeline rank (``source``, a rank of the pipeline group) alone holds the encoder and encodes
    every image of the step; its tokens are broadcast over the pipeline group. ``finish`` sums the image-token
    gradients onto it, runs the encoder's backward there and sums its gradients over ``grad_groups``. The
    other ranks pass ``encoder=None`` (and ``images=None`` to ``encode``; ``device``: where their tokens go)."""

    def __init__(self, encoder, pp_group, grad_groups=(), timeout=None, source: int = 0, device=None):
        super().__init__(encoder, pp_group, grad_groups, timeout)
        self.source = source
        self.device = torch.device("cpu") if device is None else torch.device(device)  # where the tokens go
        if (dist.get_rank(pp_group) == source) != (encoder is not None):
            raise ValueError(f"encoder is {'None' if encoder is None else 'given'} on pipeline rank "
                             f"{dist.get_rank(pp_group)}: pass it on the source rank ({source}) only")

    def encode(self, images: torch.Tensor | None) -> torch.Tensor:
        """``images``: the step's images on the source rank (ignored elsewhere); returns the fp32 image tokens."""
        device = images.device if images is not None else self.device
        shape = torch.zeros(3, dtype=torch.int64, device=device)
        if self.encoder is not None:
            self._encoded = self._run_encoder(images)
            shape[:] = torch.tensor(self._encoded.shape)
        comm.broadcast_from(shape, self.source, self.pp_group, self.timeout, "image-token shape")
        if self.encoder is not None:
            tokens = self._encoded.detach().float().contiguous()
        else:
            tokens = torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=device)
        comm.broadcast_from(tokens, self.source, self.pp_group, self.timeout, "image tokens over PP")
        self.tokens = _image_leaf(tokens)
        return self.tokens

    def finish(self) -> None:
        grad = comm.reduce_sum_to(self._token_grad().contiguous(), self.source, self.pp_group, self.timeout,
                                  "image-token gradients over PP")
        if self.encoder is not None:
            self._encoder_backward(grad, self.grad_groups, "encoder gradients")
        self.tokens = None
