"""Bugs of stock DeepSpeed versions that a test whose subject or reference is stock DeepSpeed must skip, named
(a skip here is never a pass: docs/verified.md counts these as skipped, with the reason)."""

from __future__ import annotations

import pytest

from l3plugin.upstream.versions import installed_version, version_in


def _version(package: str) -> str | None:
    found = installed_version(package)
    return None if found == "not installed" else found


_DEEPSPEED, _TORCH = _version("deepspeed"), _version("torch")

# Measured with compat/stock_zero_step.py (no l3plugin imported, L3PLUGIN_NO_AUTOLOAD=1): on DeepSpeed 0.18.9 with
# torch 2.13 every step of DeepSpeed's own ZeRO-1/2 optimizer (fp32 and bf16) raises in its
# all_gather_into_tensor_dp_groups; DeepSpeed 0.16.9, 0.17.6 and 0.19.8 step with the same torch.
STOCK_ZERO_STEP_FAILS = bool(_DEEPSPEED and _TORCH and version_in(_DEEPSPEED, ">=0.18,<0.19")
                             and version_in(_TORCH, ">=2.13"))
STOCK_ZERO_STEP_REASON = (f"stock DeepSpeed {_DEEPSPEED}'s own ZeRO-1/2 step fails with torch {_TORCH} (RuntimeError "
                          "'Output 0 of Split is a view and is being modified inplace' in its "
                          "all_gather_into_tensor_dp_groups; compat/stock_zero_step.py shows it without l3plugin): "
                          "this test steps a stock ZeRO engine")
SKIP_IF_STOCK_ZERO_STEP_FAILS = pytest.mark.skipif(STOCK_ZERO_STEP_FAILS, reason=STOCK_ZERO_STEP_REASON)
