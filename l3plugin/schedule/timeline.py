"""Draw pipeline timelines like the Llama 3 paper's Fig. 2-4: one row per rank, time to the right.

``render_text`` works in any terminal; ``render_png`` needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

from .plan import FORWARD, WEIGHT, Schedule
from .simulate import SimulationResult, TimedAction, simulate

IDLE = "."


class MissingExtraError(ImportError):
    """An optional dependency (package extra) is not installed."""


def _label(action: TimedAction, vpp: int) -> str:
    # "F3.1" = forward of microbatch 3 on local chunk 1; the chunk is dropped when vpp == 1.
    chunk = f".{action.chunk}" if vpp > 1 else ""
    return f"{action.op}{action.microbatch}{chunk}"


def unit_simulation(schedule: Schedule) -> SimulationResult:
    """``schedule`` simulated with every step one slot long (F, B and, where the plan has them, W)."""
    return simulate(schedule, forward_time=1.0, backward_time=1.0,
                    weight_time=1.0 if schedule.split_backward else None)


def render_text(schedule: Schedule, sim: SimulationResult | None = None) -> str:
    """Per-rank timeline as text.

    Without ``sim`` every action takes one slot (forward, backward and weight time 1), which shows
    the order compactly, like the paper's figures.  With ``sim`` the boxes are as long as the
    simulated durations; one slot is the shorter of the forward and backward time.
    """
    if sim is None:
        sim = unit_simulation(schedule)
    unit = min(t for t in (sim.forward_time, sim.backward_time, sim.weight_time) if t > 0)
    cell = max(len(_label(a, sim.vpp)) for a in sim.actions) + 1  # +1: a gap between boxes
    if any((t / unit) % 1 for a in sim.actions for t in (a.start, a.end)):
        cell += 1  # off-grid times (latency) round by up to a char: keep label + gap visible

    def column(t: float) -> int:
        return round(t / unit * cell)

    width = column(sim.makespan)
    header = (
        f"pp={sim.pp} vpp={sim.vpp} microbatches={sim.microbatches} "
        f"group_size={sim.group_size} makespan={sim.makespan:g}"
    )
    tag = "<mb>.<chunk>" if sim.vpp > 1 else "<mb>"
    legend = (f"F{tag} = forward, B{tag} = input gradient, W{tag} = weight gradient, '.' = idle"
              if schedule.split_backward else f"F{tag} = forward, B{tag} = backward, '.' = idle")
    lines = [header, legend]
    for plan in schedule.ranks:
        row = [IDLE] * width
        for action in (a for a in sim.actions if a.rank == plan.rank):
            start, end = column(action.start), column(action.end)
            box = _label(action, sim.vpp).ljust(end - start - 1) + " "
            row[start:end] = box[: end - start]
        lines.append(f"rank {plan.rank:<2} warmup {plan.warmup:<3}|{''.join(row).rstrip()}")
    return "\n".join(lines)


# ---- PNG ----------------------------------------------------------------------------------
FORWARD_RGB = (0.30, 0.45, 0.69)  # blue
BACKWARD_RGB = (0.87, 0.52, 0.32)  # orange
WEIGHT_RGB = (0.33, 0.66, 0.41)  # green


def _shade(rgb: tuple[float, float, float], chunk: int, vpp: int) -> tuple[float, float, float]:
    """Lighter colour for higher chunks, so virtual stages on one rank are told apart."""
    mix = 0.55 * chunk / max(vpp - 1, 1)
    return tuple(c + (1.0 - c) * mix for c in rgb)


def render_png(sim: SimulationResult, path: str) -> None:
    """Write the simulated timeline as a PNG: blue forwards, orange backwards (input gradients where the plan
    splits them), green weight gradients, lighter shades for higher chunks, the microbatch number in each box;
    rank 0 on top."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise MissingExtraError(
            "render_png needs matplotlib, which is not installed; "
            "install the plot extra: pip install 'l3plugin[plot]'"
        ) from exc

    # Figure/FigureCanvasAgg instead of pyplot: always the Agg backend, no global state.
    slots = sim.makespan / min(t for t in (sim.forward_time, sim.backward_time, sim.weight_time) if t > 0)
    fig = Figure(figsize=(min(max(6.0, 0.35 * slots), 60.0), 1.0 + 0.5 * sim.pp))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    fontsize = 7 if slots < 150 else 5
    for action in sim.actions:
        base = FORWARD_RGB if action.op == FORWARD else WEIGHT_RGB if action.op == WEIGHT else BACKWARD_RGB
        duration = action.end - action.start
        ax.barh(
            action.rank, duration, left=action.start, height=0.8,
            color=_shade(base, action.chunk, sim.vpp), edgecolor="black", linewidth=0.4,
        )
        ax.text(
            action.start + duration / 2, action.rank, str(action.microbatch),
            ha="center", va="center", fontsize=fontsize,
        )
    ax.set_yticks(range(sim.pp))
    ax.set_yticklabels([f"rank {r}" for r in range(sim.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time")
    ax.set_title(
        f"pp={sim.pp} vpp={sim.vpp} m={sim.microbatches} k={sim.group_size}: "
        f"makespan {sim.makespan:g}, bubble ratio {sim.bubble_ratio:.3f}"
    )
    kinds = [("forward", FORWARD_RGB), ("backward", BACKWARD_RGB)]
    if sim.weight_time:
        kinds = [("forward", FORWARD_RGB), ("input gradient", BACKWARD_RGB), ("weight gradient", WEIGHT_RGB)]
    handles = [
        Patch(facecolor=_shade(rgb, chunk, sim.vpp), edgecolor="black", label=f"{name} chunk {chunk}")
        for name, rgb in kinds
        for chunk in range(sim.vpp)
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
