"""Pipeline schedules side by side: bubble ratio and peak in-flight microbatches (simulated), and a real
CPU run timing l3plugin's flexible schedule against Megatron-Core's stock interleaved schedule.

    .venv/bin/python bench/pp_schedule.py              # everything (simulation + 4-rank CPU run)
    .venv/bin/python bench/pp_schedule.py --no-real    # simulation tables only (seconds)
    .venv/bin/python bench/pp_schedule.py --wire auto  # 2 ranks, pp=2, vpp 2..4 on an emulated wire (~8 min)
    .venv/bin/python bench/pp_schedule.py --zero-bubble [--png-dir DIR]  # 2 ranks: flexible vs flexible-zb

Prints tables, asserts nothing; --json: every figure as JSON on stdout, the tables on stderr (bench/harness.py).
Simulation costs: forward 1, backward 2, P2P latency 0 or 0.1 forward.
"Bubble" is the paper's idle / (forward + backward) time of the worst rank; "in-flight" is the peak
number of microbatch activations a rank holds (in units of one chunk's activations), worst rank.

On a wire (``--wire RATE|PRESET|auto``, ``--wire-mode per-rank|shared``, bench/wire.py; ``auto``: the rate at
which one activation send alone takes ``--send-share`` of the smallest chunk's forward, from two measurements,
printed): 2 gloo ranks (one per core), pp=2, for each vpp stock interleaved (k = p) and flexible k = p, 1.5p,
2p, each with the wire shaped and unshaped (every rank's link, or the shared loopback), interleaved over
rounds (bench/harness.py: the order rotating by one contender per round; a warm-up round first). Printed:
one chunk's forward and one activation send alone; per contender the step time (slowest rank, median) off and on the wire, the medians of per-round
ratios wire / no wire and wire / stock on the wire (range), CPU-busy, the peak bytes autograd holds for backward (a census through
saved_tensors_hooks, larger rank; in-flight activations), the simulated peak in-flight, whether every run's
gradients are identical, and where the flexible executor blocks (its own account, per rank: ms waiting for
receives and for sends, and the most receive buffers it posted at once, beside the plan's count and bytes),
and the simulator's prediction with the measured per-message time (simulate_posted: a message moves once its
receive is posted). The flexible executor posts receives early (l3plugin.schedule.receives); --agreed-order adds
flexible k = p and 1.5p posting in the agreed pair order instead (the executor before early receives).
Stock runs with deallocate_pipeline_outputs off: it frees an output right after starting its isend, which
gloo may still be reading (a known trap on gloo; NCCL's stream ordering makes it safe on GPUs).

Zero bubble (``--zero-bubble``): 2 gloo ranks (one per core), pp=2, k = p, v in {1, 2}, m in {p, 2p, 4p}: the
flexible schedule and flexible-zb (each backward split into B and W) interleaved over rounds, optionally on a
wire. Printed per configuration: the step (slowest rank, median), the median of per-round ratios zb / flexible
(range), each rank's busy time and idle share from the executor's own account (``waits["busy_s"]``: its compute
spans, receives excluded; idle = (step - busy) / busy), the simulated idle (F = B = W) of both plans, the peak
in flight of both plans, the peak bytes autograd saved for backward (census, larger rank) and whether the
gradients were identical in every run; below each row, both plans simulated with the step costs measured in the
run (the median span of each step kind per virtual stage, the executor's own account: it includes the load
imbalance between stages, e.g. the loss on the last, and no communication), their idle, the simulated step ratio
zb / flexible (what the plan can give at these costs) and zb's B + W over flexible's backward per stage (the
split's own cost). ``--png-dir``: measured
timelines (the executor's spans, l3plugin.schedule.timeline) of one round at v 2, m 2p, where W fills the idle.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' toy pipeline and CPU shim

import harness  # noqa: E402

# torch is imported where the ranks (and the wire's gradient checks) use it: the simulation needs none, and the
# bench process of a loopback run then starts seconds sooner.
from l3plugin.schedule.plan import build_schedule  # noqa: E402
from l3plugin.schedule.receives import agreed_order_posts, receive_posts  # noqa: E402
from l3plugin.schedule.simulate import simulate, simulate_posted  # noqa: E402


def stock_accepts(p, v, m, k):
    """Whether Megatron-Core 0.16.1's interleaved schedule accepts (p, v, m, k) (schedules.py:995-1015)."""
    if k < p:
        return False  # stock has no all-forward-all-backward fallback (v=1 would run 1F1B instead)
    if v == 1:
        return True
    final = m % k
    return p <= k <= m and not (0 < final < p)


def variants(p, v, m):
    """(name, vpp, k) of the schedules compared for one (p, v, m)."""
    rows = [("all-fwd-all-bwd, GPipe (v=1)", 1, 1), ("1F1B (v=1)", 1, min(p, m)),
            (f"flexible k=p/2={p // 2} (AFAB)", v, p // 2),
            (f"Megatron interleaved (k=p={p})", v, p)]
    for factor, label in ((1.5, "1.5p"), (2, "2p")):
        k = int(p * factor)
        rows.append((f"flexible k={label}={k}", v, k))
    return [(name, vv, k) for name, vv, k in rows if 1 <= k <= m]


def simulation_table(settings, latencies):
    """Print the table; return its rows as dicts."""
    rows = []
    header = (f"{'p':>3} {'v':>2} {'m':>3}  {'schedule':<30} {'stock?':>6} "
              + " ".join(f"{'bubble@lat=' + str(lat):>14}" for lat in latencies) + f" {'in-flight':>9}")
    print(header)
    print("-" * len(header))
    for p, v, m in settings:
        for name, vv, k in variants(p, v, m):
            sched = build_schedule(p, vv, m, k)
            bubbles = [simulate(sched, 1.0, 2.0, lat).bubble_ratio for lat in latencies]
            inflight = max(plan.peak_inflight() for plan in sched.ranks)
            ok = "yes" if stock_accepts(p, vv, m, k) else "NO"
            rows.append({"p": p, "v": vv, "m": m, "k": k, "schedule": name, "stock_accepts": ok == "yes",
                         "bubble": dict(zip(map(str, latencies), bubbles)), "inflight": inflight})
            print(f"{p:>3} {vv:>2} {m:>3}  {name:<30} {ok:>6} "
                  + " ".join(f"{b:>14.3f}" for b in bubbles) + f" {inflight:>9}")
        print()
    return rows


def real_run(steps, hidden, seq, mbs):
    """4 gloo ranks, pp=4 vpp=2, m=8, k=4: the same model and data under both schedules, alternating.
    Returns the printed figures."""
    from l3plugin.ranks.pool import RankPool

    print(f"Real CPU run: 4 gloo ranks, pp=4 vpp=2 m=8 k=4, toy model hidden={hidden} seq={seq} "
          f"micro-batch={mbs}, {steps} steps each, alternating")
    with RankPool(4, preload=("megatron.core",)) as pool:
        times = pool.run(_timed_steps, steps, hidden, seq, mbs, timeout=1800)
    flex = [max(rank["flexible"][i] for rank in times) for i in range(steps)]
    stock = [max(rank["stock"][i] for rank in times) for i in range(steps)]
    f_med, s_med = statistics.median(flex), statistics.median(stock)
    print(f"  median step time  flexible {f_med * 1e3:8.1f} ms   stock {s_med * 1e3:8.1f} ms   "
          f"ratio flexible/stock {f_med / s_med:.3f}")
    identical = all(rank["identical"] for rank in times)
    print(f"  identical gradients: {identical}")
    return {"steps": steps, "hidden": hidden, "seq": seq, "micro_batch": mbs, "flexible_step_s": f_med,
            "stock_step_s": s_med, "flexible_over_stock": f_med / s_med, "identical_gradients": identical}


def toy_model(p, v, m, k, layers, hidden, seq, mbs, deallocate_outputs=True):
    """On every rank: (mesh, this rank's model chunks, m microbatches) of the toy pipeline model."""
    import torch
    from megatron.core.transformer import TransformerConfig

    import toy_pipeline as toy
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=p, vpp=v)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=1,
                               pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v,
                               pipeline_dtype=torch.float32, microbatch_group_size_per_vp_stage=k,
                               batch_p2p_comm=False, deallocate_pipeline_outputs=deallocate_outputs)
    chunks = toy.build_chunks(config, num_layers=layers, hidden=hidden, pp_rank=mesh.coords["pp"],
                              pp_size=p, vpp_size=v)
    return mesh, chunks, toy.make_microbatches(m, seq, mbs, hidden)


def _timed_steps(steps, hidden, seq, mbs):
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from l3plugin.megatron import forward_backward_pipelining_flexible
    import toy_pipeline as toy
    from megatron_cpu_shim import stock_schedules_on_cpu

    m = 8  # pp=4 vpp=2 m=8 k=4, as real_run says
    mesh, chunks, batches = toy_model(4, 2, m, 4, 16, hidden, seq, mbs)
    schedules = {"flexible": forward_backward_pipelining_flexible, "stock": get_forward_backward_func()}

    def step(name):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        timing, _ = harness.barrier_timed(lambda: schedules[name](
            forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
            num_microbatches=m, seq_length=seq, micro_batch_size=mbs), group=mesh.pp_group)
        return timing["wall"], {lid: g[0] for c in chunks for lid, g in c.grads().items()}

    with stock_schedules_on_cpu():
        runs = harness.interleaved_rounds(schedules, step, steps)  # a warm-up round first, not counted
    identical = all(torch.equal(gf[lid], gs[lid]) for (_, gf), (_, gs) in zip(runs["flexible"], runs["stock"])
                    for lid in gf)
    return {"flexible": [t for t, _ in runs["flexible"]], "stock": [t for t, _ in runs["stock"]],
            "identical": identical}


# ---- on the emulated wire: 2 ranks, pp=2 ----------------------------------------------------------------
WIRE_P = 2


# Where the flexible executor blocks, its own account per step (PipelineChannels.waits, l3plugin/schedule/p2p.py):
# seconds waiting for receives (a message not here yet) and for sends (an output to free, the step's end).
CHANNEL_WAITS = ("recv_s", "send_s")
POSTING_SHARES = (0.1, 0.2, 0.3)  # the simulated posting table: a message's time / a chunk's forward
STOCK, EARLY, AGREED = "stock", "early", "agreed"  # the stock schedule; the flexible one's receive posting


def wire_contenders(v, agreed_order=False):
    """(name, k, kind) timed for one vpp: stock interleaved (k = p), flexible k = p, 1.5p, 2p (receives posted
    early) and with ``agreed_order`` flexible k = p, 1.5p posting in the agreed pair order."""
    p = WIRE_P
    rows = [(f"stock interleaved k={p}", p, STOCK), (f"flexible k=p={p}", p, EARLY),
            (f"flexible k=1.5p={3 * p // 2}", 3 * p // 2, EARLY), (f"flexible k=2p={2 * p}", 2 * p, EARLY)]
    if agreed_order:
        rows += [(f"agreed-order k=p={p}", p, AGREED), (f"agreed-order k=1.5p={3 * p // 2}", 3 * p // 2, AGREED)]
    return rows


def _wire_step(v, m, k, kind, layers, hidden, seq, mbs):
    """On every rank: one timed training step (wall, CPU busy, peak saved-activation bytes, grads, and the
    flexible executor's own waits)."""
    import functools

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from l3plugin.debug.saved_tensors import SavedTensorCensus
    from l3plugin.megatron import forward_backward_pipelining_flexible
    import toy_pipeline as toy
    from megatron_cpu_shim import stock_schedules_on_cpu

    stock = kind == STOCK

    # Stock frees an output (deallocate_output_tensor) right after starting its isend; on gloo the send may
    # still be reading it, which would corrupt the receiver's input: stock keeps its outputs here.
    mesh, chunks, batches = toy_model(WIRE_P, v, m, k, layers, hidden, seq, mbs, deallocate_outputs=not stock)
    census = SavedTensorCensus()
    waits = {}
    fn = get_forward_backward_func() if stock else functools.partial(
        forward_backward_pipelining_flexible, receive_posting=kind, waits=waits)  # EARLY, AGREED: the modes
    with stock_schedules_on_cpu(), census.hooks:
        timing, _ = harness.barrier_timed(lambda: fn(
            forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
            num_microbatches=m, seq_length=seq, micro_batch_size=mbs), group=mesh.pp_group)
    grads = {lid: g[0] for c in chunks for lid, g in c.grads().items()}
    return {"wall": timing["wall"], "busy": timing["busy"], "peak": census.peak, "grads": grads,
            "waits": waits}


def _chunk_forward_seconds(v, layers, hidden, seq, mbs, repeats=5):
    """On every rank: median seconds of one chunk's forward on one microbatch (no communication)."""
    _, chunks, batches = toy_model(WIRE_P, v, 1, 1, layers, hidden, seq, mbs)
    chunk = chunks[-1]
    chunk.set_input_tensor(batches[0]["x"].detach().requires_grad_())
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        chunk(batches[0]["x"])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _activation_send_alone(numel):
    """Wall/CPU seconds of one activation sent rank 0 -> rank 1 alone (wire.time_collectives_alone)."""
    import torch
    import torch.distributed as dist

    import wire

    data = torch.ones(numel)

    def send():
        (dist.isend if dist.get_rank() == 0 else dist.irecv)(data, 1 - dist.get_rank()).wait()

    return wire.time_collectives_alone(numel, ops={"activation send, one way": send})


def wire_run(pool, link, args):
    """pp=2 on 2 ranks; per vpp, every contender with the wire on and off, interleaved, in one run. Returns the
    printed figures."""
    import torch

    import wire

    figures = {}
    p, m, hidden, seq, mbs, layers = WIRE_P, args.microbatches, args.hidden, args.seq, args.mbs, args.layers
    numel = seq * mbs * hidden
    chunk_fwd = {v: max(pool.run(_chunk_forward_seconds, v, layers, hidden, seq, mbs)) for v in args.vpp}
    print(f"Real run on the wire: 2 gloo ranks (one per core), pp={p}, m={m}, toy model {layers} layers of "
          f"Linear({hidden})+tanh, fp32, activation [seq {seq}, mbs {mbs}, hidden {hidden}] = "
          f"{numel * 4 / 1e6:.2f} MB; one chunk's forward on one microbatch (unshaped, measured): "
          + ", ".join(f"vpp {v} ({layers // (p * v)} layers) {1000 * t:.1f} ms" for v, t in chunk_fwd.items()))
    figures["chunk_forward_s"] = {str(v): t for v, t in chunk_fwd.items()}
    figures["activation_bytes"] = numel * 4
    if args.wire == "auto":
        def send_alone():
            return max(r["activation send, one way"][0] for r in pool.run(_activation_send_alone, numel))

        figures["calibration"] = picked = harness.calibrate_wire(link, send_alone,
                                                                 args.send_share * chunk_fwd[max(args.vpp)])
        print(f"  rate picked so that one activation send alone takes {args.send_share:.0%} of the smallest "
              f"chunk's forward (vpp {max(args.vpp)}): {1000 * picked['unshaped']:.1f} ms unshaped, "
              f"{1000 * picked['probed']:.1f} ms at {wire.rate_text(picked['probe_rate'])} -> "
              f"{wire.rate_text(link.rate)}")
    rate = figures["rate_bits"] = link.rate
    figures["wire_mode"] = link.mode
    alone = pool.run(_activation_send_alone, numel)
    send = figures["activation_send_alone_s"] = max(r["activation send, one way"][0] for r in alone)
    print(link.describe())
    print(wire.collectives_alone_text(alone, numel))
    print("  activation send alone / one chunk's forward: "
          + ", ".join(f"vpp {v} {send / t:.0%}" for v, t in chunk_fwd.items()), flush=True)
    for v in args.vpp:
        runs = {(name, wired): (k, kind) for name, k, kind in wire_contenders(v, args.agreed_order)
                for wired in (False, True)}
        reference, differ = [], set()  # grads of the first run; who ever differed from them

        def run(key):
            (name, wired), (k, kind) = key, runs[key]
            link.set_rate(rate if wired else None)
            result = pool.run(_wire_step, v, m, k, kind, layers, hidden, seq, mbs, timeout=1800)
            reference[:] = reference or [r["grads"] for r in result]
            if not all(all(torch.equal(a[lid], r["grads"][lid]) for lid in a) for a, r in zip(reference, result)):
                differ.add(f"{name}{' on the wire' if wired else ''}")
            for r in result:
                del r["grads"]
            return result

        times = harness.interleaved_rounds(runs, run, args.rounds)  # a warm-up round first, not counted
        link.set_rate(rate)
        figures[f"vpp {v}"] = wire_table(v, m, times, differ, args.agreed_order, numel * 4)
        figures[f"vpp {v}"]["simulated"] = simulated_wire(v, m, send / chunk_fwd[v], args.agreed_order)
    return figures


def simulated_wire(v, m, share, agreed_order):
    """Print and return the simulator's step / no-wire step per flexible contender, a message taking ``share``
    of one chunk's forward (measured), backward = 2 forwards, a receive moving its message only once posted."""
    rows = {}
    for name, k, kind in wire_contenders(v, agreed_order):
        if kind == STOCK:
            continue
        schedule = build_schedule(WIRE_P, v, m, k)
        posts = [(receive_posts if kind == EARLY else agreed_order_posts)(schedule, r) for r in range(WIRE_P)]
        makespan, waited = simulate_posted(schedule, posts, 1.0, 2.0, share)
        rows[name] = {"wire_over_no_wire": makespan / simulate(schedule, 1.0, 2.0).makespan,
                      "recv_wait_forwards": waited}
    print(f"  simulated (simulate_posted, a message = {share:.0%} of a forward): wire / no wire "
          + ", ".join(f"{name} {row['wire_over_no_wire']:.3f}" for name, row in rows.items()))
    return rows


def wire_table(v, m, times, differ, agreed_order=False, message_bytes=0):
    p = WIRE_P

    def walls(key):  # slowest rank, per round
        return [max(r["wall"] for r in ranks) for ranks in times[key]]

    def ratio(a, b):  # median of per-round ratios (range)
        return harness.ratio_stats(walls(a), walls(b))

    table = {"microbatches": m, "rows": [], "identical_gradients": not differ, "differ": sorted(differ)}
    stock = f"stock interleaved k={p}"
    print(f"\npp={p} vpp={v} m={m}: step ms (slowest rank, median), CPU-busy (both ranks' CPU / (2 cores x wall)), "
          f"peak saved activations (census, larger rank) and simulated peak in-flight (chunk-microbatches)")
    print(f"  {'schedule':<24} {'no wire ms':>10} {'wire ms':>9} {'wire/no-wire':>20} {'wire / stock wire':>20} "
          f"{'CPU-busy wire':>13} {'saved MB':>8} {'in-flight':>9}")
    for name, k, _ in wire_contenders(v, agreed_order):
        off, on = (statistics.median(walls((name, w))) for w in (False, True))
        busy = statistics.median(sum(r["busy"] for r in ranks) / (2 * max(r["wall"] for r in ranks))
                                 for ranks in times[(name, True)])
        peak = max(max(r["peak"] for r in ranks) for ranks in times[(name, True)]) / 1e6
        inflight = max(plan.peak_inflight() for plan in build_schedule(p, v, m, k).ranks)
        row = {"schedule": name, "k": k, "no_wire_ms": 1000 * off, "wire_ms": 1000 * on,
               "wire_over_no_wire": ratio((name, True), (name, False)),
               "wire_over_stock_wire": ratio((name, True), (stock, True)), "cpu_busy_wire": busy,
               "saved_mb": peak, "inflight": inflight}
        table["rows"].append(row)
        print(f"  {name:<24} {1000 * off:>10.0f} {1000 * on:>9.0f} {harness.ratio_text(row['wire_over_no_wire']):>20} "
              f"{harness.ratio_text(row['wire_over_stock_wire']):>20} {busy:>13.2f} {peak:>8.1f} {inflight:>9}")
    print(f"  gradients identical in every run: {'yes' if not differ else 'NO, ' + ', '.join(sorted(differ))}")
    print("  where the flexible executor blocks (its own account), ms per step, median, rank 0 / rank 1 "
          "(no wire -> wire): waiting for receives, for sends; receive buffers posted at once, executor (plan)")
    table["waits_ms"], table["posted_receives"] = {}, {}
    for name, k, kind in wire_contenders(v, agreed_order):
        if kind == STOCK:
            continue
        cells, table["waits_ms"][name] = [], {}
        for label in CHANNEL_WAITS:
            per_rank = [[statistics.median(1000 * ranks[r]["waits"][label] for ranks in times[(name, w)])
                         for r in range(p)] for w in (False, True)]
            table["waits_ms"][name][label[:-2]] = {"no_wire": per_rank[0], "wire": per_rank[1]}
            cells.append(f"{label[:-2]} {'/'.join(f'{x:.0f}' for x in per_rank[0])} -> "
                         f"{'/'.join(f'{x:.0f}' for x in per_rank[1])}")
        executed = [max(ranks[r]["waits"]["peak_posted_receives"] for ranks in times[(name, True)]) for r in range(p)]
        schedule = build_schedule(p, v, m, k)
        planned = [(receive_posts if kind == EARLY else agreed_order_posts)(schedule, r).peak_inflight()
                   for r in range(p)]
        table["posted_receives"][name] = {"executor": executed, "plan": planned, "bytes_each": message_bytes,
                                          "executor_bytes": [n * message_bytes for n in executed]}
        cells.append(f"posted {'/'.join(map(str, executed))} ({'/'.join(map(str, planned))}) = "
                     f"{max(executed) * message_bytes / 1e6:.1f} MB")
        print(f"    {name:<22} " + "; ".join(cells))
    sys.stdout.flush()
    return table


# ---- zero bubble: flexible vs flexible-zb, 2 ranks ------------------------------------------------------------
ZB_P = 2
ZB_CONTENDERS = ("flexible", "flexible-zb")


def zb_plan(schedule, v, m, k):
    from l3plugin.schedule import build_zero_bubble_schedule

    return (build_zero_bubble_schedule if schedule == "flexible-zb" else build_schedule)(ZB_P, v, m, k)


def _zb_step(v, m, k, schedule, layers, hidden, seq, mbs):
    """On every rank: one timed training step of the toy pipeline: wall, the executor's busy seconds and waits,
    its compute spans, the peak bytes autograd saved for backward (census), the gradients."""
    from l3plugin.debug.saved_tensors import SavedTensorCensus
    from l3plugin.megatron import forward_backward_pipelining_flexible
    import toy_pipeline as toy

    mesh, chunks, batches = toy_model(ZB_P, v, m, k, layers, hidden, seq, mbs)
    waits, census = {}, SavedTensorCensus()
    with census.hooks:
        timing, _ = harness.barrier_timed(lambda: forward_backward_pipelining_flexible(
            forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
            num_microbatches=m, seq_length=seq, micro_batch_size=mbs, waits=waits, pipeline_schedule=schedule),
            group=mesh.pp_group)
    return {"wall": timing["wall"], "busy": waits["busy_s"], "recv_s": waits["recv_s"], "peak": census.peak,
            "rank": mesh.coords["pp"], "actions": waits["actions"],
            "grads": {lid: g[0] for c in chunks for lid, g in c.grads().items()}}


def zb_run(pool, args):
    """Every configuration's contenders interleaved over rounds; returns the printed figures."""
    from l3plugin.schedule.simulate import simulate

    p, k = ZB_P, ZB_P
    figures = {"rows": []}
    print(f"flexible vs flexible-zb: 2 gloo ranks, pp={p}, k={k}, toy model {args.layers} layers of "
          f"Linear({args.hidden})+tanh, activation [seq {args.seq}, mbs {args.mbs}], {args.rounds} rounds after a "
          f"warm-up round")
    print(f"  {'v':>2} {'m':>3} {'flexible ms':>11} {'zb ms':>7} {'zb / flexible':>22} "
          f"{'busy ms r0/r1 flex':>18} {'zb':>11} {'idle flex':>11} {'idle zb':>11} {'sim idle flex/zb':>16} "
          f"{'in flight':>9} {'saved MB':>11} {'identical':>9}")
    for v in args.zb_vpp:
        for m in (p, 2 * p, 4 * p):
            def run(schedule):
                return pool.run(_zb_step, v, m, k, schedule, args.layers, args.hidden, args.seq, args.mbs,
                                timeout=1800)

            times, differ = harness.rounds_with_gradients_checked(ZB_CONTENDERS, run, args.rounds)
            walls = {s: [max(r["wall"] for r in ranks) for ranks in times[s]] for s in ZB_CONTENDERS}
            busy = {s: [statistics.median(ranks[r]["busy"] for ranks in times[s]) for r in range(p)]
                    for s in ZB_CONTENDERS}
            step = {s: statistics.median(walls[s]) for s in ZB_CONTENDERS}
            idle = {s: [(step[s] - b) / b for b in busy[s]] for s in ZB_CONTENDERS}
            plans = {s: zb_plan(s, v, m, k) for s in ZB_CONTENDERS}
            simulated = {"flexible": simulate(plans["flexible"], 1.0, 2.0).bubble_ratio,
                         "flexible-zb": simulate(plans["flexible-zb"], 1.0, 1.0, weight_time=1.0).bubble_ratio}
            costs = {s: measured_stage_costs(times[s], p, v) for s in ZB_CONTENDERS}
            with_costs = {s: simulate(plans[s], stage_times=costs[s]) for s in ZB_CONTENDERS}
            simulated_measured = {s: with_costs[s].bubble_ratio for s in ZB_CONTENDERS}
            simulated_step_ratio = with_costs["flexible-zb"].makespan / with_costs["flexible"].makespan
            split_cost = [sum(costs["flexible-zb"][st][1:]) / costs["flexible"][st][1] for st in range(p * v)]
            inflight = {s: max(plan.peak_inflight() for plan in plans[s].ranks) for s in ZB_CONTENDERS}
            saved = {s: max(r["peak"] for ranks in times[s] for r in ranks) / 1e6 for s in ZB_CONTENDERS}
            ratio = harness.ratio_stats(walls["flexible-zb"], walls["flexible"])
            row = {"v": v, "m": m, "k": k, "step_ms": {s: 1000 * step[s] for s in ZB_CONTENDERS},
                   "zb_over_flexible": ratio, "busy_ms": {s: [1000 * b for b in busy[s]] for s in ZB_CONTENDERS},
                   "idle": idle, "simulated_idle": simulated, "inflight": inflight, "saved_mb": saved,
                   "identical_gradients": not differ, "measured_stage_costs_ms":
                       {s: [[1000 * t for t in c] for c in costs[s]] for s in ZB_CONTENDERS},
                   "simulated_idle_measured_costs": simulated_measured,
                   "simulated_step_ratio_measured_costs": simulated_step_ratio, "split_over_fused_backward": split_cost}
            figures["rows"].append(row)
            print(f"  {v:>2} {m:>3} {1000 * step['flexible']:>11.1f} {1000 * step['flexible-zb']:>7.1f} "
                  f"{harness.ratio_text(ratio):>22} "
                  f"{'/'.join(f'{1000 * b:.0f}' for b in busy['flexible']):>18} "
                  f"{'/'.join(f'{1000 * b:.0f}' for b in busy['flexible-zb']):>11} "
                  f"{'/'.join(f'{x:.2f}' for x in idle['flexible']):>11} "
                  f"{'/'.join(f'{x:.2f}' for x in idle['flexible-zb']):>11} "
                  f"{simulated['flexible']:>7.3f}/{simulated['flexible-zb']:<8.3f} "
                  f"{inflight['flexible']:>4}/{inflight['flexible-zb']:<4} "
                  f"{saved['flexible']:>5.1f}/{saved['flexible-zb']:<5.1f} {'yes' if not differ else 'NO':>9}",
                  flush=True)
            print(f"       with the measured per-stage costs: simulated idle flexible {simulated_measured['flexible']:.3f}"
                  f", zb {simulated_measured['flexible-zb']:.3f}, step zb / flexible {simulated_step_ratio:.3f}; "
                  f"zb's B + W over flexible's backward per stage "
                  f"{' '.join(f'{x:.2f}' for x in split_cost)}", flush=True)
            if args.png_dir and v == 2 and m == 2 * p:
                figures["png"] = zb_timelines(times, v, m, k, args.png_dir)
    return figures


def measured_stage_costs(rounds, p, v):
    """Per virtual stage (chunk * p + rank), the median seconds of each step kind the executor ran over every
    round: (forward, backward) for the flexible schedule, (forward, B, W) for flexible-zb (B 0 where the stage's
    input needs no gradient: its W is the whole backward), what ``simulate(stage_times=...)`` takes."""
    medians = harness.span_medians(rounds, p)
    split = any(op == "W" for _, op in medians)
    costs = []
    for stage in range(p * v):
        forward = medians[(stage, "F")]
        if split:
            costs.append((forward, medians.get((stage, "B"), 0.0), medians.get((stage, "W"), 0.0)))
        else:
            costs.append((forward, medians[(stage, "B")]))
    return costs


def zb_timelines(times, v, m, k, png_dir):
    """Measured timelines (the executor's spans) of the last round of each contender, as PNGs; their paths."""
    from measured_timeline import timeline

    from l3plugin.schedule.timeline import render_png

    paths = {}
    Path(png_dir).mkdir(parents=True, exist_ok=True)
    for schedule in ZB_CONTENDERS:
        ranks = sorted(times[schedule][-1], key=lambda r: r["rank"])
        per_rank = [[{"rank": r["rank"], "op": op, "microbatch": mb, "chunk": c, "start": s, "end": e}
                     for op, mb, c, s, e in r["actions"]] for r in ranks]
        path = paths[schedule] = str(Path(png_dir) / f"measured_{schedule}_p{ZB_P}_v{v}_m{m}_k{k}.png")
        measured = timeline(zb_plan(schedule, v, m, k), per_rank)
        weights = [a.end - a.start for a in measured.actions if a.op == "W"]
        if weights:  # the legend names W steps when the result has a weight time
            measured = dataclasses.replace(measured, weight_time=statistics.median(weights))
        render_png(measured, path)
        print(f"  measured timeline ({schedule}, v {v}, m {m}): {path}")
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-real", action="store_true", help="skip the multi-process CPU run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=None, help="toy model width (default 512)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 128; on a wire 256)")
    parser.add_argument("--vpp", type=int, nargs="+", default=[2, 3, 4], help="on a wire: virtual stages")
    parser.add_argument("--microbatches", type=int, default=8, help="on a wire: m")
    parser.add_argument("--layers", type=int, default=24, help="on a wire: toy model layers (divisible by 2 x vpp)")
    parser.add_argument("--mbs", type=int, default=2, help="on a wire: micro-batch size")
    parser.add_argument("--rounds", type=int, default=3, help="on a wire: timed rounds after a warm-up round")
    parser.add_argument("--agreed-order", action="store_true", help="on a wire: also flexible k = p and 1.5p "
                        "posting receives in the agreed pair order (the executor before early receives)")
    parser.add_argument("--send-share", type=float, default=0.25, help="--wire auto: the share of the smallest "
                        "chunk's forward that one activation send alone should take")
    parser.add_argument("--zero-bubble", action="store_true", help="2 ranks: flexible vs flexible-zb (pp 2, k = p, "
                        "v 1 and 2, m p..4p; --layers, --hidden, --seq, --mbs, --rounds apply; a --wire if given)")
    parser.add_argument("--png-dir", default=None, help="--zero-bubble: write measured timelines (v 2, m 2p) here")
    parser.add_argument("--zb-vpp", type=int, nargs="+", default=[1, 2], choices=(1, 2),
                        help="--zero-bubble: the virtual stages to run")
    import wire

    wire.add_argument(parser)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    args.hidden, args.seq = args.hidden or 512, args.seq or (128 if args.wire == "off" else 256)
    for v in args.zb_vpp if args.zero_bubble else args.vpp:
        if (v < 2 and not args.zero_bubble) or args.layers % (WIRE_P * v):
            parser.error(f"--vpp {v}: needs vpp >= 2 and --layers ({args.layers}) divisible by 2 x vpp")
    link = harness.enter_wire(args.wire, "float32", args.wire_mode)
    with harness.json_output(args.json, "pp_schedule", argv) as figures:
        if args.zero_bubble:
            from l3plugin.ranks.pool import RankPool

            if link.on and args.wire == "auto":
                parser.error("--zero-bubble takes a --wire rate or preset, not auto")
            options = link.pool_options(2) if link.on else {}
            with RankPool(2, preload=("megatron.core",), **options) as pool:
                figures["zero_bubble"] = zb_run(pool, args)
                if link.on:
                    harness.report_wire_traffic(link, figures["zero_bubble"])
            return 0
        if link.on:
            from l3plugin.ranks.pool import RankPool

            with RankPool(2, preload=("megatron.core",), **link.pool_options(2)) as pool:
                figures["wire"] = wire_run(pool, link, args)
                harness.report_wire_traffic(link, figures["wire"])
            return 0
        latencies = (0.0, 0.1)
        print("== Paper settings (p = 16) ==")
        figures["paper_settings"] = simulation_table([(16, v, m) for v in (2, 4, 8) for m in (16, 32, 48)],
                                                     latencies)
        print("== Small settings (p = 4) ==")
        figures["small_settings"] = simulation_table([(4, 2, m) for m in (4, 6, 8, 9, 12)] + [(4, 3, 10)],
                                                     latencies)
        print(f"== Receive posting on a wire (simulated: pp {WIRE_P}, m {args.microbatches}) ==")
        figures["posting_simulated"] = {f"vpp {v}": {f"{share:g}": simulated_wire(v, args.microbatches, share, True)
                                                     for share in POSTING_SHARES} for v in (2, 3, 4)}
        if not args.no_real:
            figures["real"] = real_run(args.steps, args.hidden, args.seq, mbs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
