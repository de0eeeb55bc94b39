"""local_first=True (kernels.PhasedFlash): each range's own keys attended while the other ranks' K/V arrive, the
rest after, merged by log-sum-exp. Against the fp64 reference as tightly as the default path; the overlapped
and the blocking (overlap=False) forms bit-identical; calls on own keys run before the first part is waited."""

import pytest
import torch

from l3plugin.cp.attention import all_gather_attention
from l3plugin.cp.kernels import phased_tiles
from l3plugin.cp.layout import make_layout, two_chunk_layout
from l3plugin.cp.overlap import part_plan
from l3plugin.cp.sharding import document_metadata

from test_attention import S, layouts, make_inputs, reference


def local_first_results(cp_layout, dtypes=(torch.float64, torch.float32)):
    """On every rank, per case: errors against the fp64 reference, and whether overlap=True equals False."""
    import torch.distributed as dist

    from l3plugin.cp import kernels

    kernels.DEFAULT_BLOCK = 5  # several blocks per range
    cp, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for dtype in dtypes:
        q, k, v, g = make_inputs(dtype, 4, 2)
        for causal in (True, False):
            for name, cu in layouts(S).items():
                ref_in = [t.detach().clone().to(torch.float64).requires_grad_() for t in (q, k, v)]
                ref_out = reference(*ref_in, cu, causal)
                ref_out.backward(g.to(torch.float64))
                idx = make_layout(cp_layout, S, cp, cu).indices(rank)
                got = []
                for overlap in (True, False):
                    local = [t[idx].detach().clone().requires_grad_() for t in (q, k, v)]
                    out = all_gather_attention(*local, torch.tensor(cu), group=dist.group.WORLD, causal=causal,
                                               kernel="cpu-flash", layout=cp_layout, overlap=overlap,
                                               local_first=True)
                    out.backward(g[idx])
                    got.append([out.detach()] + [t.grad for t in local])
                error = max(float((x.to(torch.float64) - y).abs().max())
                            for x, y in zip(got[0], [ref_out[idx].detach()] + [t.grad[idx] for t in ref_in]))
                same = [torch.equal(a, b) for a, b in zip(*got)]  # out, dq, dk, dv
                dkv = max(float((a - b).abs().max()) for a, b in zip(got[0][2:], got[1][2:]))
                results[(str(dtype), causal, name)] = (error, same, dkv)
    return results


@pytest.mark.parametrize("cp, cp_layout", [(2, "2cp"), (2, "balanced"), (4, "2cp")])
def test_local_first_matches_the_reference_and_its_blocking_form(ranks, cp, cp_layout):
    for rank, results in enumerate(ranks.run(cp, local_first_results, cp_layout, timeout=180)):
        assert len(results) == 2 * 2 * 4
        for (dtype, causal, name), (error, same, dkv) in results.items():
            case = f"cp={cp} {cp_layout} rank {rank} {dtype} causal={causal} {name}"
            tol = 1e-12 if dtype == "torch.float64" else 1e-5  # as test_attention.py's
            assert error < tol, f"{case}: {error}"
            if cp == 2:
                assert all(same), f"{case}: overlapped != blocking (out, dq, dk, dv: {same})"
            else:  # beyond cp=2 the two forms' dK/dV reduce-scatters sum the ranks in other orders (test_overlap.py)
                assert same[:2] == [True, True] and dkv < tol, f"{case}: {same}, dK/dV {dkv}"


def test_rank_one_attends_its_own_keys_before_rank_zeros_arrive():
    """The paper's layout at cp=2, S=16, one document: rank 1 holds [4, 8) and [8, 12); its own keys [4, 12)
    need no part; rank 0's [0, 4) arrive in part 0. Every call is trimmed to rows that attend one of its keys."""
    layout = two_chunk_layout(16, 2)
    plan = part_plan(layout, 1, True, 2)
    metas = document_metadata([0, 16], 16, 2, 1, causal=True, layout=layout)
    for meta in metas:
        tiles = phased_tiles(meta, meta.end - meta.start, True, plan.arrival)
        assert [p for p, _ in tiles] == sorted(p for p, _ in tiles) and {p for p, _ in tiles} == {-1, 0}
        for part, t in tiles:
            assert all(int(plan.arrival[x]) == part for x in range(t.k_lo, t.k_hi))
            assert meta.start + t.q_hi - 1 >= t.k_lo  # its last row attends a key of it (causal)
        own = sum((t.q_hi - t.q_lo) * (t.k_hi - t.k_lo) for p, t in tiles if p == -1)
        assert own > 0


def local_first_with_the_reference_kernel():
    import torch.distributed as dist

    q = torch.randn(8, 2, 4)
    try:
        all_gather_attention(q, q, q, [0, 16], group=dist.group.WORLD, kernel="reference", local_first=True)
    except ValueError as exc:
        return str(exc)


def test_local_first_needs_cpu_flash(ranks):
    message = ranks.run(2, local_first_with_the_reference_kernel, timeout=60)[0]
    assert message.startswith("local_first=True needs kernel='cpu-flash'") and "kernel='reference'" in message


def logged_local_first():
    """The kernel calls and the K/V part waits of one causal call at cp=2, S=32, in order."""
    import torch.distributed as dist

    from l3plugin.collective import comm
    from l3plugin.cp import kernels

    log, forward, wait = [], kernels._flash_forward, comm.InFlight.wait

    def logged_forward():
        log.append("attend")
        return forward()

    def logged_wait(self, timeout=600):
        log.append("wait " + self.description.split("(CP ")[1].split(" (")[0])
        return wait(self, timeout)

    kernels._flash_forward, comm.InFlight.wait = logged_forward, logged_wait
    try:
        q = torch.randn(16, 2, 4)
        all_gather_attention(q, q, q, [0, 32], group=dist.group.WORLD, kernel="cpu-flash", local_first=True)
    finally:
        kernels._flash_forward, comm.InFlight.wait = forward, wait
    return log


def test_own_keys_are_attended_before_any_part_is_waited(ranks):
    """Without local_first rank 1 waits for part 0 before its first kernel call (test_overlap.py)."""
    for rank, log in enumerate(ranks.run(2, logged_local_first, timeout=60)):
        assert log[0] == "attend" and log.index("wait K/V part 0") > 0, (rank, log)
        assert log.count("wait K/V part 0") == log.count("wait K/V part 1") == 1, (rank, log)
