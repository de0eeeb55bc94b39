"""TEST-ONLY: ``torch`` as code that hard-codes CUDA should see it on a machine without a GPU: device="cuda"
means the CPU, ``torch.cuda.current_device()`` is "cpu", ``torch.cuda.synchronize()`` does nothing. Modules
patched to see ``CPU_TORCH`` as their ``torch`` (tests/megatron_cpu_shim.py for Megatron-Core's stock schedules,
compat/verl_engine.py for verl / mbridge / Megatron) run unchanged otherwise. Imports nothing of l3plugin."""

import torch


class _CpuCuda:
    """Stands in for ``torch.cuda`` inside the patched modules: the current device is the CPU."""

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*_args, **_kwargs):
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """Stands in for the ``torch`` module inside the patched modules; maps device="cuda" to CPU."""

    cuda = _CpuCuda()

    @staticmethod
    def _cpu(kwargs):
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))

    def empty(self, *args, **kwargs):
        return torch.empty(*args, **self._cpu(kwargs))

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))

    def __getattr__(self, name):
        return getattr(torch, name)


CPU_TORCH = _CpuTorch()
