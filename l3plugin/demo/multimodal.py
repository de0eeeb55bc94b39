"""`l3plugin demo --multimodal`: the tiny mllama-like model (multimodal_model.py) trained under the flexible
schedule with its image encoder placed over the pipeline ranks, checked against one process.

``PipelinedTrainer`` runs on every pipeline rank, ``SerialTrainer`` in one process; both build the same model,
data and encoder shares from one ``MultimodalRun`` and return the same per-step record (losses, trainable
gradients by global name, encoder gradients), so the tests and the demo compare them directly.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import torch

from . import multimodal_model as mm

IMAGE_PATTERN = (2, 0, 1, 2, 1)  # images per micro-batch, cycled: one without images, odd totals


@dataclass(frozen=True)
class MultimodalRun:
    kinds: str = "SS" + "SX" * 3  # the first stage's layers frozen (self-attention only)
    pp: int = 2
    vpp: int = 1
    microbatches: int = 4
    group_size: int | None = None
    placement: str = "replicated"
    counts: tuple[int, ...] | None = None  # layers per virtual stage; None: equal counts
    seq_len: int = 8
    micro_batch_size: int = 2
    patches: int = 6  # image tokens per image
    encoder_depth: int = 2
    encoder_width: int = 16
    hidden: int = 32
    heads: int = 4
    lr: float = 0.0

    def images_per_microbatch(self) -> list[int]:
        return [min(IMAGE_PATTERN[j % len(IMAGE_PATTERN)], self.micro_batch_size) for j in range(self.microbatches)]

    def layout(self) -> str | None:
        from l3plugin.schedule.balance import megatron_layout

        return None if self.counts is None else megatron_layout(self.counts, self.pp)

    def config(self, pipelined: bool):
        if not pipelined:
            return mm.mllama_config(self.kinds, hidden=self.hidden, heads=self.heads)
        return mm.mllama_config(self.kinds, hidden=self.hidden, heads=self.heads, pp=self.pp,
                                vpp=self.vpp if self.vpp > 1 else None, k=self.group_size, layout=self.layout())

    def batches(self):
        return mm.multimodal_batches(self.microbatches, self.micro_batch_size, self.seq_len,
                                     images_per_microbatch=self.images_per_microbatch(), patches=self.patches)

    def encoder(self):
        return mm.TinyViT(patches=self.patches, depth=self.encoder_depth, width=self.encoder_width, hidden=self.hidden)


def named_grads(named_params) -> dict[str, torch.Tensor]:
    return {n: q.grad.clone() for n, q in named_params if q.grad is not None}


def text_grads(chunks) -> dict[str, torch.Tensor]:
    from l3plugin.demo.model import global_name

    return {global_name(ch.module, n): q.grad.clone() for ch in chunks for n, q in ch.module.named_parameters()
            if q.grad is not None}


def forward_step(placement, images, tokens, data_iterator, model):
    """The Megatron forward_step_func: the micro-batch's cross-attention input comes from the step's image
    tokens (broadcast, replicated) or from its own images (pipeline: the first chunk encodes them)."""
    from l3plugin.encoder import image_context

    batch = next(data_iterator)
    if placement == "pipeline":
        own, index = mm.microbatch_images(images, batch["image_index"])
        extra = {"images": own, "image_index": index}
    else:
        extra = {"context": image_context(tokens, batch["image_index"], torch.float32)}
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **extra)
    return out, functools.partial(mm.loss_func, batch["loss_mask"])


class PipelinedTrainer:
    """One pipeline rank: its chunks, its encoder (where the placement puts one), SGD on what it trains.
    ``init_mesh=False``: Megatron's parallel_state is already set up for pp x vpp (several trainers side by side)."""

    def __init__(self, run: MultimodalRun, init_mesh: bool = True):
        from megatron.core import parallel_state as ps

        from l3plugin.mesh import groups as mesh_groups
        from l3plugin.megatron.multimodal import image_encoder_placement

        self.run = run
        if init_mesh:
            mesh_groups.init_mesh(pp=run.pp, vpp=run.vpp if run.vpp > 1 else None)
        rank = ps.get_pipeline_model_parallel_rank()
        config, carry = run.config(pipelined=True), run.patches if run.placement == "pipeline" else 0
        self.encoder = run.encoder()
        self.holds_encoder = run.placement == "replicated" or rank == 0
        self.chunks = [mm.build_text_chunk(
            config, run.kinds, pre_process=rank == 0 and c == 0, post_process=rank == run.pp - 1 and c == run.vpp - 1,
            vp_stage=c, pp_rank=rank, seq_len=run.seq_len, carry_image_tokens=carry,
            encoder=self.encoder if carry and rank == 0 and c == 0 else None) for c in range(run.vpp)]
        params = [q for ch in self.chunks for q in ch.parameters() if q.requires_grad]  # pipeline: with the encoder
        if self.holds_encoder and run.placement != "pipeline":
            params += list(self.encoder.parameters())
        self.optimizer = torch.optim.SGD(params, lr=run.lr)
        self.images, self.batches = run.batches()
        # Built once: encode / finish keep only one step's state between them.
        self.placed = image_encoder_placement(run.placement, self.encoder if self.holds_encoder else None)

    def step(self, returns_record: bool = True) -> dict | None:
        from l3plugin.megatron import forward_backward_pipelining_flexible

        run, placed = self.run, self.placed
        self.optimizer.zero_grad(set_to_none=True)
        tokens = placed.encode(self.images) if placed is not None else None
        out = forward_backward_pipelining_flexible(
            forward_step_func=functools.partial(forward_step, run.placement, self.images, tokens),
            data_iterator=[iter(self.batches) for _ in self.chunks], model=self.chunks,
            num_microbatches=run.microbatches,
            seq_length=run.seq_len + (run.patches if run.placement == "pipeline" else 0),
            micro_batch_size=run.micro_batch_size)
        if placed is not None:
            placed.finish()
        if not returns_record:  # timing: no gradient copies
            self.optimizer.step()
            return None
        record = {"losses": [d["lm loss"] for d in out], "text": text_grads(self.chunks),
                  "encoder": named_grads(self.encoder.named_parameters()) if self.holds_encoder else {},
                  "frozen_grads": [q.grad for ch in self.chunks for q in ch.module.parameters()
                                   if not q.requires_grad]}
        self.optimizer.step()
        return record

    def encoder_params(self) -> dict[str, torch.Tensor]:
        return {n: q.detach().clone() for n, q in self.encoder.named_parameters()}


class SerialTrainer:
    """The same model in one chunk, the encoder run as the placement runs it: per micro-batch (pipeline),
    over all images (broadcast), over each pipeline rank's share (replicated)."""

    def __init__(self, run: MultimodalRun):
        from l3plugin.mesh.groups import init_mesh

        init_mesh()
        self.run = run
        self.chunk = mm.build_text_chunk(run.config(pipelined=False), run.kinds, seq_len=run.seq_len)
        self.encoder = run.encoder()
        params = [q for q in self.chunk.parameters() if q.requires_grad] + list(self.encoder.parameters())
        self.optimizer = torch.optim.SGD(params, lr=run.lr)
        self.images, self.batches = run.batches()

    def _encode_before(self):
        from l3plugin.encoder import image_shares

        if self.run.placement == "pipeline":
            return [], None
        shares = [range(len(self.images))] if self.run.placement == "broadcast" else image_shares(
            len(self.images), self.run.pp)
        pieces = [self.encoder(self.images[s.start:s.stop]) for s in shares]
        return pieces, torch.cat([t.detach() for t in pieces]).requires_grad_()

    def step(self) -> dict:
        from l3plugin.encoder import image_context

        run = self.run
        self.optimizer.zero_grad(set_to_none=True)
        pieces, tokens = self._encode_before()
        losses = []
        for batch in self.batches:
            if run.placement == "pipeline":
                own, index = mm.microbatch_images(self.images, batch["image_index"])
                context = image_context(self.encoder(own), index) if (index >= 0).any() else None
            else:
                context = image_context(tokens, batch["image_index"], torch.float32)
            out = self.chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], context=context)
            loss, stats = mm.loss_func(batch["loss_mask"], out)
            losses.append(stats["lm loss"])
            (loss / run.microbatches).backward()
        start = 0
        for piece in pieces:  # the image-token gradients back through each share's encoder run
            piece.backward(tokens.grad[start:start + len(piece)])
            start += len(piece)
        record = {"losses": losses, "text": text_grads([self.chunk]),
                  "encoder": named_grads(self.encoder.named_parameters()),
                  "frozen_grads": [q.grad for q in self.chunk.module.parameters() if not q.requires_grad]}
        self.optimizer.step()
        return record

    def encoder_params(self) -> dict[str, torch.Tensor]:
        return {n: q.detach().clone() for n, q in self.encoder.named_parameters()}


def train(run: MultimodalRun, steps: int = 1, pipelined: bool = True) -> dict:
    """``steps`` steps on this rank (pipelined) or in this process: the last step's record, every step's mean
    loss and the encoder's parameters after the steps."""
    trainer = (PipelinedTrainer if pipelined else SerialTrainer)(run)
    records = [trainer.step() for _ in range(steps)]
    mean_losses = [float(sum(r["losses"]) / len(r["losses"])) if r["losses"] else None for r in records]
    return {**records[-1], "step_losses": mean_losses, "encoder_params": trainer.encoder_params()}


_TRAINER = None  # the demo's pipelined trainer, kept between steps in each worker


def start(run: MultimodalRun) -> None:
    global _TRAINER
    _TRAINER = PipelinedTrainer(run)


def demo_step() -> dict:
    """One step; the mean loss on the last pipeline rank (None elsewhere) and the step's wall time."""
    t = time.perf_counter()
    record = _TRAINER.step()
    loss = float(sum(record["losses"]) / len(record["losses"])) if record["losses"] else None
    return {"loss": loss, "seconds": time.perf_counter() - t}


def balanced_counts(run: MultimodalRun) -> tuple[int, ...]:
    """The cost-balanced split (l3plugin balance) of ``run.kinds`` over its p x v stages, from FLOPs at the run's
    shapes, with the text frozen (embedding, self-attention layers, head)."""
    from l3plugin.planner.layer_costs import model_layer_costs
    from l3plugin.planner.models import ModelSpec
    from l3plugin.schedule.balance import StageSplitter
    from l3plugin.schedule.plan import build_schedule

    # Megatron's default MLP width is 4 x hidden; no GQA (mllama_config).
    model = ModelSpec(name="tiny-mllama", num_layers=len(run.kinds), hidden_size=run.hidden,
                      ffn_hidden_size=4 * run.hidden, num_attention_heads=run.heads, num_kv_heads=run.heads,
                      vocab_size=mm.VOCAB)
    embedding, layers, head = model_layer_costs(model, run.kinds, text_seq=run.seq_len, image_tokens=run.patches,
                                                frozen="SEH", micro_batch=run.micro_batch_size)
    schedule = build_schedule(run.pp, run.vpp, run.microbatches, run.group_size or run.pp)
    splitter = StageSplitter(layers, schedule, embedding=embedding, head=head, kinds=run.kinds)
    return tuple(splitter.balance()[0].counts)


def with_balanced_split(run: MultimodalRun) -> MultimodalRun:
    return dataclasses.replace(run, counts=balanced_counts(run))


DEMO_KINDS = "SSSX" * 3  # 12 layers: a trainable cross-attention layer after every 3 frozen self-attention layers
TOLERANCE = 1e-4  # max |mean loss - one-process mean loss| over the steps (fp32)


def run_multimodal_demo(args) -> int:
    """``l3plugin demo --multimodal``: train on --pp ranks with the balanced split, compare with one process."""
    from pathlib import Path

    from l3plugin.demo import _progress, finish, learned
    from l3plugin.ranks.pool import RankPool

    # lr 0.1: at 0.5 (0.2) the tiny model's loss spikes after about 20 (50) steps, and inside a spike 1e-7
    # differences in summation order grow to 1e-2: a chaotic run, not a mismatch (0.1 holds 5e-7 over 100 steps).
    run = with_balanced_split(MultimodalRun(
        kinds=DEMO_KINDS, pp=args.pp, vpp=args.vpp, microbatches=args.microbatches, group_size=args.group_size,
        placement=args.placement, seq_len=args.seq_len, patches=24, lr=0.1))
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"[1/4] starting {run.pp} CPU ranks over gloo (pp={run.pp}) ...", flush=True)
    with RankPool(run.pp, preload=("megatron.core",), keep_state=True) as pool:
        pool.run(start, run, timeout=args.timeout)
        print(f"[2/4] model: {len(run.kinds)} layers {run.kinds} (S frozen self-attention, X trainable "
              f"cross-attention), a {run.encoder_depth}-block ViT ({run.patches} image tokens per image), fp32; "
              f"split by `l3plugin balance` into {list(run.counts)} layers per virtual stage (Megatron layout "
              f"{run.layout()}); flexible schedule m={run.microbatches} k={run.group_size} vpp={run.vpp}; "
              f"encoder placement: {run.placement}; images per micro-batch {run.images_per_microbatch()}",
              flush=True)
        losses = []
        for step in range(args.steps):
            out = pool.run(demo_step, timeout=args.timeout)
            losses.append(out[-1]["loss"])
            _progress(step, args.steps, losses[-1], max(o["seconds"] for o in out))
        print()
    print("[3/4] one process: the same model, data, encoder shares and optimizer ...", flush=True)
    with RankPool(1, preload=("megatron.core",)) as pool:
        reference = pool.run(train, run, args.steps, False, timeout=args.timeout * 4)[0]["step_losses"]
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"[4/4] loss first/last: pipelined {losses[0]:.4f} -> {losses[-1]:.4f}, one process {reference[0]:.4f} "
          f"-> {reference[-1]:.4f}; max |difference| over {args.steps} steps {diff:.2e} (tolerance {TOLERANCE:g})")
    summary = {"run": dataclasses.asdict(run), "layout": run.layout(), "losses": losses,
               "reference_losses": reference, "max_abs_difference": diff, "tolerance": TOLERANCE,
               "seconds": time.monotonic() - t0}
    return finish(results, "multimodal_summary.json", summary, [], t0,
                  ok=diff <= TOLERANCE and learned(losses), what="pipelined multimodal")
