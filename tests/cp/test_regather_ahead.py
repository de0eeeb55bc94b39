"""cp_kv="regather" with prefetch (cp/regather_ahead.py): the backward's K/V all-gather of a call starts during
the backward of the call after it. Results bit-identical to regather without prefetch and to keep, over stacks
of calls, pipeline-like interleaved micro-batches, recomputed and dropped forwards; every rank issues the same
collectives in the same order."""

import pytest
import torch

from l3plugin.cp.attention import all_gather_attention
from l3plugin.cp.layout import make_layout

from test_attention import S, layouts, make_inputs

LAYERS = 3
MODES = {"keep": ("keep", False), "regather": ("regather", False), "regather prefetch": ("regather", True)}


def _logged_collectives(log):
    """Patch comm's K/V all-gather and dK/dV reduce-scatter starts and waits to append to ``log``; returns undo."""
    from l3plugin.collective import comm

    start_ag, start_rs, wait = comm.start_all_gather, comm.start_reduce_scatter_sum, comm.InFlight.wait

    def logged_ag(shard, group, what=""):
        log.append("start " + what)
        return start_ag(shard, group, what=what)

    def logged_rs(*args, **kwargs):
        log.append("start " + kwargs.get("what", ""))
        return start_rs(*args, **kwargs)

    def logged_wait(self, timeout=600):
        log.append("wait " + self.description)
        return wait(self, timeout)

    comm.start_all_gather, comm.start_reduce_scatter_sum, comm.InFlight.wait = logged_ag, logged_rs, logged_wait

    def undo():
        comm.start_all_gather, comm.start_reduce_scatter_sum, comm.InFlight.wait = start_ag, start_rs, wait
    return undo


def stacked(schedule, cp_layout="2cp", overlap=True, local_first=False, documents="crossing-every-border"):
    """On every rank: per mode, (outputs and gradients, log of collectives) of ``schedule``:
    - "step": the forward of LAYERS calls (each one's output the next one's queries), then the backward;
    - "interleaved": forwards of micro-batches 0 and 1, then backward 0, then backward 1 (a pipeline's order);
    - "recompute": a forward with grad whose output is dropped, then a step whose middle call is recomputed
      in the backward (reentrant torch.utils.checkpoint, as Megatron's), then a forward without grad."""
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from l3plugin.cp import regather_ahead

    cp, rank = dist.get_world_size(), dist.get_rank()
    cu = layouts(S)[documents]
    idx = make_layout(cp_layout, S, cp, cu).indices(rank)
    q, k, v, g = (t[idx] for t in make_inputs(torch.float32, 4, 2))
    results = {}
    for mode, (cp_kv, prefetch) in MODES.items():
        regather_ahead.reset()

        def attend(x, kk, vv):
            return all_gather_attention(x, kk, vv, torch.tensor(cu), group=dist.group.WORLD, layout=cp_layout,
                                        overlap=overlap, cp_kv=cp_kv, prefetch=prefetch, local_first=local_first)

        def forward(leaves, shift, recompute=False):
            out = leaves[0]
            for layer in range(LAYERS):
                kk, vv = leaves[1] * (1 + layer) + shift, leaves[2] - layer
                if recompute == "per call":  # as transformers' gradient checkpointing (one attention per layer)
                    out = checkpoint(attend, out, kk, vv, use_reentrant=False)
                elif recompute and layer == 1:
                    out = checkpoint(attend, out, kk, vv, use_reentrant=True)  # as Megatron's recompute
                else:
                    out = attend(out, kk, vv)
            return out

        log = []
        undo = _logged_collectives(log)
        try:
            micro = [[t.detach().clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
            if schedule == "step":
                forward(micro[0], 0.0).backward(g)
            elif schedule == "recompute per call":
                forward(micro[0], 0.0, recompute="per call").backward(g)
            elif schedule == "recompute region":
                checkpoint(lambda *leaves: forward(leaves, 0.0), *micro[0], use_reentrant=False).backward(g)
            elif schedule == "interleaved":
                outs = [forward(leaves, 0.25 * m) for m, leaves in enumerate(micro)]
                for out in outs:
                    out.backward(g)
            else:
                forward(micro[1], 0.5)  # dropped: its graph goes without a backward
                forward(micro[0], 0.0, recompute=True).backward(g)
                with torch.no_grad():
                    forward(micro[1], 0.5)
                joined_without_grad = regather_ahead.chain_of(dist.group.WORLD).last
        finally:
            undo()
        got = [t.grad for leaves in micro for t in leaves if t.grad is not None]
        results[mode] = (got, log)
        if schedule == "recompute":
            results[mode + " last state"] = getattr(joined_without_grad, "state", None)
    return results


def _check(runs, label):
    for rank, results in enumerate(runs):
        keep, _ = results["keep"]
        for mode in [m for m in ("regather", "regather prefetch") if m in results]:
            got, _ = results[mode]
            assert len(got) == len(keep) > 0
            for i, (a, b) in enumerate(zip(got, keep)):
                assert torch.equal(a, b), f"{label} rank {rank} {mode} gradient {i}: max diff {(a - b).abs().max():.3g}"
    # The same all-gathers started in the same order on every rank (the dK/dV parts are tagged point-to-point
    # exchanges on gloo, started in each rank's own order; waits differ too)
    for mode in [m for m in MODES if m in runs[0]]:
        logs = [[e for e in results[mode][1] if e.startswith("start CP K/V")] for results in runs]
        assert all(log == logs[0] for log in logs), f"{label} {mode}: ranks issued different collectives"
    return runs[0]


def _count(log, first, text):
    return sum(entry.startswith(first) and text in entry for entry in log)


def _check_step(results):
    plain, ahead = results["regather"][1], results["regather prefetch"][1]
    assert _count(plain, "start", "(again)") == LAYERS and _count(plain, "start", "ahead") == 0
    # the last call keeps its buffer until its backward; each other one is gathered ahead, once, and waited
    assert _count(ahead, "start", "ahead") == _count(ahead, "wait", "ahead") == LAYERS - 1, ahead
    assert _count(ahead, "start", "(again)") == 0


# cp = 2, 2cp, overlap, not local-first: the run of test_prefetch_starts_during_the_backward_of_the_call_after.
@pytest.mark.parametrize("cp, cp_layout, overlap, local_first", [(2, "balanced", False, False), (4, "2cp", True, False),
                                                                 (2, "2cp", True, True)])
def test_prefetch_is_bit_identical_over_a_stack_of_calls(ranks, cp, cp_layout, overlap, local_first):
    """Gradients of queries, keys and values through three calls (documents crossing chunk borders)."""
    _check_step(_check(ranks.run(cp, stacked, "step", cp_layout, overlap, local_first, timeout=120),
                       f"cp={cp} {cp_layout} local_first={local_first}"))


def test_prefetch_starts_during_the_backward_of_the_call_after(ranks):
    """The previous call's all-gather starts before this call's dK/dV leave, and is waited only when the
    previous call's backward starts (after this call's dK/dV are waited). Also the bit-identical stack of calls
    at cp = 2 (2cp, overlap)."""
    results = _check(ranks.run(2, stacked, "step", timeout=120), "cp=2 2cp local_first=False")
    _check_step(results)
    log = results["regather prefetch"][1]
    backward = log[next(i for i, e in enumerate(log) if "ahead" in e) - 1:]
    events = [("start" if e.startswith("start") else "wait") + (" ahead" if "ahead" in e else " dK/dV" if "dK/dV" in e
                                                                 else "") for e in backward]
    events = [e for e in events if e.endswith(("ahead", "dK/dV"))]
    # the last call's backward (its buffer kept): starts the middle call's gather, then its dK/dV; the middle
    # call's backward waits for its gather, starts the first call's, and so on
    one = ["start dK/dV", "start dK/dV", "wait dK/dV", "wait dK/dV"]  # cp=2, two parts each
    assert events == ["start ahead", *one, "wait ahead", "start ahead", *one, "wait ahead", *one], backward


def test_prefetch_under_interleaved_micro_batches(ranks):
    """Forwards of two micro-batches before their backwards: the first micro-batch's last call was released by
    the second's forward and is gathered again; nothing is gathered for a call already differentiated."""
    results = _check(ranks.run(2, stacked, "interleaved", timeout=120), "interleaved")
    ahead = results["regather prefetch"][1]
    assert _count(ahead, "start", "(again)") == 1  # micro-batch 0's last call: no call after it prefetched it
    assert _count(ahead, "start", "ahead") == _count(ahead, "wait", "ahead") == 2 * (LAYERS - 1)


def test_prefetch_with_recompute_and_a_dropped_forward(ranks):
    """A forward with grad never differentiated, a recomputed call, then a forward without grad: same results,
    same collectives everywhere; nothing joins the chain without grad."""
    results = _check(ranks.run(2, stacked, "recompute", timeout=120), "recompute")
    assert results["regather prefetch last state"] == "done"  # the no_grad forward joined nothing


@pytest.mark.parametrize("schedule", ["recompute per call", "recompute region"])
def test_calls_recomputed_by_a_non_reentrant_checkpoint(ranks, schedule):
    """torch.utils.checkpoint(use_reentrant=False), transformers' default, around each call or around all
    three: the backward reads the recomputed calls' gathered K/V (through the recomputed saved tensors), which a
    forward run inside a backward keeps."""
    _check(ranks.run(2, stacked, schedule, timeout=120), schedule)
