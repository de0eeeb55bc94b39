"""All-gather context-parallel attention with document masking (Llama 3 paper, section 4)."""

from l3plugin.cp.attention import all_gather_attention, thd_attention
from l3plugin.cp.kv_gather import CP_KV_MODES
from l3plugin.cp.layout import (CPLayout, LAYOUT_NAMES, balanced_layout, make_layout, per_document_layout,
                                two_chunk_layout)
from l3plugin.cp.sharding import (document_metadata, local_chunks, position_ids_per_document, shard_batch,
                                  shard_indices)

__all__ = ["CP_KV_MODES", "CPLayout", "LAYOUT_NAMES", "all_gather_attention", "balanced_layout", "document_metadata",
           "local_chunks", "make_layout", "per_document_layout", "position_ids_per_document", "shard_batch",
           "shard_indices", "thd_attention", "two_chunk_layout"]
