"""``FP32ReduceZero`` behind the interface DeepSpeed's engines expect from a ZeRO-1/2 optimizer.

``l3plugin.deepspeed`` (``engine.py``) makes ``deepspeed.initialize`` build this instead of DeepSpeed's own ZeRO-1/2
optimizer or BF16_Optimizer. What the engines call, and what we do:

- ``backward_prologue`` (start of every backward pass, both engines): count the micro-batch and decide
  whether this backward ends with a reduce-scatter: ZeRO-1 at the gradient-accumulation boundary only;
  ZeRO-2 every ``reduce_every`` micro-batches and at the boundary (``reduce_every`` = 1, the default, is
  stock ZeRO-2's rhythm; larger trades memory for traffic). If so the buckets are *armed*: with overlap
  (``zero_optimization.overlap_comm``, on unless set false) each bucket's fp32 reduce-scatter starts from
  the gradient hook that completes it, while backward goes on.
- ``overlapping_partition_gradients_reduce_epilogue`` (end of every backward, ZeRO-2) and
  ``reduce_gradients`` (boundary, ZeRO-1): start what is left and wait for everything started except, before
  the boundary, the reduce-scatters started last that fit in ``carry_bytes`` (default 1/32 of the fp32 shard;
  opt-in: ``carry_buckets`` N, the N started last, or ``carry_reductions``, all): they run on under the next
  forward and are waited where their bucket is next written (the next backward's gradient hook) or read (the
  step, ``safe_get_full_grad``). So between micro-batches ZeRO-2 holds the fp32 gradient shard plus at most
  ``carry_bytes``; ZeRO-1 keeps its fp32 full-size buffers across micro-batches and reduces once per step.
- PipelineEngine runs no post-backward epilogue on its first stages: ``_exec_backward_pass`` (patched) calls
  ``after_backward`` instead. ``_exec_reduce_tied_grads`` (patched) sums tied weights' fp32 gradients over the tie group,
  then ``_exec_reduce_grads`` reduce-scatters whatever is left, for stage 1 and stage 2.
- ``step`` -> clip on the global fp32 norm, torch optimizer step on the fp32 shards, bf16 all-gather
  (bucketed; the next bucket's all-gather runs while the previous one is copied into the parameters).
- checkpoints: ``state_dict`` is what DeepSpeed's own ZeRO-1/2 optimizer writes (layout and keys in
  ``l3plugin.checkpoint.deepspeed_layout``, plus DeepSpeed's ``ds_version``, ``LossScaler``, ``ZeroStageEnum``
  and ``fragment_address`` objects), so a stock engine resumes it and ``zero_to_fp32`` / ``ds_to_universal``
  read it; loading (ours or stock's, any data-parallel size, or universal) goes through ``l3plugin.deepspeed``'s
  ``load_checkpoint`` (``checkpoint.py``) and ``l3plugin.checkpoint``.
- accessors: every trainable parameter gets ``_hp_mapping`` and the ``get_full_hp_param`` /
  ``set_full_hp_param`` / ``get_full_hp_grad`` / ``set_full_hp_grad`` methods that
  ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` / ``safe_get_full_grad``
  (and the ``safe_set_*`` twins) look up. Like DeepSpeed's they are collectives over the DP group.
  ``safe_get_full_grad`` answers like stock's (measured on DeepSpeed 0.19.8, 2 ranks): after the last
  backward of a step, the reduced gradient (fp32); between micro-batches of ZeRO-1, this rank's gradient
  accumulated so far, not reduced (stock returns ``param.grad``, bf16; ours is the fp32 accumulation); between
  micro-batches of ZeRO-2, the reduced gradient so far (stock raises here); before any backward and after
  ``step``, stock's ``ValueError("Gradients are only available immediately after backward and before engine
  step")``. ``get_global_grad_norm`` is ``inf`` after an overflow (a skipped step), as stock.
"""

from __future__ import annotations

import types
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from l3plugin.checkpoint.deepspeed_layout import load_sharded_state_dict, sharded_state_dict
from l3plugin.zero.optimizer import FP32ReduceZero, ZeroSettings


class ParamLink:
    """What ``param._hp_mapping`` holds: where the parameter lives in the sharded optimizer."""

    def __init__(self, owner: "DeepSpeedFP32ReduceZero", param):
        self.owner = owner
        self.slot = owner.zero.slots[param]

    def get_optim_state_keys(self) -> list[str]:
        return self.owner.zero.elementwise_keys(self.owner.zero.buckets[self.slot.bucket])


def _get_full_hp_param(param, optim_state_key=None):
    return param._hp_mapping.owner.zero.full_master(param, optim_state_key)


def _set_full_hp_param(param, value, optim_state_key=None):
    param._hp_mapping.owner.zero.set_full_master(param, value, optim_state_key)


def _get_full_hp_grad(param):
    return param._hp_mapping.owner.full_grad(param)


def _set_full_hp_grad(param, value):
    param._hp_mapping.owner.zero.set_full_grad(param, value)


def _tensor_parallel_rank(mpu) -> int:
    if mpu is None:
        return 0
    for name in ("get_slice_parallel_rank", "get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return 0


def runs_fp32_reduce_zero(engine) -> bool:
    """Whether ``engine`` was built with this optimizer (read without nn.Module's attribute lookup: it is
    also asked while the engine is being built)."""
    return isinstance(engine.__dict__.get("optimizer"), DeepSpeedFP32ReduceZero)


class DeepSpeedFP32ReduceZero(ZeROOptimizer):
    def __init__(self, engine, basic_optimizer: torch.optim.Optimizer, settings: ZeroSettings):
        """``settings``: from the engine's config (``l3plugin.deepspeed.config.zero_settings``); its stage is
        the engine's."""
        super().__init__()
        from deepspeed.runtime.utils import is_model_parallel_parameter

        self.mpu = engine.mpu
        self.dp_process_group = engine.seq_data_parallel_group
        self.param_names = engine.param_names
        self.reduce_every = settings.reduce_every or 1
        self.carry_buckets = settings.carried_buckets  # None: all (carry_reductions); 0 with overlap off; by default
        # CARRY_BY_BUDGET: those that fit in carry_bytes (FP32ReduceZero.wait_uncarried)
        self._engine = weakref.ref(engine)
        self._micro_batch = 0  # backward passes since the last step
        self._reduce_this_backward = False
        # The norm is summed over the model-parallel ranks too (TP x PP), counting each weight once:
        # TP-replicated weights on TP rank 0 only, pipeline-tied copies on their owner stage only.
        # Not so under DeepSpeed's sequence-parallel module as mpu (context_parallel_size, Ulysses): it aliases
        # get_model_parallel_group / _rank to the SP group, whose ranks' gradients are already summed into the
        # DP x SP shards of self.dp_process_group; summing the norm over it again counted every element SP times
        # (sqrt(SP) too large, issue 55). Stock ZeRO-1/2 has no model-parallel group for such an mpu either.
        norm_group, tp_rank = None, 0
        if self.mpu is not None and not hasattr(self.mpu, "initialize_sequence_parallel"):
            group = self.mpu.get_model_parallel_group() if hasattr(self.mpu, "get_model_parallel_group") else None
            norm_group = group if group is not None and dist.get_world_size(group) > 1 else None
            tp_rank = _tensor_parallel_rank(self.mpu)

        def counts_in_norm(p):
            if getattr(p, "ds_pipe_replicated", False):
                return False
            return is_model_parallel_parameter(p) or tp_rank == 0

        self.zero = FP32ReduceZero(basic_optimizer, self.dp_process_group, settings=settings,
                                   norm_group=norm_group, counts_in_norm=counts_in_norm,
                                   param_names=engine.param_names)
        self.optimizer = basic_optimizer  # its param groups now hold our fp32 shards (LR schedulers work)
        self._hooks = self._forward_hooks(engine.module)
        # Parameters per param group in the flat order of our checkpoints: DeepSpeed saves their names
        # and shapes as "param_shapes", which zero_to_fp32 uses to cut the flat fp32 groups.
        self.bf16_groups = [[p for b in self.zero.buckets if b.spec.group == g for p in b.params]
                            for g in range(len(basic_optimizer.param_groups))]
        # Loss scaling: none with bf16 (ZeROOptimizer.scale_if_loss reads these).
        self.custom_loss_scaler = False
        self.external_loss_scale = None
        self.torch_autocast_gradscaler = None
        self.loss_scaler = None
        self.dynamic_loss_scale = False
        self.overflow = False
        self._global_grad_norm = None
        for p in self.zero.params:
            p._hp_mapping = ParamLink(self, p)
            p.get_full_hp_param = types.MethodType(_get_full_hp_param, p)
            p.set_full_hp_param = types.MethodType(_set_full_hp_param, p)
            p.get_full_hp_grad = types.MethodType(_get_full_hp_grad, p)
            p.set_full_hp_grad = types.MethodType(_set_full_hp_grad, p)

    def _forward_hooks(self, module) -> list:
        """Forward pre-hooks: parameter all-gathers waited where first used (overlap_param_gather); carried
        reductions completed as they finish (carry_reductions)."""
        hooks = []
        if self.zero.settings.overlap and self.zero.settings.overlap_param_gather:
            # A tied weight PipelineModule uses through a forward_fn (outside its module's forward) is completed by
            # the guard at that use (param_gather.py).
            hooks += self.zero.wait_params_in_forward(module)
        if self.carry_buckets is None:  # unbounded carry: free what has finished while the next forward runs
            hooks += [sub.register_forward_pre_hook(lambda *_: self.zero.complete_finished_reductions())
                      for sub in module.modules() if next(sub.parameters(recurse=False), None) is not None]
        return hooks

    # -- what torch-optimizer-like callers read --------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    # -- gradient reduction, driven by the engines ------------------------------------------------------
    def _at_boundary(self) -> bool:
        # DeepSpeedEngine knows its boundary before backward; PipelineEngine only forces it at ReduceGrads,
        # after its gradient_accumulation_steps() backward passes: count them.
        engine = self._engine()
        return self._micro_batch >= engine.gradient_accumulation_steps() or engine.is_gradient_accumulation_boundary()

    def backward_prologue(self):
        self._micro_batch += 1
        boundary = self._at_boundary()
        self._reduce_this_backward = boundary or (self.zero.settings.stage == 2
                                                  and self._micro_batch % self.reduce_every == 0)
        if self._reduce_this_backward:
            self.zero.arm()

    def after_backward(self):
        """End of a backward pass (or the boundary): if it ended with reductions, start what is left and
        wait for them. Before the boundary those started last that fit in ``carry_bytes`` (``carry_buckets``:
        the N started last; ``carry_reductions``: all) are not waited here but where their buffer is next
        written (the next backward's gradient hooks) or read (the step, ``safe_get_full_grad``): they run on
        under the next forward, holding their full fp32 buckets across the micro-batch boundary. Every rank
        starts the same reductions in the same order; only where each is waited differs, and the arithmetic is
        the same: bit-identical to blocking."""
        carry = self.carry_buckets
        if self._reduce_this_backward and carry != 0 and not self._at_boundary():
            self.zero.launch_reductions()
            self.zero.wait_uncarried(carry)
        elif self._reduce_this_backward or self._boundary_flag():
            self.zero.finish_grad_sync()

    def _boundary_flag(self) -> bool:
        """The boundary flag the engine gives its optimizer: a method since DeepSpeed 0.19, before it an attribute
        the engine sets (absent until then)."""
        flag = getattr(self, "is_gradient_accumulation_boundary", False)
        return flag() if callable(flag) else bool(flag)

    def backward(self, loss, retain_graph=False):
        """DeepSpeed < 0.18: ``engine.backward`` hands the (scaled) loss to its ZeRO optimizer's backward (0.18 on
        calls ``backward_prologue`` and runs the backward itself); the engine reduces afterwards, as above."""
        self.backward_prologue()
        loss.backward(retain_graph=retain_graph)

    def reduce_gradients(self, pipeline_parallel=False):  # DeepSpeedEngine, ZeRO-1, at the boundary
        self.after_backward()

    def overlapping_partition_gradients_reduce_epilogue(self):  # DeepSpeedEngine, ZeRO-2, every backward
        self.after_backward()

    def finalize_gradient_accumulation_boundary(self):
        self.zero.finish_grad_sync()

    def reduce_tied_grads(self, weights_and_groups):
        """PipelineEngine: add the fp32 gradients of weights tied across stages (before the DP reduction)."""
        for weight, group in weights_and_groups:
            if weight in self.zero.slots:
                self.zero.all_reduce_param_grad(weight, group)

    # -- step ---------------------------------------------------------------------------------------------
    def step(self, closure=None):
        self._micro_batch, self._reduce_this_backward = 0, False
        norm = self.zero.step(closure)
        self.overflow = self.zero.overflow
        self._global_grad_norm = float("inf") if self.overflow else norm.item()  # stock reports inf too

    NO_GRAD = "Gradients are only available immediately after backward and before engine step"  # stock's words

    def full_grad(self, param):
        """What ``deepspeed.utils.safe_get_full_grad`` returns for ``param`` (see the module docstring)."""
        zero = self.zero
        slot = zero.slots[param]
        bucket = zero.buckets[slot.bucket]
        if bucket.in_flight is not None:
            zero.wait_reductions([param])
        if bucket.full is None and bucket.shard_grad is None:
            raise ValueError(f"{self.NO_GRAD} (l3plugin: no gradient since the last step)")
        if bucket.shard_grad is None:  # accumulating, nothing reduced yet: this rank's local sum, like stock
            return bucket.full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        if bucket.full is not None:
            raise ValueError(f"{self.NO_GRAD} (l3plugin: between reductions with reduce_every > 1 the gradient "
                             "is partly reduced; read it after the last backward of the step)")
        return zero.full_grad(param)

    def zero_grad(self, set_to_none=True):
        self.zero.zero_grad(set_to_none)

    # -- weights and checkpoints -------------------------------------------------------------------------
    def _restore_from_bit16_weights(self):
        self.zero.refresh_master_from_params()

    refresh_fp32_params = _restore_from_bit16_weights

    def update_lp_params(self):
        self.zero.all_gather_params(wait=True)

    def state_dict(self):
        """The partition file content stock ``DeepSpeedZeroOptimizer.state_dict`` writes (rigid form)."""
        from deepspeed.git_version_info import version
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        sd = sharded_state_dict(self.zero)
        sd["zero_stage"] = ZeroStageEnum(sd["zero_stage"])
        sd["param_slice_mappings"] = [
            OrderedDict((name, fragment_address(numel=m["numel"], start=m["start"])) for name, m in group.items())
            for group in sd["param_slice_mappings"]]
        return {"loss_scaler": LossScaler(scale=1.0), "dynamic_loss_scale": False, "overflow": bool(self.overflow),
                "clip_grad": float(self.zero.settings.clip_grad), **sd, "ds_version": version}

    def load_partitions(self, sources, load_optimizer_states=True, **checks):
        """Load the partitions saved by every data-parallel rank (paths or dicts), any DP size.
        ``checks``: ``allow_nonfinite`` and ``agree`` of ``deepspeed_layout.load_sharded_state_dict``
        (``l3plugin.checkpoint``)."""
        load_sharded_state_dict(self.zero, sources, optimizer_states=load_optimizer_states, **checks)

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, **unused):
        if any(sd is None for sd in state_dict_list):
            raise RuntimeError("the FP32-reducing ZeRO optimizer loads through engine.load_checkpoint "
                               "(l3plugin.deepspeed patches it to read every partition)")
        self.load_partitions(state_dict_list, load_optimizer_states)
