"""The ``"l3plugin"`` key of a DeepSpeed JSON config: its options, and what the FP32-reducing ZeRO supports."""

from __future__ import annotations

from l3plugin.zero.settings import ZeroSettings, boolean, json_options

KEY = "l3plugin"
ENABLE = "fp32_reduce_zero"  # the switch; every other option is a ZeroSettings field (l3plugin/zero/settings.py)
SUPPORTED = ('Supported with "l3plugin": {"fp32_reduce_zero": true}: "bf16": {"enabled": true}, '
             '"zero_optimization": {"stage": 1 or 2} without offload, an optimizer, no fp16, no MoE, '
             'no torch_autocast; DeepSpeedEngine and PipelineEngine; gradient '
             'accumulation and communication dtypes are chosen with "l3plugin": {"accumulate_dtype", "reduce_dtype"}; '
             'ZeRO-2 reduces every "reduce_every" micro-batches; zero_optimization.overlap_comm false makes '
             'every collective blocking')


def plugin_options(param_dict: dict) -> dict | None:
    """The checked options under ``"l3plugin"`` ({option: value or default}), or None when the FP32-reducing
    ZeRO is not requested."""
    raw = param_dict.get(KEY)
    if raw is None:
        return None
    opts = json_options(raw, KEY, extra={ENABLE: "use the FP32-reducing ZeRO-1/2 optimizer"})
    enabled = boolean(ENABLE, opts.pop(ENABLE, False), KEY)
    return opts if enabled else None


def options_of(engine) -> dict | None:
    """The engine's validated options, or None when its config does not ask for the FP32-reducing ZeRO."""
    return plugin_options(engine._config._param_dict)


def zero_settings(engine) -> ZeroSettings:
    """The optimizer's settings: the engine's config (stage, gradient_clipping, overlap_comm,
    reduce_bucket_size) and the ``"l3plugin"`` options."""
    opts = options_of(engine)
    # DeepSpeed's overlap_comm defaults to off because its overlap costs extra buffers; ours costs
    # nothing more (the bucket being reduced exists anyway), so it is on unless the config says false.
    overlap = engine._config._param_dict.get("zero_optimization", {}).get("overlap_comm")
    # Under sequence parallelism (Ulysses, or l3plugin's context_parallel_size) DeepSpeed's engine and stock ZeRO
    # sum gradients over the SP ranks of a group and average over data parallelism: our ZeRO, reducing over
    # seq_data_parallel_group (DP x SP), does the same.
    sp = getattr(engine, "sequence_parallel_size", 1)
    scale = None if sp == 1 else sp / engine.seq_dp_world_size
    return ZeroSettings(**{**opts, "bucket_numel": opts["bucket_numel"] or int(engine.zero_reduce_bucket_size())},
                        stage=engine.zero_optimization_stage(), clip_grad=engine.gradient_clipping(),
                        overlap=overlap is not False, gradient_scale=scale)


def check_supported(engine) -> None:
    """Raise one ValueError listing everything in the config that the FP32-reducing ZeRO cannot do."""
    import torch

    problems = []
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2):
        problems.append(f"zero_optimization.stage is {stage}; only stage 1 and 2 are supported")
    if engine.fp16_enabled():
        problems.append("fp16 is enabled; only bf16 is supported")
    elif not engine.bfloat16_enabled():
        problems.append('bf16 is not enabled; set "bf16": {"enabled": true}')
    for what in ("optimizer", "param"):
        offload = getattr(engine, f"zero_offload_{what}")()
        device = getattr(getattr(offload, "device", None), "value", getattr(offload, "device", None))
        if offload is not None and device not in (None, "none"):
            problems.append(f"zero_optimization.offload_{what} is set (device {device}); offload is not supported")
    if getattr(engine, "has_moe_layers", False):
        problems.append("the model has MoE layers; they are not supported")
    if engine.torch_autocast_enabled():
        problems.append("torch_autocast is enabled; give the model bf16 weights with bf16.enabled instead")
    if getattr(engine, "zenflow", False):
        problems.append("zenflow is enabled; it is not supported")
    comm = engine._config.communication_data_type
    if comm is not None and comm != torch.float32:
        problems.append(f'communication_data_type is {comm}; use "{KEY}": {{"reduce_dtype": ...}} instead')
    accum = engine._config._param_dict.get("data_types", {}).get("grad_accum_dtype")
    if accum not in (None, "fp32", "float32"):
        problems.append(f'data_types.grad_accum_dtype is {accum!r}; use "{KEY}": {{"accumulate_dtype": ...}} instead')
    every = options_of(engine)["reduce_every"]
    if every is not None and stage == 1:
        problems.append(f'"{KEY}.reduce_every" is {every} with zero_optimization.stage 1; ZeRO-1 reduce-scatters '
                        "once per step (at the gradient-accumulation boundary): remove reduce_every or use stage 2")
    elif every is not None and every > engine.gradient_accumulation_steps():
        problems.append(f'"{KEY}.reduce_every" is {every}; valid range is 1..gradient_accumulation_steps '
                        f"({engine.gradient_accumulation_steps()})")
    if options_of(engine)["carry_reductions"] and stage == 1:
        problems.append(f'"{KEY}.carry_reductions" is true with zero_optimization.stage 1; ZeRO-1 reduce-scatters '
                        "only in the last micro-batch, whose reductions the step needs: remove it or use stage 2")
    if problems:
        raise ValueError("l3plugin FP32-reducing ZeRO cannot run this config: " + "; ".join(problems)
                         + ". " + SUPPORTED)

