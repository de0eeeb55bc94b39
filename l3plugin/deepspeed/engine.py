"""The DeepSpeed engine methods and the ``deepspeed.initialize`` l3plugin puts in place (set DEEPSPEED, declared
at the bottom, below the replacements).

Each falls through to DeepSpeed's own method unless the engine's options ask for the FP32-reducing ZeRO
(``wants_fp32_reduce_zero``) or the engine runs it (``runs_fp32_reduce_zero``). What the adapter knows about
an engine, its ``"l3plugin"`` options parsed once included, lives in an ``EngineState`` held beside the engine
(``state_of``), not in the engine.
"""

from __future__ import annotations

import inspect
import sys
import weakref

from l3plugin.deepspeed import checkpoint
from l3plugin.deepspeed.config import (PluginOptions, check_model_supported, check_supported, config_of_call,
                                       handing_over, options_for, zero_settings)
from l3plugin.deepspeed.sequence_parallel import ACCELERATE, _accelerate_cp, check_for_hf_users, initialize_with_cp
from l3plugin.upstream.after_import import after_import, cancel
from l3plugin.upstream.versions import DEEPSPEED_CHECKED
from l3plugin.upstream.patchset import Patch, PatchSet

_ENGINE, _PIPE = "DeepSpeedEngine", "PipelineEngine"


class EngineState:
    """What the adapter knows about one engine."""

    def __init__(self, options: PluginOptions | None):
        self.options = options  # the config's "l3plugin" block, parsed once (None: no key)
        # PipelineEngine.__init__ asserts stage < 2 right after the ZeRO optimizer is built; ours supports
        # stage 2, so zero_optimization_stage answers 1 until that __init__ has returned.
        self.hide_stage2 = False
        self.load: checkpoint.ReadAhead | None = None  # the load_checkpoint in progress


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_of(engine) -> EngineState:
    if engine not in _states:
        _states[engine] = EngineState(options_for(engine))
    return _states[engine]


def options_of(engine) -> PluginOptions | None:
    """The engine's ``"l3plugin"`` options (None: its config has no such key)."""
    return state_of(engine).options


def wants_fp32_reduce_zero(engine) -> bool:
    options = options_of(engine)
    return options is not None and options.fp32_reduce_zero


def runs_fp32_reduce_zero(engine) -> bool:
    """Whether ``engine`` runs l3plugin's optimizer. optimizer.py (the ZeRO optimizer, torch._dynamo: over a second)
    is imported when the first engine with the key is built, not by every `import deepspeed`: before that no
    engine can run it, and stock engines asking here never import it."""
    module = sys.modules.get("l3plugin.deepspeed.optimizer")
    return module is not None and module.runs_fp32_reduce_zero(engine)


def _stock(cls: str, name: str):
    return DEEPSPEED.stock(f"{cls}.{name}")


def install() -> None:
    """Patch DeepSpeed's engines (once) so the ``"l3plugin"`` config key takes effect; with accelerate imported
    already (the HF Trainer's order), also its data-loader sharding (sequence_parallel.py's set ACCELERATE) and its
    metric gathers (set ACCELERATE_METRICS, below); with accelerate imported later, those right after its import."""
    DEEPSPEED.apply()
    # accelerate imported later (``import deepspeed`` before trl / accelerate) is patched once its import ends
    after_import("accelerate.accelerator", apply_accelerate)


def apply_accelerate() -> None:
    ACCELERATE.apply()
    ACCELERATE_METRICS.apply()


def uninstall() -> None:
    """Restore DeepSpeed's methods and accelerate's (tests use it to show the stock behaviour)."""
    cancel("accelerate.accelerator")
    ACCELERATE_METRICS.undo()
    ACCELERATE.undo()
    DEEPSPEED.undo()


# -- deepspeed.initialize ------------------------------------------------------------------------------------
def initialize_with_key(*args, **kwargs):
    """``deepspeed.initialize`` reading the ``"l3plugin"`` key once. Without it the call reaches DeepSpeed exactly
    as given; with it the engine built takes the parsed options (``handing_over``), and ``context_parallel_size``
    above 1 goes through the CP builder of sequence_parallel.py. (Not named ``initialize``:
    undoing the patch puts DeepSpeed's function back in every module whose global ``initialize`` is this one,
    which would include this module.)"""
    stock = DEEPSPEED.stock("deepspeed.initialize")
    call = inspect.signature(stock).bind(*args, **kwargs)
    where, config, options = config_of_call(call)
    if options is None:
        return stock(*args, **kwargs)
    if "accelerate.state" in sys.modules:  # accelerate or the HF Trainer: messages name their settings
        check_for_hf_users(config, options)
    with handing_over(options):  # the engine keeps these options: its config's block is not parsed again
        if options.context_parallel_size == 1:
            return stock(*args, **kwargs)
        return initialize_with_cp(stock, call, where, config, options)


# -- building the optimizer ---------------------------------------------------------------------------------
def do_sanity_check(self):
    if wants_fp32_reduce_zero(self):  # first, so our message wins over DeepSpeed's generic ones
        check_supported(self, options_of(self))
    return _stock(_ENGINE, "_do_sanity_check")(self)


def do_optimizer_sanity_check(self, basic_optimizer):
    if not wants_fp32_reduce_zero(self):
        return _stock(_ENGINE, "_do_optimizer_sanity_check")(self, basic_optimizer)
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    return ZERO_OPTIMIZATION  # route to _configure_zero_optimizer, also where stock would pick BF16_Optimizer


def configure_zero_optimizer(self, optimizer):
    if not wants_fp32_reduce_zero(self):
        return _stock(_ENGINE, "_configure_zero_optimizer")(self, optimizer)
    check_model_supported(self)
    if optimizer is None:
        raise ValueError('l3plugin FP32-reducing ZeRO needs an optimizer: add "optimizer" to the config '
                         "or pass optimizer= to deepspeed.initialize")
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from l3plugin.deepspeed.optimizer import DeepSpeedFP32ReduceZero  # with the key only: see runs_fp32_reduce_zero

    built = DeepSpeedFP32ReduceZero(self, optimizer, zero_settings(self, options_of(self)))
    state_of(self).hide_stage2 = isinstance(self, PipelineEngine)
    return built


def zero_optimization_stage(self):
    stage = _stock(_ENGINE, "zero_optimization_stage")(self)
    return 1 if stage == 2 and state_of(self).hide_stage2 else stage


def pipeline_engine_init(self, *args, **kwargs):
    try:
        _stock(_PIPE, "__init__")(self, *args, **kwargs)
    finally:
        state_of(self).hide_stage2 = False


# -- the pipeline's instructions ----------------------------------------------------------------------------
def exec_reduce_tied_grads(self):
    if not runs_fp32_reduce_zero(self):
        return _stock(_PIPE, "_exec_reduce_tied_grads")(self)
    self.optimizer.reduce_tied_grads(self.module.get_tied_weights_and_groups())


def exec_backward_pass(self, buffer_id):
    _stock(_PIPE, "_exec_backward_pass")(self, buffer_id)
    if runs_fp32_reduce_zero(self):  # the pipeline calls no post-backward epilogue on its first stages
        self.optimizer.after_backward()


def exec_backward_pass_with_prologue(self, buffer_id):
    """DeepSpeed < 0.18: the pipeline's first stages run autograd directly, calling no optimizer prologue (0.18
    on runs it from tensor hooks): ours counts the micro-batch and arms its buckets here."""
    if runs_fp32_reduce_zero(self) and not self.is_last_stage():
        self.optimizer.backward_prologue()
    exec_backward_pass(self, buffer_id)


def backward_prologue_per_tensor(self, grad):
    """DeepSpeed 0.18 divides the gradient arriving at every forward output by the accumulation steps, also
    on the pipeline's stages before the last, which receive the last stage's gradient divided already: there it
    was divided twice (0.19's PipelineEngine divides on the last stage only). Ours: the last stage only."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if runs_fp32_reduce_zero(self) and isinstance(self, PipelineEngine) and not self.is_last_stage():
        return grad
    return _stock(_ENGINE, "_backward_prologue_per_tensor")(self, grad)


# -- checkpoints (checkpoint.py) ----------------------------------------------------------------------------
def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - stock's
                    exclude_frozen_parameters=False):
    """Crash-consistent (see ``checkpoint.py``)."""
    stock = _stock(_ENGINE, "save_checkpoint")
    if not runs_fp32_reduce_zero(self):
        return stock(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    from l3plugin.collective.fail_together import agree

    tag = str(f"global_step{self.global_steps}" if tag is None else tag)
    error = checkpoint.save_files(self, stock, save_dir, tag, client_state, exclude_frozen_parameters)
    agree(error, what=f"save of checkpoint tag {tag!r} in {save_dir}", device=self.device,
          timeout=self.optimizer.zero.wait_timeout)
    if save_latest:
        checkpoint.point_latest(self, save_dir, tag)
    return True


def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """Fail together, touching nothing on a bad checkpoint (see ``checkpoint.py``)."""
    stock = _stock(_ENGINE, "load_checkpoint")
    call = checkpoint.LoadCall(load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                               load_module_only, custom_load_fn)
    if not runs_fp32_reduce_zero(self):
        return stock(self, **call.kwargs())
    read = checkpoint.ReadAhead(self)
    tag = None
    try:
        tag = checkpoint.choose_tag(self, call, options_of(self))
        read.loaded = checkpoint.read_ahead(self, call, options_of(self))
    except Exception as exc:  # noqa: BLE001 - every rank raises in the agreement
        read.agree_on_verification(exc)
    # The tag is in the outcome: ranks that chose different tags (files differ between nodes) all raise.
    found = "verified the ZeRO partitions" if read.loaded else "found no ZeRO partitions to read"
    read.agree_on_verification(None, found + (f" of tag {tag!r}" if tag is not None else ""))
    state_of(self).load = read
    try:
        out = stock(self, **call.kwargs())
    except Exception as exc:  # noqa: BLE001 - every rank raises in the agreement
        read.agree_on_load(exc)
        raise
    finally:
        state_of(self).load = None
    # A no-op when the partitions were applied. Otherwise this rank never applied them (stock returned
    # early: no checkpoint found, load_module_only, ...): fine if no rank did, an error if others did.
    path = out[0] if isinstance(out, tuple) and out else out
    read.agree_on_load(None, f"ended without reading the ZeRO optimizer partitions (load path {path!r})")
    return out


def load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
    if not runs_fp32_reduce_zero(self):
        return _stock(_ENGINE, "_load_zero_checkpoint")(self, load_dir, tag, load_optimizer_states)
    read = state_of(self).load  # set by load_checkpoint above
    if read is not None and read.loaded is not None:
        from l3plugin.checkpoint.verified_load import READ_PARTITIONS, apply_loaded

        read.agree_on_load(None, READ_PARTITIONS)  # DeepSpeed's own part went well on every rank too
        apply_loaded(self.optimizer.zero, read.loaded)
        return True
    # Called on its own: read, verify, agree and apply in one go.
    from l3plugin.checkpoint.verified_load import load_agreed

    load_agreed(self.optimizer.zero, lambda: checkpoint.read_zero(self, load_dir, tag, load_optimizer_states,
                                                                  options_of(self)))
    return True


# -- accelerate's metric gathers under context_parallel_size (set ACCELERATE_METRICS) ------------------------------
def gather_for_metrics(self, input_data, use_gather_object=False):
    """accelerate's ``gather_for_metrics`` gathering each data-parallel replica once under ``context_parallel_size``
    N: the N ranks of a CP group hold the same batch (``prepare_data_loader``), so gathered from every process a
    summed metric (TRL's ``num_tokens``) read N times the tokens, and the cut of the last batch's padding
    (``remainder``, counted over DP) kept the wrong rows. ``gather`` stays over every process: the Trainer gathers
    ``num_items_in_batch`` with it, and that count's factor N cancels the loss's x ``num_processes``."""
    stock = ACCELERATE_METRICS.stock("Accelerator.gather_for_metrics")
    cp = _accelerate_cp()
    if cp == 1:
        return stock(self, input_data, use_gather_object)
    self.gather = lambda data: _first_of_each_cp_group(type(self).gather(self, data), self.num_processes, cp)
    try:  # the tensor path calls self.gather: shadowed for this call only; the object path is gather_object below
        return stock(self, input_data, use_gather_object)
    finally:
        del self.gather


def _first_of_each_cp_group(gathered, world: int, cp: int):
    """Of tensors gathered from every process (concatenated on dim 0 in rank order, equal parts), the parts of
    each CP group's first rank."""
    from accelerate.utils import recursively_apply

    return recursively_apply(lambda t: t.unflatten(0, (world // cp, cp, -1))[:, 0].flatten(0, 1), gathered)


def gather_object(object):  # noqa: A002 - accelerate's parameter name
    """accelerate.accelerator's ``gather_object`` (there only ``gather_for_metrics``' object path calls it): under
    CP only the first rank of each CP group contributes its objects (the list of every process's, concatenated)."""
    import torch.distributed as dist

    stock = ACCELERATE_METRICS.stock("accelerate.accelerator.gather_object")
    cp = _accelerate_cp()
    return stock(object if cp == 1 or dist.get_rank() % cp == 0 else [])


# -- the declarations -------------------------------------------------------------------------------------------
_DS_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_DS_PIPE = "deepspeed.runtime.pipe.engine:PipelineEngine"
_BACKWARD = "deepspeed.runtime.pipe.schedule:BackwardPass"

DEEPSPEED = PatchSet("l3plugin.deepspeed", "deepspeed", DEEPSPEED_CHECKED, [
    # Each replacement falls through to the original unless the config has "l3plugin": {"fp32_reduce_zero": true}.
    Patch(_DS_ENGINE, "_do_sanity_check", do_sanity_check, signature=("self",),
          why="check the l3plugin options first, so their message wins over DeepSpeed's generic ones"),
    Patch(_DS_ENGINE, "_do_optimizer_sanity_check", do_optimizer_sanity_check,
          signature=("self", "basic_optimizer"),
          why="route to _configure_zero_optimizer, also where stock would pick BF16_Optimizer"),
    Patch(_DS_ENGINE, "_configure_zero_optimizer", configure_zero_optimizer, signature=("self", "optimizer"),
          why="build l3plugin's FP32-reducing ZeRO-1/2 optimizer on DeepSpeed's seq_data_parallel_group"),
    Patch(_DS_ENGINE, "_load_zero_checkpoint", load_zero_checkpoint,
          signature=("self", "load_dir", "tag", "load_optimizer_states"),
          why="apply the partitions load_checkpoint read and verified (ours, stock's at any DP size, universal)"),
    Patch(_DS_ENGINE, "save_checkpoint", save_checkpoint,
          signature=("self", "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"),
          why="crash-consistent saves: temporary names, manifests, 'latest' moved after every rank agreed"),
    Patch(_DS_ENGINE, "load_checkpoint", load_checkpoint,
          signature=("self", "load_dir", "tag", "load_module_strict", "load_optimizer_states",
                     "load_lr_scheduler_states", "load_module_only", "custom_load_fn"),
          why="verify the tag and the partitions on every rank and agree before stock touches anything"),
    Patch(_DS_ENGINE, "zero_optimization_stage", zero_optimization_stage, signature=("self",),
          why="PipelineEngine.__init__ asserts stage < 2 for DeepSpeed's optimizer; ours supports stage 2"),
    Patch(_DS_PIPE, "__init__", pipeline_engine_init, signature=("self",),
          why="end the stage-2 disguise of zero_optimization_stage once PipelineEngine's assert has passed"),
    Patch(_DS_PIPE, "_exec_reduce_tied_grads", exec_reduce_tied_grads, signature=("self",),
          why="tied weights' gradients live in l3plugin's fp32 buckets, not in weight.grad"),
    Patch(_DS_PIPE, "_exec_backward_pass", exec_backward_pass, signature=("self", "buffer_id"),
          versions=">=0.18", why="the pipeline calls no post-backward epilogue on its first stages: end-of-backward "
          "reductions"),
    Patch(_DS_PIPE, "_exec_backward_pass", exec_backward_pass_with_prologue, signature=("self", "buffer_id"),
          versions="<0.18", why="before 0.18 the pipeline's first stages call neither the optimizer's backward "
          "prologue nor an epilogue: l3plugin's micro-batch start and end-of-backward reductions"),
    Patch(_DS_ENGINE, "_backward_prologue_per_tensor", backward_prologue_per_tensor,
          signature=("self", "grad"), versions=">=0.18,<0.19",
          why="0.18 divides the gradient the pipeline's earlier stages receive by the accumulation steps a second "
          "time (0.19's PipelineEngine does not): the last stage only"),
    # The pipeline schedule dispatches through a class-level table of functions, not attribute lookup.
    Patch(_DS_PIPE, "_INSTRUCTION_MAP", exec_reduce_tied_grads, key="deepspeed.runtime.pipe.schedule:ReduceTiedGrads",
          signature=("self",), why="the instruction table entry of _exec_reduce_tied_grads"),
    Patch(_DS_PIPE, "_INSTRUCTION_MAP", exec_backward_pass, key=_BACKWARD, signature=("self", "buffer_id"),
          versions=">=0.18", why="the instruction table entry of _exec_backward_pass"),
    Patch(_DS_PIPE, "_INSTRUCTION_MAP", exec_backward_pass_with_prologue, key=_BACKWARD,
          signature=("self", "buffer_id"), versions="<0.18", why="the instruction table entry of _exec_backward_pass"),
    Patch("deepspeed", "initialize", initialize_with_key, signature=("args", "model"), rebind=True,
          why='read the "l3plugin" key once and hand its options to the engine; "context_parallel_size": N builds '
              "DeepSpeed's sequence-parallel groups as mpu, counts the batch over DP only and gives a "
              "transformers model the all-gather CP attention (l3plugin/deepspeed/sequence_parallel.py)"),
])

# Gated by DeepSpeed's version as ACCELERATE is: it serves only the DeepSpeed key's CP. Applied with ACCELERATE.
ACCELERATE_METRICS = PatchSet("l3plugin.huggingface (accelerate's metric gathers under context_parallel_size)",
                              "deepspeed", DEEPSPEED_CHECKED, [
    Patch("accelerate.accelerator:Accelerator", "gather_for_metrics", gather_for_metrics,
          signature=("self", "input_data", "use_gather_object"), loaded_only=True,
          why="under context_parallel_size N, metrics gathered once per data-parallel replica (TRL's num_tokens "
              "read N x): a CP group's ranks hold the same batch"),
    Patch("accelerate.accelerator", "gather_object", gather_object, signature=("object",), loaded_only=True,
          why="gather_for_metrics' object path: under context_parallel_size only each CP group's first rank adds "
              "its objects"),
])
