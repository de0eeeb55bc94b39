"""4D parallelism planner (Llama 3 paper, section 5): TP, CP, PP and DP sizes, the pipeline schedule
(vpp, k) and the ZeRO stage from a model, a cluster and a batch.

    models.py     presets and JSON model files       costs.py    memory / communication / time model
    schedule_cache.py  cached schedule builds/simulations search.py   enumeration and best-first ranking
    machine.py    the machine as flags, presets, assumptions  staged.py  the paper's long-context stage rule
    report.py     what ``l3plugin plan`` prints: table, reasons, JSON, Megatron-LM and DeepSpeed configs
    layer_profile.py, layer_report.py   layers that differ (--kinds, --frozen): costs, balanced split, report
    cli.py        ``add_plan_parser`` for ``l3plugin plan``
"""

from .cli import add_plan_parser, run_plan
from .costs import Layout
from .machine import MACHINES, Hardware
from .models import PRESETS, ModelSpec, load_model
from .schedule_cache import ScheduleCache
from .search import NoPlanFits, PlanRequest, enumerate_layouts, evaluate, plan
from .staged import Base, StagedPlan, load_base, staged_plan

__all__ = ["Base", "Hardware", "Layout", "MACHINES", "ModelSpec", "NoPlanFits", "PRESETS", "PlanRequest",
           "ScheduleCache", "StagedPlan", "add_plan_parser", "enumerate_layouts", "evaluate", "load_base",
           "load_model", "plan", "run_plan", "staged_plan"]
