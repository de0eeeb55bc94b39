"""CP from Megatron-LM's flags: --context-parallel-size 2 --cp-comm-type l3plugin_all_gather through the
launcher, with document masks from EOD (--reset-attention-mask), checked against stock Megatron-Core at cp = 1
with its own dense document mask. Megatron-LM is not on PyPI: the script is a stand-in that calls the same
functions pretrain_gpt.py calls (tests/data/megatron_lm_standin/README.md)."""

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from l3plugin.cp.sharding import cu_seqlens_from_eod
from l3plugin.upstream.versions import imported_version, version_in

# Megatron-LM reorganised get_batch and argument parsing in 0.18: a stand-in per layout.
NEW_LM = version_in(imported_version("megatron.core").version, ">=0.18")
DATA = Path(__file__).resolve().parents[1] / "data"
STANDIN = DATA / ("megatron_lm_standin_0_18" if NEW_LM else "megatron_lm_standin")
# What pretrain_gpt's forward_step hands the model: up to 0.17 l3plugin's sharding returns "sbhd" params; from 0.18
# the script builds "thd" ones itself and l3plugin gives them to GPTModel as "sbhd" (batch_hooks.gpt_model_forward).
SCRIPT_FORMAT = "thd" if NEW_LM else "sbhd"
SCRIPT = STANDIN / "pretrain_gpt_standin.py"
MODEL = ["--num-layers", "2", "--seq-length", "32", "--transformer-impl", "local"]
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
OURS = ["--context-parallel-size", "2", "--cp-comm-type", "l3plugin_all_gather"]


def run_standin(argv, out_dir, launcher=True):
    """On every rank: the launcher runs the stand-in script; its saved results come back. launcher=False:
    the script alone, and the error it raises, as text; "patch": the script as the two-line patch changes it."""
    import runpy

    import torch.distributed as dist
    from megatron.core import parallel_state

    from l3plugin.megatron import launch, uninstall
    from l3plugin.mesh.groups import destroy_mesh
    from megatron_cpu_shim import sequence_parallel_norm_on_cpu, stock_attention_on_cpu, stock_schedules_on_cpu

    saved_argv, saved_path = list(sys.argv), list(sys.path)
    sys.path.insert(0, str(STANDIN))
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, f"rank{dist.get_rank()}.pt")
    try:
        # stock's local attention (the reference) and Megatron's RoPE allocate on "cuda"
        # with --sequence-parallel: the local spec's norms as with apex on a GPU (WrappedTorchNorm refuses SP)
        norms = sequence_parallel_norm_on_cpu() if "--sequence-parallel" in argv else contextlib.nullcontext()
        with stock_attention_on_cpu(), stock_schedules_on_cpu(), norms, rope_on_cpu():
            if launcher == "patch":
                sys.argv[:] = [str(SCRIPT), *argv, "--standin-result", out]
                os.environ["STANDIN_AS_PATCHED"] = "1"
                runpy.run_path(str(SCRIPT), run_name="__main__")
                return torch.load(out)
            if not launcher:
                sys.argv[:] = [str(SCRIPT), *argv, "--standin-result", out]
                try:
                    runpy.run_path(str(SCRIPT), run_name="__main__")
                except AssertionError as exc:
                    return str(exc)
                return "ran"
            assert launch.main([str(SCRIPT), *argv, "--standin-result", out]) == 0
        return torch.load(out)
    finally:
        os.environ.pop("STANDIN_AS_PATCHED", None)
        uninstall()
        # destroy_mesh: Megatron's destroy_model_parallel only forgets its process groups; left alive, the 17 of
        # a run make the rank pool replace its workers, whose next call imports Megatron's model stack again.
        destroy_mesh()
        parallel_state.destroy_model_parallel()
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        for name in [n for n in sys.modules if n.startswith("megatron.training")]:
            del sys.modules[name]


@contextlib.contextmanager
def rope_on_cpu():
    """Megatron's RotaryEmbedding.forward moves its frequencies to the current CUDA device and slices CP ranks'
    positions with a pinned CUDA index; the demo's CPU version computes the same (it slices the paper's 2cp
    chunks of the ``max_seq_len`` it is given, as stock does)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from l3plugin.demo.model import rope_on_cpu

    stock = RotaryEmbedding.forward
    RotaryEmbedding.forward = rope_on_cpu
    try:
        yield
    finally:
        RotaryEmbedding.forward = stock


def assert_same_step(got, ref, tol=1e-5):
    assert int(got["num_tokens"]) == int(ref["num_tokens"])
    assert abs(float(got["loss"] - ref["loss"])) <= tol * abs(float(ref["loss"]))
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        err = float((got["grads"][name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.fixture(scope="module")
def stock_cp1(ranks, tmp_path_factory):
    """Stock Megatron-Core: local DotProductAttention, the data loader's dense [s, s] document mask; by
    position embedding, run once each."""
    done = {}

    def run(embedding="learned_absolute"):
        if embedding not in done:
            argv = [*MODEL, *DOCS, "--position-embedding-type", embedding]
            out = ranks.run(2, run_standin, argv, str(tmp_path_factory.mktemp("stock")), timeout=180)
            assert out[0]["core_attention"] == "DotProductAttention"
            assert out[0]["seen"]["attention_mask"] == (1, 1, 32, 32)
            done[embedding] = out[0]
        return done[embedding]

    return run


# RoPE: Megatron sizes it by packed_seq_params.max_seqlen_q whenever packed_seq_params is given, then takes this
# CP rank's 2cp chunks of it: max_seqlen must be the whole sequence (32), not the longest document (14).
# 2cp with RoPE through the launcher is the 2cp-patch-rope case (the two-line patch installs the same route) and
# the pipeline tests below (all RoPE, through the launcher).
@pytest.mark.parametrize("layout, launcher, embedding", [
    ("balanced", True, "rope"), ("2cp", "patch", "rope"), ("2cp", True, "learned_absolute")])
def test_two_flags_give_document_masked_cp_equal_to_stock_cp1(ranks, tmp_path, stock_cp1, layout, launcher,
                                                              embedding):
    argv = [*MODEL, *DOCS, *OURS, "--l3plugin-cp-layout", layout, "--position-embedding-type", embedding]
    for r in ranks.run(2, run_standin, argv, str(tmp_path), launcher=launcher, timeout=180):
        assert r["core_attention"] == "AllGatherCPCoreAttention"
        # No dense mask; the GLOBAL document boundaries from the EOD tokens (the model gets them as sbhd).
        assert r["seen"] == {"attention_mask": None,
                             "packed_seq_params": (SCRIPT_FORMAT, [0, 5, 13, 14, 28, 32])}
        assert_same_step(r, stock_cp1(embedding))


def test_documents_matter(ranks, tmp_path, stock_cp1):
    """Control: the same CP run without --reset-attention-mask (one document) differs from stock's masked
    run, and equals stock cp = 1 without it (Megatron's own 2cp sharding; no packed_seq_params)."""
    ours = ranks.run(2, run_standin, [*MODEL, *OURS], str(tmp_path / "ours"), timeout=180)[0]
    assert ours["seen"] == {"attention_mask": None, "packed_seq_params": None}
    masked = stock_cp1()
    assert abs(float(ours["loss"] - masked["loss"])) > 1e-3 * abs(float(masked["loss"])) or \
        int(ours["num_tokens"]) != int(masked["num_tokens"])
    stock = ranks.run(2, run_standin, MODEL, str(tmp_path / "stock"), timeout=180)[0]
    assert_same_step(ours, stock)


def test_without_the_route_stock_megatron_refuses_our_flags(ranks, tmp_path):
    """Why the route exists: the same script and flags without the launcher stop in Megatron's local
    attention (the failure that Megatron-LM users meet without l3plugin)."""
    out = ranks.run(2, run_standin, [*MODEL, *DOCS, *OURS], str(tmp_path), launcher=False, timeout=180)
    assert all("Context parallelism is only supported by TEDotProductAttention" in r for r in out)


def ns(**kw):
    base = dict(cp_comm_type=["l3plugin_all_gather"], context_parallel_size=2, transformer_impl="local",
                reset_attention_mask=True, micro_batch_size=1, l3plugin_cp_layout="2cp", l3plugin_cp_kv="regather",
                sft=False, hybrid_context_parallel=False, use_legacy_models=False,
                create_attention_mask_in_dataloader=True)
    base.update(kw)
    return argparse.Namespace(**base)


def test_args_select_the_route_and_drop_the_dense_mask():
    from l3plugin.megatron.arguments import CPRoute, check_cp_args, prepare_cp_args

    assert check_cp_args(ns()) == CPRoute(layout="2cp", cp_kv="regather", documents=True)
    assert check_cp_args(ns(cp_comm_type=["p2p"], reset_attention_mask=True)) is None
    with pytest.warns(UserWarning, match="--calculate-per-token-loss"):
        args = prepare_cp_args(ns())
    assert args.create_attention_mask_in_dataloader is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare_cp_args(ns(calculate_per_token_loss=True))  # the exact token mean: nothing to warn about
    stock = prepare_cp_args(ns(cp_comm_type=["p2p"]))
    assert stock.create_attention_mask_in_dataloader is True  # stock runs are left alone


def test_parsed_options_are_checked_once_per_arguments_object(monkeypatch):
    """The selector and the CP hooks ask on every call; Megatron-LM's arguments are read and checked once per run
    (once per arguments object), and a new arguments object is checked again."""
    import types

    from l3plugin.megatron import arguments

    checked = []
    check = arguments.check_cp_args
    monkeypatch.setattr(arguments, "check_cp_args", lambda args: checked.append(args) or check(args))
    global_vars = types.ModuleType("megatron.training.global_vars")
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    assert arguments.parsed_options() == arguments.MegatronOptions()  # no parsed arguments: the defaults
    global_vars._GLOBAL_ARGS = first = ns(pipeline_schedule="flexible")
    for _ in range(3):
        options = arguments.parsed_options()
    assert options == arguments.MegatronOptions("flexible", arguments.CPRoute(documents=True)) and checked == [first]
    global_vars._GLOBAL_ARGS = second = ns(cp_comm_type=["p2p"], reset_attention_mask=False)
    assert arguments.parsed_options() == arguments.MegatronOptions("default", None) and checked == [first, second]
    global_vars._GLOBAL_ARGS = ns(micro_batch_size=2)
    with pytest.raises(ValueError, match="--micro-batch-size 1"):
        arguments.parsed_options()


def test_dataloader_inter_document_masking_selects_the_documents_route():
    """Megatron-LM 0.19's --dataloader-inter-document-masking: the loader's cu_seqlens are the documents (no
    --reset-attention-mask needed); one packed sequence per micro-batch; the balanced layout is allowed."""
    from l3plugin.megatron.arguments import CPRoute, check_cp_args

    loader = dict(reset_attention_mask=False, dataloader_inter_document_masking=True)
    assert check_cp_args(ns(**loader)) == CPRoute(documents=True, loader_documents=True)
    assert check_cp_args(ns(**loader, l3plugin_cp_layout="balanced")).layout == "balanced"
    assert check_cp_args(ns()).loader_documents is False
    with pytest.raises(ValueError, match="--dataloader-inter-document-masking with --cp-comm-type l3plugin_all_gather "
                                         "needs --micro-batch-size 1 \\(got 2\\)"):
        check_cp_args(ns(**loader, micro_batch_size=2))


def test_dataloader_inter_document_masking_builds_data_on_every_pipeline_stage():
    """With --dataloader-inter-document-masking pretrain_gpt's get_batch reads cu_seqlens on middle stages, whose
    data it builds only for --sft: under l3plugin's route the datasets are built on TP rank 0 of every stage;
    without the flag, or without the route, pretrain_gpt's own rule stands."""
    import types

    from l3plugin.megatron.arguments import CPRoute
    from l3plugin.megatron.batch_hooks import dataset_built_where

    def first_or_last_only():
        return False  # pretrain_gpt's rule on a middle stage

    loader = CPRoute(documents=True, loader_documents=True)
    idm = types.SimpleNamespace(inter_document_masking=True)
    for tp_rank, built in ((0, True), (1, False)):
        assert dataset_built_where(loader, idm, first_or_last_only, lambda: tp_rank)() is built
    eod = CPRoute(documents=True)
    plain = types.SimpleNamespace(inter_document_masking=False)
    for route, config in ((None, idm), (eod, idm), (loader, plain)):
        assert dataset_built_where(route, config, first_or_last_only, lambda: 0) is first_or_last_only


@pytest.mark.parametrize("change, message", [
    (dict(context_parallel_size=1), "--context-parallel-size 1"),
    (dict(cp_comm_type=["l3plugin_all_gather", "p2p"]), "mixes"),
    (dict(transformer_impl="transformer_engine"), "needs Transformer Engine"),
    (dict(micro_batch_size=2), "--micro-batch-size 1 \\(got 2\\)"),
    (dict(reset_attention_mask=False, l3plugin_cp_layout="balanced"), "balanced.*--reset-attention-mask"),
    (dict(sft=True), "--sft"),
    (dict(cp_comm_type=["p2p"], l3plugin_cp_layout="balanced"), "apply to --cp-comm-type l3plugin_all_gather"),
])
def test_bad_combinations_are_refused_naming_the_flag(change, message):
    from l3plugin.megatron.arguments import check_cp_args
    from l3plugin.megatron.te_backend import te_unavailable_reason

    if "transformer_impl" in change and te_unavailable_reason() is None:
        pytest.skip("Transformer Engine is importable here: the TE route is allowed")
    with pytest.raises(ValueError, match=message):
        check_cp_args(ns(**change))


def test_cu_seqlens_from_eod_follows_megatrons_document_mask():
    """The boundaries equal the documents of Megatron-Core's own dense mask (gpt_dataset.py)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        tokens = torch.randint(0, 6, (40,), generator=gen)  # token 5 is the EOD, often adjacent or last
        cu = cu_seqlens_from_eod(tokens[None], 5)
        mask, _, _ = _get_ltor_masks_and_position_ids(tokens, 5, False, True, False, True)
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())
        allowed = (doc[:, None] == doc[None, :]) & torch.ones(40, 40, dtype=torch.bool).tril()
        assert torch.equal(~mask[0], allowed)
    with pytest.raises(ValueError, match="one packed sequence"):
        cu_seqlens_from_eod(torch.zeros(2, 8, dtype=torch.long), 5)


def test_spec_swap_picks_the_backend():
    """Local spec -> AllGatherCPCoreAttention with the route's options; TE's spec -> l3plugin's TE
    backend, refused with the reason where TE cannot be imported; a spec already ours is kept."""
    import functools

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from l3plugin.megatron.attention import AllGatherCPCoreAttention
    from l3plugin.megatron.arguments import CPRoute
    from l3plugin.megatron.cp_route import l3plugin_core_attention
    from l3plugin.megatron.te_backend import te_unavailable_reason

    route = CPRoute(layout="balanced", cp_kv="keep", documents=True)
    core = l3plugin_core_attention(DotProductAttention, route)
    assert core.func is AllGatherCPCoreAttention
    assert core.keywords == dict(cp_layout="balanced", cp_kv="keep", documents_required=True)
    mine = functools.partial(AllGatherCPCoreAttention, cp_layout="2cp")
    assert l3plugin_core_attention(mine, route) is mine
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    if te_unavailable_reason() is None:
        assert l3plugin_core_attention(TEDotProductAttention, route).func.__name__ == "L3TEDotProductAttention"
    else:
        with pytest.raises(RuntimeError, match="Transformer Engine"):
            l3plugin_core_attention(TEDotProductAttention, route)


def boundaries_over_tp():
    """Megatron-LM's get_batch_on_this_tp_rank (up to 0.17) with TP = 2 on a last pipeline stage: TP rank 0 read
    the data (it keeps the tokens), rank 1 got labels only; l3plugin adds the boundaries on both."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    from l3plugin.megatron.cp_route import install_cp_route, uninstall_cp_route
    from l3plugin.mesh.groups import destroy_mesh

    sys.path.insert(0, str(STANDIN))
    try:
        from megatron.training import global_vars

        global_vars._GLOBAL_ARGS = ns(create_attention_mask_in_dataloader=False, seq_length=8)
        global_vars._GLOBAL_TOKENIZER = argparse.Namespace(eod=9)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
        install_cp_route()
        from megatron.training import utils as lm_utils  # read at call time: the patched function

        tokens = torch.tensor([[1, 9, 2, 3, 9, 9, 4, 5]])
        data = {"tokens": tokens, "labels": tokens.roll(-1), "position_ids": tokens * 0,
                "loss_mask": torch.ones(1, 8), "attention_mask": None}
        out = lm_utils.get_batch_on_this_tp_rank(iter([data]) if dist.get_rank() == 0 else None)
        return out["cu_seqlens"].tolist(), out["max_seqlen"].tolist()
    finally:
        uninstall_cp_route()
        destroy_mesh()  # its process groups too (see run_standin)
        parallel_state.destroy_model_parallel()
        sys.path.remove(str(STANDIN))
        for name in [n for n in sys.modules if n.startswith("megatron.training")]:
            del sys.modules[name]


@pytest.mark.skipif(NEW_LM, reason="Megatron-LM's get_batch_on_this_tp_rank(data_iterator) exists up to 0.17")
def test_document_boundaries_reach_every_tp_rank(ranks):
    """The boundaries, and max_seqlen = S as from 0.18 (the length Megatron's RoPE takes from PackedSeqParams)."""
    assert ranks.run(2, boundaries_over_tp, timeout=60) == [([[0, 2, 5, 6, 8]], [8])] * 2


def boundaries_over_tp_from_0_18():
    """Megatron-Core 0.18+'s get_batch_on_this_tp_rank with TP = 2 on a last pipeline stage: it drops the tokens on
    every rank, so l3plugin reads the EOD positions on TP rank 0 before the broadcast and sends the boundaries."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import utils as core_utils  # read at call time: the patched function

    from l3plugin.megatron.cp_route import install_cp_route, uninstall_cp_route
    from l3plugin.mesh.groups import destroy_mesh
    from megatron_cpu_shim import stock_attention_on_cpu

    sys.path.insert(0, str(STANDIN))
    try:
        from megatron.training import global_vars

        global_vars._GLOBAL_ARGS = ns(calculate_per_token_loss=True)
        global_vars._GLOBAL_TOKENIZER = argparse.Namespace(eod=9)
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
        install_cp_route()
        tokens = torch.tensor([[1, 9, 2, 3, 9, 9, 4, 5]])
        batch = {} if dist.get_rank() else {"tokens": tokens, "labels": tokens.roll(-1), "position_ids": tokens * 0,
                                             "loss_mask": torch.ones(1, 8), "attention_mask": None,
                                             "cu_seqlens": None, "max_seqlen": None}
        flag = "is_sft" if version_in(imported_version("megatron.core").version, "<0.19") else "has_cu_seqlens"
        with stock_attention_on_cpu():  # megatron.core.utils' receive buffers on torch.cuda.current_device()
            out = core_utils.get_batch_on_this_tp_rank(
                batch, **{flag: False}, is_hybrid_cp=False, create_attention_mask_in_dataloader=False,
                broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
                broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1,
                tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=1, seq_length=8, mtp_on_this_rank=False,
                pipeline_model_parallel_size=2, is_pipeline_first_stage=False, is_pipeline_last_stage=True)
        return out["tokens"], out["cu_seqlens"].tolist(), out["max_seqlen"].tolist(), out["labels"].tolist()
    finally:
        uninstall_cp_route()
        destroy_mesh()  # its process groups too (see run_standin)
        mpu.destroy_model_parallel()
        sys.path.remove(str(STANDIN))
        for name in [n for n in sys.modules if n.startswith("megatron.training")]:
            del sys.modules[name]


@pytest.mark.skipif(not NEW_LM, reason="Megatron-Core's get_batch_on_this_tp_rank(batch, ...) exists from 0.18")
def test_document_boundaries_reach_every_tp_rank_from_0_18(ranks):
    labels = [[9, 2, 3, 9, 9, 4, 5, 1]]
    assert ranks.run(2, boundaries_over_tp_from_0_18, timeout=60) == [(None, [[0, 2, 5, 6, 8]], [8], labels)] * 2


def test_a_stage_without_boundaries_refuses_instead_of_attending_across_documents():
    """Megatron-LM's get_batch gives middle pipeline stages no batch: with documents that is an error."""
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    class OneRank:
        def size(self):
            return 1

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, attention_dropout=0.0)
    q = torch.zeros(4, 1, 2, 4)
    for required in (True, False):
        core = AllGatherCPCoreAttention(config, 3, None, "self", pg_collection=SimpleNamespace(cp=OneRank()),
                                        documents_required=required)
        if required:
            with pytest.raises(ValueError, match="layer 3: document masks are on.*first and last pipeline"):
                core(q, q, q, None)
        else:
            assert core(q, q, q, None).shape == (4, 1, 8)


# ---- the 4D layouts: documents on every pipeline stage, virtual stages, TP with sequence parallel ----

PIPELINE = ["--num-layers", "4", "--seq-length", "32", "--transformer-impl", "local", "--position-embedding-type",
            "rope", "--global-batch-size", "4"]  # one layer per (virtual) stage; 4 micro-batches
PP = "--pipeline-model-parallel-size"
# Ours (cp = 2), and the reference: stock Megatron-Core at cp = 1 with its dense EOD mask where every stage is a
# first or last stage (stock gives a middle stage no mask: it attends across documents). Weights come from the
# parameters' global names, so the layouts start from the same numbers.
LAYOUTS = {
    "pp4": ([PP, "4"], [PP, "2"]),  # Megatron's stock 1F1B, two middle stages
    "pp2_vp2_flexible": ([PP, "2", "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule",
                          "flexible"], [PP, "2"]),  # every rank holds a middle virtual stage
    "tp2_pp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel", PP, "2"],
                ["--tensor-model-parallel-size", "2", "--sequence-parallel", PP, "2"]),
}


def world_of(argv, cp=1):
    sizes = {flag: int(value) for flag, value in zip(argv, argv[1:])
             if flag in (PP, "--tensor-model-parallel-size")}
    return cp * sizes.get(PP, 1) * sizes.get("--tensor-model-parallel-size", 1)


def pipelined_step(ranks, argv, out_dir, cp=1):
    """Losses ([sum, tokens] per micro-batch, from the last stage) and every gradient keyed by TP rank."""
    out = ranks.run(world_of(argv, cp), run_standin, argv, out_dir, timeout=300)
    losses = [r["losses"] for r in out if r["losses"]]
    grads = {(r["tp_rank"], name): g for r in out if r["cp_rank"] == 0 for name, g in r["grads"].items()}
    return losses[0], grads, out


@pytest.fixture(scope="module")
def stock_pipelined(ranks, tmp_path_factory):
    """pipelined_step of a stock cp = 1 reference, each argument list run once (pp4 and pp2_vp2_flexible share
    theirs)."""
    done = {}

    def run(argv):
        if tuple(argv) not in done:
            done[tuple(argv)] = pipelined_step(ranks, argv, str(tmp_path_factory.mktemp("cp1")))
        return done[tuple(argv)]

    return run


@pytest.mark.skipif(NEW_LM, reason="the 0.18+ stand-in runs one pipeline stage (its pretrain_gpt's get_batch is "
                                   "mirrored for PP = 1 only); the 4D layouts are tested on the 0.16 stand-in")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_documents_on_every_pipeline_stage_equal_stock_cp1(ranks, tmp_path, stock_pipelined, layout):
    """cp = 2 with documents through the launcher equals stock Megatron-Core at cp = 1 (dense EOD mask, every
    stage a first or last one): per micro-batch loss sums and token counts, every gradient. Middle stages get
    no batch from get_batch; their attention would otherwise see one document, and RoPE the wrong length."""
    ours, reference = LAYOUTS[layout]
    ref_losses, ref_grads, ref = stock_pipelined([*PIPELINE, *DOCS, *reference])
    assert ref[0]["core_attention"] == "DotProductAttention"
    losses, grads, out = pipelined_step(ranks, [*PIPELINE, *DOCS, *OURS, *ours], str(tmp_path / "cp2"), cp=2)
    assert {r["core_attention"] for r in out} == {"AllGatherCPCoreAttention"}
    assert len(losses) == len(ref_losses) == 4
    for got, want in zip(losses, ref_losses):
        assert int(got[1]) == int(want[1])
        assert abs(float(got[0] - want[0])) <= 1e-5 * abs(float(want[0]))
    assert grads.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
        err = float((grads[key] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err < 1e-5, f"{key}: relative error {err:.2e}"


def mismatched_boundaries():
    """Two pipeline stages; the last stage's own batch has other boundaries than the first stage sent."""
    from megatron.core import parallel_state

    from l3plugin.megatron.cp_documents import BoundaryChannel
    from l3plugin.mesh.groups import destroy_mesh

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        channel = BoundaryChannel(parallel_state.get_pipeline_model_parallel_group(), torch.device("cpu"))
        chunk = object()
        if channel.is_source:
            first = channel.boundaries(chunk, torch.tensor([0, 5, 32], dtype=torch.int32)).tolist()
            second = channel.boundaries(chunk, torch.tensor([0, 9, 32], dtype=torch.int32)).tolist()
            channel.finish()
            return [first, second]
        middle = channel.boundaries(chunk, None).tolist()  # a middle stage: the first stage's
        try:
            channel.boundaries(chunk, torch.tensor([0, 10, 32], dtype=torch.int32))
        except ValueError as exc:
            return [middle, str(exc)]
        return [middle, "no error"]
    finally:
        destroy_mesh()  # its process groups too (see run_standin)
        parallel_state.destroy_model_parallel()


def test_a_stage_reading_another_microbatch_is_named(ranks):
    source, other = ranks.run(2, mismatched_boundaries, timeout=60)
    assert source == [[0, 5, 32], [0, 9, 32]]
    assert other[0] == [0, 5, 32]
    assert "rank 1: micro-batch 1: the document boundaries of this stage's batch [0, 10, 32] differ from the " \
           "first stage's [0, 9, 32]" in other[1]
