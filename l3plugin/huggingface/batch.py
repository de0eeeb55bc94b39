"""From an HF batch to this CP rank's part: document boundaries, CP layouts, sharding, shifted labels.

HF's convention for packed documents (``DataCollatorWithFlattening``, and the mask transformers builds from
``position_ids`` itself): position ids count up by one inside a document, and a document starts wherever they
do not (``position_ids[t] - position_ids[t-1] != 1``; usually they restart at 0). Here they become
``cu_seqlens`` over the FULL row, before sharding, so documents may cross CP chunk borders.

Labels are shifted over the full row before sharding (the label of a chunk's last token is the next chunk's
first token), exactly as HF's ``ForCausalLMLoss`` shifts them: ``shift_labels[t] = labels[t + 1]``, -100 at the
end. Position ids are sliced with the tokens, so RoPE sees the global (per-document) positions. A row whose
length is not a multiple of 2 * cp gets a last document of unlabelled padding tokens (it changes no other token's
attention, loss or gradient), so DataCollatorWithFlattening's rows of any length work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.collective.waits import resolve_timeout
from l3plugin.cp import make_layout
from l3plugin.cp.layout import CPLayout

IGNORE_INDEX = -100
# Keys DataCollatorWithFlattening may add for flash-attn: they describe the unsharded row, which the CP
# attention gets from position_ids itself, so they are dropped rather than passed on sharded wrongly.
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def cu_seqlens_from_position_ids(position_ids) -> torch.Tensor:
    """Document boundaries [0, ..., S] (int64, CPU) of one row of HF position ids: a document starts at 0
    and wherever the position does not follow the previous one by exactly 1 (HF's own packed-sequence rule)."""
    pos = torch.as_tensor(position_ids).detach().to("cpu").reshape(-1).to(torch.int64)
    if pos.numel() == 0:
        raise ValueError("position_ids is empty: a row needs at least one token")
    starts = (pos[1:] - pos[:-1] != 1).nonzero().flatten() + 1
    return torch.cat([torch.tensor([0]), starts, torch.tensor([pos.numel()])])


@dataclass
class CPBatch:
    """What the CP attention and the loss of one forward need: travels as a keyword argument through the
    model (so gradient checkpointing's recompute gets it too)."""

    group: object  # the CP process group (None: no CP)
    cp_size: int
    cp_rank: int
    layouts: tuple  # one CPLayout per row
    cu_seqlens: tuple  # one global cu_seqlens per row
    seq_len: int  # S, the full row length (with the padding to 2 * cp added here)
    row_length: int = 0  # the row length the caller passed (before that padding)


def _check_same_batch_on_cp_ranks(input_ids: torch.Tensor, group) -> None:
    """Every CP rank must hold the same full batch: a small all-gather of its shape and a checksum.

    Without it, a data loader sharded over all ranks (not over data-parallel ranks only) gives CP ranks
    different rows, and the K/V all-gather would mix sequences (or hang on unequal sizes)."""
    ids = input_ids.detach().to(torch.int64)
    weights = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.int64) % 1_000_003
    mine = torch.stack([torch.tensor(ids.size(0)), torch.tensor(ids.size(-1)),
                        (ids.reshape(-1) * weights).sum().cpu()]).to(ids.device)
    everyone = comm.all_gather_shards(mine, group, resolve_timeout()).view(-1, mine.numel())  # bounded wait
    if any(not torch.equal(mine, other) for other in everyone):
        table = ", ".join(f"CP rank {r}: shape [{int(t[0])}, {int(t[1])}] checksum {int(t[2])}"
                          for r, t in enumerate(everyone))
        raise ValueError(
            "the ranks of one context-parallel group received different batches (" + table + "). Every CP rank "
            "must get the same full sequences: shard the data over data-parallel ranks only (global rank // "
            "context_parallel_size). HF Trainer and accelerate do this when l3plugin's accelerate hook is "
            "installed (it is when deepspeed is imported after accelerate); in your own loop use "
            "l3plugin.deepspeed.sequence_parallel.data_parallel_rank_and_size()")


def shard_inputs(kwargs: dict, group, layout: str) -> dict:
    """The model's keyword arguments for this CP rank (see the module docstring); adds ``l3plugin_cp``."""
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError("context-parallel forward needs input_ids (inputs_embeds is not sharded by l3plugin): "
                         "pass input_ids, or call the model without CP")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    rows, seq_len = input_ids.shape
    row_length = seq_len
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if kwargs.get("past_key_values") is not None:
        raise ValueError("context-parallel forward does not take past_key_values (training only): call "
                         "l3plugin.huggingface.disable_context_parallel(model) before generating")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("attention_mask has padding (zeros); context-parallel training takes packed rows "
                         "without padding: use transformers.DataCollatorWithFlattening (documents are found "
                         "from position_ids that restart per document); with TRL's SFTTrainer set "
                         "SFTConfig(padding_free=True) or packing=True")
    for key in FLASH_KWARGS:
        kwargs.pop(key, None)
    if cp > 1:
        _check_same_batch_on_cp_ranks(input_ids, group)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand(rows, seq_len)
    position_ids = position_ids.expand(rows, seq_len) if position_ids.size(0) == 1 else position_ids
    if tuple(position_ids.shape) != (rows, seq_len):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; input_ids has {(rows, seq_len)}")
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    if shift_labels is None and labels is not None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    pad = -seq_len % (2 * cp)
    if pad:  # the layouts cut rows into 2 * cp pieces: a last document of unlabelled tokens fills the row up
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device).expand(rows, pad)], 1)
        if shift_labels is not None:
            shift_labels = torch.nn.functional.pad(shift_labels, (0, pad), value=IGNORE_INDEX)
        seq_len += pad
    cus = tuple(cu_seqlens_from_position_ids(position_ids[r]) for r in range(rows))
    layouts = tuple(layout if isinstance(layout, CPLayout) else make_layout(layout, seq_len, cp, cu)
                    for cu in cus)
    index = torch.stack([plan.indices(rank) for plan in layouts]).to(input_ids.device)

    out = dict(kwargs)
    out["input_ids"] = input_ids.gather(1, index)
    out["position_ids"] = position_ids.gather(1, index)
    if shift_labels is not None:
        local = shift_labels.gather(1, index.to(shift_labels.device))
        out["labels"], out["shift_labels"] = local, local  # labels: any non-None makes the model compute a loss
    out["use_cache"] = False
    out["l3plugin_cp"] = CPBatch(group=group, cp_size=cp, cp_rank=rank, layouts=layouts, cu_seqlens=cus,
                                 seq_len=seq_len, row_length=row_length)
    return out
