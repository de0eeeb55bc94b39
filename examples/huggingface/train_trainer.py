"""Long-context fine-tuning with the HF Trainer and l3plugin's all-gather context parallelism: the DeepSpeed
config's "l3plugin": {"context_parallel_size": 2} is the only change (no l3plugin import, no model edit).

    torchrun --nproc-per-node 2 examples/huggingface/train_trainer.py

Both ranks form one CP group: each step's packed row (documents of varied lengths joined by
DataCollatorWithFlattening, positions restarting per document) is split over the 2 ranks, every layer's
attention all-gathers K/V over the group, documents crossing the split stay masked apart, and the loss is the
whole row's token mean. Same script on GPUs (drop the CPU lines).
"""

import argparse
import os

import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from common import documents, skip_cpu_shm_build, tiny_llama


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--docs-per-row", type=int, default=24, help="documents packed into one row (~2K tokens)")
    p.add_argument("--output-dir", default="/tmp/l3plugin_hf_trainer")
    args = p.parse_args()
    skip_cpu_shm_build()
    cpu = not torch.cuda.is_available()
    training = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.config, bf16=True, learning_rate=3e-3, max_steps=args.steps,
        per_device_train_batch_size=args.docs_per_row,  # DataCollatorWithFlattening packs them into one row
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=cpu, ddp_backend="gloo" if cpu else None)
    model = tiny_llama()
    trainer = Trainer(model=model, args=training, train_dataset=documents(args.docs_per_row * args.steps),
                      data_collator=DataCollatorWithFlattening())
    result = trainer.train()
    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.4f} attention {model.config._attn_implementation}",
                      flush=True)
        print(f"done: mean loss {result.training_loss:.4f}")
    torch.distributed.destroy_process_group()  # gloo groups left to the interpreter's exit can abort it at random


if __name__ == "__main__":
    main()
