"""The in-memory recorder and local_collectives on 2 gloo ranks: what a record says about a call, when an
async call ends, extra (cached) targets, local stand-ins, and that torch is always put back."""

import datetime
import json
import os
import types
import warnings

import pytest

WORLD = 2


def _originals():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from l3plugin.debug.patching import OPS

    return {(m, n): getattr(m, n) for m in (dist, c10d) for n in OPS if hasattr(m, n)}


def _all_restored(originals) -> bool:
    return all(getattr(m, n) is f for (m, n), f in originals.items())


# --- functions that run on the ranks --------------------------------------------------------------

def memory_log_of_calls():
    """Collectives under every name this torch has; returns what the records say and what was passed."""
    import torch
    import torch.distributed as dist

    from l3plugin.debug import record_collectives

    rank = dist.get_rank()
    calls = []  # (name called, dtype, numel, bytes) of the input handed over, as the test expects them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor is deprecated in new torch
        with record_collectives() as log:
            for i, name in enumerate(("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")):
                if hasattr(dist, name):
                    # A different dtype and size for each call, so the record must come from this call.
                    dtype = (torch.float32, torch.float64, torch.int32)[i]
                    inp = torch.arange(WORLD * (3 + i), dtype=dtype) + rank
                    out = torch.empty(3 + i, dtype=dtype)
                    getattr(dist, name)(out, inp)
                    expect = (torch.arange(WORLD * (3 + i), dtype=torch.float64) * 2 + 1)[rank * (3 + i):][:3 + i]
                    assert torch.equal(out.double(), expect), (name, out)  # recording changes no result
                    calls.append((name, str(dtype), inp.numel(), inp.numel() * inp.element_size()))
            for i, name in enumerate(("all_gather_into_tensor", "all_gather_single", "_all_gather_base")):
                if hasattr(dist, name):
                    inp = torch.full((2 + i,), rank, dtype=torch.int64)
                    getattr(dist, name)(torch.empty(WORLD * (2 + i), dtype=torch.int64), inp)
                    calls.append((name, "torch.int64", inp.numel(), 8 * inp.numel()))
            t = torch.ones(5, dtype=torch.int32)
            work = dist.all_reduce(t, async_op=True)
            async_rec = log[-1]
            end_before_wait = async_rec.end
            work.wait()
            end_after_wait = async_rec.end
            calls.append(("all_reduce", "torch.int32", 5, 20))
            never_waited = dist.all_reduce(torch.ones(3), async_op=True)
    never_waited.wait()  # after the exit: the record keeps end None
    records = [(c.op, str(c.dtype), c.numel, c.bytes, c.world_size, c.async_op) for c in log]
    return {"calls": calls, "records": records, "log_bytes": log.bytes, "n_log": len(log),
            "starts_ends": [(c.start, c.end) for c in log[:-1]],
            "async": (async_rec.start, end_before_wait, end_after_wait), "never_waited_end": log[-1].end,
            "of_rs": len(log.of("reduce_scatter_tensor")), "of_rs_single": len(log.of("reduce_scatter_single")),
            "of_ag": len(log.of("all_gather_into_tensor"))}


def extra_targets_patched_and_restored(trace_dir):
    """A cached reference (like DeepSpeed's cdb.reduce_scatter_function) is seen only through extra_targets."""
    import torch
    import torch.distributed as dist

    from l3plugin.debug import record_collectives

    original = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def cached(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return original(output, input, op=op, group=group, async_op=async_op)

    holder = types.SimpleNamespace(reduce_scatter_function=cached)
    target = [(holder, "reduce_scatter_function", "reduce_scatter_tensor")]
    out, inp = torch.empty(4), torch.ones(8)
    with record_collectives() as without:
        holder.reduce_scatter_function(out, inp)
    with record_collectives(extra_targets=target) as log:
        patched_inside = holder.reduce_scatter_function is not cached
        holder.reduce_scatter_function(out, inp)
    restored = holder.reduce_scatter_function is cached
    try:
        with record_collectives(extra_targets=target):
            raise KeyError("boom")
    except KeyError:
        pass
    restored_after_raise = holder.reduce_scatter_function is cached
    with record_collectives(trace_dir, extra_targets=target):
        holder.reduce_scatter_function(out, inp)
    originals = _originals()
    try:
        with record_collectives(extra_targets=[(holder, "reduce_scatter_function", "no_such_op")]):
            pass
        bad_op_refused = False
    except ValueError:
        bad_op_refused = True
    return {"without": len(without), "with": [(c.op, c.numel, c.bytes) for c in log],
            "patched_inside": patched_inside, "restored": restored, "restored_after_raise": restored_after_raise,
            "bad_op_refused": bad_op_refused and _all_restored(originals) and holder.reduce_scatter_function is cached}


def local_stand_ins():
    """Every collective replaced by a local copy; rank 0 makes calls rank 1 never makes."""
    import torch
    import torch.distributed as dist

    from l3plugin.debug import local_collectives, record_collectives

    rank = dist.get_rank()
    originals = _originals()
    holder = types.SimpleNamespace(all_gather_function=dist.all_gather_into_tensor)
    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with local_collectives(extra_targets=[(holder, "all_gather_function", "all_gather_into_tensor")]):
            got["isend_untouched"] = dist.isend is originals[(dist, "isend")]
            inp = torch.arange(8.0)
            for name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
                if hasattr(dist, name):
                    out = torch.full((4,), -1.0)
                    getattr(dist, name)(out, inp)
                    got[name] = out.tolist()
            out = torch.full((2, 2), -1.0)
            dist.reduce_scatter_tensor(out, inp.view(2, 4))  # stacked 2D input, 2D output
            got["rs_2d"] = out.flatten().tolist()
            out = torch.full((3,), -1.0)
            dist.reduce_scatter(out, [torch.full((3,), 10.0), torch.full((3,), 11.0)])
            got["rs_list"] = out.tolist()
            small = torch.tensor([1.0, 2.0, 3.0])
            for name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
                if hasattr(dist, name):
                    out = torch.zeros(2, 3)
                    getattr(dist, name)(out, small)
                    got[name] = out.tolist()
            out = torch.zeros(6)
            holder.all_gather_function(output_tensor=out, input_tensor=small)  # DeepSpeed's keyword call
            got["extra_target"] = out.tolist()
            outs = [torch.zeros(3), torch.zeros(3)]
            dist.all_gather(outs, small)
            got["ag_list"] = [o.tolist() for o in outs]
            if rank == 0:  # rank 1 never makes these: real collectives would block here
                t = torch.tensor([5.0, 6.0])
                dist.all_reduce(t)
                dist.broadcast(t, src=1)
                dist.barrier()
                got["all_reduce"] = t.tolist()
                work = dist.all_reduce(t, async_op=True)
                got["async"] = (work.is_completed(), work.wait(timeout=datetime.timedelta(seconds=1)),
                                work.get_future().done(), work.get_future().value()[0] is t)
                work = dist.all_gather_into_tensor(torch.zeros(6), small, async_op=True)
                got["async_gather"] = work.wait()
                got["blocking_returns"] = dist.all_reduce(t)
            try:
                with record_collectives():
                    pass
                got["nested_refused"] = False
            except RuntimeError:
                got["nested_refused"] = True
    got["restored"] = _all_restored(originals) and holder.all_gather_function is originals[
        (dist, "all_gather_into_tensor")]
    try:
        with local_collectives():
            raise KeyError("boom")
    except KeyError:
        pass
    got["restored_after_raise"] = _all_restored(originals)
    t = torch.ones(2)
    dist.all_reduce(t)  # the real one again: both ranks take part
    got["real_after"] = t.tolist()
    return got


# --- tests ----------------------------------------------------------------------------------------

def test_memory_log_records_what_each_call_hands_over(ranks):
    for r in ranks.run(WORLD, memory_log_of_calls, timeout=60):
        calls, records = r["calls"], r["records"]
        assert len(records) == len(calls) + 1 == r["n_log"]  # + the all_reduce never waited
        for (name, dtype, numel, nbytes), rec in zip(calls, records):
            op = {"reduce_scatter_single": "reduce_scatter_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
                  "all_gather_single": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor"}
            assert rec == (op.get(name, name), dtype, numel, nbytes, WORLD, name == "all_reduce"), (name, rec)
        assert r["log_bytes"] == sum(c[3] for c in calls) + 3 * 4
        n_rs = sum(c[0].startswith(("reduce_scatter", "_reduce_scatter")) for c in calls)
        assert n_rs >= 2 and r["of_rs"] == r["of_rs_single"] == n_rs  # both names, canonical in the log
        assert r["of_ag"] == sum(c[0].startswith(("all_gather", "_all_gather")) for c in calls)
        assert all(s is not None and e is not None and e >= s for s, e in r["starts_ends"])
        start, before, after = r["async"]
        assert before is None and after is not None and after >= start
        assert r["never_waited_end"] is None


def test_extra_targets_are_recorded_and_restored(ranks, tmp_path):
    results = ranks.run(WORLD, extra_targets_patched_and_restored, str(tmp_path), timeout=60)
    for r in results:
        assert r["without"] == 0  # the cached reference bypasses torch.distributed's names
        assert r["with"] == [("reduce_scatter_tensor", 8, 32)]
        assert r["patched_inside"] and r["restored"] and r["restored_after_raise"] and r["bad_op_refused"]
    with open(tmp_path / "rank1.jsonl") as fh:
        ops = [json.loads(line) for line in fh][1:-1]
    assert [(o["op"], o["dtype"], o["bytes"]) for o in ops] == [("reduce_scatter_tensor", "torch.float32", 32)]
    from l3plugin.debug.traces import load_traces

    assert [ev.op for ev in load_traces(str(tmp_path)).events[0]] == ["reduce_scatter"]


def test_local_collectives_copy_locally_and_restore(ranks):
    for rank, got in enumerate(ranks.run(WORLD, local_stand_ins, timeout=60)):
        mine = [float(x) for x in range(rank * 4, rank * 4 + 4)]
        for name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
            if name in got:
                assert got[name] == mine, name
        assert got["rs_2d"] == mine and got["rs_list"] == [10.0 + rank] * 3
        for name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
            if name in got:
                assert got[name] == [[1.0, 2.0, 3.0]] * 2, name
        assert got["extra_target"] == [1.0, 2.0, 3.0] * 2 and got["ag_list"] == [[1.0, 2.0, 3.0]] * 2
        assert got["isend_untouched"] and got["nested_refused"]
        assert got["restored"] and got["restored_after_raise"] and got["real_after"] == [2.0, 2.0]
        if rank == 0:
            assert got["all_reduce"] == [5.0, 6.0]
            assert got["async"] == (True, True, True, True) and got["async_gather"] is True
            assert got["blocking_returns"] is None


def test_local_collectives_without_a_process_group():
    """A single process that never initialised torch.distributed: the stand-ins need no group."""
    import torch
    import torch.distributed as dist

    from l3plugin.debug import local_collectives

    assert not dist.is_initialized(), "the test process must not have a process group (workers have them)"
    out = torch.empty(3)
    with local_collectives():
        dist.all_gather_into_tensor(torch.empty(6), torch.ones(3))
        dist.reduce_scatter_tensor(out, torch.arange(6.0))
        assert dist.barrier(async_op=True).wait()
    assert out.tolist() == [0.0, 1.0, 2.0]
    gathered = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    with local_collectives():  # in place, as DeepSpeed gathers: the input is this rank's slice of the output
        dist.all_gather_into_tensor(gathered, gathered[:3])
    assert gathered.tolist() == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    received = torch.ones(3)
    with local_collectives(p2p=True):  # point-to-point too: sends vanish, receives get zeros
        assert dist.isend(torch.ones(3), dst=1).wait()
        assert dist.irecv(received, src=1).is_completed()
    assert received.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):  # the real one needs a process group
        dist.barrier()


def test_recorder_arguments_are_checked():
    from l3plugin.debug import record_collectives
    from l3plugin.mesh.shape import MeshShape

    with pytest.raises(TypeError, match="extra_targets"):
        with record_collectives([(os, "getcwd", "barrier")]):  # the old positional extra_targets
            pass
    with pytest.raises(ValueError, match="trace_dir"):
        with record_collectives(mesh=MeshShape(tp=1)):
            pass
    with pytest.raises(AttributeError, match="no_such_attribute"):
        with record_collectives(extra_targets=[(os, "no_such_attribute", "barrier")]):
            pass
