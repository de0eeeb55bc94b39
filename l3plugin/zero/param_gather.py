"""The bf16 parameter all-gather after the step, and the guard that keeps its parameters from being read early.

``all_gather_params`` starts one all-gather per bucket, in ascending order (the forward's order, the same on
every rank). Blocking (``overlap_param_gather`` off, or ``wait=True``) it completes them two at a time before
returning. Deferred (``overlap_param_gather``, the default with ``overlap``) it returns at once and each bucket is
completed (waited, copied into its parameters) where its parameters are first needed, so the gathers of later
layers run on the wire under the forward of earlier ones (the paper's and Megatron's overlapped parameter
all-gather):
- in the forward pre-hooks of the modules owning them (``wait_params_in_forward``; any thread);
- by ``StaleReadGuard`` on the torch-function mode stack for anything else: a torch function that is handed a
  parameter whose all-gather is pending (or a view of one) completes that parameter's bucket first. A norm logged
  between the step and the next forward, a checkpoint, a weight used outside its own module: none sees the
  previous step's values. Calls that only read metadata (shape, dtype, ``.grad``, ``requires_grad``, hashing)
  pass without waiting;
- before the next step starts its own all-gathers.
Not seen by the guard (the caller must call ``wait_param_gather()`` first): a tensor aliasing a parameter's
storage that was made before the step and is not a view of it (``p.data`` kept from earlier), reads from another
Python thread (the mode stack is per thread), and code that reaches the storage without a torch function (C
extensions). Under torch.compile the guard runs eagerly: a graph break at each torch function of the first forward
after a step, and with inductor those breaks change the kernels' fusion, so the values are NOT bit-identical to
the blocking path (measured on an H200, bench/gpu_check.py). ``wait_params_in_forward`` avoids that: when its
module's forward is being compiled, its first pre-hook completes every pending gather (one graph break before
any of the model's work, the same with or without deferral) and the rest compiles without the guard. When the
mode stack already holds a mode that is not the guard (``torch.set_default_device``, a ``with torch.device(...)``
around the step), the guard could not leave the stack in order, so the step completes its all-gathers before
returning, as without overlap: same values, no overlap.

A mixin of ``FP32ReduceZero`` (optimizer.py): it reads its buckets, group, settings and wait_timeout.
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

from l3plugin.collective import at_exit, comm

# Tensor attributes and methods that read no element: they pass the guard without waiting.
_METADATA_ATTRIBUTES = ("shape", "dtype", "device", "grad", "_grad", "requires_grad", "is_leaf", "grad_fn",
                        "ndim", "layout", "is_cuda", "is_meta", "is_sparse", "is_quantized", "_base", "names")
_METADATA_METHODS = ("__hash__", "size", "dim", "numel", "nelement", "stride", "element_size", "is_contiguous",
                     "is_floating_point", "is_complex", "requires_grad_", "register_hook",
                     "register_post_accumulate_grad_hook", "get_device")


def _metadata_functions() -> frozenset:
    out = set()
    for name in _METADATA_ATTRIBUTES:
        attribute = getattr(torch.Tensor, name, None)
        for access in ("__get__", "__set__", "__delete__"):
            if hasattr(attribute, access):
                out.add(getattr(attribute, access))
    out.update(getattr(torch.Tensor, name) for name in _METADATA_METHODS if hasattr(torch.Tensor, name))
    return frozenset(out)


def _function_stack() -> list | None:
    """The torch-function modes of this thread, bottom first; None if this torch cannot list them (no guard then:
    the step completes its gathers)."""
    length, at = (getattr(torch._C, name, None) for name in ("_len_torch_function_stack", "_get_function_stack_at"))
    return None if length is None or at is None else [at(i) for i in range(length())]


class StaleReadGuard(TorchFunctionMode):
    """One per process (``GUARD``): on the torch-function mode stack while any parameter all-gather is pending.
    ``pending``: id(parameter) -> (weak parameter, weak owner); weak, so a dropped optimizer or model leaves
    nothing alive and a reused id never matches another tensor."""

    METADATA = _metadata_functions()

    def __init__(self):
        super().__init__()
        self.pending: dict = {}
        self.pushed = False

    # Run as plain Python under torch.compile: dynamo cannot trace the waits (nor, in torch 2.13, guard on this
    # mode's state); a compiled forward after a step breaks its graph at each torch function while gathers pend.
    @torch.compiler.disable
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.pending and func not in self.METADATA:
            self.complete_for(args)
            self.complete_for(kwargs.values())
        return func(*args, **kwargs)

    def complete_for(self, values) -> None:
        for value in values:
            if isinstance(value, (list, tuple)):
                self.complete_for(value)
            elif isinstance(value, torch.Tensor):
                self._complete(value)
                if value._base is not None:
                    self._complete(value._base)

    def _complete(self, tensor: torch.Tensor) -> None:
        entry = self.pending.get(id(tensor))
        if entry is None:
            return
        param, owner = entry[0](), entry[1]()
        if param is None or owner is None:  # left by a parameter or an optimizer that is gone (the id is reused)
            del self.pending[id(tensor)]
        elif param is tensor:
            owner.wait_param_gather([tensor])

    def hold(self, owner, params) -> bool:
        """Register ``params`` of ``owner`` as pending (once per step, before its gathers start); False when the
        guard cannot be on the stack (another mode is there without it): the caller then completes them at once."""
        if not params:
            return True  # nothing to guard (a stage with nothing trainable)
        stack = _function_stack()
        if not self.pushed:
            if stack is None or stack:
                return False
            self.__enter__()
            self.pushed = True
            at_exit.on_exit(self.finish_at_exit)
        elif self not in stack:  # popped by somebody else's exit: start over
            self.pending.clear()
            self.pushed = False
            return self.hold(owner, params)
        self.drop_dead()
        self.pending.update({id(p): (weakref.ref(p), weakref.ref(owner)) for p in params})
        return True

    def release(self, params) -> None:
        for p in params:
            self.pending.pop(id(p), None)
        self.leave_if_done()

    def drop_dead(self) -> None:
        """Forget what optimizers or models that are gone left pending (nobody can read it any more)."""
        for key in [k for k, (p, o) in self.pending.items() if p() is None or o() is None]:
            del self.pending[key]

    def finish_at_exit(self) -> None:
        """At the interpreter's exit (``at_exit``, after the gathers are waited): complete them into their
        parameters (a later exit handler may read them) and leave the stack."""
        for owner in {id(o): o for o in (entry[1]() for entry in self.pending.values()) if o is not None}.values():
            owner.wait_param_gather()
        self.pending.clear()
        self.leave_if_done()

    def leave_if_done(self) -> None:
        """Off the stack once nothing is pending, if on top (inside this guard's own dispatch it is not: a later
        call takes it off: the next forward pre-hook or gradient hook, the step)."""
        if self.pushed and not self.pending:
            stack = _function_stack()
            if stack and stack[-1] is self:
                self.__exit__(None, None, None)
                self.pushed = False


GUARD = StaleReadGuard()


@torch.compiler.disable
def _complete_all(owner) -> None:
    """Every pending gather of ``owner``, then the guard off the stack (it pends nothing more)."""
    owner.wait_param_gather()


class ParamGather:
    # ``self._gathers``: bucket index -> its started all-gather (comm.InFlight), set by the optimizer.

    @torch.no_grad()
    def all_gather_params(self, wait: bool | None = None) -> None:
        """Write the fp32 shards into every rank's parameters, gathered in the parameters' dtype.

        ``wait`` (default: not ``overlap_param_gather``): complete every bucket before returning, the next
        bucket's all-gather started before this one is copied out (two in flight: bounded memory). Else every
        all-gather is started here (all of them, so every rank issues the collectives in the same order whatever
        later waits for them) and each bucket is completed where first needed (module docstring)."""
        self.wait_param_gather()  # the previous step's gathers land first: they write the same parameters
        if wait is None:
            wait = not (self.settings.overlap and self.settings.overlap_param_gather)
        if not wait and not GUARD.hold(self, [p for bucket in self.buckets for p in bucket.params]):
            wait = True  # another torch-function mode is on the stack: no guarded deferral
        ahead = 2 if self.settings.overlap else 1
        for index, bucket in enumerate(self.buckets):
            self._gathers[index] = comm.start_all_gather(bucket.master.detach().to(bucket.spec.dtype), self.group,
                                                         what=f"parameter bucket {index}")
            if wait and index + 1 >= ahead:
                self._finish_gather(index + 1 - ahead)
        if wait:
            self.wait_param_gather()

    @torch.no_grad()
    def _finish_gather(self, index: int) -> None:
        full = self._gathers.pop(index).wait(self.wait_timeout)
        bucket = self.buckets[index]
        GUARD.release(bucket.params)
        for slot, p in zip(bucket.spec.slots, bucket.params):
            p.copy_(full[slot.offset:slot.offset + slot.numel].view_as(p))

    def wait_param_gather(self, params=None) -> None:
        """Complete the started parameter all-gathers of the buckets of ``params`` (all if None): local work
        only (the collectives were all started by ``all_gather_params``)."""
        if self._gathers:
            for bucket in self.buckets_of(params):
                if bucket.spec.index in self._gathers:
                    self._finish_gather(bucket.spec.index)
        GUARD.leave_if_done()

    def _complete_if_compiled(self, module) -> None:
        # Traced by dynamo (a compiled caller, or module.compile()): a graph break into _complete_all, run eagerly.
        # A torch.compile(module) wrapper (it holds _orig_mod) runs its own hooks eagerly, before its compiled call.
        if torch.compiler.is_compiling() or getattr(module, "_orig_mod", None) is not None:
            _complete_all(self)

    def wait_params_in_forward(self, module: torch.nn.Module) -> list:
        """Forward pre-hooks on every submodule of ``module`` that owns parameters of this optimizer: each
        completes its parameters' all-gather just before its forward (the guard would at their first use; the
        hooks also work from other threads and take the guard off the stack as soon as nothing is pending).
        Under torch.compile (``module`` compiled, or inside a compiled caller) a first pre-hook completes every
        pending gather instead, before the forward's first torch function: the compiled graph is then the one of
        the blocking path (no guard on the stack), bit for bit, at the cost of this overlap.
        Returns the hook handles."""
        handles = [module.register_forward_pre_hook(lambda module, _args: self._complete_if_compiled(module))]
        for sub in module.modules():
            owned = [p for p in sub.parameters(recurse=False) if p in self.slots]
            if owned:
                handles.append(sub.register_forward_pre_hook(
                    lambda _module, _args, owned=owned: self.wait_param_gather(owned)))
        handles.append(module.register_forward_hook(lambda *_: GUARD.leave_if_done()))
        return handles
