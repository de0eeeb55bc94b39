"""Every change l3plugin makes to an upstream object (DeepSpeed, Megatron-Core, Megatron-LM, torch), declared
in one place: what is replaced, by which named function, why, and on which upstream versions it was checked.
How a row is checked, applied and undone, and how versions gate it: l3plugin/patchset.py.

Replacements are named by "module:function" strings: this module imports nothing of l3plugin and nothing
upstream until a set is applied or checked.
"""

from __future__ import annotations

from l3plugin.patchset import (SETS, UNCHECKED_ENV, Patch, PatchMismatch, PatchSet,  # noqa: F401 - the API
                               VersionOutOfRange)


# -- the declarations --------------------------------------------------------------------------------------
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_PIPE = "deepspeed.runtime.pipe.engine:PipelineEngine"
_HOOKS = "l3plugin.deepspeed.engine"

# DeepSpeed: the latest patch of each minor release from 0.16 to 0.19 was run (compat/deepspeed.sh; docs/verified.md).
DEEPSPEED_CHECKED = ">=0.16.9,<0.20"

DEEPSPEED = PatchSet("l3plugin.deepspeed", "deepspeed", DEEPSPEED_CHECKED, [
    # Each replacement falls through to the original unless the config has "l3plugin": {"fp32_reduce_zero": true}.
    Patch(_ENGINE, "_do_sanity_check", f"{_HOOKS}:do_sanity_check", signature=("self",),
          why="check the l3plugin options first, so their message wins over DeepSpeed's generic ones"),
    Patch(_ENGINE, "_do_optimizer_sanity_check", f"{_HOOKS}:do_optimizer_sanity_check",
          signature=("self", "basic_optimizer"),
          why="route to _configure_zero_optimizer, also where stock would pick BF16_Optimizer"),
    Patch(_ENGINE, "_configure_zero_optimizer", f"{_HOOKS}:configure_zero_optimizer", signature=("self", "optimizer"),
          why="build l3plugin's FP32-reducing ZeRO-1/2 optimizer on DeepSpeed's seq_data_parallel_group"),
    Patch(_ENGINE, "_load_zero_checkpoint", f"{_HOOKS}:load_zero_checkpoint",
          signature=("self", "load_dir", "tag", "load_optimizer_states"),
          why="apply the partitions load_checkpoint read and verified (ours, stock's at any DP size, universal)"),
    Patch(_ENGINE, "save_checkpoint", f"{_HOOKS}:save_checkpoint",
          signature=("self", "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"),
          why="crash-consistent saves: temporary names, manifests, 'latest' moved after every rank agreed"),
    Patch(_ENGINE, "load_checkpoint", f"{_HOOKS}:load_checkpoint",
          signature=("self", "load_dir", "tag", "load_module_strict", "load_optimizer_states",
                     "load_lr_scheduler_states", "load_module_only", "custom_load_fn"),
          why="verify the tag and the partitions on every rank and agree before stock touches anything"),
    Patch(_ENGINE, "zero_optimization_stage", f"{_HOOKS}:zero_optimization_stage", signature=("self",),
          why="PipelineEngine.__init__ asserts stage < 2 for DeepSpeed's optimizer; ours supports stage 2"),
    Patch(_PIPE, "__init__", f"{_HOOKS}:pipeline_engine_init", signature=("self",),
          why="end the stage-2 disguise of zero_optimization_stage once PipelineEngine's assert has passed"),
    Patch(_PIPE, "_exec_reduce_tied_grads", f"{_HOOKS}:exec_reduce_tied_grads", signature=("self",),
          why="tied weights' gradients live in l3plugin's fp32 buckets, not in weight.grad"),
    Patch(_PIPE, "_exec_backward_pass", f"{_HOOKS}:exec_backward_pass", signature=("self", "buffer_id"),
          versions=">=0.18", why="the pipeline calls no post-backward epilogue on its first stages: end-of-backward "
          "reductions"),
    Patch(_PIPE, "_exec_backward_pass", f"{_HOOKS}:exec_backward_pass_with_prologue", signature=("self", "buffer_id"),
          versions="<0.18", why="before 0.18 the pipeline's first stages call neither the optimizer's backward "
          "prologue nor an epilogue: l3plugin's micro-batch start and end-of-backward reductions"),
    Patch(_ENGINE, "_backward_prologue_per_tensor", f"{_HOOKS}:backward_prologue_per_tensor",
          signature=("self", "grad"), versions=">=0.18,<0.19",
          why="0.18 divides the gradient the pipeline's earlier stages receive by the accumulation steps a second "
          "time (0.19's PipelineEngine does not): the last stage only"),
    # The pipeline schedule dispatches through a class-level table of functions, not attribute lookup.
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_reduce_tied_grads", key="deepspeed.runtime.pipe.schedule:ReduceTiedGrads",
          signature=("self",), why="the instruction table entry of _exec_reduce_tied_grads"),
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_backward_pass", key="deepspeed.runtime.pipe.schedule:BackwardPass",
          signature=("self", "buffer_id"), versions=">=0.18", why="the instruction table entry of _exec_backward_pass"),
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_backward_pass_with_prologue",
          key="deepspeed.runtime.pipe.schedule:BackwardPass", signature=("self", "buffer_id"), versions="<0.18",
          why="the instruction table entry of _exec_backward_pass"),
    Patch("deepspeed", "initialize", "l3plugin.huggingface.deepspeed_cp:initialize_with_key",
          signature=("args", "model"),
          rebind=True, why='"l3plugin": {"context_parallel_size": N}: DeepSpeed\'s sequence-parallel groups as mpu, '
          "batch size over DP only, a transformers model's attention swapped for the all-gather CP attention"),
    # Only when accelerate is imported already (the HF Trainer imports it before deepspeed).
    Patch("accelerate.accelerator", "prepare_data_loader", "l3plugin.huggingface.deepspeed_cp:prepare_data_loader",
          signature=("dataloader", "device", "num_processes", "process_index"), loaded_only=True,
          why="under context_parallel_size N, shard data over data-parallel ranks only: a CP group shares batches"),
])

# Megatron-Core releases every Megatron set was checked on (docs/verified.md; pyproject.toml says the same).
MEGATRON_CHECKED = ">=0.16.1,<0.20"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_INSTALL = "l3plugin.megatron.install"
_SELECTOR = "one selector answering the flexible schedule when it is selected and pp > 1"

AUTOLOAD = PatchSet("l3plugin_autoload", "deepspeed", DEEPSPEED_CHECKED, [
    Patch("deepspeed", "initialize", "l3plugin_autoload:initialize_after_install",
          why="deepspeed was imported while an l3plugin module was half-built: l3plugin.deepspeed is installed "
              "at the first deepspeed.initialize instead (then the stock function is put back)"),
])


def _selector_rows(versions: str, signature: tuple) -> list[Patch]:
    """The three names of Megatron's selector, for the versions whose selector takes ``signature``."""
    return [
        Patch("megatron.core.pipeline_parallel", "get_forward_backward_func", f"{_INSTALL}:get_forward_backward_func",
              signature=signature, versions=versions, why=_SELECTOR),
        Patch(_SCHEDULES, "get_forward_backward_func", f"{_INSTALL}:get_forward_backward_func",
              signature=signature, versions=versions, why=_SELECTOR),
        Patch("megatron.training.training", "get_forward_backward_func", f"{_INSTALL}:get_forward_backward_func",
              signature=signature, versions=versions, loaded_only=True,
              why="Megatron-LM's training loop imported the selector by name (a module global)"),
    ]


MEGATRON = PatchSet("l3plugin.megatron", "megatron-core", MEGATRON_CHECKED, [
    *_selector_rows("<0.19", ("pp_size", "vp_size")),
    # 0.19 adds schedule_pg_collection (Megatron-LM 0.19's loop passes it).
    *_selector_rows(">=0.19", ("pp_size", "vp_size", "schedule_pg_collection")),
    # What a selector bound before install() returns, read from these globals at call time.
    Patch(_SCHEDULES, "forward_backward_pipelining_with_interleaving", f"{_INSTALL}:guard", wraps=True,
          signature=("forward_step_func",),
          why="an early-bound stock selector still runs the flexible schedule while it is selected (warned)"),
    Patch(_SCHEDULES, "forward_backward_pipelining_without_interleaving", f"{_INSTALL}:guard", wraps=True,
          signature=("forward_step_func",),
          why="an early-bound stock selector still runs the flexible schedule while it is selected (warned)"),
])

MEGATRON_LM_ARGS = PatchSet("l3plugin.megatron (Megatron-LM arguments)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.training.initialize", "parse_args", f"{_INSTALL}:parse_args", optional=True,
          signature=("extra_args_provider",), versions="<0.18",
          why="Megatron-LM's parser accepts l3plugin's flags (chained onto the script's extra_args_provider) and "
              "the parsed CP arguments are checked (initialize_megatron calls it)"),
    Patch("megatron.training.arguments", "parse_args", f"{_INSTALL}:parse_args", optional=True,
          signature=("extra_args_provider",), versions=">=0.18",
          why="the same, where pretrain_gpt's parse_and_validate_args calls it (pretrain no longer parses)"),
])

_CP_ROUTE = "l3plugin.megatron.cp_route"
_ONLY_OURS = "; inert unless cp_comm_type l3plugin_all_gather is selected"
_BATCH_HOOKS = "l3plugin.megatron.batch_hooks"
_BOUNDARIES = ("the batch gains the document boundaries of the full sequence from EOD tokens on TP rank 0, sent over "
               "TP (--reset-attention-mask)" + _ONLY_OURS)

CP_ROUTE = PatchSet("l3plugin.megatron (CP from Megatron-LM's flags)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.core.transformer.attention:SelfAttention", "__init__", f"{_CP_ROUTE}:_self_attention_init",
          signature=("self", "config", "submodules", "layer_number", "attn_mask_type", "cp_comm_type"),
          why="a SelfAttention built with cp_comm_type l3plugin_all_gather gets l3plugin's CP core attention "
              "(whatever the layer spec)" + _ONLY_OURS),
    Patch("megatron.core.models.gpt.gpt_model:GPTModel", "__init__", f"{_CP_ROUTE}:_gpt_model_init",
          signature=("self", "config", "transformer_layer_spec"),
          why="with the balanced CP layout, the model's RoPE follows it" + _ONLY_OURS),
    # Up to 0.17: Megatron-LM's get_batch_on_this_tp_rank (megatron.training.utils) and Megatron-Core's THD
    # sharding, which pretrain_gpt calls with the boundaries and which returns the PackedSeqParams.
    Patch("megatron.core.utils", "get_thd_batch_on_this_cp_rank", f"{_CP_ROUTE}:packed_batch_on_this_cp_rank",
          signature=("batch", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "cp_size", "cp_rank"), rebind=True,
          versions="<0.18",
          why="packed batches sharded by l3plugin's CP layout, PackedSeqParams in sbhd with the global document "
              "boundaries" + _ONLY_OURS),
    Patch("megatron.training.utils", "get_batch_on_this_tp_rank", f"{_CP_ROUTE}:tp_batch_with_documents",
          signature=("data_iterator",), rebind=True, optional=True, versions="<0.18",
          why="Megatron-LM's batch gains the document boundaries from EOD tokens (--reset-attention-mask)"
              + _ONLY_OURS),
    # From 0.18: both batch functions live in megatron.core.utils (THD sharding is gone, NVIDIA/Megatron-LM
    # PR 4103) and pretrain_gpt's forward_step builds a "thd" PackedSeqParams itself (batch_hooks.py).
    Patch("megatron.core.utils", "get_batch_on_this_tp_rank", f"{_BATCH_HOOKS}:tp_batch_with_documents",
          signature=("batch", "is_sft", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                     "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank"),
          rebind=True, versions=">=0.18,<0.19", why=_BOUNDARIES),
    Patch("megatron.core.utils", "get_batch_on_this_tp_rank", f"{_BATCH_HOOKS}:tp_batch_with_documents",
          signature=("batch", "has_cu_seqlens", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                     "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank"),
          rebind=True, versions=">=0.19", why=_BOUNDARIES),
    Patch("megatron.core.utils", "get_batch_on_this_cp_rank", f"{_BATCH_HOOKS}:cp_batch_by_layout",
          signature=("batch", "is_hybrid_cp", "cp_group"), rebind=True, versions=">=0.18",
          why="the batch sharded by l3plugin's CP layout, the document boundaries left global" + _ONLY_OURS),
    Patch("megatron.core.models.gpt.gpt_model:GPTModel", "forward", f"{_BATCH_HOOKS}:gpt_model_forward",
          signature=("self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels",
                     "inference_context", "packed_seq_params"), versions=">=0.18",
          why="pretrain_gpt's PackedSeqParams (qkv_format thd, built from those boundaries) given as sbhd: every "
              "token keeps its global position" + _ONLY_OURS),
])

_ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding"

ROPE = PatchSet("l3plugin.megatron (RoPE)", "megatron-core", MEGATRON_CHECKED, [
    Patch(_ROPE, "forward", "l3plugin.demo.model:rope_on_cpu", instance=True,
          signature=("self", "max_seq_len", "offset", "packed_seq", "cp_group"),
          why="on a CPU-only machine RotaryEmbedding moves its frequencies to the CUDA device and indexes with a "
              "pinned CUDA tensor; the same result computed where inv_freq is"),
    Patch(_ROPE, "forward", "l3plugin.megatron.attention:rope_of_held_positions", instance=True,
          signature=("self", "max_seq_len", "offset", "packed_seq", "cp_group"),
          why="with a CP layout other than the paper's 2cp chunks, each rank's RoPE must follow the positions it "
              "holds (rope_follows_cp_layout)"),
])

# The torch.distributed functions record_collectives / local_collectives route through one wrapper each
# (op specs in l3plugin/debug/patching.py, OPS; tests/debug check both name the same functions).
COLLECTIVE_OPS = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                  "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
                  "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "barrier",
                  "send", "recv", "isend", "irecv", "batch_isend_irecv")

COLLECTIVES = PatchSet("l3plugin.debug (record_collectives, local_collectives)", "torch", ">=2.13", [
    Patch(module, op, "l3plugin.debug.patching:collective_wrapper", wraps=True, optional=True,
          why="while a recorder or the local stand-ins are active, each call goes to them (Megatron-Core and "
              "DeepSpeed call these functions through both modules)")
    for module in ("torch.distributed", "torch.distributed.distributed_c10d") for op in COLLECTIVE_OPS])

# -- tied embeddings on a CPU-only machine (l3plugin/demo/model.py builds GPTModel inside TIED_EMBEDDINGS.within())
_LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module:LanguageModule"

TIED_EMBEDDINGS = PatchSet("l3plugin.megatron (tied embeddings on CPU)", "megatron-core", MEGATRON_CHECKED, [
    Patch(_LANGUAGE_MODULE, "setup_embeddings_and_output_layer", "l3plugin.demo.model:tied_embeddings_on_cpu",
          wraps=True, signature=("self",),
          why="with tied embeddings at pp > 1 the copy of the first stage's embedding into the last stage moves the "
              "weight to the CUDA device first; on a CPU-only machine the same all-reduce where the weight is"),
])
