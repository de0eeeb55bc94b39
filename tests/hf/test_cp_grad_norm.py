"""The gradient norm under '"l3plugin": {"context_parallel_size": 2}' (2 gloo ranks: 1 DP x 2 CP), with and without
"fp32_reduce_zero", against one process (issue 55, item 2).

Each CP rank's gradient is a partial sum that DeepSpeed sums over the CP ranks; the norm it reports
(``get_global_grad_norm``, the HF Trainer's grad_norm) and clips with must be that of the summed gradient, each
element counted once. Reference: the same tiny Llama in one process (plain torch, fp32, the same start), the
same packed documents, loss mean over all tokens, ``clip_grad_norm_`` at the same max norm, torch SGD. The max
norm (0.01) clips every step, so a wrong norm also moves the weights off the reference's path.
"""

import pytest
import torch
import torch.distributed as dist

import transformers  # noqa: F401 (the "hf" test extra: missing, it fails here, never skips)

from hf_models import NEEDS_DEEPSPEED_SP, VOCAB, packed, quiet_deepspeed, step_rows  # noqa: E402
from stock_bugs import SKIP_IF_STOCK_ZERO_STEP_FAILS  # noqa: E402

STEPS, CLIP, LR = 3, 0.01, 20.0


def _model(tie, dtype):
    """A 2-layer GQA Llama (tiny_model's shape), optionally with tied input / output embeddings."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      attention_dropout=0.0, tie_word_embeddings=tie, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _batch(step):
    batch = packed(step_rows(step, 0))
    return batch, torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))


def _reference(tie, dtype):
    """One process, fp32, from the DeepSpeed run's start (its weights as ``dtype``): (norms before clipping,
    initial weights, final weights)."""
    model = _model(tie, dtype).float()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        batch, count = _batch(step)
        model(**batch, num_items_in_batch=count).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return norms, start, {n: p.detach().clone() for n, p in model.named_parameters()}


def run(ours, tie):
    """The DeepSpeed engine under the key (2 ranks, CP 2): its reported norms, final fp32 weights, and the
    groups / squared sums its norm is made of (for the report when it fails); rank 0 also the reference."""
    from deepspeed.utils import safe_get_full_fp32_param

    from l3plugin.deepspeed.sequence_parallel import release_groups

    deepspeed = quiet_deepspeed()
    import l3plugin.deepspeed  # noqa: F401  (the autoload does this in a real run)

    dtype = torch.bfloat16 if ours else torch.float32
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
           "l3plugin": {"context_parallel_size": 2}}
    if ours:
        cfg["bf16"] = {"enabled": True}
        cfg["l3plugin"]["fp32_reduce_zero"] = True
    try:
        model = _model(tie, dtype)
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        assert model.config._attn_implementation == "l3plugin_all_gather_cp"
        out = {"norms": [], "sq": []}
        if ours:
            group = engine.optimizer.zero.norm_group
            out["norm_group"] = None if group is None else dist.get_process_group_ranks(group)
        for step in range(STEPS):
            batch, count = _batch(step)
            engine.backward(engine(**batch, num_items_in_batch=count).loss)
            if ours:  # this rank's squared sum of its reduced fp32 shard, before the step clips it
                out["sq"].append(sum(float(b.shard_grad.float().pow(2).sum()) for b in engine.optimizer.zero.buckets
                                     if b.shard_grad is not None))
            engine.step()
            out["norms"].append(float(engine.get_global_grad_norm()))
        out["weights"] = {n: safe_get_full_fp32_param(p).detach().float().clone()
                          for n, p in engine.module.named_parameters()}
        if dist.get_rank() == 0:
            out["reference"] = _reference(tie, dtype)
        return out
    finally:
        release_groups()


# Tolerances: (norm ratio - 1, relative error of each tensor's update). Measured: stock fp32 ~1e-6 and 1e-5; ours
# (bf16 forward and backward) 1.1e-3 and 1.1e-2. With the norm sqrt(2) too large (issue 55): 0.41 and 0.33.
@NEEDS_DEEPSPEED_SP
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("zero,tol,wtol", [pytest.param("stock2", 1e-4, 1e-3, marks=SKIP_IF_STOCK_ZERO_STEP_FAILS),
                                           ("ours2", 5e-3, 3e-2)])
def test_cp2_grad_norm_and_clipped_steps_match_one_process(ranks, zero, tol, wtol, tie):
    got = ranks.run(2, run, zero == "ours2", tie, timeout=120)
    ref_norms, start, ref_weights = got[0]["reference"]
    why = {k: got[0].get(k) for k in ("norm_group", "sq")} | {"sq1": got[1]["sq"]}
    assert got[0]["norms"] == got[1]["norms"]
    ratios = [a / b for a, b in zip(got[0]["norms"], ref_norms)]
    assert len(ratios) == STEPS and all(abs(r - 1) < tol for r in ratios), (ratios, why)
    assert all(n > 10 * CLIP for n in ref_norms)  # every step clipped: the norm decides the update
    assert set(got[0]["weights"]) == set(ref_weights)
    for r in range(2):
        for n, ref in ref_weights.items():
            moved, ref_moved = got[r]["weights"][n] - start[n], ref - start[n]
            err = float((moved - ref_moved).norm() / ref_moved.norm())
            assert err < wtol, (n, err, ratios, why)
