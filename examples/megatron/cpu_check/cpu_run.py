"""CHECK TOOL, not product code: run Megatron-LM's pretrain_gpt.py (core_v0.16.1..0.19.0) on CPU / gloo, so the CP
route can be checked against the real script on a machine without a GPU. l3plugin itself needs none of this.

    torchrun --nproc-per-node 2 cpu_run.py pretrain_gpt.py <args>                               (stock)
    torchrun --nproc-per-node 2 cpu_run.py -m l3plugin.megatron.launch pretrain_gpt.py <args>   (launcher)

Run it from the Megatron-LM checkout (its directory goes first on sys.path, as for `python pretrain_gpt.py`).
Megatron-LM asserts CUDA and allocates on "cuda" in many places; here "cuda" means the CPU:
- torch.cuda: is_available() True, device_count() 1, current_device() 0 (device "cuda:0", mapped to the CPU
  below; Megatron-LM 0.19 builds f"cuda:{current_device()}"), capability (9, 0) (so
  CUDA_DEVICE_MAX_CONNECTIONS=1 is set); set_device / synchronize / empty_cache / set_rng_state do nothing;
  streams and events are no-ops; random tensors made on "cuda" come from a generator of their own
  (torch.cuda.manual_seed seeds it), as on a GPU.
- DataLoader(pin_memory=True) pins nothing and torch.accelerator reports none (with a CUDA build of torch,
  as Python 3.12 gets from the package index, both would start CUDA).
- Tensors: .cuda() and .pin_memory() return the tensor; device="cuda..." in torch's tensor factories and in
  Tensor.to becomes "cpu" and pin_memory=True is dropped (Megatron's RoPE under CP uses both); a CPU tensor's
  type() says "torch.cuda.*Tensor" (the mixed-precision optimizer checks it).
- The CUDA RNG tracker keeps no states and its fork() does nothing: give --attention-dropout 0
  --hidden-dropout 0 (then nothing random is drawn inside a fork).
- triton: batch_invariant_kernels (imported by initialize.py) is imported once with a stub triton
  (jit, cdiv, language.constexpr), removed again so torch keeps seeing no triton; where triton is installed
  (Megatron-Core 0.18+ imports it in pipeline_parallel; saving a checkpoint spawns processes that import
  pretrain_gpt.py, hence triton, themselves) nothing is stubbed.
- With --sequence-parallel: the local spec's layer norm is Megatron's FusedLayerNorm computed by torch
  (WrappedTorchNorm, the local spec's norm without apex, refuses sequence parallelism); it marks its
  parameters sequence_parallel as with apex on a GPU.
- torch.compile (Megatron's jit_fuser) returns the function: the fused bias/dropout ops run eagerly.
- megatron.legacy.fused_kernels.load (it runs nvcc; gone in 0.19) does nothing; initialize.py's JIT warm-up (dropout on
  tensors sized by the CP size) runs with the CPU generator's state restored after it.
- torch.distributed.isend sends a private copy: Megatron frees a sent output right after posting its
  isend (schedules.py deallocate_output_tensor), which on a GPU is ordered behind the send on its stream but
  on gloo can be read after the free (the stock interleaved schedule then sent garbage).
- The dataset helpers' `make` (initialize.py runs it on rank 0 at every start) builds for this Python.
"""
import contextlib
import functools
import os
import runpy
import sys
import sysconfig
import types

import torch


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


# Random numbers drawn "on the GPU" come from their own generator, as on a GPU: drawing them from the CPU
# generator would shift the CPU-initialised weights by the sizes of what was drawn before (initialize.py's
# JIT warm-up draws tensors of seq_length / context_parallel_size, so cp = 1 and cp = 2 would differ).
_CUDA_GENERATOR = torch.Generator()
_RANDOM = {"rand", "randn", "randint"}


def _device_to_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            was_cuda = str(kwargs["device"]).startswith("cuda") or isinstance(kwargs["device"], int)
            if was_cuda and fn.__name__ in _RANDOM and kwargs.get("generator") is None:
                kwargs["generator"] = _CUDA_GENERATOR
            kwargs["device"] = _cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)  # no pinned-memory allocator without an accelerator
        return fn(*args, **kwargs)
    return wrapper


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and (isinstance(args[0], int) or (isinstance(args[0], (str, torch.device))
                                                  and str(args[0]).startswith("cuda"))):
            args = ("cpu", *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return original(self, *args, **kwargs)
    return to


def _tensor_type(original):
    """Megatron's optimizers check a parameter's type() names "torch.cuda.*Tensor": CPU tensors say so."""
    @functools.wraps(original)
    def type_(self, dtype=None, *args, **kwargs):
        if dtype is None and not args and not kwargs:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original(self, dtype, *args, **kwargs)
    return type_


class _Stream:
    """A CUDA stream or event where there is one CPU thread: every wait is already satisfied."""

    def __init__(self, *args, **kwargs):
        pass

    def _nothing(self, *args, **kwargs):
        return None

    wait_stream = wait_event = record_event = synchronize = record = wait = _nothing

    def query(self):
        return True


def cuda_means_cpu():
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    # Hopper-like: arguments.py then wants CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP > 1.
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=9, minor=0, name="CPU", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        multi_processor_count=os.cpu_count())
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cuda.get_rng_state = lambda *a, **k: torch.zeros(0, dtype=torch.uint8)  # no CUDA generator to save
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: _CUDA_GENERATOR.manual_seed(seed)
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats", "set_rng_state"):
        setattr(cuda, name, lambda *a, **k: None)
    cuda.Stream = cuda.Event = _Stream
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    loader_init = torch.utils.data.DataLoader.__init__

    @functools.wraps(loader_init)
    def loader_without_pinning(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        loader_init(self, *args, **kwargs)
    torch.utils.data.DataLoader.__init__ = loader_without_pinning
    torch.accelerator.current_accelerator = lambda *a, **k: None
    torch.Tensor.type = _tensor_type(torch.Tensor.type)
    # Megatron's jit_fuser is torch.compile, warmed up on "cuda" at start (initialize.py): run eagerly.
    torch.compile = lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f)
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    for name in ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
                 "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor"):
        setattr(torch, name, _device_to_cpu(getattr(torch, name)))
    # initialize.py runs `make` for the dataset helpers on rank 0: build for this interpreter.
    import pybind11

    os.environ["MAKEFLAGS"] = (f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')} "  # "\\ ": a space in a value
                               f"CPPFLAGS=-I{sysconfig.get_paths()['include']}\\ -I{pybind11.get_include()}")


def import_batch_invariant_kernels_with_a_triton_stub():
    """initialize.py imports batch_invariant_kernels, which imports triton at its top and there only decorates
    its kernels (used with --batch-invariant-mode only). It is imported once with a stub triton in
    sys.modules; the stub is removed right after, so torch (inductor, dynamo) keeps seeing no triton."""
    import importlib.machinery
    import importlib.util

    import megatron.core  # noqa: F401  (torch.compile decorators import dynamo now, without the stub)

    if importlib.util.find_spec("triton") is not None:
        return  # the real one

    triton = types.ModuleType("triton")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    triton.jit = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
    triton.cdiv = lambda a, b: -(-a // b)
    language = types.ModuleType("triton.language")
    language.__spec__ = importlib.machinery.ModuleSpec("triton.language", None)
    language.constexpr = object
    triton.language = language
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    try:
        import megatron.core.transformer.custom_layers.batch_invariant_kernels  # noqa: F401
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


def no_cuda_kernels():
    """initialize.py asks nvcc for its version before (not) building its fused kernels. Its JIT warm-up runs
    dropout on tensors of seq_length / context_parallel_size before the model is built: on a GPU that draws
    from the CUDA generator, here from the CPU one, which initialises the weights; keep that untouched."""
    from megatron.training import initialize

    try:
        from megatron.legacy import fused_kernels
    except ImportError:
        pass  # Megatron-LM 0.19 has no legacy fused kernels
    else:
        fused_kernels.load = lambda args: None
    warmup = initialize._warmup_jit_function

    def warmup_outside_the_cpu_generator(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            warmup(*args, **kwargs)

    initialize._warmup_jit_function = warmup_outside_the_cpu_generator


def rng_tracker_without_cuda():
    from megatron.core.tensor_parallel import random

    tracker = random.CudaRNGStatesTracker
    tracker.add = lambda self, name, seed: self.states_.__setitem__(name, None) or self.seeds_.add(seed)
    tracker.fork = lambda self, name=None: contextlib.nullcontext()
    tracker.get_states = lambda self: {}
    tracker.set_states = lambda self, states: None


def isend_a_private_copy():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    stock = distributed_c10d.isend

    @functools.wraps(stock)
    def isend(tensor, *args, **kwargs):
        return stock(tensor.clone(), *args, **kwargs)

    dist.isend = distributed_c10d.isend = isend  # P2POp checks its op against distributed_c10d.isend


def sequence_parallel_norm():
    # The test-only patch sets of the l3plugin checkout this tool is in (tests/megatron_cpu_shim.py): l3plugin's
    # package does not ship them. Appended, so nothing there shadows an installed module.
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
    from megatron_cpu_shim import SEQUENCE_PARALLEL, SEQUENCE_PARALLEL_NORM

    SEQUENCE_PARALLEL.apply()
    SEQUENCE_PARALLEL_NORM.apply()


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["-m"]:
        module, rest = argv[1], argv[2:]
        script = rest[0]
    else:
        module, rest = None, argv
        script = rest[0]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python pretrain_gpt.py` would
    cuda_means_cpu()
    import_batch_invariant_kernels_with_a_triton_stub()
    rng_tracker_without_cuda()
    no_cuda_kernels()
    isend_a_private_copy()
    if "--sequence-parallel" in argv:
        sequence_parallel_norm()
    if module is None:
        sys.argv = rest
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
