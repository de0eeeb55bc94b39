"""The TE backend: refused with a clear reason where TE cannot be imported; exercised where it can."""

import pytest

from l3plugin.megatron.te_backend import CP_COMM_TYPE, te_attention_class, te_unavailable_reason

REASON = te_unavailable_reason()


@pytest.mark.skipif(REASON is None, reason="Transformer Engine is importable here")
def test_without_te_the_class_is_refused_with_the_reason():
    assert "Transformer Engine" in REASON or "HAVE_TE" in REASON
    te_attention_class.cache_clear()
    with pytest.raises(RuntimeError, match="AllGatherCPCoreAttention"):
        te_attention_class()


@pytest.mark.skipif(REASON is not None, reason=f"needs Transformer Engine on a GPU: {REASON}")
def test_te_subclass_routes_our_cp_comm_type():
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    cls = te_attention_class()
    assert issubclass(cls, TEDotProductAttention) and CP_COMM_TYPE == "l3plugin_all_gather"
