"""CP attention with overlapped communication (cp/overlap.py): the same results as one collective each
way, and every part waited only when a range needs it."""

import pytest
import torch

from l3plugin.cp.attention import all_gather_attention
from l3plugin.cp.layout import make_layout, two_chunk_layout
from l3plugin.cp.overlap import part_plan

from test_attention import SCRAMBLED, S, layouts, make_inputs


def test_part_plan_of_the_paper_layout_at_cp2():
    """S=16: rank 0 holds [0, 4) and [12, 16), rank 1 [4, 8) and [8, 12); parts are the first and the
    second half of every rank's tokens."""
    layout = two_chunk_layout(16, 2)
    zero, one = part_plan(layout, 0, True, 2), part_plan(layout, 1, True, 2)
    assert [p.tolist() for p in zero.positions] == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[12, 13, 14, 15], [8, 9, 10, 11]]]
    assert zero.needs == (-1, 1)  # its first chunk attends only its own keys
    assert one.needs == (0, 0)  # rank 0's [12, 16) is never attended by rank 1 (causal)
    assert zero.first_other == (4, 8) and one.first_other == (0, 12)
    assert part_plan(layout, 0, False, 2).needs == (1, 1)  # non-causal: every key first
    assert part_plan(layout, 0, True, 1).needs == (-1, 0)


def overlap_against_one_collective(cp_layout, dtypes=(torch.float64, torch.float32),
                                   kernels=("reference", "cpu-flash")):
    """out, dq, dk, dv with overlap on and off, for several kernels, masks and dtypes, on every rank."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for dtype in dtypes:
        q, k, v, g = make_inputs(dtype, 4, 2)
        for kernel in kernels:
            for causal in (True, False):
                for name, cu in layouts(S).items():
                    idx = make_layout(cp_layout, S, cp, cu).indices(rank)
                    got = []
                    for overlap in (True, False):
                        local = [t[idx].detach().clone().requires_grad_() for t in (q, k, v)]
                        out = all_gather_attention(*local, torch.tensor(cu), group=dist.group.WORLD, causal=causal,
                                                   kernel=kernel, layout=cp_layout, overlap=overlap)
                        out.backward(g[idx])
                        got.append([out.detach()] + [t.grad for t in local])
                    results[(str(dtype), kernel, causal, name)] = got
    return results


# Both dtypes once (2cp), fp64 for the other layouts: the kernels and the overlap have no dtype branch (the parts
# and their order come from the layout and the mask), so fp32 under balanced/scrambled takes the 2cp fp32 paths.
@pytest.mark.parametrize("cp_layout, dtypes", [("2cp", (torch.float64, torch.float32)), ("balanced", (torch.float64,)),
                                               (SCRAMBLED, (torch.float64,))], ids=["2cp", "balanced", "scrambled"])
def test_overlap_is_bit_identical_to_one_collective_at_cp2(ranks, cp_layout, dtypes):
    """Same kernel calls, same order of the dK/dV sums: equal to the last bit (test_attention.py checks
    both against the fp64 reference)."""
    for rank, results in enumerate(ranks.run(2, overlap_against_one_collective, cp_layout, dtypes, timeout=120)):
        assert len(results) == len(dtypes) * 2 * 2 * 4
        for case, (overlapped, plain) in results.items():
            for what, a, b in zip(("out", "dq", "dk", "dv"), overlapped, plain):
                assert torch.equal(a, b), f"rank {rank} {case} {what}: max diff {(a - b).abs().max():.3g}"


def test_overlap_beyond_cp2_matches_one_collective(ranks):
    """cp=4: the reduce-scatter sums the ranks in another order, so equal within fp64 rounding."""
    runs = ranks.run(4, overlap_against_one_collective, "2cp", (torch.float64,), ("cpu-flash",), timeout=120)
    for rank, results in enumerate(runs):
        assert len(results) == 2 * 4
        for case, (overlapped, plain) in results.items():
            for what, a, b in zip(("out", "dq", "dk", "dv"), overlapped, plain):
                assert (a - b).abs().max() < 1e-12, f"rank {rank} {case} {what}"


def logged_attention(cp_kv, prefetch=True):
    """The order of kernel calls, K/V part waits and dK/dV part starts/waits on this rank (2cp, S=16)."""
    import torch.distributed as dist

    from l3plugin.collective import comm
    from l3plugin.cp import kernels

    log = []
    if "logged-reference" not in kernels.KERNELS:
        def logged(q, k, v, meta, **kw):
            kernels.KERNELS["logged-reference"].log.append(f"attend [{meta.start}, {meta.end})")
            return kernels.reference_kernel(q, k, v, meta, **kw)
        kernels.register_kernel("logged-reference", logged)
    kernels.KERNELS["logged-reference"].log = log
    wait, start = comm.InFlight.wait, comm.start_reduce_scatter_sum

    def logged_wait(self, timeout=600):
        log.append("wait " + self.description.split("(CP ")[1].split(" (")[0])
        return wait(self, timeout)

    def logged_start(*args, **kwargs):
        log.append("start " + kwargs["what"].split(" (")[0].replace("CP ", ""))
        return start(*args, **kwargs)

    comm.InFlight.wait, comm.start_reduce_scatter_sum = logged_wait, logged_start
    try:
        q = torch.randn(8, 2, 4, requires_grad=True)
        out = all_gather_attention(q, q, q, [0, 16], group=dist.group.WORLD, kernel="logged-reference", cp_kv=cp_kv,
                                   prefetch=prefetch)
        log.append("backward")
        out.sum().backward()
    finally:
        comm.InFlight.wait, comm.start_reduce_scatter_sum = wait, start
    return log


@pytest.mark.parametrize("cp_kv, prefetch", [("keep", True), ("regather", False), ("regather", True)])
def test_each_part_is_waited_when_a_range_needs_it(ranks, cp_kv, prefetch):
    zero, one = ranks.run(2, logged_attention, cp_kv, prefetch, timeout=60)
    # regather: the whole K/V are gathered again (one collective) before the first range's backward; with
    # prefetch the latest call keeps them until its backward (test_regather_ahead.py: the calls before it)
    again = ["wait K/V"] if cp_kv == "regather" and not prefetch else []
    assert zero == ["attend [0, 4)", "wait K/V part 0", "wait K/V part 1", "attend [12, 16)", "backward", *again,
                    # [12, 16) differentiated: nothing left reaches rank 1's tokens, both parts go, the last first
                    # as on every rank (collectives matched by issue order: tests/cp/test_collective_order.py)
                    "start dK/dV part 1", "start dK/dV part 0", "wait dK/dV part 0", "wait dK/dV part 1"]
    assert one == ["wait K/V part 0", "attend [4, 8)", "attend [8, 12)", "wait K/V part 1", "backward", *again,
                   "start dK/dV part 1",  # rank 0's [12, 16): no range here reaches it
                   "start dK/dV part 0", "wait dK/dV part 0", "wait dK/dV part 1"]


def without_grad():
    import torch.distributed as dist

    q = torch.randn(8, 2, 4, requires_grad=True)
    with torch.no_grad():  # e.g. the first pass of a recomputed layer
        outs = [all_gather_attention(q, q, q, [0, 16], group=dist.group.WORLD, overlap=o) for o in (True, False)]
    return [torch.equal(*outs), outs[0].requires_grad]


def test_no_graph_without_grad(ranks):
    assert ranks.run(2, without_grad, timeout=60) == [[True, False], [True, False]]
