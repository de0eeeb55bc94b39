"""FP32-reducing ZeRO-1/2: bf16 compute and parameter all-gather, fp32 gradient accumulation,
reduce-scatter and master weights (Llama 3 paper, sections 3.1.3 and 6.2).

``FP32ReduceZero`` is the framework-neutral optimizer (``optimizer.py``); ``l3plugin.deepspeed`` plugs it
into ``deepspeed.initialize``.
"""

from l3plugin.zero.optimizer import FP32ReduceZero, ZeroSettings

__all__ = ["FP32ReduceZero", "ZeroSettings"]
