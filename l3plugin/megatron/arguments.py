"""l3plugin's Megatron-LM flags: adding them to Megatron-LM's parser, checking what it parsed, and reading the
parsed options once.

Megatron-LM keeps its parsed arguments in a private module global, ``megatron.training.global_vars._GLOBAL_ARGS``,
set once per run after its own validation. The schedule selector and the CP route's model and batch hooks ask
for l3plugin's options on every call; ``parsed_options()`` is the one place that reads that global, and it
checks the options once per arguments object and hands back the same frozen ``MegatronOptions`` afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings

from l3plugin.cp import CP_KV_MODES
from l3plugin.cp.layout import LAYOUT_NAMES
from l3plugin.megatron.attention import CP_COMM_TYPE
from l3plugin.upstream.patchset import PrivateState

SCHEDULES = ("default", "flexible", "flexible-zb")

# k for l3plugin's schedules instead of config.microbatch_group_size_per_vp_stage: an integer >= 1, or "pp" (k = p).
# Lets a framework keep microbatch_group_size_per_vp_stage = 1 in its config (verl then stops rounding the
# micro-batch count up to a multiple of it) while the schedule runs k = p.
GROUP_SIZE_ENV = "L3PLUGIN_MICROBATCH_GROUP_SIZE"
_K_FROM_CONFIG = ("config.microbatch_group_size_per_vp_stage, set by "
                  "--microbatch-group-size-per-virtual-pipeline-stage")


@functools.lru_cache(maxsize=8)
def group_size_setting(value: str) -> int | str | None:
    """GROUP_SIZE_ENV's ``value`` read: a positive int, "pp", or None (empty: unset). Raises a ValueError
    naming the variable, the value and what it takes."""
    text = value.strip().lower()
    if not text:
        return None
    if text == "pp":
        return "pp"
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"{GROUP_SIZE_ENV}={value!r} is invalid: give a positive integer (the micro-batches a "
                         f"virtual stage runs per round, k) or 'pp' (k = the pipeline-parallel size p); unset it "
                         f"to use config.microbatch_group_size_per_vp_stage")
    return k


def microbatch_group_size(config, pp: int, num_microbatches: int) -> tuple[int, str]:
    """(k, where it came from) for one step of l3plugin's schedules at pipeline size ``pp``: GROUP_SIZE_ENV when
    set (clipped to the micro-batch count: a group cannot hold more), else Megatron's
    ``config.microbatch_group_size_per_vp_stage`` (None: p; its default p with fewer micro-batches than p makes
    one group of them all)."""
    setting = group_size_setting(os.environ.get(GROUP_SIZE_ENV, ""))
    if setting is not None:
        k = pp if setting == "pp" else setting
        return min(k, num_microbatches), f"{GROUP_SIZE_ENV}={os.environ[GROUP_SIZE_ENV].strip()}"
    k = config.microbatch_group_size_per_vp_stage
    k = pp if k is None else k
    if k == pp and num_microbatches < pp:
        k = num_microbatches  # Megatron's default k = p: fewer microbatches than that make one group
    return k, _K_FROM_CONFIG


@dataclasses.dataclass(frozen=True)
class CPRoute:
    """l3plugin's CP as Megatron-LM's arguments select it."""

    layout: str = "2cp"
    cp_kv: str = "regather"
    documents: bool = False  # --reset-attention-mask (boundaries from EOD tokens) or the loader's (below)
    loader_documents: bool = False  # --dataloader-inter-document-masking (0.19+): the data loader's cu_seqlens


def add_cp_arguments(group):
    group.add_argument("--l3plugin-cp-layout", choices=LAYOUT_NAMES, default="2cp",
                       help="with --cp-comm-type l3plugin_all_gather: which positions each CP rank holds. '2cp' "
                            "(the paper's, Megatron's): chunks i and 2cp-1-i; 'balanced': documents dealt to ranks "
                            "by attention work (needs --reset-attention-mask).")
    group.add_argument("--l3plugin-cp-kv", choices=CP_KV_MODES, default="regather",
                       help="with --cp-comm-type l3plugin_all_gather: 'regather' keeps only the local K/V for the "
                            "backward and all-gathers them again there (TE's all-gather CP does the same); 'keep' "
                            "saves the gathered K/V (no second all-gather, cp times the K/V memory).")
    return group


def _cp_comm_types(args) -> list:
    value = getattr(args, "cp_comm_type", None)
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_cp_args(args) -> CPRoute | None:
    """The route Megatron-LM's parsed ``args`` select, None if they do not select l3plugin's CP; raises a
    ValueError naming the flag for a combination that cannot work."""
    types = _cp_comm_types(args)
    layout = getattr(args, "l3plugin_cp_layout", "2cp")
    if CP_COMM_TYPE not in types:
        if layout != "2cp" or getattr(args, "l3plugin_cp_kv", "regather") != "regather":
            raise ValueError(f"--l3plugin-cp-layout / --l3plugin-cp-kv apply to --cp-comm-type {CP_COMM_TYPE} "
                             f"only, but --cp-comm-type is {' '.join(map(str, types))}")
        return None
    if any(t != CP_COMM_TYPE for t in types):
        raise ValueError(f"--cp-comm-type {' '.join(map(str, types))} mixes {CP_COMM_TYPE} with other types: "
                         f"its document masks and sharding apply to the whole model; give it alone")
    cp = getattr(args, "context_parallel_size", 1)
    if cp < 2:
        raise ValueError(f"--cp-comm-type {CP_COMM_TYPE} with --context-parallel-size {cp}: it is a "
                         f"context-parallel attention; set --context-parallel-size 2 or more, or drop the flag")
    impl = getattr(args, "transformer_impl", "transformer_engine")
    if impl == "transformer_engine":
        from l3plugin.megatron.te_backend import te_unavailable_reason

        reason = te_unavailable_reason()
        if reason is not None:
            raise ValueError(f"--cp-comm-type {CP_COMM_TYPE} with --transformer-impl transformer_engine needs "
                             f"Transformer Engine: {reason}. Use --transformer-impl local (l3plugin's attention "
                             f"needs no TE)")
    elif impl != "local":
        raise ValueError(f"--cp-comm-type {CP_COMM_TYPE} supports --transformer-impl local or "
                         f"transformer_engine, got {impl}")
    for flag in ("sft", "hybrid_context_parallel", "use_legacy_models"):
        if getattr(args, flag, False):
            raise ValueError(f"--cp-comm-type {CP_COMM_TYPE} does not support --{flag.replace('_', '-')} "
                             f"(it brings its own packing or model); document masks come from "
                             f"--reset-attention-mask")
    loader = bool(getattr(args, "dataloader_inter_document_masking", False))
    documents = bool(getattr(args, "reset_attention_mask", False)) or loader
    if documents and getattr(args, "micro_batch_size", 1) != 1:
        flag = "--dataloader-inter-document-masking" if loader else "--reset-attention-mask"
        raise ValueError(f"{flag} with --cp-comm-type {CP_COMM_TYPE} needs --micro-batch-size 1 "
                         f"(got {args.micro_batch_size}): the document boundaries describe one packed "
                         f"sequence; raise --global-batch-size instead")
    if layout == "balanced" and not documents:
        raise ValueError("--l3plugin-cp-layout balanced deals documents to ranks: it needs "
                         "--reset-attention-mask (documents from EOD tokens) or --dataloader-inter-document-masking; "
                         "use the default 2cp layout without")
    return CPRoute(layout=layout, cp_kv=getattr(args, "l3plugin_cp_kv", "regather"), documents=documents,
                   loader_documents=loader)


def prepare_cp_args(args):
    """Check ``args`` and stop the data loader building the dense [s, s] mask: l3plugin's attention takes
    causality from the layer and documents from the boundaries, never from a mask."""
    route = check_cp_args(args)
    if route is not None:
        args.create_attention_mask_in_dataloader = False
    if route is not None and route.documents and not getattr(args, "calculate_per_token_loss", False):
        # Megatron's schedule divides each CP rank's loss by that rank's own token count (schedules.py,
        # forward_step_calc_loss); with EOD / masked tokens the counts differ between ranks.
        warnings.warn("with --cp-comm-type l3plugin_all_gather and --reset-attention-mask, each CP rank's loss "
                      "is divided by its own token count, so gradients are a mean of per-rank means, not the "
                      "token mean over the sequence; add --calculate-per-token-loss for the exact token mean "
                      "(then CP = N trains exactly like CP = 1)", UserWarning, stacklevel=2)
    return args


def add_arguments(parser):
    """Add l3plugin's flags (once: a parser that already has them is returned as it is)."""
    if "--pipeline-schedule" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group("l3plugin")
    group.add_argument(
        "--pipeline-schedule", choices=SCHEDULES, default="default",
        help="'flexible': l3plugin's interleaved 1F1B for any number of microbatches and any "
             "--microbatch-group-size-per-virtual-pipeline-stage in 1..M (k < PP runs "
             "all-forward-all-backward). 'flexible-zb': the same with each backward split into the input "
             "gradient and the weight gradients, the latter run where a rank would idle (zero bubble; the same "
             "gradients bit for bit). 'default': Megatron's stock schedules.")
    add_cp_arguments(group)
    return parser


def chain_extra_args(existing=None):
    """An extra_args_provider that runs ``existing`` (if any) and then adds l3plugin's flags."""
    def provider(parser):
        if existing is not None:
            parser = existing(parser)
        return add_arguments(parser)
    return provider


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    """l3plugin's options as Megatron-LM parsed them (the defaults without Megatron-LM)."""

    pipeline_schedule: str = "default"
    cp_route: CPRoute | None = None  # None: l3plugin's cp_comm_type is not selected


def options_from_args(args) -> MegatronOptions:
    """Read and check l3plugin's options in Megatron-LM's parsed ``args`` (raises naming a bad flag)."""
    return MegatronOptions(pipeline_schedule=getattr(args, "pipeline_schedule", "default") or "default",
                           cp_route=check_cp_args(args))


_parsed: list = [None, MegatronOptions()]  # [Megatron-LM's arguments object, its options]

GLOBAL_ARGS = PrivateState(
    "megatron.training.global_vars", "_GLOBAL_ARGS", version_of="megatron.core",
    why="Megatron-LM's parsed arguments, read by parsed_options(): without it --pipeline-schedule flexible and "
        "the CP flags are silently ignored (stock schedule, stock attention)")


def parsed_options() -> MegatronOptions:
    """The options of Megatron-LM's parsed arguments, checked once per arguments object."""
    args = getattr(sys.modules.get("megatron.training.global_vars"), "_GLOBAL_ARGS", None)
    if args is None:
        return MegatronOptions()
    if _parsed[0] is not args:
        _parsed[:] = [args, options_from_args(args)]
    return _parsed[1]
