"""Mesh check (the demo's first step): every rank initialises Megatron-Core's parallel_state in the
order [TP, CP, PP, DP] through ``l3plugin.mesh.groups.init_mesh`` and reports the members of its real process
groups; the parent checks them against the planned table.
"""

from __future__ import annotations

from l3plugin.mesh.shape import MeshShape

GROUPS = ("tp", "cp", "pp", "dp", "dp-cp")


def mesh_report(tp: int, cp: int, pp: int, dp: int) -> dict:
    """Runs on every rank: build the mesh, return this rank's coordinates and group members."""
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(tp=tp, cp=cp, pp=pp, dp=dp)
    return {"rank": mesh.rank, "coords": mesh.coords,
            "groups": {g: mesh.group_members(g) for g in GROUPS}}


def check_reports(shape: MeshShape, reports: list[dict]) -> list[str]:
    """Differences between what parallel_state built and the planned table (empty when they agree)."""
    problems = []
    for rank, rep in enumerate(reports):
        if rep["coords"] != shape.coords(rank):
            problems.append(f"rank {rank}: coordinates {rep['coords']} != planned {shape.coords(rank)}")
        for g in GROUPS:
            planned = next(grp for grp in shape.group_ranks(g.replace("dp-cp", "cp-dp")) if rank in grp)
            if rep["groups"][g] != planned:
                problems.append(f"rank {rank}: {g} group {rep['groups'][g]} != planned {planned}")
    return problems
