"""``"l3plugin": {"context_parallel_size": N}`` in a DeepSpeed config: CP from one key, for DeepSpeed,
accelerate and the HF Trainer.

``deepspeed.initialize`` (replaced through ``l3plugin/patches.py``; it falls through unchanged without the
key) then:

1. builds DeepSpeed's own sequence-parallel groups (``deepspeed.runtime.sequence_parallel.parallel_state_sp``,
   the groups DeepSpeed's Ulysses uses: N consecutive ranks per group, the sequence-data-parallel group over
   all ranks) and passes that module as ``mpu``, so DeepSpeed counts world / N data-parallel ranks and its
   engine, and l3plugin's ZeRO, reduce gradients over ``seq_data_parallel_group`` (DP x CP);
2. fixes a ``train_batch_size`` that was computed over all ranks (HF "auto" does that) to
   micro-batch x accumulation x (world / N);
3. for a transformers model, swaps in the all-gather CP attention (model.py) over the CP group.

Every rank of a CP group must then see the same batches: accelerate's data loaders are sharded over
data-parallel ranks only (``prepare_data_loader`` below, also in patches.py); in your own loop use
``data_parallel_rank_and_size()``.
"""

from __future__ import annotations

import copy
import inspect
import sys

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from l3plugin.deepspeed.config import PluginOptions

# l3plugin.deepspeed (config: KEY, the options, DeepSpeed's config loader) is imported inside the functions: its
# import installs the DeepSpeed patches, one of which is this module's initialize.


def _sequence_parallel(cp: int | None = None):
    """DeepSpeed's sequence-parallel module; without one (DeepSpeed < 0.17): None, or with ``cp`` asked for,
    a ValueError saying so."""
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
    except ImportError:
        if cp is None:
            return None
        import deepspeed

        from l3plugin.deepspeed.config import KEY

        raise ValueError(f'"{KEY}.context_parallel_size" is {cp} but DeepSpeed {deepspeed.__version__} has no '
                         "sequence-parallel groups (deepspeed.runtime.sequence_parallel, added in DeepSpeed 0.17): "
                         f'use deepspeed>=0.17 for CP, or leave context_parallel_size out ("fp32_reduce_zero" works '
                         "on this version)") from None
    return parallel_state_sp


# Where deepspeed.initialize takes its config from, in its order: config, config_params, or the arguments
# object's deepspeed_config (deepscale_config: its deprecated name). Two of them at once: stock refuses the call.
_ARGS_FIELDS = ("deepspeed_config", "deepscale_config")


def _given_config(call: inspect.BoundArguments):
    """(where, the config as given) of a ``deepspeed.initialize`` call; (None, None) when there is none or stock
    refuses the call (two configs given)."""
    given = [(name, call.arguments.get(name)) for name in ("config", "config_params")]
    given += [("args", getattr(call.arguments.get("args"), name, None)) for name in _ARGS_FIELDS]
    given = [(where, value) for where, value in given if value is not None]
    if given[:1] and given[0][0] == "config" and any(where == "config_params" for where, _ in given):
        given = [g for g in given if g[0] != "config_params"]  # config wins over config_params
    return given[0] if len(given) == 1 else (None, None)


def _read(call: inspect.BoundArguments):
    """(where, the config as a dict, its options): read by DeepSpeed's own loader; options None without the key
    or when the config cannot be read (then stock gets the call as it is and says what is wrong)."""
    from l3plugin.deepspeed.config import options_in, read_config

    where, given = _given_config(call)
    if given is None:
        return None, None, None
    try:
        config = read_config(given)
    except Exception:  # noqa: BLE001 - DeepSpeed's own loader fails on it: stock raises its own error
        return None, None, None
    return (where, config, options_in(config)) if isinstance(config, dict) else (None, None, None)


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

    from l3plugin.deepspeed.config import KEY

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
    return SequenceParallelMpu(sp)


def initialize_with_key(*args, **kwargs):
    """``deepspeed.initialize`` with the ``"l3plugin"`` key (see the module docstring); without it the call
    reaches DeepSpeed exactly as given. (Not named ``initialize``: undoing the patch puts DeepSpeed's function
    back in every module whose global ``initialize`` is this one, which would include this module.)"""
    from l3plugin.deepspeed.config import handing_over
    from l3plugin.patches import DEEPSPEED

    stock = DEEPSPEED.stock("deepspeed.initialize")
    call = inspect.signature(stock).bind(*args, **kwargs)
    where, config, options = _read(call)
    if options is None:
        return stock(*args, **kwargs)
    check_for_hf_users(config, options)
    with handing_over(options):  # the engine keeps these options: its config's block is not parsed again
        if options.context_parallel_size == 1:
            return stock(*args, **kwargs)
        return _initialize_with_cp(stock, call, where, config, options)


def _initialize_with_cp(stock, call: inspect.BoundArguments, where: str, config: dict, options: PluginOptions):
    from l3plugin.deepspeed.config import KEY

    cp = options.context_parallel_size
    _sequence_parallel(cp)  # before anything is built: DeepSpeed < 0.17 has none
    arguments = dict(call.arguments)
    if arguments.get("mpu") is not None:
        raise ValueError(f'"{KEY}.context_parallel_size" builds DeepSpeed\'s sequence-parallel groups itself: do '
                         "not pass mpu= to deepspeed.initialize as well (or drop the option and give your mpu "
                         "a get_sequence_data_parallel_group)")
    config = copy.deepcopy(config)  # the caller's config stays as given
    if where == "args":
        arguments["args"] = copy.copy(arguments["args"])
        for name in _ARGS_FIELDS:
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
    from l3plugin.deepspeed.config import options_in

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
    from l3plugin.deepspeed.config import KEY
    from l3plugin.patches import DEEPSPEED

    stock = DEEPSPEED.stock("accelerate.accelerator.prepare_data_loader")
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
