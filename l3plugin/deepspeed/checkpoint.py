"""Checkpoint I/O of a DeepSpeed engine that runs l3plugin's FP32-reducing ZeRO.

Saves are crash-consistent (``l3plugin/checkpoint/commit.py``): every file goes to a temporary name, is fsynced
and renamed, each rank records its files in a manifest, the ranks agree that all saved, and only then does
rank 0 point 'latest' at the tag (by rename). A save that fails on one rank raises on all and leaves 'latest'
where it was.

Loads fail together, touching nothing on a bad checkpoint: every rank first chooses and verifies the tag and
reads and verifies the optimizer partitions it needs (ours, stock DeepSpeed's at any DP size, or a universal
checkpoint), and the ranks agree (an error on one is an error on all); then stock DeepSpeed loads the model
file, and the ranks agree again right before the first collective (``engine.load_zero_checkpoint``) or, if
stock returned without reading partitions, at the end.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass

from l3plugin.deepspeed.config import PluginOptions


@dataclass
class LoadCall:
    """The arguments of one ``DeepSpeedEngine.load_checkpoint`` call (stock's parameters, checked by the
    patch registry against the installed DeepSpeed)."""

    load_dir: str
    tag: object = None
    load_module_strict: bool = True
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_only: bool = False
    custom_load_fn: object = None

    def kwargs(self) -> dict:
        return asdict(self)


class ReadAhead:
    """One ``load_checkpoint`` of our engine: its two agreements and the verified partitions."""

    def __init__(self, engine):
        from l3plugin.collective.fail_together import OneAgreement

        timeout = engine.optimizer.zero.wait_timeout
        # Callables: every rank calls each once (with its error, or None) and all raise if any failed.
        self.agree_on_verification = OneAgreement(None, what="checkpoint verification", device=engine.device,
                                                  timeout=timeout)
        self.agree_on_load = OneAgreement(None, what="checkpoint load", device=engine.device, timeout=timeout)
        self.loaded = None


def choose_tag(engine, call: LoadCall, options: PluginOptions) -> str | None:
    """Make the tag to load explicit in ``call``: the one given, verified, or without one the tag 'latest'
    names if complete, else the newest complete tag (warned). Raises TornCheckpoint naming the tag and the
    file. None for universal checkpoints (written by DeepSpeed's converter, not by a save)."""
    from l3plugin.checkpoint.commit import choose_tag as newest_complete, verify_tag

    if engine.load_universal_checkpoint():
        return None
    if call.tag is not None:
        call.tag = str(call.tag)
        if os.path.isdir(os.path.join(call.load_dir, call.tag)):  # else stock warns and loads nothing
            verify_tag(call.load_dir, call.tag, checksums=False)
        return call.tag
    call.tag, warning = newest_complete(call.load_dir, fallback=options.zero["checkpoint_fallback"])
    if warning:
        warnings.warn(f"rank {engine.global_rank}: {warning}", stacklevel=3)
    return call.tag


def read_ahead(engine, call: LoadCall, options: PluginOptions):
    """Read and verify the ZeRO partitions ``load_checkpoint(**call)`` will load, before stock DeepSpeed
    touches anything; None when it will not read any (mirrors its conditions)."""
    universal = engine.load_universal_checkpoint()
    optimizer_states = call.load_optimizer_states and not call.load_module_only
    if not (optimizer_states or universal):
        return None
    tag = call.tag
    if tag is None:
        latest = os.path.join(call.load_dir, "latest_universal" if universal else "latest")
        if not os.path.isfile(latest):
            return None  # stock warns and returns (None, None)
        with open(latest) as f:
            tag = f.read().strip()
    if not os.path.isdir(os.path.join(call.load_dir, str(tag))):
        return None  # stock warns and returns (None, None)
    return read_zero(engine, call.load_dir, tag, optimizer_states, options)


def read_zero(engine, load_dir, tag, optimizer_states: bool, options: PluginOptions):
    """This rank's verified ZeRO state from checkpoint ``load_dir/tag`` (ours, stock's, or universal when
    the config says so), in new tensors (``l3plugin.checkpoint.verified_load.Loaded``)."""
    from l3plugin.checkpoint.deepspeed_layout import read_partitions
    from l3plugin.checkpoint.deepspeed_universal import read_universal

    allow = options.zero["checkpoint_allow_nonfinite"]
    zero = engine.optimizer.zero
    if engine.load_universal_checkpoint():
        return read_universal(zero, os.path.join(load_dir, str(tag)), optimizer_states, allow)
    return read_partitions(zero, partition_files(engine, load_dir, tag), optimizer_states, allow)


def partition_files(engine, load_dir, tag) -> list[str]:
    """The saved ranks' partition files, found by DeepSpeed's naming. Stock learns their number from the
    model file, which it reads later; here the files are counted (``partition_count`` inside is checked)."""
    mp_rank = getattr(engine, "checkpoint_mp_rank", None)  # DeepSpeed >= 0.19; before, computed at each use:
    if mp_rank is None:
        mp_rank = engine.mpu.get_model_parallel_rank() if hasattr(engine.mpu, "get_model_parallel_rank") else 0
    names = []
    while True:
        name = engine._get_rank_zero_ckpt_name(checkpoints_path=load_dir, tag=tag, mp_rank=mp_rank,
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


class RecordingWriter:
    """Stands in for ``checkpoint_engine.save`` during one save: each file goes through
    ``save_atomically`` and is recorded. The first error is kept, not raised, and later files are skipped,
    so that this rank still reaches stock's barriers and the agreement after them (raising here would leave
    the other ranks waiting in the barrier)."""

    def __init__(self, checkpoint_engine, tag_dir):
        self.stock_save = checkpoint_engine.save
        self.tag_dir = tag_dir
        self.records, self.error = {}, None

    def save(self, state_dict, path):
        from l3plugin.checkpoint.commit import save_atomically

        if self.error is not None:
            return
        try:
            record = save_atomically(lambda tmp: self.stock_save(state_dict, tmp), path)
            self.records[os.path.relpath(path, self.tag_dir)] = record
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            self.error = exc


def save_files(engine, stock_save, save_dir, tag, client_state, exclude_frozen_parameters):
    """Stock's save of every file with ``RecordingWriter`` in the checkpoint engine's place, then this rank's
    manifest. Returns this rank's error (None: saved), for the agreement."""
    import torch.distributed as dist

    from l3plugin.checkpoint.commit import write_manifest

    writer = RecordingWriter(engine.checkpoint_engine, os.path.join(save_dir, tag))
    engine.checkpoint_engine.save = writer.save  # this save only (an instance attribute over the method)
    try:
        stock_save(engine, save_dir, tag, client_state, False, exclude_frozen_parameters)
        if writer.error is None:
            write_manifest(os.path.join(save_dir, tag), dist.get_rank(), dist.get_world_size(), writer.records)
        return writer.error
    except Exception as exc:  # noqa: BLE001 - every rank raises in the agreement
        return exc
    finally:
        del engine.checkpoint_engine.save


def point_latest(engine, save_dir, tag) -> None:
    """Rank 0 moves 'latest' to ``tag`` (by rename); every rank raises if it failed."""
    import torch.distributed as dist

    from l3plugin.checkpoint.commit import write_latest
    from l3plugin.collective.fail_together import agree

    error = None
    if dist.get_rank() == 0:
        try:
            write_latest(save_dir, tag)
        except Exception as exc:  # noqa: BLE001
            error = exc
    agree(error, what=f"pointing 'latest' in {save_dir} at {tag!r}", device=engine.device,
          timeout=engine.optimizer.zero.wait_timeout)


def export_fp32_state_dict(engine) -> dict:
    """The module's state dict with every trainable weight taken from the fp32 master (collective; CPU).

    Loadable by plain torch (``model.load_state_dict``) and hence by stock DeepSpeed or any trainer.
    """
    import torch

    from l3plugin.deepspeed.optimizer import runs_fp32_reduce_zero

    if not runs_fp32_reduce_zero(engine):
        raise ValueError("this engine does not use l3plugin's FP32-reducing ZeRO optimizer")
    zero = engine.optimizer.zero
    fp32 = zero.export_state_dict(torch.float32)
    out = {name: t.detach().cpu() for name, t in engine.module.state_dict().items()}
    for name, p in engine.module.named_parameters(remove_duplicate=False):  # tied weights under every name
        if p in zero.slots:
            out[name] = fp32[zero.param_names[p]]
    return out
