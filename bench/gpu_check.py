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

Transformer Engine (issue 57; bench/te_device.sh installs TE on a lent GPU machine and runs these). Where
``transformer_engine`` does not import (CPU, CI, a GPU machine without TE) the TE parts are recorded as
``"skipped: transformer_engine not importable (...)"``, never as failures:

6. ``te_attention``: one attention layer at cp 1 (world size 1), bf16, GQA 8/1 heads of 128, forward and backward,
   sbhd (batch 2, one causal sequence each) and THD (packed documents, ``PackedSeqParams``), each against an fp32
   reference (per-document causal SDPA in fp32 on the same bf16 inputs): TE's own ``TEDotProductAttention``,
   l3plugin's ``L3TEDotProductAttention`` with ``cp_comm_type="l3plugin_all_gather"``
   (``l3plugin/megatron/te_backend.py``) and l3plugin's local ``AllGatherCPCoreAttention``; relative max
   errors of out, dq, dk, dv, and times (median of 5). The local path runs on CPU too.
7. ``te_cp``: the l3plugin route at cp 2 and 4 on one GPU, ranks as threads (torch's in-process threaded
   process group, which matches collectives by issue order as NCCL does): each rank's ``L3TEDotProductAttention``
   on its 2cp chunks, outputs and input gradients reassembled and compared with the cp 1 run of the same layer;
   beside it (``all_gather_attention_overlap``, TE or not) l3plugin's ``all_gather_attention`` itself with
   ``overlap`` on and off. TE's own CP attention needs NCCL ranks on distinct GPUs and is not run.
8. ``te_split``: a Megatron-Core ``TransformerBlock`` with the TE layer spec (Llama-shaped, 2 layers) built
   twice from the same weights: with ``delay_wgrad_compute`` (set after the config's checks, which tie it to
   MoE overlap) the backward leaves the TE linears' weight GEMMs to ``backward_dw()``: weight gradients
   absent after B, and after W every gradient against the fused backward (bit for bit, and the control);
   B / fused and (B + W) / fused times; beside it l3plugin's autograd split (``backward_input``) on the same
   TE block, where TE's fused Functions keep the weight GEMMs in B.
9. ``guard_cost``: the ZeRO parameter-gather guard (``l3plugin/zero/param_gather.py``) pending on the
   torch-function mode stack: per-call time of F.linear (small: launch-bound; Llama-sized: GPU-bound) and of a
   Llama layer's forward, with and without it, interleaved rounds (bench/param_guard_overhead.py does the
   CPU one). Runs on CPU too.

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
SECTIONS = ("cp_kernels", "zero", "split_backward", "megatron_split", "te_attention", "te_cp", "te_split",
            "guard_cost")


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


# -- Transformer Engine (issue 57) ---------------------------------------------------------------------------
def te_skip_reason() -> str | None:
    """None when Transformer Engine's PyTorch API and Megatron's TE extension import; else why not."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or RuntimeError from a TE built for another torch
        return f"transformer_engine not importable ({type(exc).__name__}: {str(exc)[:200]})"
    from l3plugin.megatron.te_backend import te_unavailable_reason

    reason = te_unavailable_reason()
    return reason


def megatron_world_one(device):
    """World size 1 (NCCL on CUDA) with Megatron's parallel state; the model-parallel CUDA RNG seeded."""
    from megatron.core import parallel_state, tensor_parallel

    init_process_group(device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def attention_config(heads_q, heads_kv, head_dim, device):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads_q * head_dim, num_attention_heads=heads_q,
                             num_query_groups=heads_kv, kv_channels=head_dim, attention_dropout=0.0,
                             hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
                             use_cpu_initialization=device.type != "cuda")


def reference_attention(q, k, v, cu) -> torch.Tensor:
    """Per-document causal attention in fp32 ([t, heads, dim] each, GQA); cu: document boundaries."""
    outs = []
    for a, b in zip(cu, cu[1:]):
        qq, kk, vv = (t[a:b].float().transpose(0, 1)[None] for t in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                                      enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


class AttentionInputs:
    """bf16 q, k, v and an output gradient of one layer: sbhd [s, b, h, d] or THD [t, h, d] (b = 1)."""

    def __init__(self, fmt, tokens, batch, device, heads=(HEADS_Q, HEADS_KV), head_dim=HEAD_DIM, seed=0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        shape = (tokens, batch) if fmt == "sbhd" else (tokens,)
        make = lambda h: torch.randn(*shape, h, head_dim, generator=gen).to(device, torch.bfloat16)  # noqa: E731
        self.fmt, self.tokens, self.batch = fmt, tokens, batch
        self.q, self.k, self.v = make(heads[0]), make(heads[1]), make(heads[1])
        self.grad = torch.randn(*shape, heads[0] * head_dim, generator=gen).to(device, torch.bfloat16)
        self.cu = packed_documents(tokens, seed) if fmt == "thd" else [0, tokens]

    def packed_seq_params(self):
        if self.fmt != "thd":
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor(self.cu, dtype=torch.int32, device=self.q.device)
        longest = max(b - a for a, b in zip(self.cu, self.cu[1:]))
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    def mask_type(self):
        from megatron.core.transformer.enums import AttnMaskType

        return AttnMaskType.padding_causal if self.fmt == "thd" else AttnMaskType.causal

    def reference(self):
        """(out, dq, dk, dv) of the fp32 reference, shaped as the layer's."""
        leaves = [t.detach().float().requires_grad_(True) for t in (self.q, self.k, self.v)]
        if self.fmt == "thd":
            out = reference_attention(*leaves, self.cu).reshape(self.tokens, -1)
        else:
            out = torch.stack([reference_attention(*(t[:, b] for t in leaves), self.cu)
                               for b in range(self.batch)], dim=1).reshape(self.tokens, self.batch, -1)
        out.backward(self.grad.float())
        return [out.detach()] + [t.grad for t in leaves]


def run_layer(layer, inp: AttentionInputs, backward=True):
    q, k, v = (t.detach().requires_grad_(backward) for t in (inp.q, inp.k, inp.v))
    out = layer(q, k, v, None, attn_mask_type=inp.mask_type(), packed_seq_params=inp.packed_seq_params())
    out = out.reshape(inp.grad.shape)
    if backward:
        out.backward(inp.grad)
        return [out.detach(), q.grad, k.grad, v.grad]
    return [out]


def te_attention_check(device, tokens=8192, batch=2) -> dict:
    """Section 6 (module docstring)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"megatron.core is not importable ({exc})"}
    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    megatron_world_one(device)
    skip = te_skip_reason()
    config = attention_config(HEADS_Q, HEADS_KV, HEAD_DIM, device)
    out = {"tokens": tokens, "heads": [HEADS_Q, HEADS_KV], "head_dim": HEAD_DIM,
           "te": f"skipped: {skip}" if skip else "imported"}
    for fmt, b in (("sbhd", batch), ("thd", 1)):
        inp = AttentionInputs(fmt, tokens, b, device)
        reference = inp.reference()
        row = out[fmt] = {"batch": b, "documents": len(inp.cu) - 1}
        layers = {"l3plugin_local": lambda: AllGatherCPCoreAttention(config, 1, inp.mask_type(), "self")}
        if skip is None:
            from megatron.core.extensions.transformer_engine import TEDotProductAttention

            from l3plugin.megatron.te_backend import CP_COMM_TYPE, te_attention_class

            layers["te_own"] = lambda: TEDotProductAttention(config, 1, inp.mask_type(), "self")
            layers["l3plugin_in_te"] = lambda: te_attention_class()(config, 1, inp.mask_type(), "self",
                                                                    cp_comm_type=CP_COMM_TYPE)
        else:
            row["te_own"] = row["l3plugin_in_te"] = f"skipped: {skip}"
        for name, make in layers.items():
            entry = row[name] = {}
            try:
                layer = make().to(device)
                got = run_layer(layer, inp)
                entry["relative_error"] = relative_errors(got, reference)
                del got
                entry["forward_s"] = timed(lambda: run_layer(layer, inp, backward=False), device)
                entry["forward_backward_s"] = timed(lambda: run_layer(layer, inp), device)
            except Exception as exc:  # noqa: BLE001 - recorded, the other layers go on
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc(limit=8)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def te_cp_check(device, tokens=8192, sizes=(2, 4), timeout=60.0) -> dict:
    """Section 7 (module docstring): the l3plugin route at cp 2 and 4, ranks as threads on one device. Without
    TE it is skipped; on CPU the same harness then runs l3plugin's local attention (``local_attention``), so
    the thread harness itself is exercised where TE cannot be."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"megatron.core is not importable ({exc})"}
    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    skip = te_skip_reason()
    if skip is None:
        from l3plugin.megatron.te_backend import CP_COMM_TYPE, te_attention_class

        cls, kwargs = te_attention_class(), {"cp_comm_type": CP_COMM_TYPE}
        out = {"layer": "L3TEDotProductAttention(cp_comm_type='l3plugin_all_gather')"}
    elif device.type == "cpu":
        cls, kwargs = AllGatherCPCoreAttention, {}
        out = {"skipped": skip, "local_attention": {"layer": "AllGatherCPCoreAttention (harness check)"}}
    else:
        return {"skipped": skip, "all_gather_attention_overlap": overlap_order_check(device, tokens, sizes, timeout)}
    record = out if skip is None else out["local_attention"]
    megatron_world_one(device)
    config = attention_config(HEADS_Q, HEADS_KV, HEAD_DIM, device)
    inp = AttentionInputs("sbhd", tokens, 1, device)
    whole = run_layer(cls(config, 1, inp.mask_type(), "self", **kwargs).to(device), inp)
    record.update(tokens=tokens, layout="2cp", ranks="threads (torch.testing's threaded process group)")
    for cp in sizes:
        record[f"cp{cp}"] = cp_on_threads(device, cls, kwargs, config, inp, whole, cp, timeout)
    out["all_gather_attention_overlap"] = overlap_order_check(device, tokens, sizes, timeout)
    return out


def cp_on_threads(device, cls, kwargs, config, inp, whole, cp, timeout) -> dict:
    """Each of ``cp`` threads a CP rank (its own threaded process group) running ``cls`` on its 2cp chunks; the
    outputs and input gradients put back in sequence order and compared with ``whole`` (the cp 1 run)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    def rank_call(rank, group, q, k, v):
        # tp None: TE's DotProductAttention takes its TP size from the tp group when one is given (this group's
        # size would split the heads); None gives config.tensor_model_parallel_size, 1
        layer = cls(config, 1, inp.mask_type(), "self", pg_collection=ProcessGroupCollection(cp=group, tp=None),
                    **kwargs).to(device)
        return layer(q, k, v, None, attn_mask_type=inp.mask_type(), packed_seq_params=None)

    return ranks_as_threads(device, rank_call, inp, whole, cp, timeout)


def ranks_as_threads(device, rank_call, inp, whole, cp, timeout) -> dict:
    """``rank_call(rank, group, q, k, v)`` on ``cp`` threads, each a rank of one threaded process group holding
    the 2cp chunks r and 2cp-1-r of ``inp`` (sbhd, batch 1); forward and backward, the outputs and input
    gradients reassembled in sequence order against ``whole`` (out, dq, dk, dv of the cp 1 run).

    The threaded group (torch.testing's) matches collectives in the order each rank issues them, as NCCL
    does: ranks that issue the same collectives in different orders get each other's data, as under NCCL
    (gloo runs of l3plugin's CP do not show this: there its reduce-scatter is a tagged point-to-point exchange).
    """
    import threading
    from unittest import mock

    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    from l3plugin.collective import comm

    chunk = inp.tokens // (2 * cp)
    results, errors = [None] * cp, [None] * cp
    store = dist.HashStore()

    def rank_main(rank):
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("threaded", rank=rank, world_size=cp, store=store)
            try:
                group = dist.distributed_c10d._get_default_group()
                pieces = (rank, 2 * cp - 1 - rank)
                sel = torch.cat([torch.arange(p * chunk, (p + 1) * chunk) for p in pieces]).to(device)
                q, k, v = (t.index_select(0, sel).detach().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
                o = rank_call(rank, group, q, k, v).reshape(sel.numel(), *inp.grad.shape[1:])
                o.backward(inp.grad.index_select(0, sel))
                results[rank] = (sel, o.detach(), q.grad, k.grad, v.grad)
            finally:
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - recorded per rank
            errors[rank] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"

    # The threaded group's works take no timeout (FutureWrappingWork::wait(timeout) is not implemented): l3plugin's
    # bounded waits wait unbounded here; the threads' join(timeout) bounds the run instead.
    patch = mock.patch.object(comm, "wait_work", lambda work, *, timeout, what: work.wait())
    patch.start()
    multi_threaded_pg._install_threaded_pg()
    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if isolation is not None:  # group names per thread (each rank's world registers "0"), as torch's own tests
        isolation(True)
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(cp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        multi_threaded_pg._uninstall_threaded_pg()
        if isolation is not None:
            isolation(False)
        patch.stop()
    if any(errors) or any(r is None for r in results):
        return {"error": [e or "no result (timed out, or another rank failed)" for e in errors]}
    assembled = [torch.zeros_like(t) for t in whole]
    for sel, *tensors in results:
        for dst, src in zip(assembled, tensors):  # each rank's outputs and gradients of its own tokens
            dst.index_copy_(0, sel, src.reshape(-1, *dst.shape[1:]))
    return {"relative_difference_from_cp1": relative_errors(assembled, whole)}


def overlap_order_check(device, tokens, sizes, timeout) -> dict:
    """l3plugin's all_gather_attention itself (no Megatron, no TE) on threaded ranks, overlap on (the default) and
    off, against its cp 1 run: whether the overlapped backward's dK/dV reduce-scatters line up across ranks."""
    from l3plugin.cp import all_gather_attention

    inp = AttentionInputs("sbhd", tokens, 1, device)
    inp.q, inp.k, inp.v = inp.q[:, 0], inp.k[:, 0], inp.v[:, 0]  # [t, h, d]: the function's own shapes
    inp.grad = inp.grad[:, 0].reshape(inp.q.shape)
    cu = torch.tensor([0, tokens])
    out = {}
    for overlap in (True, False):
        def call(rank, group, q, k, v, overlap=overlap):
            return all_gather_attention(q, k, v, cu, group=group, causal=True, overlap=overlap)

        whole_leaves = [t.detach().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
        o = call(0, None, *whole_leaves)
        o.backward(inp.grad)
        whole = [o.detach()] + [t.grad for t in whole_leaves]
        for cp in sizes:
            out[f"overlap_{overlap}_cp{cp}"] = ranks_as_threads(device, call, inp, whole, cp, timeout)
    return out


def te_block(config, device, delay):
    """A 2-layer TransformerBlock with Megatron's TE layer spec, bf16; ``delay``: delay_wgrad_compute (set after
    the config's own checks, which allow it only with MoE's overlapped EP communication)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = copy.copy(config)
    config.delay_wgrad_compute = delay
    # The TE spec fuses the norm into TELayerNormColumnParallelLinear, which reads config.normalization.
    return TransformerBlock(config, get_gpt_layer_with_transformer_engine_spec(),
                            post_layer_norm=False).to(device, torch.bfloat16)


def te_split_check(device, hidden=4096, heads=32, kv_heads=8, ffn=14336, tokens=4096, layers=2, rounds=5) -> dict:
    """Section 8 (module docstring)."""
    skip = te_skip_reason()
    if skip is not None:
        return {"skipped": skip}
    import transformer_engine
    from megatron.core.transformer import TransformerConfig
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    megatron_world_one(device)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
        ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    fused_block = te_block(config, device, delay=False)
    delayed_block = te_block(config, device, delay=True)
    delayed_block.load_state_dict(fused_block.state_dict())
    te_linears = [m for m in delayed_block.modules()
                  if isinstance(m, TransformerEngineBaseModule) and hasattr(m, "backward_dw")]
    gemm_weights = {id(p) for m in te_linears for n, p in m.named_parameters(recurse=False) if n.startswith("weight")}
    x = torch.randn(tokens, 1, hidden, device=device, dtype=torch.bfloat16)
    grad_out = torch.randn(tokens, 1, hidden, device=device, dtype=torch.bfloat16)

    def forward(block):
        inp = x.detach().requires_grad_(True)
        return inp, block(hidden_states=inp, attention_mask=None)

    fused = StageBackward(lambda: forward(fused_block), [p for p in fused_block.parameters() if p.requires_grad],
                          grad_out)
    delayed_params = [p for p in delayed_block.parameters() if p.requires_grad]

    def delayed_b():
        inp, o = forward(delayed_block)
        o.backward(grad_out)
        return inp.grad

    def delayed_w():
        for m in te_linears:
            m.backward_dw()

    def delayed_gradients():
        for p in delayed_params:
            p.grad = None
        input_grad = delayed_b()
        absent = sum(1 for p in delayed_params if id(p) in gemm_weights and p.grad is None)
        delayed_w()
        return absent, [input_grad] + [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                                       for p in delayed_params]

    out = {"hidden": hidden, "heads": [heads, kv_heads], "ffn": ffn, "tokens": tokens, "layers": layers,
           "te_linears": len(te_linears), "gemm_weights": len(gemm_weights),
           "te": getattr(transformer_engine, "__version__", "imported")}
    deterministic = torch.are_deterministic_algorithms_enabled()
    for key, det in (("default", False), ("deterministic_algorithms", True)):
        torch.use_deterministic_algorithms(det)
        try:
            reference = fused.gradients(fused.fused)
            absent, delayed = delayed_gradients()
            out[key] = {"fused_vs_fused": compare_gradients(reference, fused.gradients(fused.fused)),
                        "delayed_vs_fused": compare_gradients(reference, delayed),
                        "gemm_weight_grads_absent_after_b": absent,
                        "l3plugin_split_vs_fused": compare_gradients(reference, fused.gradients(fused.split))}
        except Exception as exc:  # noqa: BLE001 - recorded; the timings go on
            out[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
        finally:
            torch.use_deterministic_algorithms(deterministic)
        reference = delayed = None

    try:
        per_round = []
        for _ in range(rounds):
            t = fused.timed(device, repeats=3)
            clear = lambda: [setattr(p, "grad", None) for p in delayed_params]  # noqa: E731
            b = timed(lambda: (clear(), delayed_b()), device, 3) - t["forward"]
            bw = timed(lambda: (clear(), delayed_b(), delayed_w()), device, 3) - t["forward"]
            per_round.append({**t, "delayed_b": b, "delayed_bw": bw})
        med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
        out["times"] = {
            "forward_ms": round(med["forward"] * 1e3, 2), "fused_backward_ms": round(med["fused"] * 1e3, 2),
            "delay_wgrad_b_ms": round(med["delayed_b"] * 1e3, 2),
            "delay_wgrad_w_ms": round((med["delayed_bw"] - med["delayed_b"]) * 1e3, 2),
            "delay_wgrad_b_over_fused": round(statistics.median(r["delayed_b"] / r["fused"] for r in per_round), 3),
            "delay_wgrad_b_plus_w_over_fused": round(statistics.median(
                r["delayed_bw"] / r["fused"] for r in per_round), 3),
            "l3plugin_split_b_over_fused": round(statistics.median(r["b"] / r["fused"] for r in per_round), 3),
            "rounds": rounds,
            "note": "each backward time net of the same forward; median over rounds"}
    except Exception as exc:  # noqa: BLE001
        out["times"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    return out


def guard_cost_check(device, sizes=(64, 4096), calls=2000, rounds=5, layer=None) -> dict:
    """Section 9 (module docstring): microseconds per call with the parameter-gather guard pending and without."""
    from l3plugin.zero.param_gather import GUARD

    class Owner:  # the timed calls never touch the pending parameter, so the guard never asks it
        def wait_param_gather(self, params):
            raise AssertionError("the timed calls touched the pending parameter")

    pending, owner = torch.nn.Parameter(torch.ones(4, device=device)), Owner()

    def per_call_us(fn, n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        for _ in range(n):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - began) / n * 1e6

    def compare(fn, n):
        fn()
        plain, guarded = [], []
        for _ in range(rounds):
            plain.append(per_call_us(fn, n))
            if not GUARD.hold(owner, [pending]):
                return {"error": "another torch-function mode is on the stack: nothing to measure"}
            try:
                guarded.append(per_call_us(fn, n))
            finally:
                GUARD.release([pending])
        return {"plain_us": round(statistics.median(plain), 2), "guarded_us": round(statistics.median(guarded), 2),
                "added_us": round(statistics.median(g - p for g, p in zip(guarded, plain)), 2),
                "ratio": round(statistics.median(g / p for g, p in zip(guarded, plain)), 3)}

    out = {"calls": calls, "rounds": rounds}
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
            w = torch.randn(size, size, device=device, dtype=torch.bfloat16)
            n = calls if size <= 256 else max(20, calls // 20)
            out[f"linear_{size}"] = compare(lambda: torch.nn.functional.linear(x, w), n)
        hidden, heads, kv_heads, ffn, tokens = layer or (4096, 32, 8, 14336, 4096)
        torch.manual_seed(0)
        block = LlamaLayer(hidden, heads, kv_heads, ffn).to(device, torch.bfloat16)
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        out["llama_layer_forward"] = {"shape": [hidden, heads, kv_heads, ffn, tokens],
                                      **compare(lambda: block(x), max(5, calls // 200))}
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
    attention_tokens = dict(tokens=256) if args.cpu else {}
    guard = dict(sizes=(64, 256), calls=200, rounds=3, layer=(64, 4, 2, 96, 64)) if args.cpu else {}
    for name, run in (("cp_kernels", lambda: cp_kernels(device, sizes, record)),
                      ("zero", lambda: zero_check(device, 64 if args.cpu else 2048)),
                      ("split_backward", lambda: split_backward_check(device, **small)),
                      ("megatron_split", lambda: megatron_split_check(device, **small)),
                      ("te_attention", lambda: te_attention_check(device, **attention_tokens)),
                      ("te_cp", lambda: te_cp_check(device, **attention_tokens)),
                      ("te_split", lambda: te_split_check(device, **small)),
                      ("guard_cost", lambda: guard_cost_check(device, **guard))):
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
