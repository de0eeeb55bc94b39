"""Bytes handed to l3plugin ZeRO's reduce-scatters, counted where they are started (test support)."""

import contextlib


@contextlib.contextmanager
def bytes_handed_to_reduce_scatter():
    """Yields a list that gets the byte size of every full gradient buffer handed to a reduce-scatter."""
    from l3plugin.zero import optimizer as zero_optimizer

    handed = []
    start = zero_optimizer.comm.start_reduce_scatter_sum

    def recording(full, *args, **kwargs):
        handed.append(full.numel() * full.element_size())
        return start(full, *args, **kwargs)

    zero_optimizer.comm.start_reduce_scatter_sum = recording
    try:
        yield handed
    finally:
        zero_optimizer.comm.start_reduce_scatter_sum = start
