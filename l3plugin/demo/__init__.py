"""The main job (`make demo`): a tiny Llama trained with TP, CP, PP (flexible schedule) and DP on CPU.

Steps: start tp*cp*pp*dp gloo ranks; check that Megatron's parallel_state built the [TP, CP, PP, DP]
mesh as planned; build a tiny Llama-style GPTModel (RMSNorm, SwiGLU, RoPE, GQA) whose layers are split
unevenly over the virtual pipeline stages, with l3plugin's all-gather CP attention on packed documents;
train it with the flexible interleaved 1F1B schedule (k != p, a last group smaller than p: a
configuration stock Megatron-Core refuses) and the FP32-reducing ZeRO optimizer; then run the same
model, data and optimizer in one process and compare the losses. Results go to ``--results``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from l3plugin.mesh.shape import MeshShape, format_table

MODEL = {"num_layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128}
TOLERANCE = {"bf16": 5e-2, "fp32": 1e-4}  # max |loss - reference loss| over all steps


def _progress(step, steps, loss, seconds):
    width = 30
    done = int(width * (step + 1) / steps)
    bar = "#" * done + "." * (width - done)
    print(f"\r  [{bar}] step {step + 1:>3}/{steps}  loss {loss:7.4f}  {seconds:5.2f} s/step", end="", flush=True)


def _layout(pp, vpp, num_layers):
    """Layer counts per virtual stage, one fewer on the first and last stage (they also hold the
    embedding and the loss) when the layers allow it, and Megatron's layout string for them."""
    from l3plugin.schedule.layers import layers_per_virtual_stage

    stages = pp * (vpp or 1)
    if stages >= 3 and (num_layers + 2) % stages == 0 and num_layers + 2 >= 2 * stages:
        end = (num_layers + 2) // stages - 1
        counts = layers_per_virtual_stage(num_layers, pp, vpp or 1, first_stage=end, last_stage=end)
    else:
        counts = layers_per_virtual_stage(num_layers, pp, vpp or 1)
    parts = ["t" * n for n in counts]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts), counts


def options(args) -> dict:
    import torch  # here, not at module level: registering the CLI subcommand must stay light

    vpp = args.vpp if args.vpp and args.vpp > 1 else None
    num_layers = args.layers
    layout, counts = _layout(args.pp, vpp, num_layers)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    return {"tp": args.tp, "cp": args.cp, "pp": args.pp, "dp": args.dp, "vpp": vpp,
            "group_size": args.group_size, "microbatches": args.microbatches, "seq_len": args.seq_len,
            "vocab": 256, "lr": 3e-3, "clip": 1.0, "zero_stage": args.zero_stage, "layout": layout,
            "layer_counts": counts, "model": dict(MODEL, num_layers=num_layers, dtype=dtype),
            "timeout_s": args.timeout, "cp_layout": args.cp_layout}


def _pictures(opts, losses, reference, results: Path):
    from l3plugin.schedule.plan import build_schedule
    from l3plugin.schedule.simulate import simulate
    from l3plugin.schedule.timeline import render_png, render_text

    schedule = build_schedule(opts["pp"], opts["vpp"] or 1, opts["microbatches"], opts["group_size"])
    sim = simulate(schedule)
    print(render_text(schedule))
    written = []
    try:
        render_png(sim, results / "timeline.png")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(losses, label=f"4D parallel (tp{opts['tp']} cp{opts['cp']} pp{opts['pp']} dp{opts['dp']})")
        ax.plot(reference, "--", label="single process")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(results / "loss.png", dpi=120)
        plt.close(fig)
        written += ["timeline.png", "loss.png"]
    except ImportError as exc:
        print(f"  (no pictures: {exc})")
    return written


def run_demo(args) -> int:
    from l3plugin.demo import train
    from l3plugin.demo.mesh_check import check_reports, mesh_report
    from l3plugin.ranks.pool import RankPool

    opts = options(args)
    shape = MeshShape(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"[1/5] starting {shape.world_size} CPU ranks over gloo (tp={shape.tp} cp={shape.cp} pp={shape.pp} "
          f"dp={shape.dp}) ...", flush=True)
    with RankPool(shape.world_size, preload=("megatron.core",), keep_state=True) as pool:
        print(f"[2/5] mesh: Megatron parallel_state in the order TP, CP, PP, DP "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        problems = check_reports(shape, pool.run(mesh_report, *shape.sizes, timeout=args.timeout))
        print(format_table(shape))
        if problems:
            print("MISMATCH between parallel_state and the planned table:\n  " + "\n  ".join(problems))
            return 1
        pool.run(train.setup, opts, timeout=args.timeout)
        print(f"\n[3/5] model: {opts['model']['num_layers']} layers over "
              f"{opts['pp'] * (opts['vpp'] or 1)} virtual stages {opts['layer_counts']} (layout "
              f"{opts['layout']}), {opts['model']['dtype']}; schedule: flexible m={opts['microbatches']} "
              f"k={opts['group_size']} vpp={opts['vpp'] or 1}; FP32-reducing ZeRO-{opts['zero_stage']} "
              f"over DP x CP; CP layout {opts['cp_layout']}", flush=True)
        losses = []
        for step in range(args.steps):
            t = time.monotonic()
            out = pool.run(train.train_step, step, timeout=args.timeout)
            losses.append(out[0]["loss"])
            if len({round(o["loss"], 12) for o in out}) != 1:
                print(f"\nranks disagree on the loss at step {step}: {[o['loss'] for o in out]}")
                return 1
            _progress(step, args.steps, losses[-1], time.monotonic() - t)
        print()
    print("[4/5] single-process reference of the same model, data and optimizer ...", flush=True)
    with RankPool(1, preload=("megatron.core",)) as pool:
        reference = pool.run(train.reference_losses, opts, args.steps, timeout=args.timeout * 4)[0]
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    tol = TOLERANCE[args.dtype]
    print(f"[5/5] loss first/last: parallel {losses[0]:.4f} -> {losses[-1]:.4f}, single process "
          f"{reference[0]:.4f} -> {reference[-1]:.4f}; max |difference| over {args.steps} steps "
          f"{diff:.2e} (tolerance {tol:g} for {args.dtype})")
    written = _pictures(opts, losses, reference, results)
    summary = {"options": {k: v for k, v in opts.items() if k != "model"}, "model": MODEL,
               "dtype": args.dtype, "losses": losses, "reference_losses": reference,
               "max_abs_difference": diff, "tolerance": tol, "seconds": time.monotonic() - t0}
    return finish(results, "summary.json", summary, written, t0, ok=diff <= tol and learned(losses),
                  what="4D-parallel")


def learned(losses) -> bool:
    """The loss went down (one step shows nothing either way)."""
    return len(losses) < 2 or losses[-1] < losses[0]


def finish(results: Path, name: str, summary: dict, written: list[str], t0: float, *, ok: bool, what: str) -> int:
    """Write the summary, say where everything went and whether the run matched its single-process reference."""
    (results / name).write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {', '.join(written + [name])} to {results}/ ({time.monotonic() - t0:.0f} s in all)")
    if not ok:
        print(f"FAILED: the {what} run does not match the single-process run (or did not learn)")
        return 1
    print(f"OK: the {what} run matches the single-process run.")
    return 0


TEXT_DEMO_DEFAULTS = {"tp": 2, "cp": 2, "dp": 1, "layers": MODEL["num_layers"], "zero_stage": 2, "cp_layout": "2cp",
                      "dtype": "bf16"}  # flags of the text demo only (None when not given: --multimodal refuses them)


@contextlib.contextmanager
def ranks_wait_bound(seconds: float):
    """$L3PLUGIN_WAIT_TIMEOUT = ``seconds`` for the ranks started inside (they copy this process's environment),
    unless the user set it; this process's environment is as it was afterwards (a caller of ``run`` from Python
    keeps its own waits' bound)."""
    from l3plugin.collective import waits

    if waits.ENV_VAR in os.environ:
        yield
        return
    os.environ[waits.ENV_VAR] = str(seconds)
    try:
        yield
    finally:
        os.environ.pop(waits.ENV_VAR, None)


def run(args) -> int:
    # Our pipeline and CP waits give a rank-named error at half a step's timeout, before the harness gives up
    # on the step.
    with ranks_wait_bound(args.timeout / 2):
        return _run(args)


def _run(args) -> int:
    if args.multimodal:
        from l3plugin.demo.multimodal import run_multimodal_demo

        given = [k for k in TEXT_DEMO_DEFAULTS if getattr(args, k) is not None
                 and not (k == "dtype" and args.dtype == "fp32")]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            print(f"error: {flags}: not used by --multimodal (pipeline ranks only, fp32); leave them out",
                  file=__import__("sys").stderr)
            return 2
        return run_multimodal_demo(args)
    for name, default in TEXT_DEMO_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return run_demo(args)


def add_demo_parser(sub):
    from l3plugin.arguments.flags import positive_int

    demo = sub.add_parser("demo", help="the main job: a tiny Llama trained with 4D parallelism on CPU",
                          description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    for dim in ("tp", "cp", "pp", "dp"):
        default = 2 if dim == "pp" else TEXT_DEMO_DEFAULTS[dim]
        demo.add_argument(f"--{dim}", type=positive_int, default=2 if dim == "pp" else None,
                          help=f"{dim.upper()} size (default {default})")
    demo.add_argument("--vpp", type=positive_int, default=2, help="model chunks per pipeline rank (default 2)")
    demo.add_argument("--group-size", type=positive_int, default=3,
                      help="k: consecutive microbatches per virtual stage per round (default 3)")
    demo.add_argument("--microbatches", type=positive_int, default=5, help="per DP rank and step (default 5)")
    demo.add_argument("--layers", type=positive_int, default=None, help=f"default {MODEL['num_layers']}")
    demo.add_argument("--steps", type=positive_int, default=30)
    demo.add_argument("--seq-len", type=positive_int, default=64)
    demo.add_argument("--zero-stage", type=int, choices=(1, 2), default=None, help="default 2")
    demo.add_argument("--cp-layout", choices=("2cp", "balanced"), default=None,
                      help="which tokens each CP rank holds: 2cp = the paper's chunks i and 2cp-1-i; balanced "
                           "= document pieces dealt by attention work (equal tokens per rank) (default 2cp)")
    demo.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 (--multimodal: fp32)")
    demo.add_argument("--multimodal", action="store_true",
                      help="instead: a tiny mllama-like model (small ViT, frozen text model with cross-attention "
                           "layers) on --pp ranks, its split from `l3plugin balance`, the image encoder placed "
                           "by --placement, checked against one process")
    demo.add_argument("--placement", choices=("replicated", "broadcast", "pipeline"), default="replicated",
                      help="--multimodal: where the image encoder runs (default replicated: every PP rank "
                           "encodes its share of the images, the paper's choice)")
    demo.add_argument("--results", default="results", help="folder for loss.png, timeline.png, summary.json")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung step is stopped")
    demo.set_defaults(func=run)
    return demo
