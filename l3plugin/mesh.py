"""The 4D device mesh in the paper's order, innermost to outermost: TP, CP, PP, DP.

One place owns the layout. ``MeshShape`` is pure arithmetic (rank <-> coordinates, the ranks that share
each group) and needs no processes, so the CLI and the planner use it directly. ``init_mesh`` builds the
real process groups through Megatron-Core's ``parallel_state`` (we reuse it, not re-implement it) and
returns a ``Mesh`` that exposes them.

Why this order (paper section 5): TP is the most communication-heavy, so its ranks are adjacent (same
node); CP next; PP's point-to-point traffic tolerates crossing nodes; DP (FSDP/ZeRO) is outermost
because its collectives overlap with compute.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

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


@dataclass
class Mesh:
    """This rank's view of the initialised 4D mesh: its coordinates and its process groups."""

    shape: MeshShape
    rank: int
    tp_group: Any
    cp_group: Any
    pp_group: Any
    dp_group: Any
    dp_cp_group: Any  # gradient-reduction group: CP extends DP for parameters

    @property
    def coords(self) -> dict[str, int]:
        return self.shape.coords(self.rank)

    def group(self, dims: str):
        """Process group by name: "tp", "cp", "pp", "dp" or "dp-cp"."""
        by_name = {"tp": self.tp_group, "cp": self.cp_group, "pp": self.pp_group,
                   "dp": self.dp_group, "dp-cp": self.dp_cp_group, "cp-dp": self.dp_cp_group}
        if dims not in by_name:
            raise ValueError(f"unknown group {dims!r}: valid are {sorted(by_name)}")
        return by_name[dims]

    def group_members(self, dims: str) -> list[int]:
        """Global ranks in this rank's group, as torch.distributed reports them."""
        import torch.distributed as dist

        return sorted(dist.get_process_group_ranks(self.group(dims)))


def init_mesh(tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None,
              vpp: int | None = None, **megatron_kwargs) -> Mesh:
    """Initialise Megatron-Core's parallel_state in the order [TP, CP, PP, DP] and return this rank's Mesh.

    torch.distributed must already be initialised (any backend). ``dp`` defaults to
    world_size / (tp*cp*pp). Extra keyword arguments go to ``parallel_state.initialize_model_parallel``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed to be initialised first "
                           "(torch.distributed.init_process_group or torchrun)")
    shape = MeshShape.for_world(dist.get_world_size(), tp=tp, cp=cp, pp=pp, dp=dp)
    destroy_mesh()
    # On a gloo world the regular groups already are gloo groups: duplicates would only cost time.
    megatron_kwargs.setdefault("create_gloo_process_groups", dist.get_backend() != "gloo")
    # parallel_state asserts that the expert data-parallel size equals the dense one unless PP is the
    # outermost dimension. With our order (DP outermost) that holds when expert TP spans TP x CP; the
    # expert groups then have the same PP groups as the dense ones. MoE users can override this.
    megatron_kwargs.setdefault("expert_tensor_parallel_size", tp * cp)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        order=MEGATRON_ORDER,
        **megatron_kwargs,
    )
    return Mesh(
        shape=shape,
        rank=dist.get_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
    )


def destroy_mesh() -> None:
    """Undo init_mesh: reset parallel_state and destroy the process groups it created.

    Megatron's destroy_model_parallel only forgets its groups; their communicators (and, on gloo, their
    threads) live on. A process that re-initialises many times (tests, notebooks) must free them.
    """
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return
    import torch.distributed as dist

    groups, world = {}, dist.group.WORLD
    for value in list(vars(ps).values()):
        for item in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, dist.ProcessGroup) and item is not world:
                groups[id(item)] = item
    ps.destroy_model_parallel()
    for group in groups.values():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass  # already destroyed, or not a group this rank belongs to


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
