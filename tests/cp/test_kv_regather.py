"""cp_kv="regather": only the local K/V stay for the backward, gathered again there. Results bit-identical
to "keep" (the same values at the same places); the census of saved tensors shows the gathered buffer gone."""

import pytest
import torch

from l3plugin.cp.attention import all_gather_attention
from l3plugin.cp.layout import make_layout

from test_attention import S, layouts, make_inputs


def regather_against_keep(cp_layout, overlap, kernels=("reference", "cpu-flash")):
    """On every rank: out, dq, dk, dv with cp_kv regather and keep, for kernels, masks and documents."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    q, k, v, g = make_inputs(torch.float32, 4, 2)
    for kernel in kernels:
        for causal in (True, False):
            for name, cu in layouts(S).items():
                idx = make_layout(cp_layout, S, cp, cu).indices(rank)
                got = []
                for cp_kv in ("regather", "keep"):
                    local = [t[idx].detach().clone().requires_grad_() for t in (q, k, v)]
                    out = all_gather_attention(*local, torch.tensor(cu), group=dist.group.WORLD, causal=causal,
                                               kernel=kernel, layout=cp_layout, overlap=overlap, cp_kv=cp_kv)
                    out.backward(g[idx])
                    got.append([out.detach()] + [t.grad for t in local])
                results[(kernel, causal, name)] = got
    return results


# Every layout with and without overlap, each cp with both layouts and both overlaps (cp = 2, 2cp, overlap: the
# paths of (4, "2cp", True) and of the other cp = 2 cases).
@pytest.mark.parametrize("cp, cp_layout, overlap", [(2, "2cp", False), (2, "balanced", True), (4, "2cp", True),
                                                    (4, "balanced", False)])
def test_regather_is_bit_identical_to_keep(ranks, cp, cp_layout, overlap):
    for rank, results in enumerate(ranks.run(cp, regather_against_keep, cp_layout, overlap, timeout=180)):
        assert len(results) == 2 * 2 * 4
        for case, (regather, keep) in results.items():
            for what, a, b in zip(("out", "dq", "dk", "dv"), regather, keep):
                assert torch.equal(a, b), f"rank {rank} {case} {what}: max diff {(a - b).abs().max():.3g}"


def saved_bytes(seq_len, heads_q, heads_kv, head_dim, overlap, kernel, layers=3):
    """On every rank: bytes autograd holds after the forward of ``layers`` attention calls (a saved-tensor
    census), per cp_kv (and regather without and with prefetch), and after the backward; gradients of all,
    to compare."""
    import torch.distributed as dist

    from l3plugin.debug.saved_tensors import SavedTensorCensus

    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    s_local = seq_len // cp
    q = torch.randn(s_local, heads_q, head_dim, generator=gen)
    kv = torch.randn(2, s_local, heads_kv, head_dim, generator=gen)
    cu = torch.tensor([0, seq_len // 3, seq_len])  # a document crosses every chunk border
    report = {}
    for name, cp_kv, prefetch in (("keep", "keep", False), ("regather", "regather", False),
                                  ("regather prefetch", "regather", True)):
        leaves = [t.clone().requires_grad_() for t in (q, kv[0], kv[1])]
        census = SavedTensorCensus()
        with census.hooks:
            out = leaves[0]
            for layer in range(layers):  # each layer's output is the next one's queries; K/V of its own
                out = all_gather_attention(out, leaves[1] + layer, leaves[2] + layer, cu, group=dist.group.WORLD,
                                           kernel=kernel, overlap=overlap, cp_kv=cp_kv, prefetch=prefetch)
        after_forward = census.held_bytes()
        out.sum().backward()
        report[name] = dict(forward=after_forward, backward=census.held_bytes(), grads=[t.grad for t in leaves])
    return report


@pytest.mark.parametrize("overlap, kernel", [(True, "cpu-flash"), (False, "cpu-flash"), (True, "reference")])
def test_regather_frees_the_gathered_kv_until_the_backward(ranks, overlap, kernel):
    """keep - regather = the gathered K/V less this rank's own (which regather keeps), 2 x (S - S/cp) x
    heads_kv x head_dim x 4 bytes per layer: what the planner adds for --cp-kv keep (costs.py gathered_kv;
    bench/cp_memory.py compares the two at the paper's sizes). With prefetch the latest call's whole gathered
    buffer, 2 x S x heads_kv x head_dim x 4 bytes, stays until the next call's forward (or its backward).
    After the backward nothing is held."""
    seq_len, hq, hkv, d, layers = 96, 4, 2, 8, 3
    for cp in (2, 4):
        for rank, report in enumerate(ranks.run(cp, saved_bytes, seq_len, hq, hkv, d, overlap, kernel, layers,
                                                timeout=120)):
            keep, regather, ahead = report["keep"], report["regather"], report["regather prefetch"]
            expected = layers * 2 * (seq_len - seq_len // cp) * hkv * d * 4
            assert keep["forward"] - regather["forward"] == expected, (cp, rank, keep["forward"], regather["forward"])
            latest = 2 * seq_len * hkv * d * 4
            assert ahead["forward"] - regather["forward"] == latest, (cp, rank, ahead["forward"], regather["forward"])
            assert keep["backward"] == regather["backward"] == ahead["backward"] == 0, (cp, rank)
            for a, b, c in zip(keep["grads"], regather["grads"], ahead["grads"]):
                assert torch.equal(a, b) and torch.equal(a, c), (cp, rank)


def test_bad_cp_kv_names_the_choices():
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match=r"cp_kv='drop' is invalid: choose one of \['regather', 'keep'\]"):
        all_gather_attention(q, q, q, torch.tensor([0, 4]), cp_kv="drop")


def test_planner_and_attention_share_the_modes():
    from l3plugin.cp import CP_KV_MODES
    from l3plugin.planner.machine import CP_KV_MODES as PLANNER_MODES

    assert CP_KV_MODES == PLANNER_MODES
