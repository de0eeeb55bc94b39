"""The 4D mesh's process groups: Megatron-Core's ``parallel_state`` initialised in the order TP, CP, PP, DP.

We reuse ``parallel_state`` (not re-implement it): ``init_mesh`` initialises it in ``shape.py``'s order and
returns this rank's ``Mesh``; ``destroy_mesh`` undoes it, communicators included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from l3plugin.mesh.shape import MEGATRON_ORDER, MeshShape


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
