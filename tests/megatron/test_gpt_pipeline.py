"""A real Megatron-Core GPTModel (local layer spec, no TE) under the flexible schedule matches serial."""

import pytest

import tiny_gpt as gpt
from l3plugin.debug.numerics import assert_bitwise_equal

SEQ, MBS = 16, 2
_RUNS = {}  # (world, function, arguments) -> every rank's result: see session_run


def session_run(ranks, world, fn, *args, timeout=180):
    """``ranks.run(world, fn, *args)``, each (world, fn, args) run once per session: this module and
    test_zero_bubble_pipeline (which imports it) read the same flexible and serial runs."""
    key = (world, fn.__name__, args)
    if key not in _RUNS:
        _RUNS[key] = ranks.run(world, fn, *args, timeout=timeout)
    return _RUNS[key]


def gpt_flexible_step(pp, vpp, m, k, num_layers, layout=None, pipeline_schedule="flexible"):
    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=pp, vpp=vpp)
    r = mesh.coords["pp"]
    extra = {"pipeline_model_parallel_layout": layout} if layout else {}
    config = gpt.gpt_config(num_layers, pp=pp, vpp=vpp, k=k, **extra)
    chunks = [gpt.build_gpt(config, pre_process=r == 0 and c == 0, post_process=r == pp - 1 and c == vpp - 1,
                            vp_stage=c, seq_len=SEQ) for c in range(vpp)]
    batches = gpt.microbatches(m, MBS, SEQ)
    out = forward_backward_pipelining_flexible(
        forward_step_func=gpt.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, pipeline_schedule=pipeline_schedule)
    return {"grads": gpt.named_grads(chunks), "losses": [d["lm loss"] for d in out]}


def gpt_serial_step(m, num_layers):
    """The same model in one piece, microbatch after microbatch (loss scaled as Megatron scales it)."""
    from l3plugin.mesh.groups import init_mesh

    init_mesh()  # one rank: no communication
    model = gpt.build_gpt(gpt.gpt_config(num_layers), seq_len=SEQ)
    losses = []
    for batch in gpt.microbatches(m, MBS, SEQ):
        out, reduce = gpt.forward_step(iter([batch]), model)
        loss, stats = reduce(out)
        losses.append(stats["lm loss"])
        (loss / m).backward()
    return {"grads": gpt.named_grads([model]), "losses": losses}


def assert_gpt_matches_serial(pipelined, serial, m):
    """Every parameter's gradient and every loss bit for bit (numerics names the first difference)."""
    grads = {}
    for r in pipelined:
        grads.update(r["grads"])
    assert grads.keys() == serial["grads"].keys()
    assert len(pipelined[-1]["losses"]) == m

    def flat(losses, named):
        return {**{f"loss[{i}]": x for i, x in enumerate(losses)}, **{n: named[n] for n in sorted(named)}}

    assert_bitwise_equal(flat(pipelined[-1]["losses"], grads), flat(serial["losses"], serial["grads"]))


@pytest.mark.parametrize("m,k", [(4, 2), (5, 3), (3, 1)], ids=["k=p", "k>p,partial-group", "k<p"])
def test_gpt_pp2_vpp2_flexible_matches_serial(ranks, m, k):
    layers = 4
    pipelined = session_run(ranks, 2, gpt_flexible_step, 2, 2, m, k, layers)
    serial = session_run(ranks, 1, gpt_serial_step, m, layers)[0]
    assert_gpt_matches_serial(pipelined, serial, m)


def test_gpt_uneven_layout_one_layer_on_first_and_last_stage(ranks):
    # The paper's uneven split: the stages with the embedding and the loss get one layer fewer.
    m, k, layers = 5, 3, 6
    pipelined = ranks.run(2, gpt_flexible_step, 2, 2, m, k, layers, "Et|tt|tt|tL", timeout=180)
    assert all(r["grads"] for r in pipelined)
    serial = ranks.run(1, gpt_serial_step, m, layers, timeout=180)[0]
    assert_gpt_matches_serial(pipelined, serial, m)
