"""What only a CUDA GPU can check, on one GPU in a few minutes, into one JSON file.

    python bench/gpu_check.py --out gpu_check.json            # on a CUDA machine: about 2-4 minutes on an H100/H200
    python bench/gpu_check.py --sizes 8192 --out check.json   # fewer sizes
    python bench/gpu_check.py --cpu                           # the same checks, small, on CPU (gloo): for development

Without CUDA (and without --cpu) it writes {"skipped": "..."} and exits 0: CI runs it so. It needs torch and this
checkout only (no DeepSpeed, Megatron-Core or flash-attn; those it finds are used and named). Sections, each
recorded even when another fails (the JSON is rewritten after each, so a run cut short keeps what it finished):

1. ``environment``: torch and CUDA versions, the device, which CP kernels exist and which ``kernel="auto"`` picks.
2. ``cp_kernels``: all-gather CP attention kernels on packed documents (seeded lengths, documents crossing chunk
   borders) at each size (default 8K, 32K, 128K tokens), bf16, 8 query heads sharing 1 K/V head (GQA; Llama 3 70B's
   64/8 heads at TP 8), head dim 128. Every chunk of a cp=4 "2cp" layout is computed against its gathered K/V
   prefix, exactly as the CP ranks call the kernel (the chunks' outputs concatenated, one backward over them). Forward and backward against an fp32 reference (the
   per-document ``varlen-reference`` kernel, in fp32, on the same bf16 inputs): max |error| / max |reference|
   of the output and of dq, dk, dv; the bf16 ``reference`` kernel's own error beside it (up to 32K) as the scale of
   bf16 rounding. Then time (CUDA events, median of 5 after a warm-up) and TFLOP/s counted on the unmasked pairs
   (forward 4*d per pair and query head, backward 2.5x that), against dense causal SDPA (torch's flash backend) on
   the same tokens as one sequence: what document masking saves.
3. ``zero``: the FP32-reducing ZeRO-2 optimizer on this device (world size 1; NCCL on CUDA), 3 steps of 4
   micro-batches of a 4-chunk bf16 MLP with ``wait_params_in_forward`` on each chunk (as the adapters do): the
   defaults (reduce-scatters overlapped, parameter all-gathers deferred to first use) against the blocking path
   (overlap=False), parameters bit for bit; a read of a parameter between the step and the next forward (the guard
   completes its bucket first); and the same two with every chunk ``torch.compile``d (inductor), with dynamo's
   graph breaks counted, with the hooks and without them (the guard alone).
4. ``split_backward``: the zero-bubble schedule's backward split (``l3plugin/schedule/split_backward.py``: B, the
   input gradient, then W, the weight gradients) on a virtual stage of 2 Llama-3-8B-shaped layers (hidden 4096,
   32 query / 8 K/V heads, SwiGLU 14336, RMSNorm, causal SDPA; 4096 tokens), bf16: the input gradient and every
   weight gradient against one fused backward, bit for bit, beside the control (a fused backward against itself),
   with torch's defaults and with its deterministic algorithms (``CUBLAS_WORKSPACE_CONFIG`` is set for that at
   start unless set); then the times (CUDA events, median of 5) of the fused backward, of B and of W, each net of
   the forward: B / fused is the share of the backward left on the pipeline's critical path, (B + W) / fused
   what the split costs.
5. ``megatron_split``: the same on Megatron-Core's own layers (needs megatron-core; else recorded as skipped): a
   ``TransformerBlock`` of the same shape with the local layer spec (l3plugin's attention, Megatron's
   ``ColumnParallelLinear`` / ``RowParallelLinear``, RMSNorm, SwiGLU), world size 1. Gradients of the split with
   Megatron's own linear Function and with ``l3plugin.megatron.split_linears`` (what flexible-zb runs) against
   Megatron's fused backward, bit for bit (both modes), and B / W times of each: with Megatron's Function B does
   the weight products as well (B / fused about 1), with the swap they move to W.

``--sections`` runs some of them only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l3plugin.cp import kernels  # noqa: E402
from l3plugin.cp.sharding import document_metadata  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, CP = 8, 1, 128, 4
DEFAULT_SIZES = (8192, 32768, 131072)
REFERENCE_BF16_UP_TO = 32768  # the bf16 reference kernel is many small calls: its error scale up to here only
GPU_KERNELS = ("torch-varlen", "flash", "te")
SECTIONS = ("cp_kernels", "zero", "split_backward", "megatron_split")


def environment(device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        capability = torch.cuda.get_device_capability(device)
        out.update(cuda=torch.version.cuda, name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"sm{capability[0]}{capability[1]}", multiprocessors=props.multi_processor_count,
                   auto_kernel=kernels.auto_kernel("cuda", torch.bfloat16, capability))
    else:
        out["auto_kernel"] = kernels.auto_kernel(device.type, torch.bfloat16)
    out["kernels_present"] = {"flash-attn": kernels._flash_varlen() is not None,
                              "torch-varlen": kernels._torch_varlen() is not None,
                              "te": kernels._te_attention_class() is not None}
    return out


def packed_documents(seq_len: int, seed: int = 0) -> list[int]:
    """cu_seqlens of documents with seeded lengths from 1 to seq_len / 8 (mean ~seq_len / 16): many cross the
    chunk borders of a cp=4 layout (chunks of seq_len / 8)."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    while cu[-1] < seq_len:
        cu.append(min(seq_len, cu[-1] + int(torch.randint(1, seq_len // 8 + 1, (1,), generator=gen))))
    return cu


def unmasked_pairs(cu: list[int]) -> int:
    return sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))


def attention_flops(pairs: int, backward: bool) -> float:
    forward = 4.0 * HEAD_DIM * HEADS_Q * pairs
    return forward * (3.5 if backward else 1.0)


class Inputs:
    def __init__(self, seq_len, device, seed=0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        make = lambda heads: torch.randn(seq_len, heads, HEAD_DIM, generator=gen).to(device, torch.bfloat16)  # noqa: E731
        self.q, self.k, self.v = make(HEADS_Q), make(HEADS_KV), make(HEADS_KV)
        self.grad = make(HEADS_Q)
        self.cu = packed_documents(seq_len, seed)
        self.metas = [m for rank in range(CP) for m in document_metadata(self.cu, seq_len, CP, rank)]


def run_chunks(kernel_name, inp: Inputs, dtype, backward: bool):
    """Every chunk of every CP rank through one kernel: (output, dq, dk, dv) over the whole sequence."""
    fn = kernels.KERNELS[kernel_name]
    q, k, v = (t.detach().to(dtype).requires_grad_(backward) for t in (inp.q, inp.k, inp.v))
    # The chunks in sequence order (the metas of the 2cp layout are not), one backward for all, as one layer's.
    metas = sorted(inp.metas, key=lambda m: m.start)
    out = torch.cat([fn(q[m.start:m.end], k[:m.kv_len], v[:m.kv_len], m, causal=True, softmax_scale=None)
                     for m in metas])
    if backward:
        out.backward(inp.grad.to(dtype))
    return (out.detach(), q.grad, k.grad, v.grad) if backward else (out,)


def relative_errors(got, ref) -> dict:
    names = ("out", "dq", "dk", "dv")
    return {n: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
            for n, a, b in zip(names, got, ref)}


def timed(fn, device, repeats=5) -> float:
    """Median seconds of ``fn()`` after one warm-up: CUDA events on a GPU, perf_counter on CPU."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def dense_causal(inp: Inputs, backward: bool):
    q, k, v = (t.detach().transpose(0, 1)[None].requires_grad_(backward) for t in (inp.q, inp.k, inp.v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if backward:
        out.backward(inp.grad.transpose(0, 1)[None])
    return out


def cp_kernels(device, sizes, record) -> dict:
    present = [name for name in GPU_KERNELS if device.type == "cuda" and {
        "torch-varlen": kernels._torch_varlen, "flash": kernels._flash_varlen,
        "te": kernels._te_attention_class}[name]() is not None]
    names = present + ["reference"] if device.type == "cuda" else ["cpu-flash", "reference"]
    results = record.setdefault("cp_kernels", {"kernels": names, "heads_q": HEADS_Q, "heads_kv": HEADS_KV,
                                               "head_dim": HEAD_DIM, "cp": CP, "sizes": {}})
    for seq_len in sizes:
        inp = Inputs(seq_len, device)
        pairs = unmasked_pairs(inp.cu)
        row = results["sizes"][str(seq_len)] = {"documents": len(inp.cu) - 1, "unmasked_pairs": pairs,
                                                "dense_causal_pairs": seq_len * (seq_len + 1) // 2}
        reference = run_chunks("varlen-reference", inp, torch.float32, True)
        for name in names:
            if name == "reference" and seq_len > REFERENCE_BF16_UP_TO:
                continue
            entry = row[name] = {}
            try:
                got = run_chunks(name, inp, torch.bfloat16, True)
                entry["relative_error"] = relative_errors(got, reference)
                del got
                forward = timed(lambda: run_chunks(name, inp, torch.bfloat16, False), device)
                both = timed(lambda: run_chunks(name, inp, torch.bfloat16, True), device)
                entry.update(forward_s=forward, forward_backward_s=both,
                             tflops_forward=attention_flops(pairs, False) / forward / 1e12,
                             tflops_forward_backward=attention_flops(pairs, True) / both / 1e12)
            except Exception as exc:  # noqa: BLE001 - recorded, the other kernels go on
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc(limit=6)
        del reference
        try:
            forward = timed(lambda: dense_causal(inp, False), device)
            both = timed(lambda: dense_causal(inp, True), device)
            dense_pairs = row["dense_causal_pairs"]
            row["dense_causal_sdpa"] = {"forward_s": forward, "forward_backward_s": both,
                                        "tflops_forward": attention_flops(dense_pairs, False) / forward / 1e12,
                                        "tflops_forward_backward": attention_flops(dense_pairs, True) / both / 1e12}
        except Exception as exc:  # noqa: BLE001
            row["dense_causal_sdpa"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"cp_kernels S={seq_len}: " + json.dumps(row), flush=True)
        write(record)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# -- ZeRO ---------------------------------------------------------------------------------------------------
def make_chunks(device, hidden, compiled):
    torch.manual_seed(0)
    chunks = [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU()).to(device, torch.bfloat16)
              for _ in range(4)]
    calls = [torch.compile(c) for c in chunks] if compiled else chunks
    return chunks, calls


def train(device, hidden, *, overlap, compiled, hooks=True, steps=3, micro_batches=4) -> dict:
    from l3plugin.zero import FP32ReduceZero

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    chunks, calls = make_chunks(device, hidden, compiled)
    params = [p for c in chunks for p in c.parameters()]
    zero = FP32ReduceZero(torch.optim.AdamW(params, lr=1e-3), stage=2, overlap=overlap,
                          bucket_numel=hidden * hidden + hidden, chunks=[list(c.parameters()) for c in chunks])
    for call in calls if hooks else ():  # as the DeepSpeed and Megatron adapters do on their model chunks
        zero.wait_params_in_forward(call)
    gen = torch.Generator(device="cpu").manual_seed(1)
    losses, deferred = [], []
    for step in range(steps):
        for mb in range(micro_batches):
            last = mb == micro_batches - 1
            x = torch.randn(8, hidden, generator=gen).to(device, torch.bfloat16)
            zero.before_round_end(params, last)
            for call in calls:
                x = call(x)
            loss = x.float().pow(2).mean() / micro_batches
            loss.backward()
            zero.end_of_round(params, last, carry=zero.settings.carried_buckets)
            losses.append(loss.item())
        zero.step()
        deferred.append(len(zero._gathers))  # all-gathers left to complete at first use
    read = chunks[2][0].weight.float().norm().item()  # a read before the next forward: the guard completes it
    zero.wait_param_gather()
    return {"losses": losses, "deferred_after_step": deferred, "read_norm": read,
            "params": [p.detach().clone() for p in params], "graph_breaks": sum(counters["graph_break"].values()),
            "guard_breaks": sum(n for why, n in counters["graph_break"].items() if "StaleReadGuard" in why)}


def init_process_group(device) -> None:
    """One rank (NCCL on CUDA, gloo on CPU), once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def zero_check(device, hidden) -> dict:
    import torch.distributed as dist

    init_process_group(device)
    out = {"hidden": hidden, "backend": dist.get_backend()}
    for key, compiled, hooks in (("eager", False, True), ("compiled", True, True), ("compiled_guard_only", True, False)):
        try:
            blocking = train(device, hidden, overlap=False, compiled=compiled, hooks=hooks)
            overlapped = train(device, hidden, overlap=True, compiled=compiled, hooks=hooks)
            out[key] = {
                "params_bit_identical": all(torch.equal(a, b) for a, b in zip(blocking["params"], overlapped["params"])),
                "losses_identical": blocking["losses"] == overlapped["losses"],
                "read_between_step_and_forward_identical": blocking["read_norm"] == overlapped["read_norm"],
                "deferred_gathers_after_step": overlapped["deferred_after_step"],
                "graph_breaks": {"blocking": blocking["graph_breaks"], "deferred": overlapped["graph_breaks"],
                                 "deferred_at_the_guard": overlapped["guard_breaks"]},
                "final_loss": overlapped["losses"][-1]}
        except Exception as exc:  # noqa: BLE001 - recorded; the other variant goes on
            out[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    return out


def compare_gradients(first, second) -> dict:
    """[input gradient, weight gradients...] twice: bit for bit, and the largest difference."""
    return {"input_grad_bit_identical": torch.equal(first[0], second[0]),
            "weight_grads_bit_identical": all(torch.equal(a, b) for a, b in zip(first[1:], second[1:])),
            "max_abs_difference": max(float((a.float() - b.float()).abs().max()) for a, b in zip(first, second))}


# -- the zero-bubble split ----------------------------------------------------------------------------------
class LlamaLayer(torch.nn.Module):
    """One pre-norm decoder layer: RMSNorm, fused QKV (GQA), causal SDPA, output projection, RMSNorm, SwiGLU."""

    def __init__(self, hidden, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):  # x: [tokens, hidden]
        tokens, d = x.size(0), self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = (t.view(tokens, -1, d).transpose(0, 1)[None] for t in (q, k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(attn[0].transpose(0, 1).reshape(tokens, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class StageBackward:
    """One pipeline stage's backward, fused or split, from ``forward()`` -> (input leaf, output), and the
    gradients each leaves (input gradient first, then ``params``' in order)."""

    def __init__(self, forward, params, grad_out):
        self.forward, self.params, self.grad_out = forward, params, grad_out

    def fused(self):
        inp, out = self.forward()
        out.backward(self.grad_out)
        return inp.grad

    def split(self, run_w=True):
        from l3plugin.schedule.split_backward import backward_input

        inp, out = self.forward()
        input_grad, weight_step = backward_input(out, self.grad_out, inp, self.params)
        if run_w:
            weight_step.run()
        return input_grad

    def gradients(self, backward):
        self.clear()
        input_grad = backward()
        return [input_grad] + [p.grad.clone() for p in self.params]

    def clear(self):
        for p in self.params:
            p.grad = None

    def timed(self, device, repeats=5) -> dict:
        """Seconds (``timed``) of the forward, and of the fused backward, B and B + W each net of that forward."""
        forward_s = timed(self.forward, device, repeats)  # the forward that keeps the graph, freed unused

        def net(fn):
            return timed(lambda: (self.clear(), fn()), device, repeats) - forward_s

        return {"forward": forward_s, "fused": net(self.fused), "b": net(lambda: self.split(run_w=False)),
                "split": net(self.split)}


def split_backward_check(device, hidden=4096, heads=32, kv_heads=8, ffn=14336, tokens=4096, layers=2) -> dict:
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*(LlamaLayer(hidden, heads, kv_heads, ffn) for _ in range(layers)))
    stage = stage.to(device, torch.bfloat16)
    params = list(stage.parameters())
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    grad_out = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)

    def forward():
        inp = x.detach().requires_grad_(True)
        return inp, stage(inp)

    stage_backward = StageBackward(forward, params, grad_out)
    gradients, fused, split = stage_backward.gradients, stage_backward.fused, stage_backward.split

    out = {"hidden": hidden, "heads": [heads, kv_heads], "ffn": ffn, "tokens": tokens, "layers": layers,
           "dtype": "bfloat16"}
    # The control: a fused backward against itself. On CUDA flash attention's backward accumulates dq with
    # atomics (run-to-run different) unless torch's deterministic algorithms are on: the split is compared
    # both ways, and bit for bit only means something where the control is.
    deterministic = torch.are_deterministic_algorithms_enabled()
    for key, det in (("default", False), ("deterministic_algorithms", True)):
        torch.use_deterministic_algorithms(det)
        try:
            reference = gradients(fused)
            out[key] = {"fused_vs_fused": compare_gradients(reference, gradients(fused)),
                        "split_vs_fused": compare_gradients(reference, gradients(split))}
        finally:
            torch.use_deterministic_algorithms(deterministic)
        del reference

    t = stage_backward.timed(device)
    out.update(forward_ms=round(t["forward"] * 1e3, 2), fused_backward_ms=round(t["fused"] * 1e3, 2),
               b_ms=round(t["b"] * 1e3, 2), w_ms=round((t["split"] - t["b"]) * 1e3, 2),
               b_over_fused=round(t["b"] / t["fused"], 3), b_plus_w_over_fused=round(t["split"] / t["fused"], 3),
               note="each time net of the same forward (graph kept, then freed unused)")
    return out


def megatron_split_check(device, hidden=4096, heads=32, kv_heads=8, ffn=14336, tokens=4096, layers=2,
                         rounds=9) -> dict:
    """Section 5: the split on Megatron-Core's own layers (module docstring)."""
    try:
        from megatron.core import parallel_state, tensor_parallel
    except ImportError as exc:
        return {"skipped": f"megatron.core is not importable ({exc})"}
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    from l3plugin.megatron.attention import gpt_layer_spec_with_cp_attention
    from l3plugin.megatron.split_linears import splittable_linears

    init_process_group(device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
        ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0, gradient_accumulation_fusion=False,
        use_cpu_initialization=device.type != "cuda")
    block = TransformerBlock(config, gpt_layer_spec_with_cp_attention(normalization="RMSNorm"),
                             post_layer_norm=False).to(device, torch.bfloat16)  # norms too, as Float16Module
    params = [p for p in block.parameters() if p.requires_grad]
    x = torch.randn(tokens, 1, hidden, device=device, dtype=torch.bfloat16)
    grad_out = torch.randn(tokens, 1, hidden, device=device, dtype=torch.bfloat16)

    def forward(swapped):
        inp = x.detach().requires_grad_(True)
        with splittable_linears(block) if swapped else contextlib.nullcontext():
            return inp, block(hidden_states=inp, attention_mask=None)

    megatron, swapped = (StageBackward(lambda on=on: forward(on), params, grad_out) for on in (False, True))

    out = {"hidden": hidden, "heads": [heads, kv_heads], "ffn": ffn, "tokens": tokens, "layers": layers,
           "dtype": "bfloat16", "layers_swapped": 0}
    with splittable_linears(block) as count:
        out["layers_swapped"] = count
    deterministic = torch.are_deterministic_algorithms_enabled()
    for key, det in (("default", False), ("deterministic_algorithms", True)):
        torch.use_deterministic_algorithms(det)
        try:
            reference = megatron.gradients(megatron.fused)
            out[key] = {"fused_vs_fused": compare_gradients(reference, megatron.gradients(megatron.fused)),
                        "split_vs_fused": compare_gradients(reference, megatron.gradients(megatron.split)),
                        "swapped_split_vs_fused": compare_gradients(reference, swapped.gradients(swapped.split))}
        except Exception as exc:  # noqa: BLE001 - recorded; the timings go on
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            torch.use_deterministic_algorithms(deterministic)
        reference = None

    # The two variants in interleaved rounds (each time the median of 3 after a warm-up), medians over rounds.
    per_round = {False: [], True: []}
    for _ in range(rounds):
        for is_swapped, variant in ((False, megatron), (True, swapped)):
            per_round[is_swapped].append(variant.timed(device, repeats=3))
    megatron_fused = [r["fused"] for r in per_round[False]]
    for key, is_swapped in (("megatron_function", False), ("split_linears", True)):
        rows = per_round[is_swapped]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[key] = {"forward_ms": round(med["forward"] * 1e3, 2), "fused_backward_ms": round(med["fused"] * 1e3, 2),
                    "b_ms": round(med["b"] * 1e3, 2), "w_ms": round((med["split"] - med["b"]) * 1e3, 2),
                    # against Megatron's fused backward of the same round
                    "b_over_fused": round(statistics.median(r["b"] / f for r, f in zip(rows, megatron_fused)), 3),
                    "b_plus_w_over_fused": round(statistics.median(
                        r["split"] / f for r, f in zip(rows, megatron_fused)), 3)}
    for what in ("forward", "fused"):
        out[f"{what}_swapped_over_megatron"] = round(statistics.median(
            a[what] / b[what] for a, b in zip(per_round[True], per_round[False])), 3)
    out["rounds"] = rounds
    out["note"] = ("each backward time net of the same forward (graph kept, then freed unused); ratios against "
                   "Megatron's fused backward of the same round, median over interleaved rounds")
    return out


_OUT = None


def write(record) -> None:
    if _OUT is not None:
        _OUT.write_text(json.dumps(record, indent=1) + "\n")


def main(argv=None) -> int:
    global _OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON written")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help=f"tokens per packed sequence (default {' '.join(map(str, DEFAULT_SIZES))}; --cpu: 512)")
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU, small (development only)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="the sections run (default: all)")
    args = parser.parse_args(argv)
    for s in args.sizes or ():
        if s < 8 * CP or s % (2 * CP):
            parser.error(f"--sizes {s} is invalid: each must be a multiple of {2 * CP} and >= {8 * CP}")
    _OUT = args.out
    if not torch.cuda.is_available() and not args.cpu:
        record = {"skipped": f"no CUDA device (torch {torch.__version__}, cuda available: False): nothing to check; "
                             f"--cpu runs the same checks small on CPU"}
        write(record)
        print(record["skipped"])
        return 0
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":  # before cuBLAS starts: it under deterministic algorithms (4.)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sizes = args.sizes or ((512,) if args.cpu else DEFAULT_SIZES)
    began = time.perf_counter()
    record = {"environment": environment(device)}
    print("environment: " + json.dumps(record["environment"]), flush=True)
    write(record)
    small = dict(hidden=64, heads=4, kv_heads=2, ffn=96, tokens=64) if args.cpu else {}
    for name, run in (("cp_kernels", lambda: cp_kernels(device, sizes, record)),
                      ("zero", lambda: zero_check(device, 64 if args.cpu else 2048)),
                      ("split_backward", lambda: split_backward_check(device, **small)),
                      ("megatron_split", lambda: megatron_split_check(device, **small))):
        if name not in args.sections:
            continue
        section_began = time.perf_counter()
        try:
            record[name] = run()
        except Exception as exc:  # noqa: BLE001 - one section's failure is a finding, not the end of the check
            record[name] = {**record.get(name, {}), "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc(limit=8)}
        record[name]["seconds"] = round(time.perf_counter() - section_began, 1)
        print(f"{name}: " + json.dumps({k: v for k, v in record[name].items() if k != "sizes"}), flush=True)
        write(record)
    record["seconds"] = round(time.perf_counter() - began, 1)
    write(record)
    print(f"wrote {args.out} in {record['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
