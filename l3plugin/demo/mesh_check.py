"""The main job on CPU (`make demo`): start the ranks over gloo and build the 4D mesh on them.

Every rank initialises Megatron-Core's parallel_state in the order [TP, CP, PP, DP] through
``l3plugin.mesh.init_mesh`` and reports the members of its real process groups; the parent checks them
against the planned table and prints it.
"""

from __future__ import annotations

import time

from l3plugin.mesh import MeshShape, format_table

GROUPS = ("tp", "cp", "pp", "dp", "dp-cp")


def mesh_report(tp: int, cp: int, pp: int, dp: int) -> dict:
    """Runs on every rank: build the mesh, return this rank's coordinates and group members."""
    from l3plugin.mesh import init_mesh

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


def run_demo(args) -> int:
    from l3plugin.testing.ranks import RankPool

    shape = MeshShape(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)
    print(f"[1/3] starting {shape.world_size} CPU ranks over gloo ...", flush=True)
    t0 = time.monotonic()
    with RankPool(shape.world_size, preload=("megatron.core",)) as pool:
        print(f"[2/3] ranks up in {time.monotonic() - t0:.1f} s; building the mesh with "
              f"Megatron-Core parallel_state ...", flush=True)
        reports = pool.run(mesh_report, shape.tp, shape.cp, shape.pp, shape.dp, timeout=args.timeout)
    problems = check_reports(shape, reports)
    print(f"[3/3] every rank reported its groups ({time.monotonic() - t0:.1f} s in all)\n", flush=True)
    print(format_table(shape))
    if problems:
        print("\nMISMATCH between parallel_state and the planned table:\n  " + "\n  ".join(problems))
        return 1
    print(f"\nOK: the process groups of all {shape.world_size} ranks match the table.")
    return 0
