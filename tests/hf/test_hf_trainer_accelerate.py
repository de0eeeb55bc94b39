"""The HF Trainer and an accelerate loop each drive a 2-rank cp = 2 run from the DeepSpeed key alone (no l3plugin
import in the training code), against the same script at cp = 1 (the 2 ranks as data parallelism)."""

import pytest
import torch
import torch.distributed as dist

import accelerate  # noqa: E402,F401 (the "hf" test extra, installed by make test: missing, it fails here, never skips)

from hf_models import NEEDS_DEEPSPEED_SP, ROW_A, ROW_B, documents, quiet_deepspeed, tiny_model  # noqa: E402
from stock_bugs import SKIP_IF_STOCK_ZERO_STEP_FAILS  # noqa: E402

pytestmark = NEEDS_DEEPSPEED_SP  # every run here is CP from the key

ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "steps_per_print": 10**9}


def dataset():
    """Eight documents of varied lengths (as tokenized examples), packed per micro-batch by the collator."""
    lengths = ROW_A + ROW_B + [12, 20]  # 4 per micro-batch at cp=2 (two at cp=1 on each of 2 ranks)
    return [{"input_ids": d, "labels": d} for d in documents(7, lengths)]


def _hook_accelerate():
    """In a script accelerate is imported before deepspeed (the Trainer's and `from accelerate import ...`'s
    order), so the autoload patches accelerate's data-loader sharding; these workers are reused across test files
    and may have imported deepspeed first: patch what has been imported since (idempotent)."""
    import accelerate.accelerator  # noqa: F401

    import l3plugin.deepspeed

    l3plugin.deepspeed.install()


def _accelerate_environment() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}


def _reset_accelerate(environment: dict):
    """Put back accelerate's state and its ACCELERATE_* variables as they were before the run (workers are reused:
    transformers 4.57's TrainingArguments(bf16=True) sets ACCELERATE_MIXED_PRECISION=bf16, which would make a later
    Accelerator() of the same worker run in bf16)."""
    import os

    from accelerate.state import AcceleratorState, GradientState, PartialState

    for name in set(_accelerate_environment()) - set(environment):
        del os.environ[name]
    os.environ.update(environment)

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

    from l3plugin.deepspeed.sequence_parallel import release_groups

    quiet_deepspeed()
    _hook_accelerate()
    environment = _accelerate_environment()
    config = {**ZERO, "l3plugin": {"fp32_reduce_zero": ours, "context_parallel_size": cp}}
    try:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4 // (2 // cp), max_steps=2,
                                 gradient_accumulation_steps=1, learning_rate=1e-2, bf16=bf16, use_cpu=True,
                                 deepspeed=config, report_to=[], logging_steps=1, save_strategy="no", seed=3,
                                 ddp_backend="gloo", dataloader_drop_last=True, disable_tqdm=True)
        trainer = Trainer(model=tiny_model("llama"), args=args, train_dataset=dataset(),
                          data_collator=DataCollatorWithFlattening())  # rows of any length: the hook pads
        result = trainer.train()
        return {"loss": result.training_loss, "weights": _weights(trainer.model_wrapped),
                "attn": trainer.model.config._attn_implementation}
    except ValueError as exc:
        return {"error": str(exc)}
    finally:
        release_groups()
        _reset_accelerate(environment)


def close(got, ref, tol):
    return all(float((got[n] - w).abs().max()) < tol * float(w.abs().max()) for n, w in ref.items())


@SKIP_IF_STOCK_ZERO_STEP_FAILS  # its reference is stock ZeRO-2
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


def accelerate_run(cp):
    """An accelerate loop (Qwen2, the paper's 2cp layout, the model's own loss without num_items_in_batch, ZeRO-1,
    2 micro-batches per step): each rank's batch at cp = 1 is one row of 2 documents (accelerate shards the loader
    over the 2 ranks); at cp = 2 one row of the same 4 documents (the loader sharded over DP ranks only)."""
    import os

    from accelerate import Accelerator, DeepSpeedPlugin, PartialState
    from deepspeed.utils import safe_get_full_grad
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithFlattening

    from l3plugin.deepspeed.sequence_parallel import release_groups

    quiet_deepspeed()
    _hook_accelerate()
    environment = _accelerate_environment()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
              "steps_per_print": 10**9, "l3plugin": {"context_parallel_size": cp, "cp_layout": "2cp"}}
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch --use_deepspeed` sets
    try:
        PartialState(backend="gloo")  # CPU ranks: without it accelerate sees one process
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        # Documents of 20 and 12 tokens: every 32-token cp = 1 row holds 30 labelled tokens, so the mean of the
        # two DP rows' token means (cp = 1) is the token mean of their concatenation (cp = 2).
        data = [{"input_ids": d, "labels": d} for d in documents(11, [20, 12] * 8)]
        loader = DataLoader(data, batch_size=2 * cp, collate_fn=DataCollatorWithFlattening())
        model = tiny_model("qwen2")
        # SGD: weights stay linear in the gradients. AdamW's per-element normalisation turns fp32 rounding of
        # near-zero gradient elements into weight differences of ~5e-4 of the largest weight after 2 steps,
        # between the stock cp = 1 run and an fp64 reference as much as between cp = 2 and cp = 1.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        engine, _, loader = accelerator.prepare(model, optimizer, loader)
        grads, losses = [], []
        stock_step = engine.step

        def step(*args, **kwargs):  # accelerate's backward calls engine.step(): the reduced gradients, before it
            if engine.is_gradient_accumulation_boundary():
                grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()})
            return stock_step(*args, **kwargs)

        engine.step = step
        for batch in loader:
            with accelerator.accumulate(engine):
                loss = engine(**batch).loss
                accelerator.backward(loss)
                losses.append(float(loss))
        seen = torch.tensor([len(losses)])
        dist.all_reduce(seen)
        return {"losses": losses, "grads": grads, "weights": _weights(engine), "batches": int(seen),
                "attn": model.config._attn_implementation, "bf16": engine.bfloat16_enabled()}
    finally:
        release_groups()
        _reset_accelerate(environment)


@SKIP_IF_STOCK_ZERO_STEP_FAILS  # both runs are stock ZeRO-1
def test_accelerate_cp2_matches_cp1(ranks):
    got = ranks.run(2, accelerate_run, 2)
    ref = ranks.run(2, accelerate_run, 1)
    assert got[0]["attn"] == "l3plugin_all_gather_cp" and ref[0]["attn"] == "sdpa"
    assert not got[0]["bf16"] and not ref[0]["bf16"]  # fp32, as configured (no mixed precision left by another run)
    assert got[0]["losses"] == got[1]["losses"]  # one CP group: the same batches, the whole sequences' loss
    assert got[0]["batches"] == 8 and ref[0]["batches"] == 8  # DP-only sharding: both ranks of the group saw all 4
    want = [(a + b) / 2 for a, b in zip(ref[0]["losses"], ref[1]["losses"])]
    assert max(abs(a - b) for a, b in zip(got[0]["losses"], want)) < 1e-5
    assert len(got[0]["grads"]) == len(ref[0]["grads"]) == 2
    for mine, theirs in zip(got[0]["grads"], ref[0]["grads"]):
        assert close(mine, theirs, 1e-5)
    assert close(got[0]["weights"], ref[0]["weights"], 1e-5)
