"""Megatron-Core GPTModel with l3plugin's core_attention: cp=2 on gloo matches cp=1 (loss and grads)."""

import pytest
import torch

import tiny_gpt as gpt

SEQ = 16
LAYOUTS = {"one-document": [0, SEQ], "paper-3-3-8-2": [0, 3, 6, 14, 16], "tiny-docs": [0, 1, 2, 5, 9, 10, 13, 16]}


def gpt_step(cp, cu, dtype, cp_layout="2cp", position_embedding_type="learned_absolute"):
    """Loss (mean over the full sequence's masked tokens) and full-model grads summed over CP ranks."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from l3plugin.cp import sharding
    from l3plugin.demo.model import build_chunk
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(cp=cp)  # cp 2 on two ranks, cp 1 (the reference) on one
    config = gpt.gpt_config(2, cp=cp, params_dtype=dtype)
    model = build_chunk(config, vocab=gpt.VOCAB, seq_len=SEQ, pre_process=True, post_process=True,
                        position_embedding_type=position_embedding_type, cp_layout=cp_layout).to(dtype)
    batch = gpt.microbatches(1, 1, SEQ)[0]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    batch["position_ids"] = sharding.position_ids_per_document(cu_t, SEQ)[None]
    den = batch["loss_mask"].sum()
    if cp > 1:
        batch = sharding.shard_batch(batch, cp, mesh.coords["cp"], layout=cp_layout, cu_seqlens=cu_t)
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                             max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                      packed_seq_params=packed)
    return gpt.cp_loss_and_grads(model, per_token, batch["loss_mask"], den, dtype, mesh.cp_group)


def gpt_steps(cases):
    """``fn(*args)`` for each (fn, args) in turn on this rank: every run of a world size in one call."""
    return [fn(*args) for fn, args in cases]


def gpt_step_without_rope_fix(*args):
    from l3plugin.megatron import attention

    keep = attention.rope_follows_cp_layout
    attention.rope_follows_cp_layout = lambda model, cp_layout: model  # Megatron's 2cp-chunk RoPE slicing
    try:
        return gpt_step(*args)
    finally:
        attention.rope_follows_cp_layout = keep


def cp2_run(layout, cp_layout="2cp", embedding="learned_absolute", fix=True):
    return (gpt_step if fix else gpt_step_without_rope_fix,
            (2, tuple(LAYOUTS[layout]), torch.float64, cp_layout, embedding))


def cp1_run(layout, embedding="learned_absolute"):
    return gpt_step, (1, tuple(LAYOUTS[layout]), torch.float64, "2cp", embedding)


BALANCED = ["paper-3-3-8-2", "tiny-docs"]
EMBEDDINGS = ["rope", "learned_absolute"]
# Every run of the tests below: the cp 2 ones in one call to two ranks, their cp 1 references (each once) in one
# call to one rank.
CP2_RUNS = ([cp2_run(layout) for layout in LAYOUTS]
            + [cp2_run(layout, "balanced", embedding) for layout in BALANCED for embedding in EMBEDDINGS]
            + [cp2_run("paper-3-3-8-2", "balanced", "rope", fix=False)])
CP1_RUNS = list(dict.fromkeys([cp1_run(layout) for layout in LAYOUTS]
                              + [cp1_run(layout, embedding) for layout in BALANCED for embedding in EMBEDDINGS]))


@pytest.fixture(scope="module")
def gpt_runs(ranks):
    """{(fn, args) of CP2_RUNS: both ranks' results} and {CP1_RUNS: the one rank's result}."""
    done = dict(zip(CP2_RUNS, zip(*ranks.run(2, gpt_steps, CP2_RUNS, timeout=240))))
    done.update(zip(CP1_RUNS, ranks.run(1, gpt_steps, CP1_RUNS, timeout=240)[0]))
    return done


# Megatron's RoPE moves its frequencies to torch.cuda.current_device() (rotary_pos_embedding.py:162),
# so on CPU the model uses learned absolute positions; on GPUs RoPE's CP slicing uses the same layout.
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_cp2_matches_cp1(gpt_runs, layout):
    gpt.assert_equal_to_cp1(list(gpt_runs[cp2_run(layout)]), gpt_runs[cp1_run(layout)])


# The balanced layout with RoPE: rope_follows_cp_layout must give each rank its own positions' rotary
# embedding (the demo's CPU RoPE, wrapped). The documents make the balanced layout differ from the paper's.
@pytest.mark.parametrize("layout", BALANCED)
@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_gpt_cp2_balanced_layout_matches_cp1(gpt_runs, layout, embedding):
    from l3plugin.cp.layout import balanced_layout, two_chunk_layout

    assert balanced_layout(LAYOUTS[layout], SEQ, 2).ranges != two_chunk_layout(SEQ, 2).ranges
    cp2 = list(gpt_runs[cp2_run(layout, "balanced", embedding)])
    gpt.assert_equal_to_cp1(cp2, gpt_runs[cp1_run(layout, embedding)])


def test_balanced_layout_needs_the_rope_fix(gpt_runs):
    """Control for the test above: without rope_follows_cp_layout the loss differs from cp=1."""
    wrong = gpt_runs[cp2_run("paper-3-3-8-2", "balanced", "rope", fix=False)][0]
    cp1 = gpt_runs[cp1_run("paper-3-3-8-2", "rope")]
    assert abs(float(wrong["loss"] - cp1["loss"])) > 1e-6


def test_cp_layout_option_errors():
    from megatron.core.transformer.enums import AttnMaskType

    from l3plugin.cp.layout import two_chunk_layout
    from l3plugin.megatron.attention import AllGatherCPCoreAttention, gpt_layer_spec_with_cp_attention

    config = gpt.gpt_config(2)
    with pytest.raises(ValueError, match=r"cp_layout='zigzag' is invalid: a model takes a layout name, one of "
                                         r"\['2cp', 'balanced'\]"):
        AllGatherCPCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=object(),
                                 cp_layout="zigzag")
    with pytest.raises(ValueError, match=r"cp_layout='2cp' is invalid: .*a CPLayout fits one sequence only"):
        gpt_layer_spec_with_cp_attention(cp_layout=two_chunk_layout(16, 2))
    spec = gpt_layer_spec_with_cp_attention(cp_layout="balanced")
    assert spec.submodules.self_attention.submodules.core_attention.keywords == {"cp_layout": "balanced"}


def test_attention_dropout_is_refused():
    from megatron.core.transformer.enums import AttnMaskType

    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    config = gpt.gpt_config(2)
    with pytest.raises(ValueError, match="attention_dropout=0.1 is not supported"):
        AllGatherCPCoreAttention(config, 1, AttnMaskType.causal, "self", attention_dropout=0.1,
                                 pg_collection=object())
