"""TRL as the client, with its own defaults: its fused LM head (the loss TRL computes itself from per-token
log-probs) and SFTTrainer (gradient checkpointing on, clipping at 1.0, padding-free batches) at cp = 2 from the
DeepSpeed key alone, against the same script at cp = 1."""

import pytest
import torch
import torch.distributed as dist

import trl  # noqa: E402,F401 (the "test" extra, installed by make test: missing, it fails here, never skips)

from hf_models import NEEDS_DEEPSPEED_SP, ROW_A, ROW_B, documents, packed, quiet_deepspeed, tiny_model  # noqa: E402
from test_hf_trainer_accelerate import _accelerate_environment, _hook_accelerate, _reset_accelerate, _weights  # noqa


def fused_head_loss(cp_on, num_items):
    """TRL's SFT loss as SFTTrainer computes it from its fused LM head: -log_probs.sum() / tokens; the gradients
    summed over the CP ranks (as DeepSpeed sums them over its sequence-parallel ranks)."""
    from trl.trainer.utils import add_fused_lm_head

    from l3plugin.huggingface import enable_context_parallel

    batch = packed([documents(1, ROW_A), documents(2, ROW_B)])
    model = tiny_model("llama")
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    if cp_on:
        enable_context_parallel(model, dist.group.WORLD, "balanced")
    extra = {"num_items_in_batch": torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))} if num_items else {}
    out = model(**batch, fused_lm_head=True, **extra)
    tokens = out.label_mask.sum() if not num_items else extra["num_items_in_batch"]
    loss = -out.log_probs.sum() / tokens
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if cp_on:
        for g in grads.values():
            dist.all_reduce(g)
    shifted = out.log_probs if not cp_on else out.log_probs[:, :-1]  # cp: pre-shifted labels, one more column
    return {"loss": float(loss), "model_loss": float(out.loss), "tokens": int(out.label_mask.sum()),
            "log_probs": shifted.detach(), "top1": int(out.is_top1.sum()), "grads": grads}


@pytest.mark.parametrize("num_items", [False, True])
def test_fused_lm_head_loss_is_the_whole_sequences(ranks, num_items):
    ref = ranks.run(1, fused_head_loss, False, num_items)[0]
    for rank, got in enumerate(ranks.run(2, fused_head_loss, True, num_items)):
        assert abs(got["loss"] / ref["loss"] - 1) < 1e-6, (rank, got["loss"], ref["loss"])
        assert abs(got["model_loss"] / ref["model_loss"] - 1) < 1e-6, (rank, got["model_loss"], ref["model_loss"])
        assert got["tokens"] == ref["tokens"] and got["top1"] == ref["top1"], rank
        assert torch.allclose(got["log_probs"], ref["log_probs"], atol=1e-5), rank
        for name, want in ref["grads"].items():
            assert torch.allclose(got["grads"][name], want, atol=1e-5, rtol=1e-4), (rank, name)


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary, built here (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from hf_models import VOCAB

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                   pad_token="t0", eos_token="t2", unk_token="t1")


CLIP = 0.5  # below every step's norm here: clipping scales every step

SFT_ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
            "optimizer": {"type": "SGD", "params": {"lr": "auto"}}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9}


def sft_run(cp, out_dir, ours, packing=False, accumulation=1):
    """SFTTrainer with SFTConfig's defaults (gradient checkpointing, max_grad_norm 1.0, its fused-head loss),
    padding-free (or packed) rows, the DeepSpeed key; every logged step and the weights after it."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from l3plugin.deepspeed.sequence_parallel import release_groups

    quiet_deepspeed()
    _hook_accelerate()
    environment = _accelerate_environment()
    config = {**SFT_ZERO, "l3plugin": {"fp32_reduce_zero": ours, "context_parallel_size": cp}}
    lengths = ROW_A + ROW_B + [12, 20]  # 4 per micro-batch at cp = 2 (two per rank at cp = 1)
    rows = [{"input_ids": d} for d in documents(7, lengths * accumulation)]
    try:
        args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=4 // (2 // cp), max_steps=3,
                         gradient_accumulation_steps=accumulation, learning_rate=0.5, use_cpu=True, bf16=ours,
                         deepspeed=config, report_to=[], logging_steps=1, save_strategy="no", seed=3,
                         ddp_backend="gloo", dataloader_drop_last=True, disable_tqdm=True, lr_scheduler_type="constant",
                         padding_free=not packing, packing=packing, max_length=None if not packing else 64,
                         dataset_num_proc=None, max_grad_norm=CLIP)
        trainer = SFTTrainer(model=tiny_model("llama"), args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tiny_tokenizer())
        trainer.train()
        logs = [{k: entry[k] for k in ("loss", "grad_norm", "num_tokens") if k in entry}
                for entry in trainer.state.log_history if "loss" in entry]
        return {"logs": logs, "weights": _weights(trainer.model_wrapped),
                "checkpointing": bool(trainer.model.is_gradient_checkpointing),
                "attn": trainer.model.config._attn_implementation}
    finally:
        release_groups()
        _reset_accelerate(environment)


@pytest.mark.parametrize("ours, tol", [(False, 1e-4), (True, 2e-2)])
def test_sft_trainer_cp2_logs_and_clips_as_cp1(ranks, tmp_path, ours, tol):
    """SGD with clipping active (the norms are above 1.0): a wrong norm or a wrong loss scale moves the weights.
    ours: l3plugin's FP32-reducing ZeRO (it needs bf16, so bf16 rounding: tol) at both sizes, else stock ZeRO-2 in
    fp32."""
    ref = ranks.run(2, sft_run, 1, str(tmp_path / "cp1"), ours, timeout=240)[0]
    got = ranks.run(2, sft_run, 2, str(tmp_path / "cp2"), ours, timeout=240)[0]
    assert got["checkpointing"] and got["attn"] == "l3plugin_all_gather_cp" and ref["attn"] == "sdpa"
    assert len(got["logs"]) == len(ref["logs"]) == 3
    for step, (g, r) in enumerate(zip(got["logs"], ref["logs"])):
        assert r["grad_norm"] > CLIP, (step, r)  # clipping is active
        assert abs(g["loss"] / r["loss"] - 1) < tol, (step, g, r)
        assert abs(g["grad_norm"] / r["grad_norm"] - 1) < tol, (step, g, r)
    for name, want in ref["weights"].items():
        assert torch.allclose(got["weights"][name], want, atol=tol), name


def custom_loop_loss(cp_on):
    """A loop computing its own loss from the logits (log_softmax, gather, sum): made whole with full_rows."""
    from l3plugin.huggingface import enable_context_parallel, full_rows, last_cp_batch, sum_over_cp

    batch = packed([documents(1, ROW_A), documents(2, ROW_B)])
    model = tiny_model("llama")
    if cp_on:
        enable_context_parallel(model, dist.group.WORLD, "balanced")
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # next-token labels, full rows
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    if cp_on:  # this rank's tokens, local order: its labels, then the per-token NLL as whole rows
        cp_batch = last_cp_batch(model)
        index = torch.stack([layout.indices(cp_batch.cp_rank) for layout in cp_batch.layouts])
        mine = labels.gather(1, index)
    else:
        mine = labels
    nll = -logits.log_softmax(-1).gather(-1, mine.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (mine != -100)
    if cp_on:
        whole = full_rows(nll, cp_batch)
        by_sum = sum_over_cp(nll.sum(), cp_batch.group) / (labels != -100).sum()
    else:
        whole = by_sum = None
    loss = (whole if cp_on else nll).sum() / (labels != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if cp_on:
        for g in grads.values():
            dist.all_reduce(g)
    return {"loss": float(loss), "by_sum": None if by_sum is None else float(by_sum), "grads": grads}


def test_a_custom_loss_made_whole_with_full_rows_or_sum_over_cp(ranks):
    ref = ranks.run(1, custom_loop_loss, False)[0]
    for rank, got in enumerate(ranks.run(2, custom_loop_loss, True)):
        assert abs(got["loss"] / ref["loss"] - 1) < 1e-6 and abs(got["by_sum"] / ref["loss"] - 1) < 1e-6, (rank, got)
        for name, want in ref["grads"].items():
            assert torch.allclose(got["grads"][name], want, atol=1e-5, rtol=1e-4), (rank, name)
