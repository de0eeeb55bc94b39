"""All-gather context-parallel attention with document masking (Llama 3 paper, section 4)."""

from l3plugin.cp.attention import all_gather_attention
from l3plugin.cp.sharding import (document_metadata, local_chunks, position_ids_per_document, shard_batch,
                                  shard_indices)

__all__ = ["all_gather_attention", "document_metadata", "local_chunks", "position_ids_per_document",
           "shard_batch", "shard_indices"]
