"""Flexible interleaved 1F1B pipeline schedule (Llama 3 paper, section 3.1.1) and its zero-bubble variant
(backward split into B and W): planning, validation, receive posting, simulation and timelines.  Pure Python; matplotlib only for PNG output."""

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
from .receives import ReceivePosts, agreed_order_posts, receive_budget, receive_posts
from .simulate import SimulationResult, TimedAction, simulate, simulate_posted
from .timeline import MissingExtraError, render_png, render_text
from .zero_bubble import build_zero_bubble_schedule

__all__ = [
    "Action",
    "Message",
    "MissingExtraError",
    "RankPlan",
    "ReceivePosts",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "TimedAction",
    "agreed_order_posts",
    "build_schedule",
    "build_zero_bubble_schedule",
    "execution_order",
    "render_png",
    "receive_budget",
    "receive_posts",
    "render_text",
    "schedule_from_warmups",
    "simulate",
    "simulate_posted",
    "validate",
    "warmup_count",
    "with_trainable_stages",
]
