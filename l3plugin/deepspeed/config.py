"""The ``"l3plugin"`` key of a DeepSpeed JSON config: its options, and what the FP32-reducing ZeRO supports."""

from __future__ import annotations

KEY = "l3plugin"
# option -> (accepted types, default, help)
OPTIONS = {
    "fp32_reduce_zero": ((bool,), False, "use the FP32-reducing ZeRO-1/2 optimizer"),
    "bucket_numel": ((int,), None, "elements per gradient bucket (default: zero_optimization.reduce_bucket_size)"),
    "accumulate_dtype": ((str,), "fp32", "micro-batch gradient accumulation dtype: fp32 or bf16 (to compare)"),
    "reduce_dtype": ((str,), "fp32", "reduce-scatter dtype: fp32 or bf16 (to compare)"),
    "reduce_every": ((int,), None, "ZeRO-2 only: reduce-scatter every N micro-batches (1..gradient_accumulation_"
                     "steps, default 1); larger N holds a full fp32 gradient buffer between reductions but "
                     "sends 1/N as much"),
    "wait_timeout": ((int, float), None, "seconds a collective may take before a rank-named error (default 600)"),
    "carry_reductions": ((bool,), False, "ZeRO-2: reduce-scatters still running when a micro-batch's backward "
                         "ends run on under the next forward (waited where their bucket is next needed) instead "
                         "of at the end of the backward; holds those buckets' full fp32 buffers across the "
                         "micro-batch boundary"),
    "overlap_param_gather": ((bool,), False, "start the bf16 parameter all-gathers at the step and wait for each "
                             "bucket just before the forward of the first module using it; holds a gathered bf16 "
                             "copy of the parameters until the next forward has used them"),
    "checkpoint_allow_nonfinite": ((bool,), False, "resume from a checkpoint whose weights or optimizer states "
                                   "hold NaN/Inf (refused by default)"),
    "checkpoint_fallback": ((bool,), True, "load_checkpoint without a tag falls back to the newest complete tag "
                            "when the one 'latest' names is torn (a crash during its save), with a warning"),
}
SUPPORTED = ('Supported with "l3plugin": {"fp32_reduce_zero": true}: "bf16": {"enabled": true}, '
             '"zero_optimization": {"stage": 1 or 2} without offload, an optimizer, no fp16, no MoE, '
             'no torch_autocast; DeepSpeedEngine and PipelineEngine; gradient '
             'accumulation and communication dtypes are chosen with "l3plugin": {"accumulate_dtype", "reduce_dtype"}; '
             'ZeRO-2 reduces every "reduce_every" micro-batches; zero_optimization.overlap_comm false makes '
             'every collective blocking')


def plugin_options(param_dict: dict) -> dict | None:
    """The validated options under ``"l3plugin"``, or None when the FP32-reducing ZeRO is not requested."""
    raw = param_dict.get(KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f'"{KEY}" must be an object like {{"fp32_reduce_zero": true}}, got {raw!r}')
    unknown = sorted(set(raw) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{k}: {h}" for k, (_, _, h) in OPTIONS.items())
        raise ValueError(f'unknown option(s) {unknown} under "{KEY}". Valid options: {valid}')
    opts = {k: raw.get(k, default) for k, (_, default, _) in OPTIONS.items()}
    for k, (types, default, _) in OPTIONS.items():
        v = opts[k]
        if v is not default and (not isinstance(v, types) or (bool not in types and isinstance(v, bool))):
            raise ValueError(f'"{KEY}.{k}" must be {"/".join(t.__name__ for t in types)}, got {v!r}')
    for k in ("accumulate_dtype", "reduce_dtype"):
        if opts[k] not in ("fp32", "bf16"):
            raise ValueError(f'"{KEY}.{k}" must be "fp32" or "bf16", got {opts[k]!r}')
    if opts["bucket_numel"] is not None and opts["bucket_numel"] < 1:
        raise ValueError(f'"{KEY}.bucket_numel" must be >= 1, got {opts["bucket_numel"]}')
    if opts["reduce_every"] is not None and opts["reduce_every"] < 1:
        raise ValueError(f'"{KEY}.reduce_every" must be >= 1 (micro-batches between ZeRO-2 reduce-scatters), '
                         f'got {opts["reduce_every"]}')
    if opts["wait_timeout"] is not None:
        from l3plugin.waits import resolve_timeout

        resolve_timeout(opts["wait_timeout"], f'"{KEY}.wait_timeout"')
    return opts if opts["fp32_reduce_zero"] else None


def options_of(engine) -> dict | None:
    """The engine's validated options, or None when its config does not ask for the FP32-reducing ZeRO."""
    return plugin_options(engine._config._param_dict)


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

