"""A transformers model under l3plugin's all-gather CP (the HF bridge, l3plugin/huggingface): step time and
saved-activation bytes of cp = 2 against cp = 1 on this CPU, S = 8K..32K.

    .venv/bin/python bench/hf_cp.py                          # S = 8K, 16K, 32K, 4 rounds (~10 min, idle machine)
    .venv/bin/python bench/hf_cp.py --seq 8192 --rounds 2    # ~1 min

Model: a tiny GQA Llama built from a config (2 layers, hidden 256, 8 query heads, 2 K/V heads, head dim 32,
MLP 512, vocab 512), fp32, one packed row of documents (log-normal lengths, median ~600 tokens, as
DataCollatorWithFlattening gives them: positions restarting per document), labels = inputs. A step is the
model's forward (its own loss) and backward; no optimizer (its cost does not depend on CP).

Contenders, on 2 gloo ranks (one thread each, the 2 cores):
- cp=1: each rank runs the whole row, the same l3plugin attention without a group (documents as cu_seqlens,
  no [S, S] mask; HF's SDPA would build one), so both cores are busy as under cp=2 and only CP differs;
- cp=2: the two ranks are one CP group ("balanced" layout, K/V regathered for the backward, the default):
  each holds S/2 tokens.
Rounds interleave the contenders (bench/harness.py: each round runs both, the order alternating; a warm-up
round of each first, not counted); the table gives each one's median step time (cp=1: the mean of its
ranks; cp=2: the slowest rank) and the median over rounds of the per-round ratio cp2 / cp1, of wall times and
of busy (CPU) times. Other processes on the machine stretch wall times: the load average is printed with the
figures.

Memory: one forward per contender under l3plugin.debug.SavedTensorCensus (torch's saved-tensor hooks):
"peak" is the most bytes autograd's saved tensors held at once during the forward, "held" what they hold
when it ends (what the backward needs); the largest rank. Not timed, independent of load. Asserts nothing.
--json: every figure as JSON on stdout, the table on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402

MIB = 2**20
_MODELS = {}  # per worker: cp -> the model with CP enabled (built once, reused by every round)


def _model(cp):
    import torch  # in the functions the ranks run: the bench process itself needs no torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from l3plugin.huggingface import enable_context_parallel

    if cp not in _MODELS:
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                             use_cache=False)
        torch.manual_seed(0)
        _MODELS[cp] = enable_context_parallel(LlamaForCausalLM(config), dist.group.WORLD if cp > 1 else None,
                                              "balanced")
    return _MODELS[cp]


def packed_row(seq_len, seed=0):
    """input_ids and position_ids [1, S]: documents of log-normal length (median ~600 tokens), positions
    restarting at 0 per document (HF's packed convention)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_len:
        n = max(16, int(torch.empty(1).log_normal_(6.4, 0.9, generator=g)))
        n = min(n, seq_len - total)
        lengths.append(n)
        total += n
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, 512, (1, seq_len), generator=g)
    return ids, positions, len(lengths)


def step(cp, seq_len, census=False):
    """One forward + backward on this rank: {"wall", "busy"} seconds (wall: this rank's own, from a barrier;
    busy: this process's CPU time, which other processes on the machine hardly stretch; time blocked in a
    collective is not busy) or, with census, the saved-tensor bytes and the row's documents."""
    import torch

    from l3plugin.debug.saved_tensors import SavedTensorCensus

    torch.set_num_threads(1)
    model = _model(cp)
    ids, positions, documents = packed_row(seq_len)
    model.zero_grad(set_to_none=True)
    if census:
        tally = SavedTensorCensus()
        with tally.hooks:
            loss = model(input_ids=ids, position_ids=positions, labels=ids).loss
        held, peak = tally.held_bytes(), tally.peak
        del loss
        return {"held": held, "peak": peak, "documents": documents}
    timing, _ = harness.barrier_timed(lambda: model(input_ids=ids, position_ids=positions, labels=ids).loss.backward())
    return {"wall": timing["own"], "busy": timing["busy"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--rounds", type=int, default=4)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    with harness.json_output(args.json, "hf_cp", argv) as figures:
        figures["rows"] = table(args)


def table(args):
    """Print the table; return its rows (seconds, bytes)."""
    from l3plugin.ranks.pool import RankPool

    rows = []
    print(f"transformers Llama (2 layers, hidden 256, 8 query / 2 K/V heads), fp32, one packed row, forward + "
          f"backward, 2 gloo ranks x 1 thread; load average at start {os.getloadavg()[0]:.2f}")
    header = (f"{'S':>6} {'docs':>5} | {'cp1 s':>7} {'cp2 s':>7} {'cp2/cp1':>8} {'(range)':>13} {'busy':>6} | "
              f"{'peak MiB cp1':>12} {'cp2':>7} {'ratio':>6} | {'held MiB cp1':>12} {'cp2':>7} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    # The model's modules imported once, in the pool's fork server, not in every rank (seconds each)
    with RankPool(2, preload=("transformers.models.llama.modeling_llama",)) as pool:
        for seq_len in args.seq:
            memory = {cp: pool.run(step, cp, seq_len, True, timeout=3600) for cp in (1, 2)}
            docs = memory[1][0]["documents"]
            runs = harness.interleaved_rounds((1, 2), lambda cp: pool.run(step, cp, seq_len, timeout=3600),
                                              args.rounds)  # a warm-up round first, not counted
            walls, busy = {}, {}
            for cp, results in runs.items():
                pick = statistics.mean if cp == 1 else max  # cp=1: ranks run alone; cp=2: they wait
                walls[cp] = [pick(r["wall"] for r in ranks) for ranks in results]
                busy[cp] = [pick(r["busy"] for r in ranks) for ranks in results]
            ratio = harness.ratio_stats(walls[2], walls[1])
            busy_ratio = harness.ratio_stats(busy[2], busy[1])["median"]
            peak = {cp: max(r["peak"] for r in memory[cp]) for cp in (1, 2)}
            held = {cp: max(r["held"] for r in memory[cp]) for cp in (1, 2)}
            rows.append({"seq": seq_len, "documents": docs, "step_s": {str(cp): statistics.median(walls[cp])
                                                                        for cp in (1, 2)},
                         "cp2_over_cp1": ratio, "busy_cp2_over_cp1": busy_ratio, "load_average": os.getloadavg()[0],
                         "peak_bytes": {str(cp): peak[cp] for cp in (1, 2)},
                         "held_bytes": {str(cp): held[cp] for cp in (1, 2)}})
            spread = f"{ratio['min']:.2f}..{ratio['max']:.2f}"
            print(f"{seq_len:>6} {docs:>5} | {statistics.median(walls[1]):>7.3f} {statistics.median(walls[2]):>7.3f} "
                  f"{ratio['median']:>8.3f} {spread:>13} {busy_ratio:>6.3f} | "
                  f"{peak[1] / MIB:>12.1f} {peak[2] / MIB:>7.1f} {peak[2] / peak[1]:>6.3f} | "
                  f"{held[1] / MIB:>12.1f} {held[2] / MIB:>7.1f} {held[2] / held[1]:>6.3f}", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}; cp2/cp1: median of per-round ratios of wall times (ideal "
          "0.5: half the tokens per rank), busy: the same for CPU times; memory: largest rank")
    return rows


if __name__ == "__main__":
    main()
