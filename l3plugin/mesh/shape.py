"""The 4D mesh's arithmetic in the paper's order, innermost to outermost: TP, CP, PP, DP.

``MeshShape`` is pure arithmetic (rank <-> coordinates, the ranks that share each group) and needs no
processes, so the CLI, the planner and the trace analysis use it directly; ``groups.py`` builds the real
process groups in the same order.

Why this order (paper section 5): TP is the most communication-heavy, so its ranks are adjacent (same
node); CP next; PP's point-to-point traffic tolerates crossing nodes; DP (FSDP/ZeRO) is outermost
because its collectives overlap with compute.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from l3plugin.arguments.checks import check_int

DIMS = ("tp", "cp", "pp", "dp")
# parallel_state's order string lists dimensions innermost first; ep=1 is a no-op placeholder.
MEGATRON_ORDER = "tp-cp-ep-pp-dp"


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the four parallel dimensions. Rank = tp + TP*(cp + CP*(pp + PP*dp))."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for dim in DIMS:
            size = getattr(self, dim)
            check_int(dim, size)

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None):
        """Shape for ``world_size`` ranks; ``dp`` defaults to what is left after tp*cp*pp."""
        model = tp * cp * pp
        if dp is None:
            if world_size % model:
                raise ValueError(
                    f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {model}; "
                    f"choose sizes whose product divides the world size"
                )
            dp = world_size // model
        shape = cls(tp=tp, cp=cp, pp=pp, dp=dp)
        if shape.world_size != world_size:
            raise ValueError(
                f"world size {world_size} != tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {shape.world_size}; "
                f"the product of the mesh sizes must equal the number of ranks"
            )
        return shape

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.tp, self.cp, self.pp, self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': .., 'cp': .., 'pp': .., 'dp': ..} of a global rank (mixed radix, TP fastest)."""
        check_int("rank", rank, 0, self.world_size - 1)
        out = {}
        for dim, size in zip(DIMS, self.sizes):
            out[dim] = rank % size
            rank //= size
        return out

    def rank(self, tp: int = 0, cp: int = 0, pp: int = 0, dp: int = 0) -> int:
        coords = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        rank, stride = 0, 1
        for dim, size in zip(DIMS, self.sizes):
            check_int(dim, coords[dim], 0, size - 1)
            rank += coords[dim] * stride
            stride *= size
        return rank

    def group_ranks(self, dims: str) -> list[list[int]]:
        """All groups of ranks that vary only along ``dims`` ("tp", "dp", or several: "cp-dp").

        Each group lists ranks in increasing order; groups are sorted by their first rank.
        """
        varying = dims.split("-")
        unknown = [d for d in varying if d not in DIMS]
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {unknown} in {dims!r}: valid are {DIMS}")
        fixed = [d for d in DIMS if d not in varying]
        groups = []
        for fixed_coords in itertools.product(*(range(getattr(self, d)) for d in fixed)):
            base = dict(zip(fixed, fixed_coords))
            members = [
                self.rank(**base, **dict(zip(varying, vc)))
                for vc in itertools.product(*(range(getattr(self, d)) for d in varying))
            ]
            groups.append(sorted(members))
        return sorted(groups)

    def table(self) -> list[dict[str, int]]:
        return [{"rank": r, **self.coords(r)} for r in range(self.world_size)]

    def megatron_group_ranks(self, dims: str) -> list[list[int]]:
        """The same groups as Megatron-Core's parallel_state computes them for our order (no processes)."""
        from megatron.core.parallel_state import RankGenerator

        gen = RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=self.cp, order=MEGATRON_ORDER)
        return sorted(sorted(g) for g in gen.get_ranks(dims))


def format_table(shape: MeshShape) -> str:
    """Rank table plus, per dimension, the ranks that share each group (for `l3plugin mesh`)."""
    lines = [f"4D mesh tp={shape.tp} cp={shape.cp} pp={shape.pp} dp={shape.dp} "
             f"(world size {shape.world_size}; order innermost->outermost: TP, CP, PP, DP)", ""]
    lines.append(f"{'rank':>5} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>3}")
    for row in shape.table():
        lines.append(f"{row['rank']:>5} {row['tp']:>3} {row['cp']:>3} {row['pp']:>3} {row['dp']:>3}")
    lines.append("")
    for dims, label in (("tp", "TP"), ("cp", "CP"), ("pp", "PP"), ("dp", "DP"),
                        ("cp-dp", "DPxCP (gradient reduction)")):
        groups = shape.group_ranks(dims)
        lines.append(f"{label} groups: " + " ".join("(" + ",".join(map(str, g)) + ")" for g in groups))
    return "\n".join(lines)
