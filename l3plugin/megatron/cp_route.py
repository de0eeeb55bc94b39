"""Context parallelism from Megatron-LM's own flags: ``--context-parallel-size N --cp-comm-type
l3plugin_all_gather`` (plus ``--reset-attention-mask`` for document masks) in an unmodified pretrain_gpt.py.

Stock Megatron-LM gives CP only to Transformer Engine's attention (the local DotProductAttention asserts
cp == 1), and its document masks (--reset-attention-mask) are a dense [s, s] mask that CP cannot use.
``install_cp_route()`` (called by ``l3plugin.megatron.install()``, hence by the launcher and the patch)
changes five things, each only while l3plugin's cp_comm_type is selected:

- Model: every ``SelfAttention`` built with ``cp_comm_type="l3plugin_all_gather"`` (Megatron's
  TransformerLayer passes the config's cp_comm_type when cp > 1) gets l3plugin's all-gather CP attention
  as its core attention: ``AllGatherCPCoreAttention`` for the local spec, the TE subclass from
  ``te_backend.py`` for a TE spec (refused with the reason when TE cannot be imported). Keyed on the config,
  so it works with Megatron-LM's own model_provider and with any spec, and for Megatron-Core users who set
  ``TransformerConfig.cp_comm_type`` themselves. With the balanced layout every GPTModel's RoPE follows it.
- Batch (Megatron-LM only): with --reset-attention-mask, ``get_batch_on_this_tp_rank`` adds the document
  boundaries of the FULL sequence, from the EOD tokens before CP sharding (``cu_seqlens_from_eod``; sent
  over TP from the rank that read the data), so pretrain_gpt's ``get_batch`` takes its packed-sequence
  branch, where ``get_thd_batch_on_this_cp_rank`` shards by l3plugin's layout and returns
  ``PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=<global boundaries>)``. Without
  --reset-attention-mask, Megatron's own get_batch_on_this_cp_rank shards by the paper's layout, which is
  l3plugin's "2cp". The dense mask is never built (``create_attention_mask_in_dataloader`` is turned off).
- Every pipeline stage: Megatron-LM's get_batch reads data on the first and last stages only, so with
  document masks a forward pre-hook on every GPTModel chunk gives each micro-batch the first stage's
  boundaries (``l3plugin.megatron.cp_documents``: sent over the pipeline group, per micro-batch, with bounded
  waits): any PP, virtual stages, stock or flexible schedules.
- Arguments: bad combinations are refused when Megatron-LM has parsed them (``arguments.check_cp_args``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch

from l3plugin.cp.sharding import cu_seqlens_from_eod, shard_batch
from l3plugin.megatron.arguments import CPRoute, parsed_options
from l3plugin.megatron.attention import CP_COMM_TYPE, AllGatherCPCoreAttention
from l3plugin.megatron.batch_hooks import CP_BATCH, broadcast_boundaries, eod_token, with_boundaries
from l3plugin.megatron.cp_documents import fill_boundaries, sbhd_packed_params
from l3plugin.upstream.versions import MEGATRON_CHECKED
from l3plugin.upstream.patchset import Patch, PatchSet

TE_MODULE = "megatron.core.extensions.transformer_engine"


def active_route() -> CPRoute | None:
    """The route of Megatron-LM's parsed arguments (None without Megatron-LM or l3plugin's cp_comm_type)."""
    return parsed_options().cp_route


def _route_for_model() -> CPRoute:
    """Settings for a model built with our cp_comm_type: Megatron-LM's flags, else the defaults."""
    return parsed_options().cp_route or CPRoute()


# ---- model: core attention and RoPE ----

def _target(core):
    return core.func if isinstance(core, functools.partial) else core


def _is_ours(core) -> bool:
    target = _target(core)
    return isinstance(target, type) and issubclass(target, AllGatherCPCoreAttention)


def _is_te(core) -> bool:
    """A core attention from Megatron's TE extension (without TE, Megatron's TE names are MagicMocks: a TE
    spec then still names one, and gets the TE backend's refusal, not a silent local swap)."""
    target = _target(core)
    if getattr(target, "__module__", "").startswith(TE_MODULE):
        return True
    te_class = getattr(sys.modules.get(TE_MODULE), "TEDotProductAttention", None)
    if te_class is None:
        return False
    return target is te_class or (isinstance(target, type) and isinstance(te_class, type)
                                  and issubclass(target, te_class))


def l3plugin_core_attention(core, route: CPRoute):
    """What replaces the spec's ``core`` for ``route``: TE's spec gets l3plugin's TE backend (raises with the
    reason where TE is missing), any other spec the local AllGatherCPCoreAttention; ours is kept as it is."""
    if _is_ours(core):
        return core
    options = dict(cp_layout=route.layout, cp_kv=route.cp_kv, documents_required=route.documents)
    if _is_te(core):
        from l3plugin.megatron.te_backend import te_attention_class

        return functools.partial(te_attention_class(), **options)
    return functools.partial(AllGatherCPCoreAttention, **options)


def _self_attention_init(self, *args, **kwargs):
    stock = CP_ROUTE.stock("SelfAttention.__init__")
    bound = inspect.signature(stock).bind(self, *args, **kwargs)
    if bound.arguments.get("cp_comm_type") == CP_COMM_TYPE:
        submodules = bound.arguments["submodules"]
        core = l3plugin_core_attention(submodules.core_attention, _route_for_model())
        # A copy: one spec object is shared by every layer (and maybe by other models).
        bound.arguments["submodules"] = dataclasses.replace(submodules, core_attention=core)
    stock(*bound.args, **bound.kwargs)


def _gpt_model_init(self, *args, **kwargs):
    CP_ROUTE.stock("GPTModel.__init__")(self, *args, **kwargs)
    comm = self.config.cp_comm_type
    if self.config.context_parallel_size > 1 and CP_COMM_TYPE in (comm if isinstance(comm, list) else [comm]):
        route = _route_for_model()
        if route.documents:  # before the RoPE hook below, which reads the boundaries
            self.register_forward_pre_hook(fill_boundaries, with_kwargs=True, prepend=True)
        layout = route.layout
        if layout != "2cp":
            from l3plugin.megatron.attention import rope_follows_cp_layout

            rope_follows_cp_layout(self, layout)


# ---- batch (Megatron-LM): document boundaries from EOD, l3plugin's sharding ----

def _boundaries_on_tp_group(batch) -> torch.Tensor:
    """The document boundaries, computed where the tokens are (TP rank 0 holds the whole batch; on the last
    pipeline stage the others get no tokens) and sent to the rest of the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    tokens = batch.get("tokens")
    device = next(v.device for v in batch.values() if torch.is_tensor(v))
    single = group is None or dist.get_world_size(group) == 1
    cu = cu_seqlens_from_eod(tokens, eod_token()) if single or dist.get_rank() == src else None
    return broadcast_boundaries(cu, src, group, device)


def tp_batch_with_documents(data_iterator, *args, **kwargs):
    """Megatron-LM's, plus the document boundaries as ``cu_seqlens`` [1, n] and ``max_seqlen`` [1] (= S: see
    ``with_boundaries``) when l3plugin's CP has document masks (pretrain_gpt's get_batch then takes its
    packed-sequence branch)."""
    batch = CP_ROUTE.stock("megatron.training.utils.get_batch_on_this_tp_rank")(data_iterator, *args, **kwargs)
    route = active_route()
    if route is None or not route.documents:
        return batch
    return with_boundaries(batch, _boundaries_on_tp_group(batch))


def packed_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=None, cp_rank=None):
    """Megatron-Core's, except for l3plugin's CP: this rank's positions by l3plugin's layout, and
    PackedSeqParams in the "sbhd" format carrying the GLOBAL boundaries (TE's THD split is not ours)."""
    from megatron.core import parallel_state

    route = active_route()
    if route is None:
        return CP_ROUTE.stock("megatron.core.utils.get_thd_batch_on_this_cp_rank")(
            batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size, cp_rank)
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    cu = cu_seqlens.reshape(-1)
    if cp_size > 1:
        batch = shard_batch(batch, cp_size, cp_rank, layout=route.layout, cu_seqlens=cu)
    return batch, sbhd_packed_params(cu)


# ---- install ----

def install_cp_route():
    """Patch Megatron-Core's SelfAttention and GPTModel, and Megatron-LM's batch functions when present
    (idempotent; sets CP_ROUTE below and batch_hooks.py's CP_BATCH). Inert unless a config / Megatron-LM's flags
    select cp_comm_type l3plugin_all_gather. Functions imported by name before (the two-line patch of
    pretrain_gpt.py calls install() after its imports) are rebound too."""
    CP_ROUTE.apply()
    CP_BATCH.apply()


def uninstall_cp_route():
    CP_BATCH.undo()
    CP_ROUTE.undo()


# ---- the declaration ----
_ONLY_OURS = "; inert unless cp_comm_type l3plugin_all_gather is selected"

CP_ROUTE = PatchSet("l3plugin.megatron (CP from Megatron-LM's flags)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.core.transformer.attention:SelfAttention", "__init__", _self_attention_init,
          signature=("self", "config", "submodules", "layer_number", "attn_mask_type", "cp_comm_type"),
          why="a SelfAttention built with cp_comm_type l3plugin_all_gather gets l3plugin's CP core attention "
              "(whatever the layer spec)" + _ONLY_OURS),
    Patch("megatron.core.models.gpt.gpt_model:GPTModel", "__init__", _gpt_model_init,
          signature=("self", "config", "transformer_layer_spec"),
          why="with the balanced CP layout, the model's RoPE follows it" + _ONLY_OURS),
    # Up to 0.17: Megatron-LM's get_batch_on_this_tp_rank (megatron.training.utils) and Megatron-Core's THD
    # sharding, which pretrain_gpt calls with the boundaries and which returns the PackedSeqParams (from 0.18:
    # batch_hooks.py, set CP_BATCH).
    Patch("megatron.core.utils", "get_thd_batch_on_this_cp_rank", packed_batch_on_this_cp_rank,
          signature=("batch", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "cp_size", "cp_rank"), rebind=True,
          versions="<0.18",
          why="packed batches sharded by l3plugin's CP layout, PackedSeqParams in sbhd with the global document "
              "boundaries" + _ONLY_OURS),
    Patch("megatron.training.utils", "get_batch_on_this_tp_rank", tp_batch_with_documents,
          signature=("data_iterator",), rebind=True, optional=True, versions="<0.18",
          why="Megatron-LM's batch gains the document boundaries from EOD tokens (--reset-attention-mask)"
              + _ONLY_OURS),
])
