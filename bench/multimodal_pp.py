"""Multimodal pipeline (Llama 3 paper, section 3.2): stage splits of a frozen text model with trainable
cross-attention layers, and where the image encoder runs under pipeline parallelism (figure 6).

    .venv/bin/python bench/multimodal_pp.py                      # = simulated, the paper-sized tables (seconds)
    .venv/bin/python bench/multimodal_pp.py simulated --json     # every figure as JSON
    .venv/bin/python bench/multimodal_pp.py simulated --pp 2 --vpp 1 --microbatches 4 --image-tokens 1200

simulated (pure Python, no processes, FLOP-based: l3plugin/planner/encoder_costs.py, layer_costs.py,
l3plugin/schedule/balance.py): a Llama-3.2-11B-like text model (--model shapes, default llama3-8b: its 32
self-attention layers frozen with a trainable cross-attention layer after every 4, 40 layers; embedding
and head frozen), one sample of --text-seq text tokens and one image of --image-tokens tokens per
micro-batch, m micro-batches, k = p. Per (image tokens, p, v): rank load max/min and bubble (worst rank's
idle / busy) of the equal-count split, the paper's grouping (4 S + 1 X per stage, where the stages divide
the groups) and the balanced split; then, on the balanced split, the step time and the encoder's share of
it (encoder compute on the critical path / step) for the three encoder placements: pipeline (inside stage
0 per micro-batch), broadcast (rank 0 before and after the pipeline) and replicated (every PP rank encodes
ceil(B/P) images). Encoder: ViT-H/14-like (width 1280, MLP 5120) with Llama 3's 40 layers, trainable.
Times: FLOPs / (--peak-tflops x --mfu); communication: bytes / --bandwidth-gbps (0: free).
Prints tables, asserts nothing; --json (either section): every figure as JSON on stdout, the tables on stderr
(bench/harness.py; bench/docs_tables.py renders docs/pipeline.md's simulated tables from it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402

from l3plugin.planner.encoder_costs import (  # noqa: E402
    PLACEMENTS,
    EncoderSpec,
    multimodal_kinds,
    multimodal_step,
)
from l3plugin.planner.machine import Hardware  # noqa: E402
from l3plugin.planner.models import load_model  # noqa: E402

# torch is imported where the real section's ranks use it: the simulated section runs without it (seconds less).

SPLITS = ("count", "grouped", "balanced")


# ---- simulated -----------------------------------------------------------------------------------------------
def add_simulated_parser(subparsers) -> None:
    parser = subparsers.add_parser("simulated", help="stage splits and encoder placements from the cost model "
                                   "(pure Python, the default)")
    parser.add_argument("--model", default="llama3-8b", help="text model shapes: a planner preset or JSON file")
    parser.add_argument("--self-layers", type=int, default=None, help="self-attention layers (default: the "
                        "model's num_layers)")
    parser.add_argument("--self-per-cross", type=int, default=4, help="a cross-attention layer after every N "
                        "self-attention layers (default 4)")
    parser.add_argument("--text-seq", type=int, default=192, help="text tokens per sample (default 192)")
    parser.add_argument("--image-tokens", type=int, nargs="+", default=[1200, 3000],
                        help="tokens per image (= its patches; paper: 1.2K at 448x448, 3K at 672x672)")
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--vpp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--microbatches", type=int, default=32, help="m (default 32); k = p")
    parser.add_argument("--encoder-width", type=int, default=1280)
    parser.add_argument("--encoder-depth", type=int, default=40)
    parser.add_argument("--encoder-mlp-ratio", type=int, default=4)
    parser.add_argument("--frozen-encoder", action="store_true", help="encoder frozen (no backward)")
    parser.add_argument("--peak-tflops", type=float, default=Hardware.peak_tflops)
    parser.add_argument("--mfu", type=float, default=Hardware.mfu)
    parser.add_argument("--bandwidth-gbps", type=float, default=Hardware.inter_node_gbps,
                        help="GB/s per GPU for P2P and the encoder's collectives over PP (default the network's "
                             "50; 0: communication free)")
    harness.add_json_argument(parser)
    parser.set_defaults(func=run_simulated)


def simulated(args) -> dict:
    """Every figure of the simulated section (what --json prints)."""
    model = load_model(args.model)
    kinds = multimodal_kinds(args.self_layers or model.num_layers, args.self_per_cross)
    encoder = EncoderSpec(width=args.encoder_width, depth=args.encoder_depth, mlp_ratio=args.encoder_mlp_ratio,
                          trainable=not args.frozen_encoder)
    hardware = Hardware(peak_tflops=args.peak_tflops, mfu=args.mfu)
    settings = {"model": model.name, "kinds": kinds, "frozen": "SEH", "text_seq": args.text_seq,
                "images_per_sample": 1, "micro_batch_samples": 1, "microbatches": args.microbatches,
                "group_size": "pp", "encoder": {"width": encoder.width, "depth": encoder.depth,
                                                "mlp_ratio": encoder.mlp_ratio, "patch_size": encoder.patch_size,
                                                "trainable": encoder.trainable,
                                                "params": encoder.params(model.hidden_size)},
                "peak_tflops": hardware.peak_tflops, "mfu": hardware.mfu, "bandwidth_gbps": args.bandwidth_gbps,
                "time_unit": "seconds"}
    rows, skipped = [], []
    for image_tokens in args.image_tokens:
        for pp in args.pp:
            for vpp in args.vpp:
                if pp * vpp > len(kinds):
                    skipped.append({"image_tokens": image_tokens, "pp": pp, "vpp": vpp,
                                    "why": f"{len(kinds)} layers cannot fill {pp * vpp} virtual stages"})
                    continue
                step = multimodal_step(model, kinds, pp=pp, vpp=vpp, microbatches=args.microbatches,
                                       group_size=min(pp, args.microbatches), text_seq=args.text_seq,
                                       image_tokens=image_tokens, encoder=encoder, hardware=hardware,
                                       bandwidth_gbps=args.bandwidth_gbps)
                splits = {name: (step.split(name).to_dict() if step.split(name) else None) for name in SPLITS}
                rows.append({"image_tokens": image_tokens, "pp": pp, "vpp": vpp, "microbatches": args.microbatches,
                             "group_size": min(pp, args.microbatches), "splits": splits,
                             "encoder_per_image": {"forward": step.encoder.forward, "backward": step.encoder.backward,
                                                   "token_bytes": step.encoder.token_bytes},
                             "text_message_bytes": step.text_message_bytes,
                             "placements": {p.name: p.to_dict() for p in step.placements}})
    return {"settings": settings, "rows": rows, "skipped": skipped}


def print_simulated(result: dict) -> None:
    s = result["settings"]
    enc = s["encoder"]
    print(f"Simulated: {s['model']} shapes, {s['kinds'].count('S')} frozen S + {s['kinds'].count('X')} trainable X "
          f"layers ({s['kinds'][:10]}...), T={s['text_seq']}, 1 sample and 1 image per micro-batch, "
          f"m={s['microbatches']}, k=p; encoder ViT width {enc['width']} depth {enc['depth']} MLP x{enc['mlp_ratio']} "
          f"({enc['params'] / 1e6:.0f}M params, {'trainable' if enc['trainable'] else 'frozen'}); "
          f"{s['peak_tflops']:g} TFLOPs x MFU {s['mfu']:g}, {s['bandwidth_gbps']:g} GB/s")
    print("\nText pipeline splits: rank load max/min / bubble (worst rank's idle / busy)")
    header = (f"{'I':>5} {'p':>3} {'v':>2} | {'count':>11} | {'grouped':>11} | {'balanced':>11} | "
              f"{'bal/count step':>14} | balanced layers per virtual stage")
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        cells = []
        for name in SPLITS:
            split = row["splits"][name]
            cells.append(f"{split['load_max_over_min']:.2f} / {split['bubble']:.2f}" if split else "n/a")
        ratio = row["splits"]["balanced"]["makespan"] / row["splits"]["count"]["makespan"]
        print(f"{row['image_tokens']:>5} {row['pp']:>3} {row['vpp']:>2} | " + " | ".join(f"{c:>11}" for c in cells)
              + f" | {ratio:>14.3f} | {' '.join(map(str, row['splits']['balanced']['counts']))}")
    print("\nEncoder placements on the balanced split: step (s) / encoder share of the step; comm = encoder-related "
          "communication on the critical path (s)")
    header = (f"{'I':>5} {'p':>3} {'v':>2} | {'text pipe':>9} | "
              + " | ".join(f"{name + ' step/share':>22}" for name in PLACEMENTS) + " | comm pipe/bcast/repl")
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        places = [row["placements"][name] for name in PLACEMENTS]
        print(f"{row['image_tokens']:>5} {row['pp']:>3} {row['vpp']:>2} | {places[0]['pipeline']:>9.3f} | "
              + " | ".join(f"{p['step']:>13.3f} / {p['encoder_share']:>5.1%}" for p in places)
              + " | " + "/".join(f"{p['comm']:.3f}" for p in places))
    for skip in result["skipped"]:
        print(f"skipped I={skip['image_tokens']} p={skip['pp']} v={skip['vpp']}: {skip['why']}")


def run_simulated(args) -> int:
    try:
        result = simulated(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with harness.json_output(args.json, "multimodal_pp", args.argv) as figures:
        figures.update(result)
        print_simulated(result)
    return 0


# ---- real: 2 gloo ranks, measured -----------------------------------------------------------------------------
REAL_KINDS = "SSSX" * 3  # 12 layers: a trainable cross-attention layer after every 3 frozen self-attention layers
_TRAINERS = {}  # in each worker: contender name -> PipelinedTrainer (one mesh for all of them)


def add_real_parser(subparsers) -> None:
    parser = subparsers.add_parser("real", help="2 gloo ranks (pp 2, one per core): encoder placements and "
                                   "splits timed side by side (interleaved rounds)")
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--text-seq", type=int, default=128)
    parser.add_argument("--image-tokens", type=int, default=256, help="tokens (patches) per image")
    parser.add_argument("--encoder-width", type=int, default=256)
    parser.add_argument("--encoder-depths", type=int, nargs=2, default=[2, 8])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up round (default 5)")
    parser.add_argument("--png", metavar="FOLDER", help="also draw one measured step of the balanced and the count "
                        "split (replicated, first depth) as timelines")
    harness.add_json_argument(parser)
    parser.set_defaults(func=run_real)


def real_runs(args, layer_times=None) -> dict:
    """Contender name -> MultimodalRun: the three placements at two encoder depths on the FLOP-balanced split,
    the count split and (given ``layer_times``) the split balanced on measured layer times, both beside the
    FLOP-balanced one (replicated, first depth)."""
    from l3plugin.demo.multimodal import MultimodalRun, balanced_counts

    base = MultimodalRun(kinds=REAL_KINDS, pp=2, vpp=args.vpp, microbatches=args.microbatches, group_size=2,
                         seq_len=args.text_seq, micro_batch_size=1, patches=args.image_tokens,
                         encoder_width=args.encoder_width, hidden=args.hidden, heads=args.heads)
    balanced = balanced_counts(base)
    count = tuple(len(REAL_KINDS) // (2 * args.vpp) for _ in range(2 * args.vpp))
    runs = {}
    for depth in args.encoder_depths:
        for placement in PLACEMENTS:
            runs[f"{placement} depth {depth}"] = dataclasses.replace(
                base, placement=placement, encoder_depth=depth, counts=balanced)
    depth = args.encoder_depths[0]
    runs["count split"] = dataclasses.replace(base, placement="replicated", encoder_depth=depth, counts=count)
    if layer_times is not None:
        runs["measured split"] = dataclasses.replace(base, placement="replicated", encoder_depth=depth,
                                                     counts=measured_counts(base, layer_times))
    return runs


def measured_counts(run, times) -> tuple[int, ...]:
    """The split StageSplitter balances on measured per-layer times (``_layer_times``): a frozen self-attention
    layer's backward costs its measured input-gradient time after the first cross-attention layer, nothing
    before it (the frozen prefix runs no backward)."""
    from l3plugin.schedule.balance import LayerCost, StageSplitter
    from l3plugin.schedule.plan import build_schedule

    first_x = run.kinds.index("X")
    layers = [LayerCost(*times["X"]) if kind == "X" else LayerCost(times["S"][0], times["S"][1] if i > first_x else 0.0)
              for i, kind in enumerate(run.kinds)]
    schedule = build_schedule(run.pp, run.vpp, run.microbatches, run.group_size)
    return tuple(StageSplitter(layers, schedule, kinds=run.kinds).balance()[0].counts)


def _layer_times(run, repeats=7) -> dict:
    """In one process, on the run's shapes: medians of (forward, backward) seconds of a frozen self-attention
    layer (input gradients only) and a trainable cross-attention layer reading one image's tokens."""
    import statistics

    import torch

    from l3plugin.demo import multimodal_model as mm
    from l3plugin.encoder import image_context
    from l3plugin.mesh.groups import init_mesh

    init_mesh(dp=2)
    config = mm.mllama_config("SX", hidden=run.hidden, heads=run.heads)
    chunk = mm.build_text_chunk(config, "SX", pre_process=False, post_process=False, seq_len=run.seq_len)
    context = image_context(torch.randn(1, run.patches, run.hidden), [0])
    times = {"S": [], "X": []}
    for i in range(repeats + 1):
        for kind, layer in zip("SX", chunk.module.decoder.layers):
            x = torch.randn(run.seq_len, 1, run.hidden, requires_grad=True)
            start = time.perf_counter()
            out, _ = layer(x, attention_mask=None, context=context)
            middle = time.perf_counter()
            out.sum().backward()
            if i:  # the first repeat warms up
                times[kind].append((middle - start, time.perf_counter() - middle))
    return {kind: tuple(statistics.median(t[j] for t in pairs) for j in range(2)) for kind, pairs in times.items()}


def _build_trainers(runs) -> None:
    from l3plugin.demo.multimodal import PipelinedTrainer
    from l3plugin.mesh.groups import init_mesh

    first = next(iter(runs.values()))
    init_mesh(pp=first.pp, vpp=first.vpp if first.vpp > 1 else None)
    _TRAINERS.clear()
    for name, run in runs.items():
        _TRAINERS[name] = PipelinedTrainer(run, init_mesh=False)


def _timed_step(name, timeline=False) -> dict:
    """On every rank: one training step of a contender: wall (barrier to barrier) and this rank's CPU seconds
    (its compute, plus the CPU its gloo traffic costs on loopback; waiting costs none). ``timeline``: also the
    rank's forward / backward step calls, labelled by its plan (bench/measured_timeline.py)."""
    import torch
    from megatron.core import parallel_state as ps

    import measured_timeline
    from l3plugin.megatron.pipeline import trainable_stages
    from l3plugin.schedule.plan import build_schedule, with_trainable_stages

    calls = []
    with measured_timeline.record_steps(calls) if timeline else contextlib.nullcontext():
        timing, _ = harness.barrier_timed(lambda: _TRAINERS[name].step(returns_record=False))
    result = {"wall": timing["wall"], "busy": timing["busy"]}
    if timeline:
        trainer, run = _TRAINERS[name], _TRAINERS[name].run
        flags = trainable_stages(trainer.chunks, ps.get_pipeline_model_parallel_group(), torch.device("cpu"))
        schedule = with_trainable_stages(build_schedule(run.pp, run.vpp, run.microbatches, run.group_size), flags)
        result["actions"] = measured_timeline.label(schedule, ps.get_pipeline_model_parallel_rank(), calls)
        result["schedule"] = schedule
    return result


def _draw_timelines(pool, names, folder) -> list[str]:
    """One measured step of each named contender drawn as a timeline PNG in ``folder``."""
    import measured_timeline
    from l3plugin.schedule.timeline import render_png

    Path(folder).mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        ranks = pool.run(_timed_step, name, True, timeout=900)
        path = str(Path(folder) / f"multimodal_{name.replace(' ', '_')}.png")
        render_png(measured_timeline.timeline(ranks[0]["schedule"], [r["actions"] for r in ranks]), path)
        written.append(path)
    return written


def _backward_ratio(hidden, heads, seq, repeats=7) -> dict:
    """In one process: backward / forward seconds of a self-attention layer, trainable and frozen (input
    gradients only), medians of interleaved repeats on the same input."""
    import statistics
    import time

    import torch

    from l3plugin.demo import multimodal_model as mm
    from l3plugin.mesh.groups import init_mesh

    init_mesh(dp=2)
    chunk = mm.build_text_chunk(mm.mllama_config("S", hidden=hidden, heads=heads), "S", pre_process=False,
                                post_process=False, seq_len=seq)
    layer = chunk.module.decoder.layers[0]
    x = torch.randn(seq, 1, hidden, requires_grad=True)
    times = {True: [], False: []}
    for i in range(2 * repeats + 2):
        trainable = bool(i % 2)
        for q in layer.parameters():
            q.requires_grad_(trainable)
            q.grad = None
        start = time.perf_counter()
        out, _ = layer(x, attention_mask=None)
        middle = time.perf_counter()
        out.sum().backward()
        end = time.perf_counter()
        if i >= 2:  # the first pair warms up
            times[trainable].append((end - middle) / (middle - start))
    return {"trainable": statistics.median(times[True]), "frozen": statistics.median(times[False])}


def real(args) -> dict:
    import statistics

    from l3plugin.ranks.pool import RankPool

    with RankPool(2, preload=("megatron.core",), keep_state=True) as pool:
        layer_times = pool.run(_layer_times, real_runs(args)["count split"], timeout=900)[0]
        runs = real_runs(args, layer_times)
        names = list(runs)
        pool.run(_build_trainers, runs, timeout=900)
        record = harness.interleaved_rounds(names, lambda name: pool.run(_timed_step, name, timeout=900),
                                            args.rounds)
        pictures = _draw_timelines(pool, [f"replicated depth {args.encoder_depths[0]}", "count split",
                                          "measured split"], args.png) if args.png else []
        ratio = pool.run(_backward_ratio, args.hidden, args.heads, args.text_seq, timeout=900)[0]  # a new mesh

    def wall(name):
        return [max(r["wall"] for r in ranks) for ranks in record[name]]

    def per_round_ratio(a, b):
        return harness.ratio_stats(wall(a), wall(b))

    depth0 = args.encoder_depths[0]
    baseline = {name: (f"replicated depth {name.split()[-1]}" if "depth" in name else f"replicated depth {depth0}")
                for name in names}  # the same depth's replicated placement; the count split: the balanced one
    rows = []
    for name in names:
        busy = [statistics.median(ranks[i]["busy"] for ranks in record[name]) for i in range(2)]
        rows.append({"contender": name, "counts": list(runs[name].counts), "step_s": statistics.median(wall(name)),
                     "busy_s": busy, "busy_max_over_min": max(busy) / min(busy),
                     "step_vs_baseline": per_round_ratio(name, baseline[name])["median"],
                     "step_vs_baseline_range": [per_round_ratio(name, baseline[name])[k] for k in ("min", "max")],
                     "baseline": baseline[name]})
    return {"setup": {k: v for k, v in vars(args).items() if k not in ("func", "argv", "json")},
            "kinds": REAL_KINDS, "rows": rows, "backward_over_forward": ratio, "layer_times": layer_times,
            "pictures": pictures}


def print_real(result: dict) -> None:
    setup = result["setup"]
    print(f"Measured: 2 gloo ranks (pp 2, one core each), vpp {setup['vpp']}, m {setup['microbatches']}, k 2, "
          f"micro-batch 1 sample: {setup['text_seq']} text tokens, one image of {setup['image_tokens']} tokens "
          f"(every 5th micro-batch, j % 5 == 1, without); text hidden {setup['hidden']}, layers {result['kinds']} "
          f"(S frozen); ViT width {setup['encoder_width']}; medians of {setup['rounds']} interleaved rounds")
    print(f"  {'contender':<22} {'layers per stage':<16} {'step s':>7} {'rank CPU s':>13} {'CPU max/min':>12} "
          f"{'step / baseline (per-round median)':>34}")
    for row in result["rows"]:
        busy = "/".join(f"{b:.3f}" for b in row["busy_s"])
        print(f"  {row['contender']:<22} {' '.join(map(str, row['counts'])):<16} {row['step_s']:>7.3f} {busy:>13} "
              f"{row['busy_max_over_min']:>12.2f} {row['step_vs_baseline']:>8.3f} "
              f"({row['step_vs_baseline_range'][0]:.2f}-{row['step_vs_baseline_range'][1]:.2f}) vs {row['baseline']}")
    ratio = result["backward_over_forward"]
    print(f"Self-attention layer backward / forward, one process: trainable {ratio['trainable']:.2f}, frozen "
          f"(input gradients only) {ratio['frozen']:.2f}")
    times = result["layer_times"]
    print(f"Measured per layer (forward / backward ms): frozen self-attention {1e3 * times['S'][0]:.2f} / "
          f"{1e3 * times['S'][1]:.2f}, trainable cross-attention {1e3 * times['X'][0]:.2f} / {1e3 * times['X'][1]:.2f}")
    for path in result["pictures"]:
        print(f"wrote {path}")


def run_real(args) -> int:
    with harness.json_output(args.json, "multimodal_pp", args.argv) as figures:
        figures.update(real(args))
        print_real(figures)
    return 0


# ---- entry point: one subcommand per section (simulated is the default) -------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="section")
    add_simulated_parser(subparsers)
    add_real_parser(subparsers)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "simulated")
    args = parser.parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
