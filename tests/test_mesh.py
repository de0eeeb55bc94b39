"""The 4D mesh: planned table == Megatron-Core parallel_state's groups, in the order TP, CP, PP, DP."""

import itertools
import json

import pytest

from l3plugin.cli import main as cli_main
from l3plugin.demo.mesh_check import check_reports, mesh_report
from l3plugin.mesh.shape import DIMS, MeshShape


def factorizations(world):
    """Every (tp, cp, pp, dp) with product ``world``."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [(tp, cp, pp, world // (tp * cp * pp)) for tp, cp, pp in itertools.product(divisors, repeat=3)
            if world % (tp * cp * pp) == 0]


@pytest.mark.parametrize("sizes", factorizations(8) + factorizations(16))
def test_planned_groups_match_parallel_state_without_processes(sizes):
    shape = MeshShape(*sizes)
    for dims in ("tp", "cp", "pp", "dp", "cp-dp", "tp-cp"):
        assert shape.group_ranks(dims) == shape.megatron_group_ranks(dims), dims


@pytest.mark.parametrize("sizes", factorizations(16))
def test_tp_neighbours_adjacent_and_dp_outermost(sizes):
    shape = MeshShape(*sizes)
    tp, cp, pp, dp = sizes
    for group in shape.group_ranks("tp"):
        assert group == list(range(group[0], group[0] + tp))  # adjacent ranks: same node
    for group in shape.group_ranks("dp"):
        assert all(b - a == tp * cp * pp for a, b in zip(group, group[1:]))  # largest stride
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        assert c["dp"] == rank // (tp * cp * pp)
        assert shape.rank(**c) == rank


def test_every_rank_in_exactly_one_group_per_dimension():
    shape = MeshShape(tp=2, cp=2, pp=2, dp=2)
    for dims in DIMS:
        members = sorted(r for g in shape.group_ranks(dims) for r in g)
        assert members == list(range(16))


def test_bad_sizes_name_the_sizes_and_the_product():
    with pytest.raises(ValueError, match=r"world size 8 != tp\*cp\*pp\*dp = 2\*2\*2\*2 = 16"):
        MeshShape.for_world(8, tp=2, cp=2, pp=2, dp=2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\*cp\*pp = 2\*2\*1 = 4"):
        MeshShape.for_world(6, tp=2, cp=2)
    with pytest.raises(ValueError, match=r"tp=0 is out of range: must be an integer >= 1"):
        MeshShape(tp=0)
    with pytest.raises(ValueError, match=r"rank=8 is out of range: must be an integer in 0..7"):
        MeshShape(tp=2, pp=4).coords(8)


def test_cli_mesh_json(capsys):
    assert cli_main(["mesh", "--tp", "2", "--cp", "2", "--pp", "2", "--dp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"][:2] == [{"rank": 0, "tp": 0, "cp": 0, "pp": 0, "dp": 0},
                                {"rank": 1, "tp": 1, "cp": 0, "pp": 0, "dp": 0}]
    assert len(out["ranks"]) == 16 and out["ranks"][15] == {"rank": 15, "tp": 1, "cp": 1, "pp": 1, "dp": 1}
    assert out["groups"]["pp"][0] == [0, 4]


def test_cli_mesh_table_and_bad_input(capsys):
    assert cli_main(["mesh", "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP groups: (0,1) (2,3)" in out and "PP groups: (0,2) (1,3)" in out
    with pytest.raises(SystemExit) as exc:
        cli_main(["mesh", "--tp", "0"])
    assert exc.value.code == 2
    assert "must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", [(2, 1, 2, 1), (1, 2, 1, 2), (2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2)],
                         ids=lambda s: "tp{}cp{}pp{}dp{}".format(*s))
def test_real_groups_match_table_on_gloo(ranks, sizes):
    shape = MeshShape(*sizes)
    reports = ranks.run(shape.world_size, mesh_report, *sizes, timeout=120)
    assert [r["rank"] for r in reports] == list(range(shape.world_size))
    assert check_reports(shape, reports) == []


def deepspeed_mpu_report(tp, cp, pp, dp):
    import torch.distributed as dist
    from deepspeed.utils import groups

    from deepspeed_mpu import DeepSpeedMPU
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(tp=tp, cp=cp, pp=pp, dp=dp)
    mpu = DeepSpeedMPU(mesh)
    ranks_of = dist.get_process_group_ranks
    saved, groups.mpu = groups.mpu, mpu
    try:
        seq_dp = ranks_of(groups._get_sequence_data_parallel_group())  # DeepSpeed's gradient-reduction group
    finally:
        groups.mpu = saved
    return {
        "model": (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank(),
                  ranks_of(mpu.get_model_parallel_group())),
        "data": (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(),
                 mpu.get_data_parallel_group_ranks()),
        "pipe": (mpu.get_pipe_parallel_world_size(), ranks_of(mpu.get_pipe_parallel_group())),
        "seq": (mpu.get_sequence_parallel_world_size(), ranks_of(mpu.get_sequence_parallel_group())),
        "seq_dp": (mpu.get_sequence_data_parallel_world_size(), seq_dp),
    }


# Every pair of TP, CP and DP above 1 at once, on 4 ranks: a getter that returned another dimension's group is told
# apart in one of them (8 ranks would take all three at once, and pay DeepSpeed's import in 8 workers).
MPU_SHAPES = [(2, 2, 1, 1), (2, 1, 1, 2), (1, 2, 1, 2)]


@pytest.mark.parametrize("sizes", MPU_SHAPES, ids=lambda s: "tp{}cp{}pp{}dp{}".format(*s))
def test_deepspeed_mpu_exposes_the_same_groups(ranks, sizes):
    shape = MeshShape(*sizes)
    tp, cp, pp, dp = sizes
    reports = ranks.run(shape.world_size, deepspeed_mpu_report, *sizes, timeout=180)
    for rank, rep in enumerate(reports):
        c = shape.coords(rank)

        def mine(dims):
            return next(g for g in shape.group_ranks(dims) if rank in g)

        assert rep["model"] == (tp, c["tp"], mine("tp"))
        assert rep["data"] == (dp, c["dp"], mine("dp"))
        assert rep["pipe"] == (pp, mine("pp"))
        assert rep["seq"] == (cp, mine("cp"))
        assert rep["seq_dp"] == (cp * dp, mine("cp-dp"))
