"""``"l3plugin": {"context_parallel_size": N}`` in a DeepSpeed config: CP from one key, for DeepSpeed,
accelerate and the HF Trainer.

``deepspeed.initialize`` (engine.py's ``initialize_with_key``: it falls through unchanged without the key)
hands a config with ``context_parallel_size`` above 1 to ``initialize_with_cp``, which:

1. builds DeepSpeed's own sequence-parallel groups (``deepspeed.runtime.sequence_parallel.parallel_state_sp``,
   the groups DeepSpeed's Ulysses uses: N consecutive ranks per group, the sequence-data-parallel group over
   all ranks) and passes that module as ``mpu``, so DeepSpeed counts world / N data-parallel ranks and its
   engine, and l3plugin's ZeRO, reduce gradients over ``seq_data_parallel_group`` (DP x CP);
2. fixes a ``train_batch_size`` that was computed over all ranks (HF "auto" does that) to
   micro-batch x accumulation x (world / N);
3. for a transformers model, swaps in the all-gather CP attention over the CP group
   (``l3plugin.huggingface.enable_context_parallel``, imported only then).

Every rank of a CP group must then see the same batches: accelerate's data loaders are sharded over
data-parallel ranks only (``prepare_data_loader`` below, set ACCELERATE, which engine.py's install applies
when accelerate was imported first, as the Trainer does); in your own loop use
``data_parallel_rank_and_size()``. DeepSpeed's and accelerate's private state read here is declared at the
bottom (``l3plugin doctor`` checks it).
"""

from __future__ import annotations

import copy
import inspect
import sys

from l3plugin.deepspeed.config import ARGS_FIELDS, KEY, PluginOptions, options_in
from l3plugin.upstream.patchset import Patch, PatchSet, PrivateState
from l3plugin.upstream.versions import DEEPSPEED_CHECKED


def _sequence_parallel(cp: int | None = None):
    """DeepSpeed's sequence-parallel module; without one (DeepSpeed < 0.17): None, or with ``cp`` asked for,
    a ValueError saying so."""
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
    except ImportError:
        if cp is None:
            return None
        import deepspeed

        raise ValueError(f'"{KEY}.context_parallel_size" is {cp} but DeepSpeed {deepspeed.__version__} has no '
                         "sequence-parallel groups (deepspeed.runtime.sequence_parallel, added in DeepSpeed 0.17): "
                         f'use deepspeed>=0.17 for CP, or leave context_parallel_size out ("fp32_reduce_zero" works '
                         "on this version)") from None
    return parallel_state_sp


def _under_accelerate() -> bool:
    state = sys.modules.get("accelerate.state")
    return state is not None and bool(state.AcceleratorState._shared_state.get("deepspeed_plugins"))


def check_for_hf_users(config: dict, options: PluginOptions) -> None:
    """The messages an HF Trainer / accelerate user gets name their own settings."""
    if not _under_accelerate():
        return
    bf16 = config.get("bf16", {}).get("enabled", False) if isinstance(config.get("bf16"), dict) else False
    if options.fp32_reduce_zero and bf16 is not True:
        raise ValueError(
            'l3plugin FP32-reducing ZeRO needs bf16, and this run has it off (the DeepSpeed config\'s "bf16" '
            f'"enabled" resolved to {bf16!r}). With the HF Trainer pass TrainingArguments(bf16=True) (a "bf16": '
            '{"enabled": "auto"} config follows it); with accelerate use Accelerator(mixed_precision="bf16") or '
            '`accelerate launch --mixed_precision bf16`; or set "bf16": {"enabled": true} in the DeepSpeed config')


def _fix_batch_size(config: dict, world: int, cp: int) -> None:
    micro, gas = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps", 1)
    total = config.get("train_batch_size")
    if isinstance(micro, int) and isinstance(gas, int) and total == micro * gas * world and cp > 1:
        config["train_batch_size"] = micro * gas * (world // cp)  # counted over all ranks, as HF's "auto" does


class SequenceParallelMpu:
    """The ``mpu`` DeepSpeed is handed under CP from the key: its sequence-parallel module (every name read from
    it), plus the model-parallel rank and size. DeepSpeed 0.17 and 0.18 ask any mpu for
    ``get_model_parallel_rank`` when naming checkpoint files (0.19 only when model-parallel size > 1), which
    their module lacks. CP from the key has no tensor parallelism: rank 0 of 1, the ``mp_rank_00`` files every
    version writes."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    @staticmethod
    def get_model_parallel_rank() -> int:
        return 0

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return 1


def _sequence_parallel_groups(cp: int) -> SequenceParallelMpu:
    """DeepSpeed's sequence-parallel module with groups of ``cp`` ranks (built once, reused after), as an mpu."""
    import torch.distributed as dist

    sp = _sequence_parallel(cp)
    world = dist.get_world_size()
    if world % cp:
        raise ValueError(f'"{KEY}.context_parallel_size" is {cp} but the world size {world} is not a multiple of '
                         f"it: use a divisor of {world}")
    if sp._SEQUENCE_PARALLEL_GROUP is not None:
        have = sp.get_sequence_parallel_world_size()
        if have != cp:
            raise ValueError(f'"{KEY}.context_parallel_size" is {cp} but DeepSpeed\'s sequence-parallel groups '
                             f"already have {have} ranks (built earlier in this process)")
        return SequenceParallelMpu(sp)
    sp.initialize_sequence_parallel(cp)
    from l3plugin.collective import at_exit

    at_exit.on_exit(release_groups)  # groups l3plugin had DeepSpeed make: destroyed at exit
    return SequenceParallelMpu(sp)


def initialize_with_cp(stock, call: inspect.BoundArguments, where: str, config: dict, options: PluginOptions):
    """``deepspeed.initialize`` (``stock``, bound as ``call``) under ``"context_parallel_size"`` N > 1 (see the
    module docstring); ``where`` the config came from, ``config`` as read, ``options`` its parsed key."""
    cp = options.context_parallel_size
    _sequence_parallel(cp)  # before anything is built: DeepSpeed < 0.17 has none
    arguments = dict(call.arguments)
    if arguments.get("mpu") is not None:
        raise ValueError(f'"{KEY}.context_parallel_size" builds DeepSpeed\'s sequence-parallel groups itself: do '
                         "not pass mpu= to deepspeed.initialize as well (or drop the option and give your mpu "
                         "a get_sequence_data_parallel_group)")
    from deepspeed.pipe import PipelineModule

    if isinstance(arguments.get("model"), PipelineModule):  # stock asserts "mpu must be None" much later
        raise ValueError(f'"{KEY}.context_parallel_size" is {cp} but the model is a DeepSpeed PipelineModule: '
                         "DeepSpeed's PipelineEngine takes no sequence-parallel groups. Leave context_parallel_size "
                         "out with PipelineModule (fp32_reduce_zero works with it), or use CP with a plain module "
                         "(the HF Trainer, your own loop) or with Megatron-Core's pipeline and l3plugin's CP layer "
                         "spec")
    config = copy.deepcopy(config)  # the caller's config stays as given
    if where == "args":
        arguments["args"] = copy.copy(arguments["args"])
        for name in ARGS_FIELDS:
            if hasattr(arguments["args"], name):
                setattr(arguments["args"], name, None)
    arguments["config"], arguments["config_params"] = config, None
    import deepspeed.comm as ds_dist
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                             distributed_port=arguments.get("distributed_port", 29500),
                             dist_init_required=arguments.get("dist_init_required"))
    arguments["mpu"] = _sequence_parallel_groups(cp)
    _fix_batch_size(config, dist.get_world_size(), cp)
    out = stock(**arguments)
    model = out[0].module
    if hasattr(model, "set_attn_implementation") and hasattr(model, "config"):
        from l3plugin.huggingface.context_parallel import enable_context_parallel

        enable_context_parallel(model, arguments["mpu"].get_sequence_parallel_group(), options.cp_layout)
    return out


def data_parallel_rank_and_size(cp: int | None = None) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) for sharding data when CP groups are ``cp`` consecutive ranks
    (default: DeepSpeed's sequence-parallel groups, if built): every CP rank of a group gets the same data."""
    import torch.distributed as dist

    if cp is None:
        sp = _sequence_parallel()
        cp = 1 if sp is None or sp._SEQUENCE_PARALLEL_GROUP is None else sp.get_sequence_parallel_world_size()
    return dist.get_rank() // cp, dist.get_world_size() // cp


def _accelerate_cp() -> int:
    """context_parallel_size of the DeepSpeed config accelerate runs with (1 without one)."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.AcceleratorState._shared_state.get("deepspeed_plugins"):
        return 1
    plugin = state.AcceleratorState().deepspeed_plugin
    config = getattr(plugin, "deepspeed_config", None)
    options = options_in(config) if isinstance(config, dict) else None
    return 1 if options is None else options.context_parallel_size


def prepare_data_loader(dataloader, *args, num_processes=None, process_index=None, **kwargs):
    """accelerate's ``prepare_data_loader`` sharding over data-parallel ranks only under CP (every CP rank
    of a group gets the same batches; groups are consecutive ranks, as DeepSpeed builds them)."""
    stock = ACCELERATE.stock("accelerate.accelerator.prepare_data_loader")
    cp = _accelerate_cp()
    if cp > 1 and num_processes is not None and process_index is not None:
        if num_processes % cp:
            raise ValueError(f'"{KEY}.context_parallel_size" is {cp} but accelerate runs {num_processes} processes: '
                             f"use a divisor of {num_processes}")
        num_processes, process_index = num_processes // cp, process_index // cp
    return stock(dataloader, *args, num_processes=num_processes, process_index=process_index, **kwargs)


def release_groups() -> None:
    """Destroy DeepSpeed's sequence-parallel groups (tests and notebooks that build engines repeatedly)."""
    import torch.distributed as dist

    sp = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if sp is None or sp._SEQUENCE_PARALLEL_GROUP is None:
        return
    for group in {id(g): g for g in (sp._SEQUENCE_PARALLEL_GROUP, sp._SEQUENCE_DATA_PARALLEL_GROUP)}.values():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass
    # DeepSpeed 0.19 has _release_sequence_parallel_groups for this; 0.17 and 0.18 only the two globals.
    sp._SEQUENCE_PARALLEL_GROUP = sp._SEQUENCE_DATA_PARALLEL_GROUP = None


# -- the declarations ------------------------------------------------------------------------------------------
# Gated by DeepSpeed's version like the DeepSpeed set: it serves only the DeepSpeed key's CP.
ACCELERATE = PatchSet("l3plugin.huggingface (accelerate under context_parallel_size)", "deepspeed",
                      DEEPSPEED_CHECKED, [
    # Only when accelerate is imported already (the HF Trainer imports it before deepspeed).
    Patch("accelerate.accelerator", "prepare_data_loader", prepare_data_loader,
          signature=("dataloader", "device", "num_processes", "process_index"), loaded_only=True,
          why="under context_parallel_size N, shard data over data-parallel ranks only: a CP group shares batches"),
])

_SP = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
SEQUENCE_PARALLEL_GROUP = PrivateState(
    _SP, "_SEQUENCE_PARALLEL_GROUP",
    why="whether DeepSpeed's sequence-parallel groups are built (reused, or refused at another size), the CP size "
        "data_parallel_rank_and_size reads, and release_groups: without it context_parallel_size fails at "
        "deepspeed.initialize (AttributeError)")
SEQUENCE_DATA_PARALLEL_GROUP = PrivateState(
    _SP, "_SEQUENCE_DATA_PARALLEL_GROUP",
    why="release_groups destroys it and resets it with _SEQUENCE_PARALLEL_GROUP: without it release_groups fails")
ACCELERATOR_SHARED_STATE = PrivateState(
    "accelerate.state:AcceleratorState", "_shared_state",
    why="whether accelerate runs DeepSpeed (its deepspeed_plugins), read without building the state: without it "
        "deepspeed.initialize under accelerate fails (AttributeError) and its data loaders are not sharded "
        "by data-parallel rank under CP")
