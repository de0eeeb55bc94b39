"""The CP route's batch hooks for Megatron-LM 0.18 and later (``--cp-comm-type l3plugin_all_gather`` with
``--reset-attention-mask``; cp_route.py has the route itself and the hooks for 0.16 / 0.17).

From 0.18, pretrain_gpt.py's ``get_batch`` reads the batch on TP rank 0, calls Megatron-Core's
``megatron.core.utils.get_batch_on_this_tp_rank(batch, ...)`` (broadcast over TP) and
``get_batch_on_this_cp_rank(batch, ...)`` (CP sharding; ``get_thd_batch_on_this_cp_rank`` is gone), and its
``forward_step`` builds ``PackedSeqParams(qkv_format="thd", ...)`` itself whenever the batch has ``cu_seqlens``.
So on these versions l3plugin (set CP_BATCH, declared at the bottom; its rows are for >=0.18):

- ``tp_batch_with_documents``: the document boundaries of the FULL sequence, from the EOD tokens on TP rank 0
  BEFORE the stock broadcast (on the last pipeline stage it drops the tokens), sent to the TP group, as
  ``cu_seqlens`` [1, n] and ``max_seqlen`` [1] = S (Megatron's RoPE takes its length from max_seqlen;
  ``broadcast_boundaries`` and ``with_boundaries``, shared with cp_route.py's hook for 0.16 / 0.17);
- ``cp_batch_by_layout``: this CP rank's positions by l3plugin's layout, the boundaries left global;
- ``gpt_model_forward``: the "thd" PackedSeqParams that pretrain_gpt built from those boundaries become
  "sbhd" (every token keeps its global position; TE's per-document THD split is not l3plugin's layout).

With ``--dataloader-inter-document-masking`` (0.19+) the boundaries are the data loader's own ``cu_seqlens``
(broadcast over TP and flattened by Megatron, given to middle stages too): ``tp_batch_with_documents`` leaves
them as they are; the sharding and the "sbhd" form are the same (``sbhd_from_thd``). pretrain_gpt's get_batch
then reads data on middle pipeline stages as well, which it builds only for --sft: ``dataset_builder_init``
builds it on every stage.

Each falls through to Megatron's own unless Megatron-LM's parsed arguments select l3plugin's CP.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from l3plugin.cp.sharding import cu_seqlens_from_eod, shard_batch
from l3plugin.megatron.arguments import parsed_options
from l3plugin.upstream.versions import MEGATRON_CHECKED
from l3plugin.upstream.patchset import Patch, PatchSet

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # what get_batch_on_this_cp_rank shards


def eod_token() -> int:
    """Megatron-LM's end-of-document token (its tokenizer's), where the document boundaries come from."""
    from megatron.training import get_tokenizer

    return int(get_tokenizer().eod)


def _documents_route():
    route = parsed_options().cp_route
    return route if route is not None and route.documents else None


def broadcast_boundaries(cu, src: int, group, device, timeout=None) -> torch.Tensor:
    """``cu`` (given on global rank ``src``, None elsewhere) on every rank of ``group``: its length, then its
    values (bounded waits: ``timeout`` seconds, else ``l3plugin.collective.waits``' setting)."""
    import torch.distributed as dist

    from l3plugin.collective.comm import broadcast_from
    from l3plugin.collective.waits import resolve_timeout

    if group is None or dist.get_world_size(group) == 1:
        return cu
    timeout = resolve_timeout(timeout)
    group_src = dist.get_group_rank(group, src)
    mine = dist.get_rank() == src
    count = torch.tensor([cu.numel() if mine else 0], dtype=torch.int64, device=device)
    broadcast_from(count, group_src, group, timeout, "document boundaries' count over TP")
    cu = cu.to(device, torch.int32) if mine else torch.empty(int(count), dtype=torch.int32, device=device)
    return broadcast_from(cu, group_src, group, timeout, "document boundaries over TP")


def with_boundaries(batch: dict, cu: torch.Tensor) -> dict:
    """``batch`` plus ``cu_seqlens`` [1, n] and ``max_seqlen`` [1] for the global boundaries ``cu``.

    max_seqlen is S, the whole sequence, not the longest document (what THD kernels would want): l3plugin's CP
    attention reads only cu_seqlens (its kernels get per-chunk maxima from cp/sharding.py), and Megatron's RoPE
    takes its length from PackedSeqParams.max_seqlen_q/kv (RotaryEmbedding.get_rotary_seq_len), which pretrain_gpt
    builds from this value from 0.18 on (up to 0.17 cp_route.py's sharding builds it, also with S); in "sbhd" every
    token keeps its global position, up to S - 1."""
    batch["cu_seqlens"] = cu.view(1, -1)
    batch["max_seqlen"] = cu[-1:].to(torch.int32)
    return batch


def tp_batch_with_documents(batch, *args, **kwargs):
    """Megatron-Core's get_batch_on_this_tp_rank, plus ``cu_seqlens`` [1, n] (global document boundaries from
    EOD) and ``max_seqlen`` [1] (= S) when l3plugin's CP has document masks."""
    stock = CP_BATCH.stock("megatron.core.utils.get_batch_on_this_tp_rank")
    route = _documents_route()
    if route is None:
        return stock(batch, *args, **kwargs)
    bound = inspect.signature(stock).bind(batch, *args, **kwargs).arguments
    if route.loader_documents:  # the data loader's cu_seqlens (0.19+), broadcast and flattened by Megatron itself
        return stock(batch, *args, **kwargs)
    tokens = batch.get("tokens") if bound["tp_rank"] == 0 else None
    cu = None if tokens is None else cu_seqlens_from_eod(tokens, eod_token())
    out = stock(batch, *args, **kwargs)
    device = next((v.device for v in out.values() if torch.is_tensor(v)), torch.device("cpu"))
    cu = broadcast_boundaries(cu, bound["broadcast_src_rank"], bound["broadcast_group"], device)
    out["cu_seqlens_padded"] = None
    return with_boundaries(out, cu)


def cp_batch_by_layout(batch, *args, **kwargs):
    """Megatron-Core's get_batch_on_this_cp_rank, except for l3plugin's CP with documents: this rank's
    positions by l3plugin's layout; cu_seqlens and max_seqlen stay those of the full sequence."""
    route = _documents_route()
    cu = batch.get("cu_seqlens")
    if route is None or cu is None:
        return CP_BATCH.stock("megatron.core.utils.get_batch_on_this_cp_rank")(batch, *args, **kwargs)
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    sequences = {key: batch[key] for key in SEQUENCE_KEYS if batch.get(key) is not None}
    if cp_size > 1 and sequences:
        sequences = shard_batch(sequences, cp_size, cp_rank, layout=route.layout, cu_seqlens=cu.reshape(-1))
    return {**batch, **sequences}


def sbhd_from_thd(packed):
    """pretrain_gpt's "thd" PackedSeqParams (global document boundaries, no padded offsets; the batch sharded over
    the whole packed sequence: l3plugin's layout, or Megatron's own per-sequence zigzag with
    --dataloader-inter-document-masking, the same as l3plugin's "2cp") as "sbhd": every token keeps its global
    position, and RoPE's length (max_seqlen, RotaryEmbedding.get_rotary_seq_len) becomes the whole sequence S.

    Given as "thd", Megatron's THD RoPE would split each rank's S/cp tokens by cu_seqlens // cp, the per-document
    split of TE, which this batch does not have: with documents of odd length those pieces do not even add up to
    S/cp (core_v0.19.0: ``split_with_sizes expects split_sizes to sum exactly to 128 ... got [8, 67, 43, 9]``)."""
    seq_len = int(torch.as_tensor(packed.cu_seqlens_q).reshape(-1)[-1])
    return dataclasses.replace(packed, qkv_format="sbhd", max_seqlen_q=seq_len, max_seqlen_kv=seq_len)


def dataset_built_where(route, config, is_built_on_rank, tp_rank):
    """Where the datasets are built: pretrain_gpt's ``is_built_on_rank``, except with l3plugin's CP and
    ``--dataloader-inter-document-masking`` (``route.loader_documents`` and the dataset config's
    ``inter_document_masking``): on TP rank 0 of EVERY pipeline stage (``tp_rank()`` gives this rank's TP rank).

    With that flag, pretrain_gpt's ``get_batch`` reads the next batch on middle stages too (a middle virtual stage
    of any rank, or PP > 2) for its ``cu_seqlens``, but its ``is_dataset_built_on_rank`` builds data there only
    for ``--sft``: core_v0.19.0 then fails on a middle stage with ``'NoneType' object is not an iterator``. Built
    on every stage (as pretrain_gpt does for --sft), each stage reads its micro-batches' own boundaries;
    cp_documents.py checks them against the first stage's."""
    if route is None or not route.loader_documents or not getattr(config, "inter_document_masking", False):
        return is_built_on_rank

    def on_tp_rank_0_of_every_stage():
        return tp_rank() == 0

    return on_tp_rank_0_of_every_stage


def dataset_builder_init(self, cls, sizes, is_built_on_rank, config, *args, **kwargs):
    """BlendedMegatronDatasetBuilder.__init__ building where ``dataset_built_where`` says."""
    from megatron.core import parallel_state

    stock = CP_BATCH.stock("BlendedMegatronDatasetBuilder.__init__")
    where = dataset_built_where(_documents_route(), config, is_built_on_rank,
                                parallel_state.get_tensor_model_parallel_rank)
    return stock(self, cls, sizes, where, config, *args, **kwargs)


def gpt_model_forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
    """GPTModel.forward with pretrain_gpt's "thd" PackedSeqParams (built from the global boundaries of
    ``tp_batch_with_documents``) given as "sbhd" when l3plugin's CP with documents is selected."""
    stock = CP_BATCH.stock("GPTModel.forward")
    if _documents_route() is not None:
        bound = inspect.signature(stock).bind(self, input_ids, position_ids, attention_mask, *args, **kwargs)
        packed = bound.arguments.get("packed_seq_params")
        if packed is not None and packed.qkv_format == "thd" and packed.cu_seqlens_q_padded is None:
            bound.arguments["packed_seq_params"] = sbhd_from_thd(packed)
            return stock(*bound.args, **bound.kwargs)
    return stock(self, input_ids, position_ids, attention_mask, *args, **kwargs)


# ---- the declaration ----
_ONLY_OURS = "; inert unless cp_comm_type l3plugin_all_gather is selected"
_BOUNDARIES = ("the batch gains the document boundaries of the full sequence from EOD tokens on TP rank 0, sent over "
               "TP (--reset-attention-mask)" + _ONLY_OURS)

# From 0.18: both batch functions live in megatron.core.utils (THD sharding is gone, NVIDIA/Megatron-LM
# PR 4103) and pretrain_gpt's forward_step builds a "thd" PackedSeqParams itself.
CP_BATCH = PatchSet("l3plugin.megatron (CP batches from Megatron-LM 0.18 on)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.core.utils", "get_batch_on_this_tp_rank", tp_batch_with_documents,
          signature=("batch", "is_sft", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                     "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank"),
          rebind=True, versions=">=0.18,<0.19", why=_BOUNDARIES),
    Patch("megatron.core.utils", "get_batch_on_this_tp_rank", tp_batch_with_documents,
          signature=("batch", "has_cu_seqlens", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                     "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank"),
          rebind=True, versions=">=0.19", why=_BOUNDARIES),
    Patch("megatron.core.utils", "get_batch_on_this_cp_rank", cp_batch_by_layout,
          signature=("batch", "is_hybrid_cp", "cp_group"), rebind=True, versions=">=0.18",
          why="the batch sharded by l3plugin's CP layout, the document boundaries left global" + _ONLY_OURS),
    Patch("megatron.core.datasets.blended_megatron_dataset_builder:BlendedMegatronDatasetBuilder", "__init__",
          dataset_builder_init, signature=("self", "cls", "sizes", "is_built_on_rank", "config"), versions=">=0.19",
          why="with --dataloader-inter-document-masking the datasets are built on TP rank 0 of every pipeline "
              "stage: pretrain_gpt's get_batch reads cu_seqlens on middle stages too, but builds their data only "
              "for --sft" + _ONLY_OURS),
    Patch("megatron.core.models.gpt.gpt_model:GPTModel", "forward", gpt_model_forward,
          signature=("self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels",
                     "inference_context", "packed_seq_params"), versions=">=0.18",
          why="pretrain_gpt's PackedSeqParams (qkv_format thd, built from those boundaries) given as sbhd: every "
              "token keeps its global position" + _ONLY_OURS),
])
