"""bench/gpu_check.py where CI runs it: without CUDA it records that it skipped and exits 0."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gpu_check  # noqa: E402


def test_skips_cleanly_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text())["skipped"].startswith("no CUDA device")


def test_bad_sizes_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "g.json"), "--sizes", "100"])
    assert "--sizes 100 is invalid: each must be a multiple of 8 and >= 32" in capsys.readouterr().err


def test_documents_cross_the_chunk_borders_of_cp4():
    cu = gpu_check.packed_documents(8192)
    chunk = 8192 // (2 * gpu_check.CP)
    assert cu[0] == 0 and cu[-1] == 8192 and all(b > a for a, b in zip(cu, cu[1:]))
    inside_a_document = [c for c in range(chunk, 8192, chunk) if c not in cu]
    assert len(inside_a_document) >= 4  # of the 7 chunk borders
    assert gpu_check.unmasked_pairs([0, 3, 5]) == 6 + 3


def test_split_backward_section_compares_against_one_fused_backward():
    """The section's own check, small on CPU: B then W give the fused backward's gradients bit for bit."""
    out = gpu_check.split_backward_check(torch.device("cpu"), hidden=32, heads=4, kv_heads=2, ffn=48, tokens=16)
    for mode in ("default", "deterministic_algorithms"):
        for pair in ("fused_vs_fused", "split_vs_fused"):
            got = out[mode][pair]
            assert got["input_grad_bit_identical"] and got["weight_grads_bit_identical"], (mode, pair, got)
            assert got["max_abs_difference"] == 0.0


def megatron_section_small():
    return gpu_check.megatron_split_check(torch.device("cpu"), hidden=32, heads=4, kv_heads=2, ffn=48, tokens=16)


def test_megatron_split_section_compares_against_megatrons_fused_backward(ranks):
    """Section 5 small on CPU (a rank worker: it sets up Megatron's parallel state): the swapped linears of a
    Megatron TransformerBlock, B then W, give Megatron's fused backward bit for bit."""
    out = ranks.run(1, megatron_section_small, timeout=120)[0]
    assert out["layers_swapped"] == 8  # qkv, proj, fc1, fc2 of 2 layers
    for mode in ("default", "deterministic_algorithms"):
        for pair in ("fused_vs_fused", "split_vs_fused", "swapped_split_vs_fused"):
            got = out[mode][pair]
            assert got["input_grad_bit_identical"] and got["weight_grads_bit_identical"], (mode, pair, got)
    assert {"b_ms", "w_ms", "b_over_fused"} <= out["split_linears"].keys()
