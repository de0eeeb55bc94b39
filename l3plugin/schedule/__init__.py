"""Flexible interleaved 1F1B pipeline schedule (Llama 3 paper, section 3.1.1): planning,
validation, simulation and timelines.  Pure Python; matplotlib only for PNG output."""

from .plan import (
    Action,
    Message,
    RankPlan,
    Schedule,
    ScheduleError,
    build_schedule,
    execution_order,
    schedule_from_warmups,
    validate,
    warmup_count,
    with_trainable_stages,
)
from .simulate import SimulationResult, TimedAction, simulate
from .timeline import MissingExtraError, render_png, render_text

__all__ = [
    "Action",
    "Message",
    "MissingExtraError",
    "RankPlan",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "TimedAction",
    "build_schedule",
    "execution_order",
    "render_png",
    "render_text",
    "schedule_from_warmups",
    "simulate",
    "validate",
    "warmup_count",
    "with_trainable_stages",
]
