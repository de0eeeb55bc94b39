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
``reduce_every`` micro-batches (default 1, like stock ZeRO-2) and keeps only the fp32 gradient shard in
between. Buckets are ``bucket_numel`` or ``zero_optimization.reduce_bucket_size`` elements; their
reduce-scatters start from gradient hooks during backward unless ``zero_optimization.overlap_comm`` is
false. Without the key (or with ``"fp32_reduce_zero": false``)
DeepSpeed behaves exactly as stock. Options under ``"l3plugin"`` (see ``OPTIONS``) are validated.

DeepSpeed has no plug-in registry, so ``install`` wraps these engine methods, each falling through to the
stock one unless the key is on: ``_do_sanity_check`` (validate the config first),
``_do_optimizer_sanity_check`` (route to ZeRO), ``_configure_zero_optimizer`` (build ours),
``load_checkpoint`` (verify the partitions first and fail together, see ``fail_together.py``),
``_load_zero_checkpoint`` (read every rank's partition, ours or stock DeepSpeed's: resume on another DP
size; or a universal checkpoint with ``checkpoint.load_universal``),
``zero_optimization_stage`` + ``PipelineEngine.__init__`` (PipelineEngine refuses stage 2 for DeepSpeed's
optimizer; ours supports it), ``PipelineEngine._exec_reduce_tied_grads`` (tied weights' gradients live in
our fp32 buckets, not in ``weight.grad``) and ``PipelineEngine._exec_backward_pass`` (end-of-backward
reductions), both also in the schedule's instruction table.
Engine-side details: ``zero/deepspeed_engine.py``. ``uninstall()`` restores everything.

Checkpoints are stock ZeRO-1/2 checkpoints: a stock engine (same config without the key) resumes them with
optimizer state; ``zero_to_fp32`` and ``ds_to_universal --inject_missing_state`` read them; our engine
resumes stock ones (any DP size) and universal ones. ``export_fp32_state_dict(engine)`` gives the plain fp32
state dict from a live engine.
"""

from __future__ import annotations

import functools
import os

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


def _options(engine) -> dict | None:
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
    every = _options(engine)["reduce_every"]
    if every is not None and stage == 1:
        problems.append(f'"{KEY}.reduce_every" is {every} with zero_optimization.stage 1; ZeRO-1 reduce-scatters '
                        "once per step (at the gradient-accumulation boundary): remove reduce_every or use stage 2")
    elif every is not None and every > engine.gradient_accumulation_steps():
        problems.append(f'"{KEY}.reduce_every" is {every}; valid range is 1..gradient_accumulation_steps '
                        f"({engine.gradient_accumulation_steps()})")
    if _options(engine)["carry_reductions"] and stage == 1:
        problems.append(f'"{KEY}.carry_reductions" is true with zero_optimization.stage 1; ZeRO-1 reduce-scatters '
                        "only in the last micro-batch, whose reductions the step needs: remove it or use stage 2")
    if problems:
        raise ValueError("l3plugin FP32-reducing ZeRO cannot run this config: " + "; ".join(problems)
                         + ". " + SUPPORTED)


_stock: dict = {}


def _ours(engine) -> bool:
    from l3plugin.zero.deepspeed_engine import DeepSpeedFP32ReduceZero

    return isinstance(engine.__dict__.get("optimizer"), DeepSpeedFP32ReduceZero)


class _ReadAhead:
    """One ``load_checkpoint`` of our engine: its two agreements and the verified partitions."""

    def __init__(self, verified, applied):
        self.verified, self.applied, self.loaded = verified, applied, None


def _with_verified_tag(engine, stock_load_checkpoint, args, kwargs):
    """(args, kwargs, tag) of a ``load_checkpoint`` call with the tag to load made explicit: the one given,
    verified (l3plugin/checkpoint_commit.py), or without one the tag 'latest' names if complete, else the
    newest complete tag (warned). Raises TornCheckpoint naming the tag and the file."""
    import inspect
    import warnings

    from l3plugin.checkpoint_commit import choose_tag, verify_tag

    if engine.load_universal_checkpoint():
        return args, kwargs, None  # universal checkpoints are written by DeepSpeed's converter, not by a save
    call = inspect.signature(stock_load_checkpoint).bind(engine, *args, **kwargs)
    call.apply_defaults()
    a = dict(call.arguments)
    a.pop(next(iter(a)))  # self
    if a["tag"] is not None:
        if os.path.isdir(os.path.join(a["load_dir"], str(a["tag"]))):  # else stock warns and loads nothing
            verify_tag(a["load_dir"], str(a["tag"]), checksums=False)
        return (), a, str(a["tag"])
    tag, warning = choose_tag(a["load_dir"], fallback=_options(engine)["checkpoint_fallback"])
    if warning:
        warnings.warn(f"rank {engine.global_rank}: {warning}", stacklevel=3)
    a["tag"] = tag
    return (), a, tag


def _read_ahead(engine, stock_load_checkpoint, args, kwargs):
    """Read and verify the ZeRO partitions ``load_checkpoint(*args, **kwargs)`` will load, before stock
    DeepSpeed touches anything; None when it will not read any (mirrors its conditions)."""
    import inspect

    call = inspect.signature(stock_load_checkpoint).bind(engine, *args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    universal = engine.load_universal_checkpoint()
    optimizer_states = a["load_optimizer_states"] and not a["load_module_only"]
    if not (optimizer_states or universal):
        return None
    tag = a["tag"]
    if tag is None:
        latest = os.path.join(a["load_dir"], "latest_universal" if universal else "latest")
        if not os.path.isfile(latest):
            return None  # stock warns and returns (None, None)
        with open(latest) as f:
            tag = f.read().strip()
    if not os.path.isdir(os.path.join(a["load_dir"], str(tag))):
        return None  # stock warns and returns (None, None)
    return _read_zero(engine, a["load_dir"], tag, optimizer_states)


def _read_zero(engine, load_dir, tag, optimizer_states: bool):
    """This rank's verified ZeRO state from checkpoint ``load_dir/tag`` (ours, stock's, or universal when
    the config says so), in new tensors (``l3plugin.zero.checkpoint.Loaded``)."""
    from l3plugin.zero.checkpoint import read_partitions, read_universal

    allow = _options(engine)["checkpoint_allow_nonfinite"]
    zero = engine.optimizer.zero
    if engine.load_universal_checkpoint():
        return read_universal(zero, os.path.join(load_dir, str(tag)), optimizer_states, allow)
    return read_partitions(zero, _partition_files(engine, load_dir, tag), optimizer_states, allow)


def _partition_files(engine, load_dir, tag) -> list[str]:
    """The saved ranks' partition files, found by DeepSpeed's naming. Stock learns their number from the
    model file, which it reads later; here the files are counted (``partition_count`` inside is checked)."""
    names = []
    while True:
        name = engine._get_rank_zero_ckpt_name(checkpoints_path=load_dir, tag=tag, mp_rank=engine.checkpoint_mp_rank,
                                               dp_rank=len(names), bf16_mode=engine.bfloat16_enabled())
        if not os.path.exists(name):
            older = name.replace("_optim_states.pt", "optim_states.pt")  # DeepSpeed's older file names
            if not os.path.exists(older):
                break
            name = older
        names.append(name)
    if not names:
        raise FileNotFoundError(f"checkpoint {os.path.join(load_dir, str(tag))} has no ZeRO partition files (looked "
                                f"for {name})")
    return names


class _RecordingWriter:
    """Stands in for ``checkpoint_engine.save`` during one save: each file goes through
    ``save_atomically`` and is recorded. The first error is kept, not raised, and later files are skipped,
    so that this rank still reaches stock's barriers and the agreement after them (raising here would leave
    the other ranks waiting in the barrier)."""

    def __init__(self, checkpoint_engine, tag_dir):
        self.stock_save = checkpoint_engine.save
        self.tag_dir = tag_dir
        self.records, self.error = {}, None

    def save(self, state_dict, path):
        from l3plugin.checkpoint_commit import save_atomically

        if self.error is not None:
            return
        try:
            record = save_atomically(lambda tmp: self.stock_save(state_dict, tmp), path)
            self.records[os.path.relpath(path, self.tag_dir)] = record
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            self.error = exc


def install() -> None:
    """Patch DeepSpeed's engines (once) so the ``"l3plugin"`` config key takes effect."""
    if _stock:
        return
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from l3plugin.zero.deepspeed_engine import DeepSpeedFP32ReduceZero

    def wrap(cls, name):
        _stock[(cls, name)] = stock = cls.__dict__[name]

        def deco(fn):
            setattr(cls, name, functools.wraps(stock)(fn))
            return fn
        return stock, deco

    config_check, deco = wrap(DeepSpeedEngine, "_do_sanity_check")

    @deco
    def _do_sanity_check(self):
        if _options(self) is not None:  # first, so our message wins over DeepSpeed's generic ones
            check_supported(self)
        return config_check(self)

    sanity, deco = wrap(DeepSpeedEngine, "_do_optimizer_sanity_check")

    @deco
    def _do_optimizer_sanity_check(self, basic_optimizer):
        if _options(self) is None:
            return sanity(self, basic_optimizer)
        check_supported(self)
        return ZERO_OPTIMIZATION  # route to _configure_zero_optimizer, also where stock would pick BF16_Optimizer

    configure, deco = wrap(DeepSpeedEngine, "_configure_zero_optimizer")

    @deco
    def _configure_zero_optimizer(self, optimizer):
        opts = _options(self)
        if opts is None:
            return configure(self, optimizer)
        check_supported(self)
        if optimizer is None:
            raise ValueError('l3plugin FP32-reducing ZeRO needs an optimizer: add "optimizer" to the config '
                             "or pass optimizer= to deepspeed.initialize")
        import torch

        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        # DeepSpeed's overlap_comm defaults to off because its overlap costs extra buffers; ours costs
        # nothing more (the bucket being reduced exists anyway), so it is on unless the config says false.
        overlap = self._config._param_dict.get("zero_optimization", {}).get("overlap_comm")
        built = DeepSpeedFP32ReduceZero(
            self, optimizer, bucket_numel=opts["bucket_numel"] or int(self.zero_reduce_bucket_size()),
            accumulate_dtype=dtypes[opts["accumulate_dtype"]], reduce_dtype=dtypes[opts["reduce_dtype"]],
            reduce_every=opts["reduce_every"] or 1, overlap=overlap is not False, wait_timeout=opts["wait_timeout"],
            carry_reductions=opts["carry_reductions"], overlap_param_gather=opts["overlap_param_gather"])
        # PipelineEngine.__init__ asserts stage < 2 right after this; ours supports stage 2 (see below).
        self.__dict__["_l3plugin_hide_stage2"] = isinstance(self, PipelineEngine)
        return built

    load_zero, deco = wrap(DeepSpeedEngine, "_load_zero_checkpoint")

    @deco
    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        if not _ours(self):
            return load_zero(self, load_dir, tag, load_optimizer_states)
        read = self.__dict__.get("_l3plugin_load")  # set by load_checkpoint below
        if read is not None and read.loaded is not None:
            from l3plugin.zero.checkpoint import READ_PARTITIONS, apply_loaded

            read.applied(None, READ_PARTITIONS)  # DeepSpeed's own part went well on every rank too
            apply_loaded(self.optimizer.zero, read.loaded)
            return True
        # Called on its own: read, verify, agree and apply in one go.
        from l3plugin.zero.checkpoint import load_agreed

        load_agreed(self.optimizer.zero, lambda: _read_zero(self, load_dir, tag, load_optimizer_states))
        return True

    stock_save_checkpoint, deco = wrap(DeepSpeedEngine, "save_checkpoint")

    @deco
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - stock's
                        exclude_frozen_parameters=False):
        """Crash-consistent (l3plugin/checkpoint_commit.py): every file is written to a temporary name, fsynced
        and renamed, each rank records its files in a manifest, the ranks agree that all saved, and only then
        does rank 0 point 'latest' at the tag (by rename). A save that fails on one rank raises on all and
        leaves 'latest' where it was."""
        if not _ours(self):
            return stock_save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        import torch.distributed as dist

        from l3plugin.checkpoint_commit import write_latest, write_manifest
        from l3plugin.fail_together import agree

        tag = str(f"global_step{self.global_steps}" if tag is None else tag)
        writer = _RecordingWriter(self.checkpoint_engine, os.path.join(save_dir, tag))
        self.checkpoint_engine.save = writer.save  # this save only (an instance attribute over the method)
        try:
            stock_save_checkpoint(self, save_dir, tag, client_state, False, exclude_frozen_parameters)
            error = writer.error
            if error is None:
                write_manifest(os.path.join(save_dir, tag), dist.get_rank(), dist.get_world_size(), writer.records)
        except Exception as exc:  # noqa: BLE001 - every rank raises in the agreement
            error = exc
        finally:
            del self.checkpoint_engine.save
        timeout = self.optimizer.zero.wait_timeout
        agree(error, what=f"save of checkpoint tag {tag!r} in {save_dir}", device=self.device, timeout=timeout)
        if save_latest:
            error = None
            if dist.get_rank() == 0:
                try:
                    write_latest(save_dir, tag)
                except Exception as exc:  # noqa: BLE001
                    error = exc
            agree(error, what=f"pointing 'latest' in {save_dir} at {tag!r}", device=self.device, timeout=timeout)
        return True

    stock_load_checkpoint, deco = wrap(DeepSpeedEngine, "load_checkpoint")

    @deco
    def load_checkpoint(self, *args, **kwargs):
        """Fail together, touching nothing on a bad checkpoint: every rank first reads and verifies the
        optimizer partitions it needs and the ranks agree (an error on one is an error on all); then stock
        DeepSpeed loads the model file, and the ranks agree again right before the first collective (or at
        the end, if stock returned without reading partitions), so an error in DeepSpeed's part on one rank
        stops every rank too."""
        if not _ours(self):
            return stock_load_checkpoint(self, *args, **kwargs)
        from l3plugin.fail_together import OneAgreement

        def agreement(what):
            return OneAgreement(None, what=what, device=self.device, timeout=self.optimizer.zero.wait_timeout)

        read = _ReadAhead(agreement("checkpoint verification"), agreement("checkpoint load"))
        tag = None
        try:
            args, kwargs, tag = _with_verified_tag(self, stock_load_checkpoint, args, kwargs)
            read.loaded = _read_ahead(self, stock_load_checkpoint, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - every rank raises in the agreement
            read.verified(exc)
        # The tag is in the outcome: ranks that chose different tags (files differ between nodes) all raise.
        read.verified(None, ("verified the ZeRO partitions" if read.loaded else "found no ZeRO partitions to read")
                      + (f" of tag {tag!r}" if tag is not None else ""))
        self.__dict__["_l3plugin_load"] = read
        try:
            out = stock_load_checkpoint(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every rank raises in the agreement
            read.applied(exc)
            raise
        finally:
            self.__dict__.pop("_l3plugin_load", None)
        # A no-op when the partitions were applied. Otherwise this rank never applied them (stock returned
        # early: no checkpoint found, load_module_only, ...): fine if no rank did, an error if others did.
        path = out[0] if isinstance(out, tuple) and out else out
        read.applied(None, f"ended without reading the ZeRO optimizer partitions (load path {path!r})")
        return out

    stage_of, deco = wrap(DeepSpeedEngine, "zero_optimization_stage")

    @deco
    def zero_optimization_stage(self):
        stage = stage_of(self)
        return 1 if stage == 2 and self.__dict__.get("_l3plugin_hide_stage2") else stage

    pipe_init, deco = wrap(PipelineEngine, "__init__")

    @deco
    def __init__(self, *args, **kwargs):
        try:
            pipe_init(self, *args, **kwargs)
        finally:
            self.__dict__["_l3plugin_hide_stage2"] = False

    tied, deco = wrap(PipelineEngine, "_exec_reduce_tied_grads")

    @deco
    def _exec_reduce_tied_grads(self):
        if not _ours(self):
            return tied(self)
        self.optimizer.reduce_tied_grads(self.module.get_tied_weights_and_groups())

    backward_pass, deco = wrap(PipelineEngine, "_exec_backward_pass")

    @deco
    def _exec_backward_pass(self, buffer_id):
        backward_pass(self, buffer_id)
        if _ours(self):  # the pipeline calls no post-backward epilogue on its first stages
            self.optimizer.after_backward()

    # The pipeline schedule dispatches through a class-level table of functions, not attribute lookup.
    from deepspeed.runtime.pipe.schedule import BackwardPass, ReduceTiedGrads

    for instruction, fn in ((ReduceTiedGrads, _exec_reduce_tied_grads), (BackwardPass, _exec_backward_pass)):
        _stock[("instruction", instruction)] = PipelineEngine._INSTRUCTION_MAP[instruction]
        PipelineEngine._INSTRUCTION_MAP[instruction] = fn


def uninstall() -> None:
    """Restore DeepSpeed's methods (tests use it to show the stock behaviour)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    for (cls, name), fn in _stock.items():
        if cls == "instruction":
            PipelineEngine._INSTRUCTION_MAP[name] = fn
        else:
            setattr(cls, name, fn)
    _stock.clear()


def export_fp32_state_dict(engine) -> dict:
    """The module's state dict with every trainable weight taken from the fp32 master (collective; CPU).

    Loadable by plain torch (``model.load_state_dict``) and hence by stock DeepSpeed or any trainer.
    """
    import torch

    if not _ours(engine):
        raise ValueError("this engine does not use l3plugin's FP32-reducing ZeRO optimizer")
    zero = engine.optimizer.zero
    fp32 = zero.export_state_dict(torch.float32)
    out = {name: t.detach().cpu() for name, t in engine.module.state_dict().items()}
    for name, p in engine.module.named_parameters(remove_duplicate=False):  # tied weights under every name
        if p in zero.slots:
            out[name] = fp32[zero.param_names[p]]
    return out


install()
