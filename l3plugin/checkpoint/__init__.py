"""Checkpoints of the FP32-reducing ZeRO optimizer: every file format and the protocol that commits them.

``commit.py`` makes a save crash-consistent (atomic files, per-rank manifests, ``latest`` moved last, the
newest complete tag chosen on load); ``deepspeed_layout.py`` writes and reads DeepSpeed's own ZeRO-1/2
partition layout, whoever wrote the files, checked by ``partition_files.py``; ``deepspeed_universal.py``
reads DeepSpeed universal checkpoints; ``megatron_dist.py`` gives the optimizer state to Megatron-Core's
dist_checkpointing; ``verified_load.py`` is what every load shares: read and verify into new tensors, agree
across the ranks, then install. The room sits above ``l3plugin.zero`` (the optimizer, which knows no file
format) and below the adapters, which call it; it imports no adapter (``megatron_dist`` imports only
``megatron.core``).
"""
