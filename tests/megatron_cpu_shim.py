"""TEST-ONLY: run Megatron-Core 0.16.1's *stock* pipeline schedules on CPU, so tests can compare with them.

The stock schedules hard-code CUDA in a few places (measured on Megatron-Core 0.16.1):
  schedules.py:596/983/2138      torch.zeros([], dtype=torch.int, device="cuda")   (token counter)
  p2p_communication.py:313/321   torch.empty(..., device=torch.cuda.current_device())  (receive buffers)
  p2p_communication.py:398/242   torch.cuda.synchronize()
Inside ``stock_schedules_on_cpu()`` those two modules see a ``torch`` whose "cuda" device means CPU.
Megatron's local DotProductAttention takes its score buffer from the global memory buffer, allocated at
torch.cuda.current_device() (megatron/core/utils.py:631), and runs its dropout under the CUDA RNG
tracker's fork (dot_product_attention.py:217): ``stock_attention_on_cpu()`` redirects the first like the
schedules and makes the fork a no-op (for attention_dropout=0 only). Nothing else changes. l3plugin's own code
never needs this; the package does not ship it (the tests, bench/pp_schedule.py and examples/megatron/cpu_check
take it from here).
"""

from __future__ import annotations

import contextlib

import torch

from cpu_torch import CPU_TORCH  # noqa: F401  (tests/cpu_torch.py; the rows below name it here)
from l3plugin.upstream.patches import MEGATRON_CHECKED, Patch, PatchSet


_HERE = __name__  # the rows name this module's objects by the name it was imported under


def no_fork_tensor_parallel(module, _attribute):
    return _NoForkTensorParallel(module)


# Declared with l3plugin's PatchSet (l3plugin/upstream/patchset.py), like every patch of an upstream object.
STOCK_SCHEDULES = PatchSet("tests/megatron_cpu_shim.py (stock schedules on CPU; TEST-ONLY)", "megatron-core",
                           MEGATRON_CHECKED, [
    Patch(f"megatron.core.pipeline_parallel.{module}", "torch", f"{_HERE}:CPU_TORCH",
          why='the stock schedules and P2P code allocate on device="cuda" and call torch.cuda')
    for module in ("schedules", "p2p_communication")])
STOCK_ATTENTION = PatchSet("tests/megatron_cpu_shim.py (stock attention on CPU; TEST-ONLY)", "megatron-core",
                           MEGATRON_CHECKED, [
    Patch("megatron.core.utils", "torch", f"{_HERE}:CPU_TORCH",
          why="the global memory buffer is allocated at torch.cuda.current_device()"),
    Patch("megatron.core.transformer.dot_product_attention", "tensor_parallel",
          f"{_HERE}:no_fork_tensor_parallel", wraps=True,
          why="dropout runs under the CUDA RNG tracker's fork (a no-op here, for attention_dropout=0 only)"),
])


def no_cuda_rng_state(*_args, **_kwargs):
    """Megatron's _get_cuda_rng_state without CUDA: there is no CUDA generator to save."""
    return None


def set_no_cuda_rng_state(new_state, *_args, **_kwargs):
    """Megatron's _set_cuda_rng_state without CUDA: the state saved above is None; nothing to restore."""
    assert new_state is None, "a CUDA RNG state on a CPU-only run"


_RANDOM = "megatron.core.tensor_parallel.random"
# Megatron's activation recompute (tensor_parallel.checkpoint: recompute_granularity full or selective) saves and
# restores the CPU and the CUDA RNG states around the recomputed forward; the CPU one stays as Megatron does it.
RECOMPUTE = PatchSet("tests/megatron_cpu_shim.py (activation recompute on CPU; TEST-ONLY)", "megatron-core",
                     MEGATRON_CHECKED, [
    Patch(_RANDOM, "_get_cuda_rng_state", f"{_HERE}:no_cuda_rng_state",
          why="CheckpointFunction saves the CUDA RNG state (torch.cuda.get_rng_state needs CUDA)"),
    Patch(_RANDOM, "_set_cuda_rng_state", f"{_HERE}:set_no_cuda_rng_state",
          why="and restores it around the recomputed forward"),
])


def recompute_on_cpu():
    """Within this block Megatron-Core's activation recompute runs on CPU (CPU RNG state only)."""
    return RECOMPUTE.within()


SEQUENCE_PARALLEL = PatchSet("tests/megatron_cpu_shim.py (sequence parallel on CPU; TEST-ONLY)", "megatron-core",
                           MEGATRON_CHECKED, [
    Patch(f"megatron.core.{module}", "torch", f"{_HERE}:CPU_TORCH",
          why="the sequence-parallel gathers and scatters allocate at torch.cuda.current_device()")
    for module in ("utils", "tensor_parallel.mappings", "tensor_parallel.layers")
] + [
    Patch(f"megatron.core.{module}", "tensor_parallel", f"{_HERE}:no_fork_tensor_parallel",
          wraps=True, why="with sequence parallelism the embedding's dropout and the block run under the CUDA RNG "
                          "tracker's fork (a no-op here, for hidden_dropout=0 only)")
    for module in ("models.common.embeddings.language_model_embedding", "transformer.transformer_block")])


def sequence_parallel_on_cpu():
    """Within this block a sequence-parallel GPTModel runs its forward on CPU (no CUDA RNG tracker)."""
    return SEQUENCE_PARALLEL.within()


def fused_layer_norm_by_torch(self, input):
    """Megatron's FusedLayerNorm.forward (apex's fused affine layer norm), computed by torch."""
    weight = self.weight + 1 if self.zero_centered_gamma else self.weight
    return torch.nn.functional.layer_norm(input, tuple(self.hidden_size), weight, self.bias, self.eps)


_FUSED_LN = "megatron.core.fusions.fused_layer_norm"
# Megatron-Core's local spec, without apex, takes WrappedTorchNorm, which refuses sequence parallelism.
SEQUENCE_PARALLEL_NORM = PatchSet("tests/megatron_cpu_shim.py (sequence-parallel layer norm on CPU; TEST-ONLY)",
                                  "megatron-core", MEGATRON_CHECKED, [
    Patch(_FUSED_LN, "HAVE_FUSED_LAYER_NORM", f"{_HERE}:HAVE_FUSED_LAYER_NORM",
          why="Megatron's FusedLayerNorm needs apex (GPU); its torch equivalent below stands in"),
    Patch(f"{_FUSED_LN}:FusedLayerNorm", "forward", f"{_HERE}:fused_layer_norm_by_torch",
          signature=("self", "input"), why="apex's fused layer norm, computed by torch.nn.functional.layer_norm"),
    Patch("megatron.core.models.backends", "LNImpl", f"{_FUSED_LN}:FusedLayerNorm",
          why="without apex the local spec takes WrappedTorchNorm, which refuses sequence parallelism"),
    Patch("megatron.core.models.gpt.gpt_layer_specs", "LNImpl", f"{_FUSED_LN}:FusedLayerNorm",
          why="the same choice where the decoder block specs read it"),
    Patch("megatron.core.transformer.transformer_block", "LayerNormImpl", f"{_FUSED_LN}:FusedLayerNorm",
          why="the final layer norm, likewise"),
])
HAVE_FUSED_LAYER_NORM = True


@contextlib.contextmanager
def sequence_parallel_norm_on_cpu():
    """Within this block Megatron-Core's local spec uses FusedLayerNorm (computed by torch), which marks its
    parameters sequence_parallel as on a GPU with apex, and sequence parallelism runs on CPU
    (``sequence_parallel_on_cpu``): the local spec then runs with sequence parallelism."""
    with SEQUENCE_PARALLEL.within(), SEQUENCE_PARALLEL_NORM.within():
        yield


def stock_schedules_on_cpu():
    """Within this block Megatron-Core's stock schedules and P2P communication run on CPU tensors."""
    return STOCK_SCHEDULES.within()


def stock_attention_on_cpu():
    """Within this block Megatron-Core's local DotProductAttention (its global memory buffer) runs on CPU."""
    return STOCK_ATTENTION.within()


class _NoForkTensorParallel:
    """megatron.core.tensor_parallel whose RNG tracker's fork does nothing (no CUDA RNG on CPU)."""

    class _Tracker:
        @staticmethod
        def fork(*_args, **_kwargs):
            return contextlib.nullcontext()

    def __init__(self, module):
        self._module = module

    def get_cuda_rng_tracker(self):
        return self._Tracker()

    def __getattr__(self, name):
        return getattr(self._module, name)
