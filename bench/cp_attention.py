"""All-gather CP attention on this CPU: kernel work-proportionality, cp=2 against a fair cp=1, the two CP
layouts, and a ring-attention baseline (written for this benchmark) on the same inputs.

    .venv/bin/python bench/cp_attention.py                  # timed S = 2048, 4096, 8192 (a few minutes)
    .venv/bin/python bench/cp_attention.py --seq 4096 --rounds 3
    .venv/bin/python bench/cp_attention.py --wire auto      # on an emulated wire, S = 8K/16K/32K (~50 min)
    .venv/bin/python bench/cp_attention.py --wire auto --seq 8192 16384 --rounds 2 --work-seq   # ~12 min

Prints tables, asserts nothing; --json: every figure as JSON on stdout, the tables on stderr (bench/harness.py,
which also holds the rounds, the ratios and the wire calibration). fp32, one packed sequence, heads_q=8, heads_kv=2 (GQA), head_dim=64,
forward + backward, kernel "cpu-flash" (torch's CPU flash-attention ops, the CPU default).

Work tables (analytic, "simulated from work counts", nothing timed): attention work per CP rank is the
number of query-key pairs inside the causal document mask; Llama-like documents have log-normal lengths
(median ~600 tokens). For the paper's "2cp" layout and the document-"balanced" one, max/min work over
ranks and the speedup it allows (total work / busiest rank) at cp 2, 4, 8 and S = 8K..128K.
Then the same for torch 2.13's own all-gather CP load balancers (head-tail, per-document head-tail, PTRR) beside
both layouts on the same documents, lengths rounded to multiples of 2cp (bench/torch_cp.py).
``--torch-flex`` (``only``: nothing else timed): torch's all-gather CP itself (compiled FlexAttention, its block
mask and balancers) against l3plugin's attention on 2 gloo ranks, forward only (no CPU FlexAttention backward in
torch 2.13), outputs against fp64 (bench/torch_cp.py).

Timed table: 2 gloo ranks on this 2-core CPU, one thread each. Contenders per S, interleaved (every round
runs each once, the order rotating between rounds; the first round is a warm-up) and summarised by the
median over rounds of per-round ratios:
- cp=1 (fair baseline): the same kernel on the whole sequence, run by both ranks at once (one core
  each, so the machine is loaded as under cp=2), non-causal, causal and documents;
- cp=2 all-gather: causal, and documents with the "2cp" and "balanced" layouts;
- cp=2 ring (2cp layout, causal and documents): K/V (and in the backward dK/dV) travel the ring while
  each rank attends its queries to the visiting chunks with torch's CPU flash ops, merging partial
  results by log-sum-exp; P2P is posted before the compute so it overlaps (a chunk's dK/dV accumulator
  starts at the next rank, is waited one step late and goes home: cp-1 hops, the last one exposed; the
  ring keeps only local K/V, so the backward sends them again). For fairness it computes the
  same work-proportional pieces as the all-gather kernel (l3plugin.cp.kernels.query_blocks) cut to
  each visiting chunk, so it skips fully masked key blocks too, and stacks GQA query heads as the
  kernel does (l3plugin.cp.kernels.pack_heads).
On a wire (``--wire RATE|PRESET|auto``, bench/wire.py: by default each rank on its own full-duplex link at
RATE each way, ``--wire-mode shared`` one loopback bus for both; traffic costs wall time and little CPU, as on
GPUs): cp=2 only,
all-gather with the "2cp" and "balanced" layouts, each "plain" (overlap=False: one K/V all-gather and
one dK/dV reduce-scatter, waited at once) and "overlapped" (the default, cp/overlap.py), against the
ring; with the 2cp layout also "overlapped local-first" (local_first=True: each range's own keys attended
while the other rank's K/V arrive, merged by log-sum-exp), and stacks of ``--layers`` calls (4) for what
cp_kv costs: "overlapped keep xN", "overlapped regather xN" (only the local K/V kept for the backward, which
gathers them again: prefetch=False) and "overlapped regather ahead xN" (the default, prefetch=True: each
call's gather travels during the backward of the call after it). Every single-call contender keeps the
K/V (cp_kv="keep"). The correctness checks and the warm-up run at the first S only. ``auto`` picks the rate at which
the K/V all-gather alone takes ``--kv-share`` (0.2) of cp=2 causal attention at the smallest S, from
two measurements, and prints them. Printed per S: the K/V all-gather and the dK/dV reduce-scatter alone
at that rate (wall and CPU), per contender wall, busy, CPU-busy (both ranks' CPU seconds / (2 cores x
wall)) and the all-gather's share of its step, and the medians of per-round ratios (with their range).
"wall" is the step's elapsed time (cp=2: the slowest rank's; ranks wait for each other), "busy" a rank's
process CPU time in it (time blocked in a collective is not busy). Other processes on the machine
stretch wall times but hardly CPU times, so every ratio is printed for both; cp=2 "busy" speedups
leave out the communication that wall times include. For cp=1 both ranks' times are averaged.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import harness  # noqa: E402
import ring_attention  # noqa: E402
import torch_cp  # noqa: E402

from l3plugin.cp.layout import imbalance, make_layout, rank_work  # noqa: E402
from l3plugin.cp.sharding import shard_indices  # noqa: E402

HQ, HKV, D = 8, 2, 64
KERNEL = "cpu-flash"


def load():
    return "load average %.1f %.1f %.1f" % os.getloadavg()


def document_lengths(seq_len, gen):
    cu, pos = [0], 0
    while pos < seq_len:
        n = int(torch.empty(1).log_normal_(6.4, 1.0, generator=gen).clamp(min=16))
        pos = min(seq_len, pos + n)
        cu.append(pos)
    return cu


def pairs(cu, causal=True):
    """Query-key pairs inside the (causal) document mask of the whole sequence."""
    lengths = torch.diff(torch.tensor(cu))
    return int((lengths * (lengths + 1) // 2).sum()) if causal else int((lengths ** 2).sum())


# ---- analytic work ---------------------------------------------------------------------------------
def work_table(seqs, draws):
    """Print the table; return its rows."""
    rows = []
    print(f"== Attention work per CP rank, Llama-like documents, {draws} draws per row "
          f"(simulated from work counts) ==")
    print(f"{'S':>7} {'cp':>3} | {'2cp max/min mean, worst':>24} {'speedup':>8} | "
          f"{'balanced max/min mean, worst':>29} {'speedup':>8}")
    for s in seqs:
        for cp in (2, 4, 8):
            gen = torch.Generator().manual_seed(s + cp)
            stats = {"2cp": ([], []), "balanced": ([], [])}
            for _ in range(draws):
                cu = document_lengths(s, gen)
                for name, (ratios, speedups) in stats.items():
                    work = rank_work(make_layout(name, s, cp, cu), cu)
                    ratios.append(imbalance(work))
                    speedups.append(sum(work) / max(work))
            cells = [f"{statistics.mean(r):>16.3f}, {max(r):>6.3f} {statistics.mean(p):>8.2f}"
                     for r, p in stats.values()]
            rows.append({"seq": s, "cp": cp, **{layout: {"max_over_min_mean": statistics.mean(r),
                                                         "max_over_min_worst": max(r),
                                                         "speedup_mean": statistics.mean(p)}
                                                for layout, (r, p) in stats.items()}})
            print(f"{s:>7} {cp:>3} | {cells[0]} | {cells[1]:>38}")
    print("speedup: total work / busiest rank's work (cp is the ideal). Causal, one document: both layouts "
          "max/min 1.000.\n")
    return rows


# ---- rank functions (run on every rank of the pool) ----------------------------------------------------
def _inputs(seq_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, HQ, D, generator=gen)
    k = torch.randn(seq_len, HKV, D, generator=gen)
    v = torch.randn(seq_len, HKV, D, generator=gen)
    g = torch.randn(seq_len, HQ, D, generator=gen)
    return q, k, v, g


def _timed(step, keep):
    """wall: this rank's own time from the opening barrier; busy: its CPU seconds (harness.barrier_timed)."""
    timing, result = harness.barrier_timed(step)
    out = {"wall": timing["own"], "busy": timing["busy"]}
    if keep:
        out["out"], out["grads"] = result
    return out


def all_gather_run(seq_len, cp, cu, causal, layout, overlap=True, cp_kv="keep", local_first=False, prefetch=True,
                   layers=1, keep=False):
    """One step of ``layers`` attention calls, each one's output the next one's queries (K/V its own: the
    leaves times the layer number), forward then backward."""
    import torch.distributed as dist

    from l3plugin.cp.attention import all_gather_attention

    group = dist.group.WORLD if cp > 1 else None
    idx = shard_indices(seq_len, cp, dist.get_rank() if cp > 1 else 0, layout, cu)
    q, k, v, g = (t[idx] for t in _inputs(seq_len))

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = leaves[0]
        for layer in range(layers):
            out = all_gather_attention(out, leaves[1] * (1 + layer), leaves[2] * (1 + layer), torch.tensor(cu),
                                       group=group, causal=causal, kernel=KERNEL, layout=layout, overlap=overlap,
                                       cp_kv=cp_kv, local_first=local_first, prefetch=prefetch)
        out.backward(g)
        return out.detach(), [t.grad for t in leaves]

    return _timed(step, keep)


def ring_run(seq_len, cp, cu, keep=False):
    """Causal ring attention over the 2cp layout (bench/ring_attention.py; see the module docstring)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    q, k, v, g = (t[shard_indices(seq_len, cp, rank)] for t in _inputs(seq_len))
    return _timed(ring_attention.ring_step(q, k, v, g, cu, seq_len, cp, rank), keep)


# ---- timed table ------------------------------------------------------------------------------------
def contenders(s, cu_docs):
    """name -> (rank function, args)."""
    causal = [0, s]
    return {
        "cp1 non-causal": (all_gather_run, (s, 1, causal, False, "2cp")),
        "cp1 causal": (all_gather_run, (s, 1, causal, True, "2cp")),
        "cp1 docs": (all_gather_run, (s, 1, cu_docs, True, "2cp")),
        "cp2 causal": (all_gather_run, (s, 2, causal, True, "2cp")),
        "cp2 docs 2cp": (all_gather_run, (s, 2, cu_docs, True, "2cp")),
        "cp2 docs balanced": (all_gather_run, (s, 2, cu_docs, True, "balanced")),
        "ring causal": (ring_run, (s, 2, causal)),
        "ring docs": (ring_run, (s, 2, cu_docs)),
    }


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip([a["out"]] + a["grads"], [b["out"]] + b["grads"]))


def timed_rows(pool, runs, rounds, checks, warm_up=True):
    """Interleaved rounds of ``runs`` (name -> (rank function, args)); ``checks``: name pairs whose outputs
    and gradients are compared first (also a warm-up). ``warm_up``: one more round first, not counted.
    Returns (times, {pair: max abs difference})."""
    names = list(runs)
    kept = {n: pool.run(runs[n][0], *runs[n][1], keep=True, timeout=3600) for n in dict.fromkeys(sum(checks, ()))}
    diff = {(x, y): max(max_diff(a, b) for a, b in zip(kept[x], kept[y])) for x, y in checks}
    del kept
    times = harness.interleaved_rounds(names, lambda n: pool.run(runs[n][0], *runs[n][1], timeout=3600), rounds,
                                       warmup=int(warm_up))  # per round: [per-rank {"wall", "busy"}]
    return times, diff


def report(s, cu_docs, times, diff):
    """Print the timed table of one S; return its figures."""
    def per_round(name, key):  # cp1: both ranks run the whole sequence (their mean); cp2: the slowest rank
        pick = statistics.mean if name.startswith("cp1") else max
        return [pick(rank[key] for rank in ranks) for ranks in times[name]]

    def ratio(a, b, key):  # median over rounds of per-round ratios
        return harness.ratio_stats(per_round(a, key), per_round(b, key))["median"]

    ratios = {}

    def both(a, b, scale=1.0):
        pair = ratios[f"{a} / {b}" + (f" / {scale:.3f}" if scale != 1.0 else "")] = {
            "wall": ratio(a, b, "wall") / scale, "busy": ratio(a, b, "busy") / scale}
        return f"wall {pair['wall']:>6.3f}  busy {pair['busy']:>6.3f}"

    pair_ratio = pairs(cu_docs) / pairs([0, s])
    figures = {"seq": s, "load_average": os.getloadavg()[0], "documents": len(cu_docs) - 1,
               "pairs_of_causal": pair_ratio, "contenders": {}, "ratios": ratios,
               "ring_vs_all_gather_max_abs_difference": max(diff.values()), "work_max_over_min": {}}
    print(f"S={s}  ({load()}; documents: {len(cu_docs) - 1}, pairs {pair_ratio:.3f} of causal)")
    for n in times:
        busy = [statistics.median(ranks[r]["busy"] for ranks in times[n]) for r in range(2)]
        figures["contenders"][n] = {"wall_s": statistics.median(per_round(n, "wall")), "busy_s": busy}
        print(f"  {n:<18} wall {statistics.median(per_round(n, 'wall')):>7.3f} s   busy rank0 {busy[0]:>7.3f} s"
              f"  rank1 {busy[1]:>7.3f} s")
    print(f"  causal / non-causal (cp1):          {both('cp1 causal', 'cp1 non-causal')}"
          f"   (pairs {pairs([0, s]) / pairs([0, s], False):.3f}; target <= 0.6)")
    print(f"  docs / causal (cp1):                {both('cp1 docs', 'cp1 causal')}   (pairs {pair_ratio:.3f})")
    print(f"    / pair ratio:                     {both('cp1 docs', 'cp1 causal', pair_ratio)}   (target <= 1.5)")
    for mask, ag in (("causal", "cp2 causal"), ("docs", "cp2 docs 2cp")):
        print(f"  ring / all-gather, {mask:<7} (cp2):   {both('ring ' + mask, ag)}   (target >= 1.0)")
    above = []
    for label, one, two, layout, cu in (("causal", "cp1 causal", "cp2 causal", "2cp", [0, s]),
                                        ("docs 2cp", "cp1 docs", "cp2 docs 2cp", "2cp", cu_docs),
                                        ("docs balanced", "cp1 docs", "cp2 docs balanced", "balanced", cu_docs)):
        work = rank_work(make_layout(layout, s, 2, cu), cu)
        figures["work_max_over_min"][label] = imbalance(work)
        if max(ratio(one, two, "wall"), ratio(one, two, "busy")) > 2.0:
            above.append(one)
        print(f"  cp2 speedup, {label + ':':<23}{both(one, two)}   (work max/min {imbalance(work):.3f}, "
              f"ideal {sum(work) / max(work):.2f}; target >= 1.8)")
    print(f"  balanced / 2cp, docs (cp2):         {both('cp2 docs balanced', 'cp2 docs 2cp')}")
    print(f"  ring vs all-gather max abs difference (out and grads): {max(diff.values()):.1e}")
    if above:
        # Both cp=1 ranks run the same work: how far apart they are is the noise of one measurement.
        spread = max(abs(ranks[0]["busy"] / ranks[1]["busy"] - 1) for n in above for ranks in times[n])
        figures["cp1_rank_spread"] = spread
        print(f"  note: a speedup above 2.0 is more than 2 cores give for the same attention calls; this row's "
              f"noise: the two cp=1 ranks, doing identical work, differ by up to {100 * spread:.0f}% (busy)")
    return figures

# ---- on the emulated wire ---------------------------------------------------------------------------

def stack_names(name, layers):
    """The contenders of a stack of ``layers`` calls: K/V kept, regathered in each backward, regathered ahead."""
    return {kind: f"{name} overlapped {kind} x{layers}" for kind in ("keep", "regather", "regather ahead")}


def wire_contenders(s, cu_docs, masks, layers):
    """name -> (rank function, args): cp=2 all-gather (both layouts for documents), each with its
    communication waited at once ("plain", overlap=False) and overlapped (cp/overlap.py), the 2cp layout also
    overlapped with local_first, and the ring; for the 2cp layout, stacks of ``layers`` calls with cp_kv keep,
    regather (prefetch=False) and regather ahead (prefetch=True, the default)."""
    runs = {}
    for mask, cu, layouts in (("causal", [0, s], ["2cp"]), ("docs", cu_docs, ["2cp", "balanced"])):
        if mask not in masks:
            continue
        for layout in layouts:
            name = f"all-gather {mask}" + (f" {layout}" if mask == "docs" else "")
            runs[name + " plain"] = (all_gather_run, (s, 2, cu, True, layout, False))
            runs[name + " overlapped"] = (all_gather_run, (s, 2, cu, True, layout, True))
            if layout == "2cp":
                runs[name + " overlapped local-first"] = (all_gather_run, (s, 2, cu, True, layout, True, "keep", True))
                # what keeping only the local K/V costs: each backward gathers them again, or ahead
                stack = stack_names(name, layers)
                for kind, cp_kv, prefetch in (("keep", "keep", False), ("regather", "regather", False),
                                              ("regather ahead", "regather", True)):
                    runs[stack[kind]] = (all_gather_run, (s, 2, cu, True, layout, True, cp_kv, False, prefetch,
                                                          layers))
        runs[f"ring {mask}"] = (ring_run, (s, 2, cu))
    return runs


def kv_collectives_alone(seq_len):
    """Wall and CPU seconds of the K/V all-gather and the dK/dV reduce-scatter of cp=2 attention at S,
    alone (the calls all_gather_attention makes: l3plugin/collective/comm.py). Run on every rank."""
    import torch.distributed as dist

    from l3plugin.collective import comm
    import wire

    group = dist.group.WORLD
    local = torch.randn(2, seq_len // 2, HKV, D)  # K and V of this rank's S/2 tokens
    grads = torch.randn(2 * local.numel())  # dK/dV of the whole sequence, rank-major
    ops = {"K/V all-gather": lambda: comm.start_all_gather(local, group).wait(),
           "dK/dV reduce-scatter": lambda: comm.start_reduce_scatter_sum(grads, group, grads.dtype).wait()}
    return wire.time_collectives_alone(local.numel(), ops=ops)


def kv_alone(pool, seq_len):
    """(all-gather wall seconds of the slower rank, printable lines) for S."""
    import wire

    results = pool.run(kv_collectives_alone, seq_len, timeout=600)
    gather = max(r["K/V all-gather"][0] for r in results)
    return gather, wire.collectives_alone_text(results, 2 * (seq_len // 2) * HKV * D)


def pick_rate(pool, link, seq_len, share):
    """--wire auto: the rate at which the K/V all-gather alone takes ``share`` of cp=2 causal attention
    (fwd+bwd, unshaped) at S=seq_len. A tbf transfer costs CPU time plus bytes / rate, so two measurements
    (unshaped and at the probe rate) give the rate; it is measured again after. Returns (why, printable;
    the figures)."""
    import wire

    def target():  # attention fwd+bwd on the unshaped wire, the second of two runs
        return share * [max(r["wall"] for r in pool.run(all_gather_run, seq_len, 2, [0, seq_len], True, "2cp",
                                                          False, timeout=3600)) for _ in range(2)][-1]

    picked = harness.calibrate_wire(link, lambda: kv_alone(pool, seq_len)[0], target)
    attention, unshaped, probed = picked["target"] / share, picked["unshaped"], picked["probed"]
    probe, rate = picked["probe_rate"], picked["rate"]
    now = picked["all_gather_at_rate_s"] = kv_alone(pool, seq_len)[0]
    return (f"rate picked so that the K/V all-gather alone takes {share:.0%} of cp=2 causal attention "
            f"(fwd+bwd) at S={seq_len}: attention {attention:.2f} s unshaped; the all-gather alone "
            f"{1000 * unshaped:.0f} ms unshaped, {1000 * probed:.0f} ms at {wire.rate_text(probe)} -> "
            f"{wire.rate_text(rate)}, where it takes {1000 * now:.0f} ms ({now / attention:.1%}). The all-gather "
            f"is O(S), causal attention O(S^2): at 2S its share halves. Under documents attention is "
            f"O(S x document length): its share stays about the same with S."), picked


def wire_report(s, cu_docs, times, diff, gather_alone):
    """Print the wire table of one S; return its figures."""
    def per_round(name, key):  # the slowest rank (ranks wait for each other)
        return [max(rank[key] for rank in ranks) for ranks in times[name]]

    def busy_share(name):  # process CPU seconds of both ranks / (2 cores x wall), per round
        return [sum(rank["busy"] for rank in ranks) / (2 * max(rank["wall"] for rank in ranks))
                for ranks in times[name]]

    ratios = {}

    def ratio(a, b):  # median over rounds of per-round ratios, and their range
        stats = ratios[f"{a} / {b}"] = harness.ratio_stats(per_round(a, "wall"), per_round(b, "wall"))
        return harness.ratio_text(stats)

    pair_ratio = pairs(cu_docs) / pairs([0, s])
    figures = {"seq": s, "load_average": os.getloadavg()[0], "documents": len(cu_docs) - 1,
               "pairs_of_causal": pair_ratio, "all_gather_alone_s": gather_alone, "contenders": {},
               "wall_ratios": ratios, "max_abs_difference": {f"{a} vs {b}": d for (a, b), d in diff.items()}}
    print(f"S={s}  ({load()}; documents: {len(cu_docs) - 1}, pairs {pair_ratio:.3f} of causal)")
    print(f"  {'contender':<48} {'wall s':>7} {'busy r0 s':>9} {'busy r1 s':>9} {'CPU-busy':>8} "
          f"{'all-gather alone / wall':>23}")
    for n in times:
        wall = statistics.median(per_round(n, "wall"))
        busy = [statistics.median(ranks[r]["busy"] for ranks in times[n]) for r in range(2)]
        figures["contenders"][n] = {"wall_s": wall, "busy_s": busy, "cpu_busy": statistics.median(busy_share(n))}
        print(f"  {n:<48} {wall:>7.3f} {busy[0]:>9.3f} {busy[1]:>9.3f} {statistics.median(busy_share(n)):>8.2f} "
              f"{gather_alone / wall:>23.1%}")
    single = [n for n in times if n.startswith("all-gather") and " x" not in n]  # one call per step
    for ag in single:
        ring = "ring " + ag.split()[1]
        print(f"  {ring + ' / ' + ag + ':':<60} {ratio(ring, ag)}   (above 1: the all-gather is faster)")
    for ag in [n for n in times if n.endswith(" overlapped")]:
        plain = ag.replace(" overlapped", " plain")
        print(f"  {ag + ' / plain:':<60} {ratio(ag, plain)}   (below 1: overlapping helps)")
    for ag in [n for n in times if n.endswith(" local-first")]:
        over = ag.replace(" local-first", "")
        print(f"  {ag + ' / overlapped:':<60} {ratio(ag, over)}   (below 1: attending own keys first helps)")
    for keep in [n for n in times if " overlapped keep x" in n]:
        for kind in ("regather", "regather ahead"):
            other = keep.replace(" keep x", f" {kind} x")
            print(f"  {other + ' / keep:':<60} {ratio(other, keep)}   (above 1: what gathering again costs)")
    for (a, b), d in diff.items():
        print(f"  max abs difference (out and grads), {a} vs {b}: {d:.1e}")
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="*", help="timed sizes (default 2048 4096 8192; on a wire "
                        "8192 16384 32768)")
    parser.add_argument("--work-seq", type=int, nargs="*", default=[8192, 16384, 32768, 65536, 131072],
                        help="sizes of the analytic work table (none: skip it)")
    parser.add_argument("--draws", type=int, default=20, help="document draws per work-table row")
    parser.add_argument("--rounds", type=int, help="timed rounds after one warm-up round (default 5; on a "
                        "wire 3)")
    parser.add_argument("--masks", nargs="+", choices=("causal", "docs"), default=["causal", "docs"],
                        help="on a wire: which masks to time (causal at S=32K is most of the run time)")
    parser.add_argument("--kv-share", type=float, default=0.2, help="--wire auto: the share of cp=2 causal "
                        "attention time the K/V all-gather alone should take at the smallest S")
    parser.add_argument("--torch-flex", nargs="?", const="with", choices=("with", "only"),
                        help="also (or, with 'only', just) time torch 2.13's own all-gather CP (FlexAttention, its load "
                        "balancers) beside l3plugin's, forward only, at --seq, on loopback (bench/torch_cp.py; builds "
                        "a block mask and a compiled kernel per S and balancer: minutes)")
    parser.add_argument("--layers", type=int, default=4, help="on a wire: attention calls per step of the "
                        "keep / regather / regather ahead contenders (regather ahead gathers a call's K/V during "
                        "the backward of the call after it)")
    import wire

    wire.add_argument(parser)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers={args.layers} is invalid: must be at least 1")
    on_wire = args.wire != "off"
    if args.torch_flex and on_wire:
        parser.error("--torch-flex times on loopback only (no --wire)")
    args.seq = args.seq or ([8192, 16384, 32768] if on_wire else [2048, 4096, 8192])
    args.rounds = args.rounds or (3 if on_wire else 5)
    link = harness.enter_wire(args.wire, "float32", args.wire_mode)
    with harness.json_output(args.json, "cp_attention", argv) as figures:
        figures.update(heads_q=HQ, heads_kv=HKV, head_dim=D, kernel=KERNEL, rounds=args.rounds)
        print(f"{load()} at start ({os.cpu_count()} CPUs)\n")
        if args.work_seq:
            figures["work"] = work_table(args.work_seq, args.draws)
            figures["torch_work"] = torch_cp.work_table(args.work_seq, args.draws, document_lengths)
        timed(args, link, on_wire, figures)
    return 0


def timed(args, link, on_wire, figures):
    """The timed tables (on loopback or on the wire); figures["timed"]: one entry per S."""
    from l3plugin.ranks.pool import RankPool

    began = time.perf_counter()
    print(f"== Timed, fwd+bwd, fp32, kernel {KERNEL}: 2 gloo ranks on this CPU, cp 4 and 8 only simulated "
          f"above; median of {args.rounds} interleaved rounds ==")
    print(link.describe(), flush=True)
    figures["timed"] = []
    with RankPool(2, **link.pool_options(2)) as pool:
        if args.wire == "auto":
            why, figures["calibration"] = pick_rate(pool, link, min(args.seq), args.kv_share)
            print("  " + why, flush=True)
        figures["rate_bits"], figures["wire_mode"], figures["layers"] = link.rate, link.mode, args.layers
        if args.torch_flex:
            figures["torch_flex"] = torch_cp.timed_table(pool, args.seq, args.rounds, _inputs, document_lengths, KERNEL)
        for s in args.seq if args.torch_flex != "only" else ():
            cu_docs = document_lengths(s, torch.Generator().manual_seed(s))
            if not on_wire:
                checks = (("cp2 causal", "ring causal"), ("cp2 docs 2cp", "ring docs"))
                figures["timed"].append(report(s, cu_docs, *timed_rows(pool, contenders(s, cu_docs), args.rounds,
                                                                       checks)))
                continue
            gather, lines = kv_alone(pool, s)
            print(f"S={s}, K/V of {s // 2} tokens per rank, {HKV} heads of {D}, fp32:\n{lines}", flush=True)
            checks = []  # at the first S only (each check is a run more); they warm every kind of contender up
            for m in ("causal", "docs 2cp") if s == args.seq[0] else ():
                if m.split()[0] in args.masks:
                    stack = stack_names(f"all-gather {m}", args.layers)
                    checks += [(f"all-gather {m} plain", f"all-gather {m} overlapped"),
                               (f"all-gather {m} overlapped", f"ring {m.split()[0]}"),
                               (f"all-gather {m} overlapped", f"all-gather {m} overlapped local-first"),
                               (stack["keep"], stack["regather"]), (stack["keep"], stack["regather ahead"])]
            figures["timed"].append(wire_report(s, cu_docs, *timed_rows(
                pool, wire_contenders(s, cu_docs, args.masks, args.layers), args.rounds, checks, warm_up=False),
                gather))
        harness.report_wire_traffic(link, figures)
    print(f"\n{load()} at the end; timed part {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
