"""What variable sequence lengths cost the pipeline per step, against fixed lengths: messages, bytes, milliseconds.

    .venv/bin/python bench/pp_variable_lengths.py            # 2 gloo ranks (one per core), ~1 min
    .venv/bin/python bench/pp_variable_lengths.py --json     # every figure as JSON on stdout
    .venv/bin/python bench/pp_variable_lengths.py --wire 1gbit   # each rank its own 1 Gbit/s full-duplex link

The same model and the same micro-batches (all of one length, so the fixed-shape path is valid too), with
``config.variable_seq_lengths`` off and on: l3plugin's flexible schedule at pp=2, vpp 1 and 2, posting receives
early (gloo's) and in the agreed pair order (NCCL's), and Megatron-Core's stock 1F1B (vpp 1; the CPU shim of the
tests), whose variable-length path exchanges shapes before every message. Interleaved rounds (bench/harness.py:
the order rotating every round, a warm-up round first); per contender the step time (slowest rank, median), the
median of per-round ratios variable / fixed (range), and for the flexible schedule a census of what one rank sent
per step (PipelineChannels.waits: the tensors handed to isend) and its blocking in receives. Asserts nothing but
that variable and fixed gradients are identical. Without ``--wire`` on the shared loopback, where the cost is latency
and CPU; with ``--wire RATE`` (bench/wire.py, per-rank links by default) every byte also waits for the wire, so a
data receive posted late (after its header) would show as receive wait.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' toy pipeline and CPU shim

import harness  # noqa: E402  (bench/harness.py)

P, M = 2, 8
CONTENDERS = [  # (name, vpp, kind): kind "stock" or the flexible schedule's receive posting
    ("stock 1F1B v=1", 1, "stock"), ("flexible early v=1", 1, "early"), ("flexible agreed v=1", 1, "agreed"),
    ("flexible early v=2", 2, "early"), ("flexible agreed v=2", 2, "agreed")]


def _rank_rounds(rounds, layers, hidden, seq):
    """On every rank: interleaved rounds over (contender, fixed|variable); per run the wall time, the
    flexible executor's account and the gradients."""
    import functools

    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    import toy_pipeline as toy
    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh.groups import init_mesh
    from megatron_cpu_shim import stock_schedules_on_cpu

    torch.set_num_threads(1)
    current = {"vpp": None, "mesh": None}  # parallel_state is made again only when the contender's vpp changes
    batches = toy.make_microbatches(M, seq, 1, hidden)

    def run(key):
        name, variable = key
        _, v, kind = next(c for c in CONTENDERS if c[0] == name)
        if current["vpp"] != v:
            current.update(vpp=v, mesh=init_mesh(pp=P, vpp=v if v > 1 else None))
        mesh = current["mesh"]
        config = TransformerConfig(
            num_layers=layers, hidden_size=hidden, num_attention_heads=1, pipeline_model_parallel_size=P,
            virtual_pipeline_model_parallel_size=v if v > 1 else None, pipeline_dtype=torch.float32,
            microbatch_group_size_per_vp_stage=P, variable_seq_lengths=variable,
            moe_token_dispatcher_type="alltoall", batch_p2p_comm=False, deallocate_pipeline_outputs=kind != "stock")
        chunks = toy.build_chunks(config, num_layers=layers, hidden=hidden, pp_rank=mesh.coords["pp"], pp_size=P,
                                  vpp_size=v)
        waits = {}
        fn = get_forward_backward_func() if kind == "stock" else functools.partial(
            forward_backward_pipelining_flexible, receive_posting=kind, waits=waits)
        with stock_schedules_on_cpu():
            timing, _ = harness.barrier_timed(lambda: fn(
                forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks],
                model=chunks if v > 1 else chunks[0], num_microbatches=M, seq_length=seq, micro_batch_size=1),
                group=mesh.pp_group)
        grads = {lid: g[0] for c in chunks for lid, g in c.grads().items()}
        return {"wall": timing["wall"], "waits": waits, "grads": grads}

    keys = [(name, variable) for name, _, _ in CONTENDERS for variable in (False, True)]
    runs = harness.interleaved_rounds(keys, run, rounds)
    identical = all(torch.equal(a["grads"][lid], b["grads"][lid])
                    for name, _, _ in CONTENDERS for a, b in zip(runs[(name, False)], runs[(name, True)])
                    for lid in a["grads"])
    return {"runs": {f"{name}|{variable}": [{"wall": r["wall"], "waits": r["waits"]} for r in results]
                     for (name, variable), results in runs.items()}, "identical": identical}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8, help="layers of the toy model (pp x vpp must divide it)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256, help="tokens per micro-batch (every micro-batch)")
    import wire

    wire.add_argument(parser)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    from l3plugin.ranks.pool import RankPool

    link = harness.enter_wire(args.wire, "float32", args.wire_mode)
    with harness.json_output(args.json, "pp_variable_lengths", argv) as figures:
        where = link.describe() if link.on else "the shared loopback"
        print(f"pp={P}, m={M}, k=p, toy model: {args.layers} layers, hidden {args.hidden}, {args.seq} tokens per "
              f"micro-batch, 2 gloo ranks on {where}, {args.rounds} interleaved rounds")
        with RankPool(P, preload=("megatron.core",), **link.pool_options(P)) as pool:
            per_rank = pool.run(_rank_rounds, args.rounds, args.layers, args.hidden, args.seq, timeout=1800)
        harness.report_wire_traffic(link, figures)
        identical = all(r["identical"] for r in per_rank)
        print(f"{'contender':22} {'fixed ms':>9} {'variable ms':>12} {'variable/fixed':>20} {'msgs/step':>10} "
              f"{'bytes/step':>16} {'recv wait ms':>14}")
        for name, _, kind in CONTENDERS:
            walls = {variable: [max(r["runs"][f"{name}|{variable}"][i]["wall"] for r in per_rank)
                                for i in range(args.rounds)] for variable in (False, True)}
            stats = harness.ratio_stats(walls[True], walls[False])
            row = {"fixed_ms": statistics.median(walls[False]) * 1e3,
                   "variable_ms": statistics.median(walls[True]) * 1e3, "variable_over_fixed": stats}
            census = msgs = recv = ""
            if kind != "stock":  # rank 0's account (both ranks send the same number of messages at pp=2)
                acc = {variable: per_rank[0]["runs"][f"{name}|{variable}"][-1]["waits"] for variable in (False, True)}
                row.update({f"{'variable' if variable else 'fixed'}_{key}": acc[variable][key]
                            for variable in (False, True) for key in ("sent_messages", "sent_bytes")})
                row["recv_wait_ms"] = {str(variable): statistics.median(
                    r["runs"][f"{name}|{variable}"][i]["waits"]["recv_s"] * 1e3 for r in per_rank
                    for i in range(args.rounds)) for variable in (False, True)}
                msgs = f"{acc[False]['sent_messages']} -> {acc[True]['sent_messages']}"
                census = f"{acc[False]['sent_bytes']} -> {acc[True]['sent_bytes']}"
                recv = f"{row['recv_wait_ms']['False']:.1f} -> {row['recv_wait_ms']['True']:.1f}"
            figures[name] = row
            print(f"{name:22} {row['fixed_ms']:9.1f} {row['variable_ms']:12.1f} {harness.ratio_text(stats):>20} "
                  f"{msgs:>10} {census:>16} {recv:>14}")
        print(f"gradients identical with fixed and variable lengths: {identical}")
        figures["identical_gradients"] = identical
        figures["setting"] = vars(args) | {"pp": P, "m": M}


if __name__ == "__main__":
    main()
