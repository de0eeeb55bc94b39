"""verl's own Megatron engine as a client of l3plugin's flexible schedule (issue 55), on CPU / gloo.

    .compat/verl-venv/bin/python compat/verl_engine.py            # what compat/verl.sh (make compat-verl) runs

verl 0.9.1's ``MegatronEngineWithLMHead`` (verl/workers/engine/megatron/transformer_impl.py) builds a tiny Llama
from a Hugging Face checkpoint through its mbridge path, splits each batch into token-balanced micro-batches
(``rearrange_micro_batches``), packs them as THD (``preprocess_thd_engine``, CP 1) and calls Megatron's
``get_forward_backward_func()(..., num_microbatches=m, seq_length=1, micro_batch_size=1)``. This script runs its
``infer_batch`` (forward-only log-probs) and ``train_batch`` (verl's sft_loss, Megatron's optimizer step) at
pp 2 without and with virtual stages (2 per rank) for m = 3, 5, 7 micro-batches of documents of odd lengths,
one engine per layout with m changing every call (as RL training calls it), and compares log-probs, losses,
gradients and the updated weights with the same engine in one process (pp 1, stock Megatron). The model: a tiny
Llama (4 layers, GQA, untied output layer, bf16: verl's engine takes bf16 or fp16 only), saved with transformers
and loaded by verl's mbridge path; verl's clip_grad is 0 for that table, because the gradient norm is a sum over
pipeline ranks whose order differs between pp 1 and pp 2 (the norm's last bits differ, in stock Megatron too, and
clipping carries them into the step); with verl's default clip_grad 1.0 the flexible schedule is compared with
stock Megatron's 1F1B at the same pp 2 instead, where stock accepts any m.

l3plugin is never imported or called here: the pp 2 runs only get the environment variables
``L3PLUGIN_PIPELINE_SCHEDULE=flexible`` and ``L3PLUGIN_MICROBATCH_GROUP_SIZE=pp`` (read by the start-up hook
l3plugin-autoload.pth), with verl's ``microbatch_group_size_per_vp_stage`` at 1 so that verl does not round m up.
The stock rows run the same engine without the variables: with k = 1 Megatron refuses, with verl's default
(k = p) verl pads m to a multiple of p.

Everything under "CPU shims" exists because this machine has no GPU; none of it is for users and none of it
touches l3plugin. Each shim names the file it works around (verl 0.9.1, mbridge 0.15.1, megatron-core 0.16.1).
Exit status: 0 when every flexible row is bit-identical to its reference and ran the flexible schedule with m
micro-batches, and every stock line shows the refusal or the padding, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

MS = (3, 5, 7)
SCHEDULE_ENV = "L3PLUGIN_PIPELINE_SCHEDULE"
GROUP_SIZE_ENV = "L3PLUGIN_MICROBATCH_GROUP_SIZE"

FLEXIBLE = {SCHEDULE_ENV: "flexible", GROUP_SIZE_ENV: "pp"}


class Layout(NamedTuple):
    pp: int
    vpp: int | None
    env: dict  # what the ranks' environment gets (nothing else switches l3plugin on)
    k: int | None  # microbatch_group_size_per_vp_stage in verl's override_transformer_config (None: Megatron's = p)
    clip_grad: float  # McoreOptimizerConfig.clip_grad (verl's default: 1.0)


LAYOUTS = {
    # The table: clip_grad 0, so that the step does not depend on the gradient norm, a sum over pipeline ranks
    # whose order (and last bit) differs between pp 1 and pp 2 in stock Megatron too (the clip rows below).
    "pp1": Layout(1, None, {}, None, 0.0),  # the reference: one process, stock Megatron (no pipelining)
    "pp2": Layout(2, None, FLEXIBLE, 1, 0.0),
    "pp2-vpp2": Layout(2, 2, FLEXIBLE, 1, 0.0),
    # What stock does with these m: refuses (verl's k at 1) or gets them padded by verl (verl's default k = p).
    "stock-pp2-vpp2-k1": Layout(2, 2, {}, 1, 0.0),
    "stock-pp2-vpp2": Layout(2, 2, {}, None, 0.0),
    # verl's default clip_grad 1.0 where stock accepts any m (pp 2, 1F1B): flexible vs stock at the same layout.
    "clip-pp2": Layout(2, None, FLEXIBLE, 1, 1.0),
    "clip-stock-pp2": Layout(2, None, {}, 1, 1.0),
}

# The tiny Llama (Hugging Face config; 4 layers: one per virtual stage at pp 2 x 2).
LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, initializer_range=0.2, architectures=["LlamaForCausalLM"])


# ---------------------------------------------------------------------------------------------------------------
# The model directory (a Hugging Face checkpoint and tokenizer; no download)
# ---------------------------------------------------------------------------------------------------------------

def make_model_dir(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(LLAMA["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", bos_token="t1", eos_token="t2",
                            unk_token="t3").save_pretrained(path)


# ---------------------------------------------------------------------------------------------------------------
# CPU shims (test support for a machine without a GPU; verl 0.9.1, mbridge 0.15.1, megatron-core 0.16.1)
# ---------------------------------------------------------------------------------------------------------------

def cpu_torch():
    """``torch`` as the shimmed modules see it: device="cuda" means the CPU (tests/cpu_torch.py, which imports
    nothing of l3plugin)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from cpu_torch import CPU_TORCH

    return CPU_TORCH


def thd_core_attention_class():
    """Stands in for Transformer Engine's DotProductAttention with packed THD sequences (what verl's layer spec
    asks for): causal attention within each document of ``packed_seq_params.cu_seqlens_q``, GQA, computed in
    fp32 by torch's scaled_dot_product_attention, one document at a time. Megatron's local DotProductAttention
    refuses packed sequences, and TE does not run on CPU."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class ThdCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            assert (attention_dropout or config.attention_dropout) == 0.0, "the stand-in has no dropout"
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is not None and packed_seq_params.qkv_format == "thd", \
                "the stand-in takes verl's packed THD batches only"
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            cu = [int(x) for x in cu.tolist()]
            heads, groups = query.size(1), key.size(1)
            outs = []
            for start, end in zip(cu[:-1], cu[1:]):
                q = query[start:end].float().transpose(0, 1)
                k = key[start:end].float().repeat_interleave(heads // groups, dim=1).transpose(0, 1)
                v = value[start:end].float().repeat_interleave(heads // groups, dim=1).transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
                outs.append(o.transpose(0, 1).to(query.dtype))
            if cu[-1] < query.size(0):  # tokens after the last document (none at TP 1, CP 1): zero output
                outs.append(torch.zeros_like(query[cu[-1]:]))
            return torch.cat(outs).reshape(query.size(0), -1)

    return ThdCoreAttention


@contextlib.contextmanager
def cpu_tensors_named_cuda():
    """Within this block a CPU tensor's ``.type()`` names the CUDA type ("torch.cuda.BFloat16Tensor")."""
    import torch

    stock = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return stock(self).replace("torch.", "torch.cuda.", 1)
        return stock(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = stock


def install_cpu_shims() -> None:
    """Run before verl's engine modules are imported (verl creates its platform object on first use)."""
    import types

    import torch

    # 1. verl's device layer: without an accelerator verl/plugin/platform/platform_manager.py:117
    #    (_detect_platform_name) falls back to "nvidia", so get_device_name() says "cuda" and
    #    get_device_id() calls torch.cuda.current_device() (e.g. transformer_impl.py forward_backward_batch,
    #    `.to(get_device_id())`; utils/seqlen_balancing.py `torch.tensor(..., device=get_device_name())`).
    #    verl's own extension point, set_platform(), takes a CPU platform instead.
    from verl.plugin.platform import PlatformBase, set_platform

    cpu_module = types.SimpleNamespace(
        current_device=lambda: "cpu", device_count=lambda: 0, set_device=lambda *_: None,
        synchronize=lambda *_: None, is_available=lambda: True, manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed, empty_cache=lambda: None, memory_allocated=lambda *_: 0,
        memory_reserved=lambda *_: 0, max_memory_allocated=lambda *_: 0, max_memory_reserved=lambda *_: 0,
        reset_peak_memory_stats=lambda *_: None, mem_get_info=lambda *_: (0, 0),
        get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state)

    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = cpu_module

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            # verl's set_random_seed (engine/megatron/utils.py:35) then skips Megatron's CUDA RNG tracker; its
            # other condition, `is_device_available`, names the function (always true), not its result
            return 0

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    set_platform(CpuPlatform())
    # verl registers its Megatron engine for device "cuda" (transformer_impl.py:1171, @EngineRegistry.register
    # default device); VERL_ENGINE_DEVICE (workers/engine/base.py:405, get_engine_cls) picks that engine here.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"

    # 2. Megatron-Core 0.16.1's stock schedules and P2P code allocate on device="cuda" and call torch.cuda
    #    (pipeline_parallel/schedules.py:596/983/2138 token counter; p2p_communication.py:190-202/313/321
    #    receive buffers, :242/398 synchronize). Needed for the pp 1 reference (forward_backward_no_pipelining)
    #    and the stock rows; l3plugin's schedule does not use them.
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules

    schedules.torch = p2p.torch = cpu_torch()

    # 3. verl asks for Transformer Engine's layer spec: mbridge 0.15.1 core/llm_bridge.py:150
    #    (_get_transformer_layer_spec) calls get_gpt_decoder_block_spec(config, use_transformer_engine=True).
    #    TE does not run on CPU: Megatron's local spec instead, with the THD stand-in above as core_attention.
    #    The local spec keeps the two RMSNorms as modules of their own (input_layernorm, pre_mlp_layernorm) where
    #    TE fuses them into linear_qkv / linear_fc1 (layer_norm_weight): mbridge's name maps get those two names.
    import mbridge.core.llm_bridge as llm_bridge

    stock_block_spec = llm_bridge.get_gpt_decoder_block_spec
    core_attention = thd_core_attention_class()

    @functools.wraps(stock_block_spec)  # mbridge reads its signature for vp_stage (llm_bridge.py:144)
    def local_block_spec(config, use_transformer_engine, **kwargs):
        spec = stock_block_spec(config, use_transformer_engine=False, **kwargs)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core_attention
        return spec

    llm_bridge.get_gpt_decoder_block_spec = local_block_spec
    from mbridge.models.llama import LLaMABridge

    LLaMABridge._OTHER_MAPPING = {**LLaMABridge._OTHER_MAPPING,
                                  "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    LLaMABridge._MLP_MAPPING = {
        **LLaMABridge._MLP_MAPPING,
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]}

    # 4. mbridge 0.15.1 core/util.py:151 (get_model) moves every chunk to torch.cuda.current_device() with
    #    model_module.cuda(...): the chunks stay on the CPU.
    import mbridge.core.util as mb_util

    mb_util.torch = cpu_torch()
    stock_provider = llm_bridge.LLMBridge._model_provider

    def cpu_model_provider(self, *args, **kwargs):
        provide = stock_provider(self, *args, **kwargs)

        def provider(*p_args, **p_kwargs):
            model = provide(*p_args, **p_kwargs)
            model.cuda = lambda *_a, **_k: model  # this instance only: stays where it was built (CPU)
            return model
        return provider

    llm_bridge.LLMBridge._model_provider = cpu_model_provider

    # 5. Megatron-Core 0.16.1's DistributedDataParallel (which verl wraps every chunk in for training) allocates
    #    its parameter and gradient buffers at torch.cuda.current_device()
    #    (distributed/param_and_grad_buffer.py:783/800/806).
    import megatron.core.distributed.param_and_grad_buffer as grad_buffer

    grad_buffer.torch = cpu_torch()

    # 6. Megatron-Core 0.16.1's optimizer: device='cuda' scalars (optimizer/optimizer.py:473/481/485,
    #    clip_grads.py:90/103/115/174/207, grad_scaler.py) and type checks that refuse CPU parameters and
    #    gradients ("Wrapped parameters must be one of torch.cuda.FloatTensor, ...": distrib_optimizer.py:361/420,
    #    optimizer.py:671/690; clip_grads.py:167 `param.grad.type() == 'torch.cuda.FloatTensor'`), and the
    #    grad-norm fallback without apex / TE (utils.py:1207 local_multi_tensor_l2_norm, device="cuda"). The scalars
    #    go to the CPU; the type checks see CPU tensors named as their CUDA twins, only while verl builds the
    #    optimizer (verl/utils/megatron/optimizer.py get_megatron_optimizer) and while it steps.
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.grad_scaler as grad_scaler
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.utils as megatron_utils
    import verl.utils.megatron.optimizer as verl_optimizer

    for module in (clip_grads, distrib_optimizer, grad_scaler, optimizer, megatron_utils):
        module.torch = cpu_torch()
    stock_get_optimizer = verl_optimizer.get_megatron_optimizer

    def get_megatron_optimizer(*args, **kwargs):
        with cpu_tensors_named_cuda():
            built = stock_get_optimizer(*args, **kwargs)
        stock_step = built.step

        def step(*s_args, **s_kwargs):
            with cpu_tensors_named_cuda():
                return stock_step(*s_args, **s_kwargs)
        built.step = step
        return built

    verl_optimizer.get_megatron_optimizer = get_megatron_optimizer

    # 7. Megatron-Core 0.16.1's RoPE moves its frequencies to torch.cuda.current_device() at the first forward
    #    (models/common/embeddings/rotary_pos_embedding.py:162): they stay on the CPU.
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary

    rotary.torch = cpu_torch()


# ---------------------------------------------------------------------------------------------------------------
# The worker (one torchrun rank)
# ---------------------------------------------------------------------------------------------------------------

def make_batch(m: int, tu, torch):
    """Documents of odd lengths (2m + 1 of them), the first third of each masked out of the loss (a prompt),
    and the max_token_len_per_gpu for which verl's own token balancing makes exactly m micro-batches."""
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    gen = torch.Generator().manual_seed(1000 + m)
    lengths = [int(2 * torch.randint(1, 20, (1,), generator=gen) + 1) for _ in range(2 * m + 1)]
    ids = [torch.randint(4, LLAMA["vocab_size"], (n,), generator=gen) for n in lengths]
    masks = [torch.cat([torch.zeros(n // 3, dtype=torch.int64), torch.ones(n - n // 3, dtype=torch.int64)])
             for n in lengths]
    input_ids = torch.nested.as_nested_tensor(ids, layout=torch.jagged)
    loss_mask = torch.nested.as_nested_tensor(masks, layout=torch.jagged)
    for limit in range(max(lengths), sum(lengths) + 1):
        probe = tu.get_tensordict({"input_ids": input_ids, "loss_mask": loss_mask}, {})
        if len(rearrange_micro_batches(probe, max_token_len=limit)[0]) == m:
            break
    else:
        raise RuntimeError(f"no max_token_len gives {m} micro-batches for lengths {lengths}")
    data = tu.get_tensordict(
        {"input_ids": input_ids, "loss_mask": loss_mask},
        {"temperature": 1.0, "use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": limit,
         "use_fused_kernels": False, "global_batch_size": len(lengths)})
    return data, lengths, limit


def global_names(engine):
    """(global name, parameter) of this rank's chunks: layer indices made global (layer_number - 1)."""
    from verl.utils.megatron_utils import unwrap_model

    out = []
    for chunk in engine.module:
        model = unwrap_model(chunk)
        local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
        for name, param in model.named_parameters():
            if name.startswith("decoder.layers."):
                rest = name[len("decoder.layers."):]
                index, tail = rest.split(".", 1)
                name = f"decoder.layers.{local_to_global[int(index)]}.{tail}"
            out.append((name, param))
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    install_cpu_shims()

    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry
    import verl.workers.engine.megatron.transformer_impl as transformer_impl
    from verl.workers.utils.losses import sft_loss

    layout = LAYOUTS[args.layout]
    pp, vpp, k = layout.pp, layout.vpp, layout.k
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    # Observation only: which schedule verl's bound name answers and with how many micro-batches it was called.
    calls = []
    bound = transformer_impl.get_forward_backward_func

    def recording_selector(*a, **kw):
        schedule = bound(*a, **kw)

        def run(*sa, **skw):
            calls.append({"schedule": getattr(schedule, "__name__", str(schedule)),
                          "num_microbatches": skw.get("num_microbatches")})
            return schedule(*sa, **skw)
        return run

    transformer_impl.get_forward_backward_func = recording_selector

    # use_cpu_initialization: Megatron's default initializes weights on the GPU under its CUDA RNG tracker
    # (tensor_parallel/layers.py); mbridge loads the checkpoint's weights over them either way.
    override = {"attention_dropout": 0.0, "hidden_dropout": 0.0, "use_cpu_initialization": True}
    if k is not None:
        override["microbatch_group_size_per_vp_stage"] = k
    engine = EngineRegistry.new(
        model_type="language_model", backend="megatron",
        model_config=HFModelConfig(path=args.model, use_remove_padding=True),
        engine_config=McoreEngineConfig(
            forward_only=False, use_mbridge=True, vanilla_mbridge=True, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, context_parallel_size=1,
            use_dynamic_bsz=True, use_remove_padding=True, override_transformer_config=override, seed=1),
        optimizer_config=McoreOptimizerConfig(lr=1e-2, lr_decay_steps=10, lr_warmup_steps=0, weight_decay=0.0,
                                              clip_grad=layout.clip_grad),
        checkpoint_config=CheckpointConfig())
    engine.initialize()
    loss_fn = functools.partial(sft_loss, None)  # verl's SFT loss (its config argument is unused)

    grads = {}
    step = engine.optimizer_step

    def optimizer_step():
        grads.clear()
        for name, param in global_names(engine):
            grad = getattr(param, "main_grad", None)
            grads[name] = (grad if grad is not None else param.grad).detach().float().clone()
        return step()

    engine.optimizer_step = optimizer_step

    out_dir = Path(args.out)
    for m in MS:
        data, lengths, limit = make_batch(m, tu, torch)
        record = {"layout": args.layout, "m": m, "lengths": lengths, "max_token_len_per_gpu": limit}
        calls.clear()
        try:
            with engine.eval_mode():
                infer = engine.infer_batch(data.clone(), loss_function=None)
            before = {name: p.detach().float().clone() for name, p in global_names(engine)}
            with engine.train_mode():
                train = engine.train_batch(data.clone(), loss_function=loss_fn)
        except Exception as exc:  # noqa: BLE001 - the stock rows record the refusal
            import traceback

            traceback.print_exc()
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["calls"] = list(calls)
            torch.save(record, out_dir / f"{args.layout}.m{m}.rank{rank}.pt")
            print(f"[{args.layout} rank {rank}] m={m}: {record['error'][:300]}", flush=True)
            continue
        record["calls"] = list(calls)
        if "log_probs" in infer.get("model_output", {}):
            record["log_probs"] = infer["model_output"]["log_probs"].values().detach().float().clone()
            record["train_loss"] = torch.tensor(train["loss"], dtype=torch.float64)
            record["grad_norm"] = float(train["metrics"]["grad_norm"])
        record["grads"] = dict(grads)
        record["weights"] = {name: p.detach().float().clone() for name, p in global_names(engine)}
        record["step_size"] = max((record["weights"][n] - before[n]).abs().max().item() for n in before)
        torch.save(record, out_dir / f"{args.layout}.m{m}.rank{rank}.pt")
        print(f"[{args.layout} rank {rank}] m={m}: {calls}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The driver: launch each layout, compare, print
# ---------------------------------------------------------------------------------------------------------------

def launch(layout: str, model: Path, out: Path, timeout: float) -> tuple[int, float, str]:
    env = {k: v for k, v in os.environ.items() if k not in (SCHEDULE_ENV, GROUP_SIZE_ENV, "L3PLUGIN_NO_AUTOLOAD")}
    env.update(LAYOUTS[layout].env)
    pp = LAYOUTS[layout].pp
    env.setdefault("OMP_NUM_THREADS", "1")
    log = out / f"{layout}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
           __file__, "worker", "--layout", layout, "--model", str(model), "--out", str(out)]
    start = time.time()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - start, str(log)


def load(out: Path, layout: str, m: int) -> list[dict]:
    import torch

    return [torch.load(p, weights_only=False) for p in sorted(out.glob(f"{layout}.m{m}.rank*.pt"))]


def merged(records: list[dict]) -> dict:
    """One layout's ranks as one record: the last stage's outputs, every rank's gradients and weights."""
    out = {"grads": {}, "weights": {}, "calls": [], "error": None, "step_size": 0.0}
    for r in records:
        out["grads"].update(r.get("grads", {}))
        out["weights"].update(r.get("weights", {}))
        for key in ("log_probs", "train_loss", "grad_norm"):
            if key in r:
                out[key] = r[key]
        out["step_size"] = max(out["step_size"], r.get("step_size", 0.0))
        out["calls"] = out["calls"] or r.get("calls", [])
        out["error"] = out["error"] or r.get("error")
    return out


def max_diff(a, b) -> tuple[float, bool]:
    import torch

    if isinstance(a, dict):
        if a.keys() != b.keys():
            return float("inf"), False
        pairs = [(a[k], b[k]) for k in a]
    else:
        pairs = [(a, b)]
    worst, equal = 0.0, True
    for x, y in pairs:
        if x.shape != y.shape:
            return float("inf"), False
        equal &= torch.equal(x, y)
        worst = max(worst, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return worst, equal


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def schedules_run(run: dict) -> str:
    return ", ".join(sorted({f"{c['schedule']} (m={c['num_microbatches']})" for c in run["calls"]}))


def compare_pair(name: str, run: dict, ref: dict, m: int, vpp: int, ref_name: str,
                 schedule: str = "forward_backward_pipelining_flexible") -> tuple[list[str], bool]:
    """Two table rows (infer_batch, train_batch) of ``run`` against ``ref``; whether all is bit-identical."""
    if run["error"] or "log_probs" not in run:
        return [f"| {name} | {m} | {vpp} | - | NO | failed: {run['error']} |"], False
    d_lp, e_lp = max_diff(run["log_probs"], ref["log_probs"])
    d_loss, e_loss = max_diff(run["train_loss"], ref["train_loss"])
    d_grad, e_grad = max_diff(run["grads"], ref["grads"])
    d_w, e_w = max_diff(run["weights"], ref["weights"])
    e_train = e_loss and e_grad and e_w
    norm = abs(run["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    rows = [f"| {name}: infer_batch log-probs vs {ref_name} | {m} | {vpp} | {d_lp:.3g} | {yes(e_lp)} | "
            f"{schedules_run(run)} |",
            f"| {name}: train_batch losses, gradients, updated weights vs {ref_name} | {m} | {vpp} | "
            f"{max(d_loss, d_grad, d_w):.3g} | {yes(e_train)} | grad norm {run['grad_norm']:.7g} "
            f"(relative diff {norm:.1e}); step moved weights by up to {ref['step_size']:.3g} |"]
    ran_m = len(run["calls"]) == 2 and all(c["num_microbatches"] == m and c["schedule"] == schedule
                                           for c in run["calls"])
    return rows, e_lp and e_train and ran_m


def compare(out: Path) -> tuple[list[str], list[str], bool]:
    rows, stock_lines, ok = [], [], True
    for m in MS:
        ref = merged(load(out, "pp1", m))
        if ref["error"] or "log_probs" not in ref:
            return [f"| reference pp 1 | {m} | - | - | NO | no result: {ref['error']} |"], [], False
        ok &= {c["schedule"] for c in ref["calls"]} == {"forward_backward_no_pipelining"}
        for layout, vpp in (("pp2", 1), ("pp2-vpp2", 2)):
            new, good = compare_pair("flexible pp 2", merged(load(out, layout, m)), ref, m, vpp, "pp 1")
            rows += new
            ok &= good
    for m in MS:
        k1 = merged(load(out, "stock-pp2-vpp2-k1", m))
        refused = bool(k1["error"]) and "should range in" in k1["error"]
        stock_lines.append(f"stock Megatron, pp 2 x 2 virtual stages, verl k=1 (no env), m={m}: "
                           + (f"refused: {k1['error'][:150]}" if k1["error"] else "ran (unexpected)"))
        ok &= refused
    for m in MS:
        pad = merged(load(out, "stock-pp2-vpp2", m))
        counts = sorted({c["num_microbatches"] for c in pad["calls"]})
        padded = bool(counts) and all(c % 2 == 0 and c > m for c in counts)
        line = (f"stock Megatron, pp 2 x 2 virtual stages, verl's default k=p=2 (no env), m={m}: verl padded to "
                f"{counts} micro-batches")
        if pad["error"]:
            line += f", then {pad['error'][:150]}"
        else:
            line += f" ({', '.join(sorted({c['schedule'] for c in pad['calls']}))} ran)"
        stock_lines.append(line)
        ok &= padded
    for m in MS:
        stock = merged(load(out, "clip-stock-pp2", m))
        ok &= {c["schedule"] for c in stock["calls"]} == {"forward_backward_pipelining_without_interleaving"}
        new, good = compare_pair("clip_grad 1.0, flexible pp 2", merged(load(out, "clip-pp2", m)), stock, m, 1,
                                 "stock 1F1B pp 2")
        rows += new
        ok &= good
    return rows, stock_lines, ok


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("verl", "megatron-core", "torch", "transformers", "mbridge",
                                                    "tensordict"))


def main_all(args) -> int:
    start = time.time()
    out = Path(args.out or tempfile.mkdtemp(prefix="verl-compat-"))
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    if not args.compare_only:
        for old in out.glob("*.pt"):
            old.unlink()
        if model.exists():
            shutil.rmtree(model)
        make_model_dir(model)
    print(f"verl compat: {versions()}; results in {out}", flush=True)
    for layout in [] if args.compare_only else args.layouts:
        rc, took, log = launch(layout, model, out, args.timeout)
        print(f"  {layout}: exit {rc}, {took:.0f} s (log: {log})", flush=True)
    rows, stock_lines, ok = compare(out)
    print()
    print("| case | m | vpp | max abs diff | bit-identical | notes |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("\n".join(stock_lines))
    print(f"\nverl compat: {'OK' if ok else 'MISMATCH'} in {time.time() - start:.0f} s")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    run = sub.add_parser("all")
    run.add_argument("--out", default=None)
    run.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    run.add_argument("--timeout", type=float, default=400)
    run.add_argument("--compare-only", action="store_true", help="compare the results already in --out")
    w = sub.add_parser("worker")
    w.add_argument("--layout", required=True, choices=list(LAYOUTS))
    w.add_argument("--model", required=True)
    w.add_argument("--out", required=True)
    args = parser.parse_args(sys.argv[1:] or ["all"])
    if args.cmd == "worker":
        worker(args)
        return 0
    return main_all(args)


if __name__ == "__main__":
    sys.exit(main())
