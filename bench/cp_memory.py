"""What CP attention keeps for the backward, per layer: cp_kv "keep" against "regather", measured by a census
of the tensors autograd saves (l3plugin.debug.SavedTensorCensus, torch.autograd.graph.saved_tensors_hooks),
next to the planner's estimate of the same quantity.

    .venv/bin/python bench/cp_memory.py                        # cp 2 and 4, S = 4K..32K (~2 min)
    .venv/bin/python bench/cp_memory.py --cp 2 --seq 4096 --model llama3-70b --tp 8

Shapes: one TP rank of ``--model`` at ``--tp`` (llama3-405b at TP 8: 16 query heads, 1 K/V head, head
dim 128), bf16, micro-batch 1, one packed sequence of ``--doc-len``-token documents (they cross the CP
chunk borders), the default kernel and the overlapped path. On every CP rank: one attention call's
forward under the census, then the bytes its saved tensors hold (each storage once, read after the
forward, so a buffer freed in place counts as freed); the largest rank is printed. Memory, not time:
the figures do not depend on the machine's load.

Planner columns (l3plugin/planner/costs.py, LayoutCosts for the same model, TP, CP and S):
``attention_saved`` (Q, K, V, the attention output, fp32 softmax statistics per head, + the other ranks'
K/V with --cp-kv keep) and ``gathered_kv`` (what keep adds). Asserts nothing; prints the table; --json: every
figure as JSON on stdout (bench/harness.py), from which bench/docs_tables.py renders docs/cp.md's table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402

from l3plugin.planner.costs import Layout, LayoutCosts  # noqa: E402
from l3plugin.planner.machine import Hardware  # noqa: E402
from l3plugin.planner.models import load_model  # noqa: E402

MIB = 2**20


def saved_per_layer(seq_len, heads_q, heads_kv, head_dim, doc_len):
    """On every rank: {cp_kv: bytes the saved tensors of one attention call hold after its forward}."""
    import torch  # here, not at the top: the bench process itself needs no torch (the ranks have it loaded)
    import torch.distributed as dist

    from l3plugin.cp import CP_KV_MODES, all_gather_attention
    from l3plugin.debug.saved_tensors import SavedTensorCensus

    torch.set_num_threads(1)
    cp = dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    s_local = seq_len // cp
    cu = torch.tensor(list(range(0, seq_len, doc_len)) + [seq_len])
    held = {}
    for cp_kv in CP_KV_MODES:
        q, k, v = (torch.randn(s_local, h, head_dim, generator=gen).to(torch.bfloat16).requires_grad_()
                   for h in (heads_q, heads_kv, heads_kv))
        census = SavedTensorCensus()
        with census.hooks:
            # prefetch=False: what every call but the latest holds (with prefetch, the default, the latest call
            # keeps its whole gathered K/V until the next call's forward: one layer's more, not per layer)
            out = all_gather_attention(q, k, v, cu, group=dist.group.WORLD, cp_kv=cp_kv, prefetch=False)
        held[cp_kv] = census.held_bytes()
        del out  # the graph, and with it every saved tensor, goes: no backward needed to measure
    return held


def planner_estimate(model, tp, cp, seq_len):
    """The planner's per-layer attention_saved (regather, keep) and gathered_kv, in bytes."""
    def costs(cp_kv):
        layout = Layout(tp=tp, cp=cp, pp=1, dp=1, vpp=1, group_size=1, microbatches=1,
                        layers=(model.num_layers,), split="even")
        return LayoutCosts(model, layout, seq_len, 1, 8, Hardware(cp_kv=cp_kv))
    regather, keep = costs("regather"), costs("keep")
    return regather.attention_saved, keep.attention_saved, keep.gathered_kv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--model", default="llama3-405b", help="a planner preset or ModelSpec JSON")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=1500)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    if model.num_attention_heads % args.tp or model.num_kv_heads % args.tp:
        parser.error(f"--tp {args.tp} must divide the heads of {model.name} ({model.num_attention_heads} query, "
                     f"{model.num_kv_heads} K/V)")
    hq, hkv, d = model.num_attention_heads // args.tp, model.num_kv_heads // args.tp, model.head_dim
    with harness.json_output(args.json, "cp_memory", argv) as figures:
        figures.update(model=model.name, tp=args.tp, heads_q=hq, heads_kv=hkv, head_dim=d, doc_len=args.doc_len,
                       dtype="bfloat16", micro_batch=1, rows=[], skipped=[])
        table(args, model, hq, hkv, d, figures)


def table(args, model, hq, hkv, d, figures):
    """Measure and print every (cp, S) row; the figures go to ``figures`` (bytes)."""
    from l3plugin.ranks.pool import RankPool

    print(f"Saved for the backward by one CP attention layer, per GPU: {model.name} at TP {args.tp} "
          f"({hq} query heads, {hkv} K/V heads, head dim {d}), bf16, micro-batch 1, {args.doc_len}-token "
          f"documents. Measured: saved-tensor census after the forward (largest rank). MiB.")
    header = (f"{'cp':>3} {'S':>6} | {'keep':>8} {'regather':>8} {'saved':>8} | {'planner keep':>12} "
              f"{'regather':>8} {'gathered_kv':>11} | {'measured/planner':>16}")
    print(header)
    print("-" * len(header))
    for cp in args.cp:
        with RankPool(cp) as pool:
            for seq_len in args.seq:
                if seq_len % (2 * cp):
                    figures["skipped"].append({"cp": cp, "seq": seq_len,
                                               "why": f"S must be divisible by 2 x cp = {2 * cp}"})
                    print(f"{cp:>3} {seq_len:>6} | skipped: S must be divisible by 2 x cp = {2 * cp}")
                    continue
                ranks = pool.run(saved_per_layer, seq_len, hq, hkv, d, args.doc_len, timeout=1800)
                keep = max(r["keep"] for r in ranks)
                regather = max(r["regather"] for r in ranks)
                p_regather, p_keep, p_gathered = planner_estimate(model, args.tp, cp, seq_len)
                figures["rows"].append({"cp": cp, "seq": seq_len, "keep": keep, "regather": regather,
                                        "planner_keep": p_keep, "planner_regather": p_regather,
                                        "planner_gathered_kv": p_gathered})
                ratios = f"{keep / p_keep:.3f} / {regather / p_regather:.3f} / {(keep - regather) / p_gathered:.3f}"
                print(f"{cp:>3} {seq_len:>6} | {keep / MIB:>8.2f} {regather / MIB:>8.2f} {(keep - regather) / MIB:>8.2f} "
                      f"| {p_keep / MIB:>12.2f} {p_regather / MIB:>8.2f} {p_gathered / MIB:>11.2f} | {ratios:>16}")
    print("saved = keep - regather (what regathering frees per layer); measured/planner: keep / regather / saved")


if __name__ == "__main__":
    main()
