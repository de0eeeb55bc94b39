"""All-gather CP attention on real gloo ranks against single-process attention with a document mask."""

import pytest
import torch

from l3plugin.cp.attention import all_gather_attention
from l3plugin.cp.layout import CPLayout, make_layout, two_chunk_layout

S = 48  # divisible by 2*cp for cp in 1..4


def layouts(seq_len, seed=0):
    """Document layouts as cu_seqlens over the full sequence."""
    gen = torch.Generator().manual_seed(seed)
    tiny, pos = [0], 0
    while pos < seq_len:
        pos = min(seq_len, pos + int(torch.randint(1, 4, (1,), generator=gen)))
        tiny.append(pos)
    return {
        "one-document": [0, seq_len],
        "many-tiny": tiny,
        "crossing-every-border": [0] + list(range(5, seq_len, 6)) + [seq_len],  # chunk is 6 at cp=4
        "longer-than-a-chunk": [0, 3, 30, 41, seq_len],
    }


def reference(q, k, v, cu, causal, scale=None):
    """Single-process attention over the whole sequence with an explicit block-diagonal (causal) mask."""
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.arange(q.size(0))[None, :] <= torch.arange(q.size(0))[:, None]
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scale or q.size(-1) ** -0.5)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_inputs(dtype, heads_q, heads_kv, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(S, h, 8, generator=gen, dtype=torch.float64) for h in (heads_q, heads_kv, heads_kv))
    grad_out = torch.randn(S, heads_q, 8, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, grad_out)]


KERNELS = (((4, 4), "reference"), ((4, 2), "reference"), ((4, 2), "varlen-reference"), ((4, 2), "cpu-flash"))
CASES = [(dtype, causal, heads, kernel)
         for dtype in (torch.float64, torch.float32) for causal in (True, False) for heads, kernel in KERNELS]
# Half of CASES, for the runs with CP > 1: every kernel (and head count) in both dtypes and both masks, and
# every (dtype, causal) pair. The kernels have no dtype or CP branch (the dtype only sets the tolerance); CP
# moves the K/V around them (gathered in parts, by part plans that depend on the mask, not the dtype). All 16
# cases run at cp = 1, every kernel through all_gather_attention without communication.
PAIRWISE = [(dtype, causal == (i % 2 == 0), heads, kernel)
            for i, (heads, kernel) in enumerate(KERNELS)
            for dtype, causal in ((torch.float64, True), (torch.float32, False))]


# A hand-built layout at cp=2: many ranges, out of order across ranks, one crossing the middle.
SCRAMBLED = CPLayout("scrambled", S, 2, (((0, 5), (11, 20), (37, 47)), ((5, 11), (20, 37), (47, 48))))


def cp_attention_errors(block_size, cp_layout="2cp", cases=CASES):
    """On every rank: max abs error of out, dq, dk, dv vs the reference, for every case (of ``cases``) and
    document layout, with this CP layout ("2cp", "balanced" or a CPLayout)."""
    import torch.distributed as dist

    from l3plugin.cp import kernels

    kernels.DEFAULT_BLOCK = block_size
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(), dist.get_rank()
    errors = {}
    for dtype, causal, (hq, hkv), kernel in cases:
        q, k, v, g = make_inputs(dtype, hq, hkv)
        for name, cu in layouts(S).items():
            idx = make_layout(cp_layout, S, cp, cu).indices(rank)
            ref_in = [t.detach().clone().to(torch.float64).requires_grad_() for t in (q, k, v)]
            ref_out = reference(*ref_in, cu, causal)
            ref_out.backward(g.to(torch.float64))
            local = [t[idx].detach().clone().requires_grad_() for t in (q, k, v)]
            out = all_gather_attention(*local, torch.tensor(cu), group=group, causal=causal, kernel=kernel,
                                       layout=cp_layout)
            out.backward(g[idx])
            pairs = [(out, ref_out[idx])] + [(a.grad, b.grad[idx]) for a, b in zip(local, ref_in)]
            errors[(str(dtype), causal, hq, hkv, kernel, name)] = max(
                float((x.to(torch.float64) - y).abs().max()) for x, y in pairs)
    return errors


def _dtype_causal_pairs(cases):
    return {(dtype, causal) for dtype, causal, _, _ in cases}


def test_pairwise_cases_cover_every_kernel_dtype_and_mask():
    """PAIRWISE reaches what CASES does, two cases per kernel instead of four."""
    for heads, kernel in KERNELS:
        mine = [case for case in PAIRWISE if case[2:] == (heads, kernel)]
        assert {dtype for dtype, _, _, _ in mine} == {torch.float64, torch.float32}
        assert {causal for _, causal, _, _ in mine} == {True, False}
    assert _dtype_causal_pairs(PAIRWISE) == _dtype_causal_pairs(CASES) and set(PAIRWISE) < set(CASES)


@pytest.mark.parametrize("cp, cases", [(1, CASES), (2, PAIRWISE), (3, PAIRWISE), (4, PAIRWISE)],
                         ids=["1", "2", "3", "4"])
def test_matches_single_process_attention(ranks, cp, cases):
    results = ranks.run(cp, cp_attention_errors, 5, "2cp", cases, timeout=240)  # block 5: several blocks per chunk
    for rank, errors in enumerate(results):
        assert len(errors) == len(cases) * 4
        for (dtype, causal, hq, hkv, kernel, layout), err in errors.items():
            tol = 1e-12 if dtype == "torch.float64" else 1e-5
            assert err < tol, f"cp={cp} rank={rank} {dtype} causal={causal} heads={hq}/{hkv} {kernel} {layout}: {err}"


@pytest.mark.parametrize("cp_layout", ["balanced", SCRAMBLED], ids=["balanced", "scrambled"])
def test_other_layouts_match_single_process_attention(ranks, cp_layout):
    """Any partition of the queries is correct after the K/V all-gather: fwd + bwd against fp64."""
    results = ranks.run(2, cp_attention_errors, 5, cp_layout, PAIRWISE, timeout=240)
    for rank, errors in enumerate(results):
        assert len(errors) == len(PAIRWISE) * 4
        for (dtype, causal, hq, hkv, kernel, layout), err in errors.items():
            tol = 1e-12 if dtype == "torch.float64" else 1e-5
            assert err < tol, (f"{cp_layout} rank={rank} {dtype} causal={causal} heads={hq}/{hkv} {kernel} {layout}: "
                               f"{err}")


def test_balanced_layouts_here_are_varied():
    """The parity test above sees balanced layouts with one range per rank (later half on rank 0),
    with merged ranges, and with many ranges."""
    ranges = {name: make_layout("balanced", S, 2, cu).ranges for name, cu in layouts(S).items()}
    assert ranges["longer-than-a-chunk"] == (((24, 48),), ((0, 24),))
    assert ranges["one-document"] == (((0, 12), (36, 48)), ((12, 36),))
    assert len(ranges["crossing-every-border"][0]) == 5


def bad_input_messages():
    import torch.distributed as dist

    group = dist.group.WORLD
    q = torch.randn(8, 4, 8)
    calls = {
        "s-not-divisible": lambda: all_gather_attention(torch.randn(7, 4, 8), torch.randn(7, 2, 8),
                                                        torch.randn(7, 2, 8), [0, 14], group=group),
        "cu-start": lambda: all_gather_attention(q, q, q, [2, 16], group=group),
        "cu-end": lambda: all_gather_attention(q, q, q, [0, 15], group=group),
        "cu-increasing": lambda: all_gather_attention(q, q, q, [0, 9, 5, 16], group=group),
        "gqa": lambda: all_gather_attention(q, torch.randn(8, 3, 8), torch.randn(8, 3, 8), [0, 16], group=group),
        "shapes": lambda: all_gather_attention(q, torch.randn(6, 4, 8), torch.randn(6, 4, 8), [0, 16], group=group),
        "rank-2": lambda: all_gather_attention(q[0], q[0], q[0], [0, 16], group=group),
        "kernel": lambda: all_gather_attention(q, q, q, [0, 16], group=group, kernel="fast"),
        "dtype": lambda: all_gather_attention(q, q.double(), q.double(), [0, 16], group=group),
        "causal": lambda: all_gather_attention(q, q, q, [0, 16], group=group, causal="no"),
        "cu-float": lambda: all_gather_attention(q, q, q, [0, 7.5, 16], group=group),
        "wait-timeout": lambda: all_gather_attention(q, q, q, [0, 16], group=group, wait_timeout=0),
        "layout": lambda: all_gather_attention(q, q, q, [0, 16], group=group, layout="zigzag"),
        "layout-cp": lambda: all_gather_attention(q, q, q, [0, 16], group=group,
                                                  layout=two_chunk_layout(16, 4)),
        "layout-seq": lambda: all_gather_attention(q, q, q, [0, 32], group=group,
                                                   layout=make_layout("balanced", 32, 2, [0, 32])),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_bad_input_names_the_problem(ranks):
    messages = ranks.run(2, bad_input_messages, timeout=60)[0]
    assert "must be even" in messages["s-not-divisible"]
    assert "must start at 0" in messages["cu-start"]
    assert "must end at the full sequence length S=16" in messages["cu-end"]
    assert "strictly increasing" in messages["cu-increasing"]
    assert "heads_kv=3 does not divide heads_q=4" in messages["gqa"]
    assert "mismatched shapes" in messages["shapes"]
    assert "must be [s_local, heads, head_dim]" in messages["rank-2"]
    assert "kernel='fast' is unknown" in messages["kernel"]
    assert ("q, k, v must share one dtype; got q torch.float32, k torch.float64, v torch.float64: cast them"
            in messages["dtype"])
    assert "causal='no' is invalid: must be True or False" in messages["causal"]
    assert "cu_seqlens must hold integer token offsets, got 7.5" in messages["cu-float"]
    assert "wait_timeout=0 is invalid: must be a finite number of seconds > 0" in messages["wait-timeout"]
    assert "layout='zigzag' is unknown: choose one of ['2cp', 'balanced'] or pass a CPLayout" in messages["layout"]
    assert ("layout='2cp' was built for seq_len=16, cp_size=4 but is used with seq_len=16, cp_size=2"
            in messages["layout-cp"])
    assert "cu_seqlens must end at the full sequence length S=16" in messages["layout-seq"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU kernels need a CUDA GPU (none here)")
@pytest.mark.parametrize("kernel", ["flash", "torch-varlen", "te"])
def test_gpu_kernel_matches_reference_on_gpu(kernel):
    from l3plugin.cp.kernels import _flash_varlen, _te_attention_class, _torch_varlen

    if {"flash": _flash_varlen, "torch-varlen": _torch_varlen, "te": _te_attention_class}[kernel]() is None:
        pytest.skip(f"{kernel}: its package is not installed")
    q, k, v, _ = (t.cuda().to(torch.bfloat16) for t in make_inputs(torch.float32, 4, 2))
    cu = torch.tensor(layouts(S)["crossing-every-border"])
    ours = all_gather_attention(q, k, v, cu, kernel=kernel).float()
    ref = reference(*(t.double().cpu() for t in (q, k, v)), cu.tolist(), True).float().to(ours.device)
    assert (ours - ref).abs().max() < 2e-2
