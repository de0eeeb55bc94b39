"""Switching Megatron training scripts to the flexible schedule: the flag and the patch of
``get_forward_backward_func``.

The flag, ``--pipeline-schedule {default,flexible,flexible-zb}``, and the reading of Megatron-LM's parsed
arguments are in arguments.py (``add_arguments`` / ``chain_extra_args`` / ``parsed_options``).
``install()`` (idempotent) makes every ``get_forward_backward_func`` name Megatron's training loop reads
return ``forward_backward_pipelining_flexible`` when the flexible schedule is selected and pp > 1 (its
zero-bubble variant, ``forward_backward_pipelining_flexible_zb``, for ``flexible-zb``):
``megatron.core.pipeline_parallel.get_forward_backward_func``, ``...schedules.get_forward_backward_func``
and ``megatron.training.training.get_forward_backward_func`` (imported there as a module global). These
patches are declared at the bottom (sets MEGATRON and MEGATRON_LM_ARGS).

A script that bound the selector by name before ``install()`` ran (``from megatron.core.pipeline_parallel
import get_forward_backward_func`` at its top) keeps Megatron's own selector. That selector returns the stock
pipelined schedules it reads from ``schedules``' module globals at call time, so ``install()`` also puts a
guard there: while the flexible schedule is selected, a call that reaches the stock pipelined schedule runs
the flexible one instead and warns once (``EarlyBoundSelectorWarning``) naming the fix. The guard also runs
each stock pipelined schedule call inside ``cp_documents.boundaries_for_step`` (document masks of the CP
route on middle pipeline stages), as the flexible schedule does itself. ``install()`` also
warns right away about modules whose global ``get_forward_backward_func`` is still Megatron's.

Without code: the environment variable ``L3PLUGIN_PIPELINE_SCHEDULE`` (``flexible`` or ``flexible-zb``; ``default``
or unset: nothing). The start-up hook (l3plugin_autoload.py) calls ``install_from_environment()`` once Megatron-Core
has been imported, before the importer can bind ``get_forward_backward_func`` by name; a script's own ``install()``
call wins over the variable (the hook does nothing while one is running, and a later call replaces the choice).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

from l3plugin.megatron.cp_documents import schedule_step
from l3plugin.megatron.arguments import SCHEDULES, chain_extra_args, parsed_options, prepare_cp_args
from l3plugin.megatron.cp_route import install_cp_route, uninstall_cp_route
from l3plugin.upstream.versions import MEGATRON_CHECKED
from l3plugin.upstream.patchset import Patch, PatchSet

_state = {"schedule": None, "warned": False, "installing": 0}
SCHEDULE_ENV = "L3PLUGIN_PIPELINE_SCHEDULE"  # l3plugin_autoload.py reads the same name (it imports nothing of ours)
_STOCK_SELECTOR = "megatron.core.pipeline_parallel.schedules.get_forward_backward_func"
_PIPELINED = ("forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_without_interleaving")


class EarlyBoundSelectorWarning(UserWarning):
    """The stock get_forward_backward_func was bound by name before l3plugin.megatron.install() ran."""


FIX = ("call l3plugin.megatron.install() before importing get_forward_backward_func by name, or call it "
       "through the module (megatron.core.pipeline_parallel.get_forward_backward_func(...))")


def guarded_schedule(stock_fn, name: str):
    """The stock pipelined schedule ``name`` as the MEGATRON set puts it in place (see the module docstring)."""
    stock_step = schedule_step(stock_fn)  # document boundaries for middle stages (cp_documents.py)

    @functools.wraps(stock_fn)
    def guarded(*args, **kwargs):
        if selected_schedule() == "default":
            return stock_step(*args, **kwargs)
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(f"Megatron's stock {name} was reached through a get_forward_backward_func bound before "
                          "l3plugin.megatron.install(); the flexible schedule runs instead (it was selected). "
                          f"To silence this, {FIX}.", EarlyBoundSelectorWarning, stacklevel=2)
        return selected_function()(*args, **kwargs)
    guarded.l3plugin_guard = True
    return guarded


def _early_bound(stock) -> list[str]:
    """Modules (other than Megatron's own) whose global get_forward_backward_func is Megatron's selector."""
    own = {"megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules",
           "megatron.training.training"}
    out = []
    for name, module in list(sys.modules.items()):
        if name in own or module is None:
            continue
        try:
            if vars(module).get("get_forward_backward_func") is stock:
                out.append(name)
        except TypeError:  # modules without __dict__
            continue
    return sorted(out)


def selected_schedule() -> str:
    """The schedule chosen by install(schedule=...) or, failing that, by Megatron-LM's parsed args."""
    return _state["schedule"] or parsed_options().pipeline_schedule


def selected_function():
    """The forward_backward_func of the selected l3plugin schedule ('flexible' or 'flexible-zb')."""
    from l3plugin.megatron.pipeline import forward_backward_pipelining_flexible, forward_backward_pipelining_flexible_zb

    if selected_schedule() == "flexible-zb":
        return forward_backward_pipelining_flexible_zb
    return forward_backward_pipelining_flexible


def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None, **kwargs):
    """Megatron's selector, answering the flexible schedule when it is selected and pp > 1.

    Takes what every supported version's selector takes: (pp_size, vp_size) up to 0.18, plus
    ``schedule_pg_collection`` from 0.19 (Megatron-LM 0.19's loop passes its ProcessGroupCollection). Only the
    arguments given are passed on to Megatron's own selector."""
    if selected_schedule() != "default":
        if type(schedule_pg_collection).__name__ == "MultiModuleProcessGroupCollection":
            raise NotImplementedError(
                f"--pipeline-schedule {selected_schedule()} runs one model's pipeline; Megatron-Core's multi-module "
                "(cross-grid) pipelines (a MultiModuleProcessGroupCollection) need --pipeline-schedule default")
        if pp_size is None:
            from megatron.core import parallel_state

            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        if pp_size > 1:
            return selected_function()
    if schedule_pg_collection is not None:
        kwargs["schedule_pg_collection"] = schedule_pg_collection
    return MEGATRON.stock(_STOCK_SELECTOR)(pp_size, vp_size, **kwargs)


def parse_args(extra_args_provider=None, *args, **kwargs):
    """Megatron-LM's parse_args with l3plugin's flags chained on, the parsed CP arguments checked."""
    # one row per version: megatron.training.initialize's up to 0.17, megatron.training.arguments' from 0.18
    stock = MEGATRON_LM_ARGS.stock(MEGATRON_LM_ARGS.rows()[0].name)
    return prepare_cp_args(stock(chain_extra_args(extra_args_provider), *args, **kwargs))


def hook_megatron_lm_arguments() -> bool:
    """Make Megatron-LM's parse_args accept l3plugin's flags (chained onto the script's
    extra_args_provider) and check/prepare the parsed CP arguments. False without Megatron-LM."""
    try:
        import megatron.training.initialize  # noqa: F401
    except ImportError:
        return False  # megatron-core alone: no Megatron-LM argument parser to extend
    MEGATRON_LM_ARGS.apply()
    return True


def install(schedule: str | None = None):
    """Patch Megatron's get_forward_backward_func names (``schedule`` fixes the choice; None reads
    ``--pipeline-schedule`` from Megatron-LM's args at call time), the CP route (cp_route.py) and, when
    Megatron-LM is importable, its argument parsing. Safe to call more than once."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is invalid: choose one of {SCHEDULES}")
    _state["schedule"] = schedule
    _state["installing"] += 1  # its first apply imports Megatron: the start-up hook then leaves it to this call
    try:
        MEGATRON.apply()  # also patches megatron.training.training if it was imported since the last call
        install_cp_route()
        hook_megatron_lm_arguments()
    finally:
        _state["installing"] -= 1
    early = _early_bound(MEGATRON.stock(_STOCK_SELECTOR))
    if early and schedule != "default":
        warnings.warn(f"{', '.join(early)} bound Megatron's get_forward_backward_func before "
                      "l3plugin.megatron.install(): calls through that name reach Megatron's selector (l3plugin "
                      f"redirects its pipelined schedules to the flexible one when selected, with a warning); {FIX}",
                      EarlyBoundSelectorWarning, stacklevel=2)


def schedule_from_environment() -> str | None:
    """The schedule ``L3PLUGIN_PIPELINE_SCHEDULE`` names (None: unset or empty). Raises a ValueError naming the
    variable, its value and the valid values."""
    value = os.environ.get(SCHEDULE_ENV, "").strip()
    if not value:
        return None
    if value not in SCHEDULES:
        raise ValueError(f"{SCHEDULE_ENV}={value!r} is invalid: choose one of {', '.join(SCHEDULES)} "
                         f"('default' or unset: Megatron's own schedules)")
    return value


def install_from_environment() -> str | None:
    """``install(schedule_from_environment())``, as the start-up hook calls it once Megatron-Core is imported.
    Nothing for 'default' or an unset variable, nor while a script's own ``install()`` is running (its first
    apply imports Megatron: that call is in charge). Returns the schedule installed, else None."""
    schedule = schedule_from_environment()
    if schedule in (None, "default") or _state["installing"]:
        return None
    install(schedule)
    return schedule


def uninstall():
    """Restore Megatron's own selector everywhere install() patched it."""
    if not MEGATRON.applied:
        return
    MEGATRON.undo()
    uninstall_cp_route()
    MEGATRON_LM_ARGS.undo()
    _state.update(schedule=None, warned=False)  # ("installing" is install()'s own count)


# -- the declarations ------------------------------------------------------------------------------------------
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_SELECTOR = "one selector answering the flexible schedule when it is selected and pp > 1"


def _selector_rows(versions: str, signature: tuple) -> list[Patch]:
    """The three names of Megatron's selector, for the versions whose selector takes ``signature``."""
    return [
        Patch("megatron.core.pipeline_parallel", "get_forward_backward_func", get_forward_backward_func,
              signature=signature, versions=versions, why=_SELECTOR),
        Patch(_SCHEDULES, "get_forward_backward_func", get_forward_backward_func,
              signature=signature, versions=versions, why=_SELECTOR),
        Patch("megatron.training.training", "get_forward_backward_func", get_forward_backward_func,
              signature=signature, versions=versions, loaded_only=True,
              why="Megatron-LM's training loop imported the selector by name (a module global)"),
    ]


MEGATRON = PatchSet("l3plugin.megatron", "megatron-core", MEGATRON_CHECKED, [
    *_selector_rows("<0.19", ("pp_size", "vp_size")),
    # 0.19 adds schedule_pg_collection (Megatron-LM 0.19's loop passes it).
    *_selector_rows(">=0.19", ("pp_size", "vp_size", "schedule_pg_collection")),
    # What a selector bound before install() returns, read from these globals at call time.
    *[Patch(_SCHEDULES, name, guarded_schedule, wraps=True, signature=("forward_step_func",),
            why="an early-bound stock selector still runs the flexible schedule while it is selected (warned)")
      for name in _PIPELINED],
])

MEGATRON_LM_ARGS = PatchSet("l3plugin.megatron (Megatron-LM arguments)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.training.initialize", "parse_args", parse_args, optional=True,
          signature=("extra_args_provider",), versions="<0.18",
          why="Megatron-LM's parser accepts l3plugin's flags (chained onto the script's extra_args_provider) and "
              "the parsed CP arguments are checked (initialize_megatron calls it)"),
    Patch("megatron.training.arguments", "parse_args", parse_args, optional=True,
          signature=("extra_args_provider",), versions=">=0.18",
          why="the same, where pretrain_gpt's parse_and_validate_args calls it (pretrain no longer parses)"),
])
