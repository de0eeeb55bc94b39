"""The HF Trainer drives a 2-rank cp = 2 run from the DeepSpeed key alone (no l3plugin import in the training
code), against the same script at cp = 1 (the 2 ranks as data parallelism)."""

import pytest
import torch

pytest.importorskip("accelerate")

from hf_models import ROW_A, ROW_B, documents, quiet_deepspeed, tiny_model  # noqa: E402

ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "steps_per_print": 10**9}


def dataset():
    """Eight documents of varied lengths (as tokenized examples), packed per micro-batch by the collator."""
    lengths = ROW_A + ROW_B + [12, 20]  # 4 per micro-batch at cp=2 (two at cp=1 on each of 2 ranks)
    return [{"input_ids": d, "labels": d} for d in documents(7, lengths)]


def _reset_accelerate():
    import os

    from accelerate.state import AcceleratorState, GradientState, PartialState

    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set by the Trainer / Accelerator; workers are reused

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _weights(engine):
    from deepspeed.utils import safe_get_full_fp32_param

    # Without bf16 DeepSpeed keeps no separate fp32 master: the (replicated) module weights are it.
    return {n: (safe_get_full_fp32_param(p) if engine.bfloat16_enabled() else p).detach().cpu().clone()
            for n, p in engine.module.named_parameters()}


def trainer_run(cp, out_dir, bf16=True, ours=True):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from l3plugin.huggingface.deepspeed_cp import release_groups

    quiet_deepspeed()
    config = {**ZERO, "l3plugin": {"fp32_reduce_zero": ours, "context_parallel_size": cp}}
    try:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4 // (2 // cp), max_steps=2,
                                 gradient_accumulation_steps=1, learning_rate=1e-2, bf16=bf16, use_cpu=True,
                                 deepspeed=config, report_to=[], logging_steps=1, save_strategy="no", seed=3,
                                 ddp_backend="gloo", dataloader_drop_last=True, disable_tqdm=True)
        # padding-free collator: a DataCollatorWithFlattening row is a multiple of 2*cp long only by luck; pad
        # with a last document of labels -100 so every row is (the CP attention asks for S % (2*cp) == 0).
        flatten = DataCollatorWithFlattening()

        def collate(features):
            batch = flatten(features)
            pad = (-batch["input_ids"].size(1)) % 4
            tail = {"input_ids": 0, "labels": -100}
            for key, fill in tail.items():
                batch[key] = torch.cat([batch[key], torch.full((1, pad), fill)], 1)
            batch["position_ids"] = torch.cat([batch["position_ids"], torch.arange(pad)[None]], 1)
            return batch

        trainer = Trainer(model=tiny_model("llama"), args=args, train_dataset=dataset(), data_collator=collate)
        result = trainer.train()
        return {"loss": result.training_loss, "weights": _weights(trainer.model_wrapped),
                "attn": trainer.model.config._attn_implementation}
    except ValueError as exc:
        return {"error": str(exc)}
    finally:
        release_groups()
        _reset_accelerate()


def close(got, ref, tol):
    return all(float((got[n] - w).abs().max()) < tol * float(w.abs().max()) for n, w in ref.items())


def test_trainer_cp2_matches_cp1(ranks, tmp_path):
    # fp32 with DeepSpeed's own ZeRO-2: AdamW's first steps amplify bf16 noise past any useful tolerance.
    ref = ranks.run(2, trainer_run, 1, str(tmp_path / "cp1"), False, False)
    got = ranks.run(2, trainer_run, 2, str(tmp_path / "cp2"), False, False)
    assert got[0]["attn"] == "l3plugin_all_gather_cp" and ref[0]["attn"] == "sdpa"
    assert abs(got[0]["loss"] - ref[0]["loss"]) < 1e-5
    assert close(got[0]["weights"], ref[0]["weights"], 1e-4)
    # l3plugin's ZeRO (bf16 weights, fp32 reduction) at cp=2: the same losses to bf16 precision.
    ours = ranks.run(2, trainer_run, 2, str(tmp_path / "ours"))
    assert abs(ours[0]["loss"] - ref[0]["loss"]) < 2e-2


def test_trainer_bf16_off_message_speaks_trainer(ranks, tmp_path):
    for r in ranks.run(2, trainer_run, 2, str(tmp_path / "nobf16"), False):
        assert "TrainingArguments(bf16=True)" in r["error"]
