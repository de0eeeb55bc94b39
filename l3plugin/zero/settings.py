"""The FP32-reducing ZeRO optimizer's settings, checked when built (bad values name the field and the range)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from l3plugin.waits import resolve_timeout

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class ZeroSettings:
    stage: int = 1  # 1: reduce-scatter once per step; 2: once per round, full buffers freed in between
    bucket_numel: int = 25_000_000  # elements per bucket (one reduce-scatter and one all-gather each)
    accumulate_dtype: torch.dtype = torch.float32  # micro-batch gradient accumulation (bf16 only to compare)
    reduce_dtype: torch.dtype = torch.float32  # reduce-scatter dtype (bf16 only to compare)
    clip_grad: float = 0.0  # max global L2 norm of the fp32 gradient; 0 = no clipping
    gradient_scale: float | None = None  # multiplies the summed gradient; None = 1 / group size (average)
    overlap: bool = True  # start reduce-scatters as soon as a bucket is final and wait late; False: blocking
    # With overlap: step() only starts the bf16 parameter all-gathers; each bucket is waited just before the
    # forward of the first module using it (hooks from wait_params_in_forward). Costs one gathered bf16 copy of
    # the parameters in flight until the next forward has used them.
    overlap_param_gather: bool = False
    wait_timeout: float | None = None  # seconds a collective may take before a rank-named error;
    # None: $L3PLUGIN_WAIT_TIMEOUT or 600 (l3plugin.waits)

    def __post_init__(self):
        if self.stage not in (1, 2) or isinstance(self.stage, bool):
            raise ValueError(f"stage={self.stage!r}: the FP32-reducing ZeRO optimizer supports stage 1 "
                             "(optimizer states sharded) and stage 2 (also gradients); use FSDP/ZeRO-3 for more")
        for name in ("accumulate_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value not in DTYPES:
                    raise ValueError(f"{name}={value!r}: valid are {sorted(DTYPES)}")
                setattr(self, name, DTYPES[value])
            elif value not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name}={value}: valid are torch.float32 (default) and torch.bfloat16")
        if isinstance(self.bucket_numel, bool) or int(self.bucket_numel) != self.bucket_numel \
                or self.bucket_numel < 1:
            raise ValueError(f"bucket_numel={self.bucket_numel!r} must be a whole number >= 1 (elements per bucket)")
        self.bucket_numel = int(self.bucket_numel)
        if not (isinstance(self.clip_grad, (int, float)) and math.isfinite(self.clip_grad) and self.clip_grad >= 0):
            raise ValueError(f"clip_grad={self.clip_grad!r} must be a finite number >= 0 (0 disables clipping)")
        for name in ("overlap", "overlap_param_gather"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.wait_timeout is not None:
            resolve_timeout(self.wait_timeout, "wait_timeout")
