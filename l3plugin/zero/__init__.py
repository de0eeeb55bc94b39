"""FP32-reducing ZeRO-1/2: bf16 compute and parameter all-gather, fp32 gradient accumulation,
reduce-scatter and master weights (Llama 3 paper, sections 3.1.3 and 6.2).

``FP32ReduceZero`` is the framework-neutral optimizer (``optimizer.py``); ``l3plugin.deepspeed`` plugs it
into ``deepspeed.initialize``.
"""

from l3plugin.zero.settings import ZeroSettings

__all__ = ["FP32ReduceZero", "ZeroSettings"]


def __getattr__(name):
    # FP32ReduceZero on first use: optimizer.py pulls param_gather and with it torch._dynamo (over a second), and
    # every `import deepspeed` imports settings.py through this package (the autoload hook's config parsing).
    if name == "FP32ReduceZero":
        from l3plugin.zero.optimizer import FP32ReduceZero

        return FP32ReduceZero
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
