"""Long-context fine-tuning in an accelerate loop with l3plugin's all-gather context parallelism: the DeepSpeed
config's "l3plugin": {"context_parallel_size": 2} is the only change (no l3plugin import, no model edit).

    torchrun --nproc-per-node 2 examples/huggingface/train_accelerate.py

accelerate shards the data loader over data-parallel ranks only (both ranks of a CP group get the same packed
rows); deepspeed.initialize, called by accelerator.prepare, builds the CP groups and swaps the attention; the
model's loss is the whole row's token mean on every rank. Same script on GPUs (drop the CPU lines).
"""

import argparse
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.utils import DummyOptim
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening

from common import documents, skip_cpu_shm_build, tiny_llama


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--docs-per-row", type=int, default=24, help="documents packed into one row (~2K tokens)")
    args = p.parse_args()
    skip_cpu_shm_build()
    if not torch.cuda.is_available():
        PartialState(backend="gloo")  # CPU ranks under torchrun: torch.distributed over gloo
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.config))
    model = tiny_llama()
    loader = DataLoader(documents(args.docs_per_row * args.steps), batch_size=args.docs_per_row,
                        collate_fn=DataCollatorWithFlattening())  # one packed row per batch
    optimizer = DummyOptim(model.parameters(), lr=3e-3)  # the config's AdamW, built by DeepSpeed
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        accelerator.backward(loss)  # DeepSpeed's backward and optimizer step
        if accelerator.is_main_process:
            print(f"step {step}: loss {loss.item():.4f} tokens {batch['input_ids'].size(1)} attention "
                  f"{model.module.config._attn_implementation}", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
