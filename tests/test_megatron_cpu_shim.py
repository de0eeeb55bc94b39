"""The test-only shim runs Megatron-Core's stock pipeline schedules on CPU, matching a serial run bit for bit."""

import pytest
import torch

import toy_pipeline as toy

HIDDEN, SEQ, MBS = 8, 4, 2


def toy_config(pp, vpp, num_layers, group_size=None):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=1,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32, microbatch_group_size_per_vp_stage=group_size,
        # pp=2 with virtual stages and batched P2P silently corrupts gradients upstream (Megatron-LM#750).
        batch_p2p_comm=not (pp == 2 and vpp is not None),
    )


def run_stock(pp, vpp, num_microbatches, num_layers, group_size=None, use_shim=True):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from l3plugin.mesh.groups import init_mesh
    from megatron_cpu_shim import stock_schedules_on_cpu

    mesh = init_mesh(pp=pp, vpp=vpp)
    config = toy_config(pp, vpp, num_layers, group_size)
    chunks = toy.build_chunks(config, num_layers=num_layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                              pp_size=pp, vpp_size=vpp or 1)
    batches = toy.make_microbatches(num_microbatches, SEQ, MBS, HIDDEN)
    kwargs = dict(forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks],
                  model=chunks, num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
    if not use_shim:
        try:
            get_forward_backward_func()(**kwargs)
        except (RuntimeError, AssertionError) as exc:  # fails before any P2P, on every rank alike
            return {"error": str(exc)}
        return {"error": None}
    with stock_schedules_on_cpu():
        losses = get_forward_backward_func()(**kwargs)
    grads = {}
    for chunk in chunks:
        grads.update(chunk.grads())
    return {"losses": [d["loss"] for d in losses], "grads": grads}


@pytest.mark.parametrize("pp,vpp,m,layers", [(2, None, 5, 4), (2, 2, 4, 8), (4, None, 6, 4), (4, 2, 8, 8)],
                         ids=["1f1b-pp2", "interleaved-pp2-vp2", "1f1b-pp4", "interleaved-pp4-vp2"])
def test_stock_schedule_on_cpu_matches_serial_bitwise(ranks, pp, vpp, m, layers):
    results = ranks.run(pp, run_stock, pp, vpp, m, layers, timeout=120)
    toy.assert_matches_serial(results, toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=layers,
                              hidden=HIDDEN)


def test_without_the_shim_stock_schedules_need_cuda(ranks):
    results = ranks.run(2, run_stock, 2, None, 2, 2, use_shim=False, timeout=120)
    # a CPU build of torch names CUDA; a CUDA build (Python 3.12's from the package index) the missing driver
    assert all(r["error"] and ("CUDA" in r["error"] or "NVIDIA driver" in r["error"]) for r in results), results
