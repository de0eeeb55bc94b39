"""The registry of l3plugin's upstream patches: the modules that declare sets (each adapter declares its own,
beside the replacements: see l3plugin/upstream/patchset.py). The version ranges the sets are checked on are
l3plugin/upstream/versions.py's, handed on here.

``declared()`` imports those modules and returns every set and every ``PrivateState``; ``l3plugin doctor`` is its
only user. Nothing here imports an adapter or anything upstream until it is called.
"""

from __future__ import annotations

import importlib

from l3plugin.upstream.patchset import (  # noqa: F401 - the API
    PRIVATE_STATE, SETS, UNCHECKED_ENV, Patch, PatchMismatch, PatchSet, PrivateState, VersionOutOfRange)
from l3plugin.upstream.versions import DEEPSPEED_CHECKED, MEGATRON_CHECKED  # noqa: F401 - the API

# The modules that declare sets or private state, in the order ``l3plugin doctor`` lists them. Importing
# l3plugin.deepspeed installs its patches (that is how the autoload works): a failed install is reported row
# by row by the doctor, its declarations made already.
DECLARED_IN = (
    "l3plugin.deepspeed.engine",            # DEEPSPEED: the engines' methods and deepspeed.initialize
    "l3plugin.deepspeed.config",            # the config's _param_dict
    "l3plugin.deepspeed.sequence_parallel", # ACCELERATE: accelerate's data-loader sharding; sequence-parallel state
    "l3plugin.megatron.install",            # MEGATRON, MEGATRON_LM_ARGS: the schedule selector, the flags
    "l3plugin.megatron.arguments",          # Megatron-LM's _GLOBAL_ARGS
    "l3plugin.megatron.cp_route",           # CP_ROUTE: CP from Megatron-LM's flags (batch_hooks.py's rows too)
    "l3plugin.megatron.attention",          # ROPE: RoPE of the positions a rank holds
    "l3plugin.demo.model",                  # CPU_ROPE, TIED_EMBEDDINGS: Megatron's CUDA-only pieces on CPU
    "l3plugin.debug.patching",              # COLLECTIVES: record_collectives, local_collectives
    "l3plugin.ranks.worker",                 # torch's process-group map (RankPool counts what a call left)
)


def declared() -> tuple[list[PatchSet], list[PrivateState], dict[str, str]]:
    """Every declared patch set and private upstream name (the declaring modules imported first), and
    {module: why it could not be imported} for the declaring modules that failed."""
    failed = {}
    for name in DECLARED_IN:
        try:
            importlib.import_module(name)
        except PatchMismatch:  # l3plugin.deepspeed's install: its sets were declared before it ran
            pass
        except Exception as exc:  # noqa: BLE001 - the doctor reports a broken install, it does not crash on it
            failed[name] = f"{type(exc).__name__}: {exc}"
    import l3plugin_autoload

    l3plugin_autoload.deferred_install()  # built at first use: that module runs at every interpreter start
    return SETS, PRIVATE_STATE, failed
