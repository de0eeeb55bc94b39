"""Select l3plugin's FP32-reducing ZeRO-1/2 optimizer from a DeepSpeed JSON config.

    # no import needed: the package's l3plugin-autoload.pth installs this module when deepspeed is imported
    # (L3PLUGIN_NO_AUTOLOAD=1 turns that off; then: import l3plugin.deepspeed, or install(); idempotent)
    config = {..., "bf16": {"enabled": true}, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {...}}, "scheduler": {...},
              "l3plugin": {"fp32_reduce_zero": true}}
    engine, *_ = deepspeed.initialize(model=model, config=config, ...)

With the key, ``deepspeed.initialize`` builds ``l3plugin.zero.FP32ReduceZero`` on DeepSpeed's own
``seq_data_parallel_group`` (DP x sequence-parallel): fp32 gradient accumulation, fp32 reduce-scatter,
fp32 master shard, bf16 parameter all-gather. ZeRO-1 reduce-scatters once per step; ZeRO-2 every
``reduce_every`` micro-batches (default 1, like stock ZeRO-2) and keeps the fp32 gradient shard in between,
plus the reductions it lets run on under the next forward, by default only what fits in ``carry_bytes`` (1/32 of
the shard). Buckets are ``bucket_numel`` elements, else ``zero_optimization.reduce_bucket_size`` cut to at most
1/16 of the model; their
reduce-scatters start from gradient hooks during backward unless ``zero_optimization.overlap_comm`` is
false. Without the key (or with ``"fp32_reduce_zero": false``)
DeepSpeed behaves exactly as stock. Options under ``"l3plugin"`` are the JSON-settable fields of
``l3plugin.zero.ZeroSettings`` (their help there), checked there, and ``context_parallel_size`` / ``cp_layout``
(sequence_parallel.py); the block is parsed once per engine into a frozen ``PluginOptions``
(``options_of(engine)``). Configs are read by DeepSpeed's own loader (``read_config``), so every form DeepSpeed
accepts (dict, JSON or hjson file, base64 string, ``args.deepspeed_config``) works with the key and, without it,
reaches DeepSpeed exactly as given.

DeepSpeed has no plug-in registry, so ``install`` replaces these engine methods (set DEEPSPEED, declared in
engine.py beside them; ``l3plugin doctor`` checks them against the installed DeepSpeed), each falling
through to the stock one unless the key is on: ``_do_sanity_check`` (validate the config first),
``_do_optimizer_sanity_check`` (route to ZeRO), ``_configure_zero_optimizer`` (build ours),
``save_checkpoint`` (crash-consistent: ``latest`` moves only after every rank saved),
``load_checkpoint`` (verify the partitions first and fail together, see ``collective/fail_together.py``),
``_load_zero_checkpoint`` (read every rank's partition, ours or stock DeepSpeed's: resume on another DP
size; or a universal checkpoint with ``checkpoint.load_universal``),
``zero_optimization_stage`` + ``PipelineEngine.__init__`` (PipelineEngine refuses stage 2 for DeepSpeed's
optimizer; ours supports it), ``PipelineEngine._exec_reduce_tied_grads`` (tied weights' gradients live in
our fp32 buckets, not in ``weight.grad``) and ``PipelineEngine._exec_backward_pass`` (end-of-backward
reductions; before DeepSpeed 0.18 also the optimizer's backward prologue), both also in the schedule's
instruction table, ``_backward_prologue_per_tensor`` (DeepSpeed 0.18:
the pipeline's earlier stages' gradients divided once); and ``deepspeed.initialize`` (``initialize_with_key``:
the key read once, CP above 1 through ``sequence_parallel.py``), plus accelerate's ``prepare_data_loader``
when accelerate was imported first (set ACCELERATE, in sequence_parallel.py).
``uninstall()`` restores everything. The package: ``config.py`` (the options and what is supported),
``engine.py`` (the replaced methods), ``sequence_parallel.py`` (``context_parallel_size``: DeepSpeed's
sequence-parallel groups, accelerate's data loaders, a transformers model's attention through
``l3plugin.huggingface``), ``optimizer.py`` (the optimizer the engines drive, and what they call; imported
when the first engine with the key builds it, so that a plain ``import deepspeed`` stays as light as stock),
``checkpoint.py`` (crash-consistent saves, verified loads, ``export_fp32_state_dict``).

Checkpoints are stock ZeRO-1/2 checkpoints: a stock engine (same config without the key) resumes them with
optimizer state; ``zero_to_fp32`` and ``ds_to_universal --inject_missing_state`` read them; our engine
resumes stock ones (any DP size) and universal ones. ``export_fp32_state_dict(engine)`` gives the plain fp32
state dict from a live engine.
"""

from l3plugin.deepspeed.checkpoint import export_fp32_state_dict
from l3plugin.deepspeed.config import KEY, SUPPORTED, PluginOptions, read_config
from l3plugin.deepspeed.engine import install, options_of, uninstall

__all__ = ["KEY", "SUPPORTED", "PluginOptions", "export_fp32_state_dict", "install", "options_of", "read_config",
           "uninstall"]

install()
