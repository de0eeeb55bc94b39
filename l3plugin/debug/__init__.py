"""Debugging at scale (paper section 6): top-down slow-rank trace analysis and bitwise numerics parity.

    from l3plugin.debug import record_collectives      # collectives to per-rank traces or in memory (recorder.py)
    from l3plugin.debug import local_collectives       # collectives replaced by local copies (patching.py)
    from l3plugin.debug import analyze_traces          # top-down slow-rank analysis (slow_rank.py)
    from l3plugin.debug import assert_bitwise_equal    # numerics parity against a same-order reference
    from l3plugin.debug import SavedTensorCensus       # bytes autograd saves for the backward (saved_tensors.py)

Names load on first use, so ``l3plugin analyze-trace`` does not import torch.
"""

import importlib

_EXPORTS = {
    "record_collectives": "recorder",
    "local_collectives": "patching",
    "load_traces": "traces",
    "analyze_traces": "slow_rank",
    "analyze_trace_dir": "slow_rank",
    "compare_bitwise": "numerics",
    "assert_bitwise_equal": "numerics",
    "grads_snapshot": "numerics",
    "relative_error_vs_fp64": "numerics",
    "accumulation_error": "numerics",
    "SavedTensorCensus": "saved_tensors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
