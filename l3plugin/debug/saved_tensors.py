"""A census of the tensors autograd saves for the backward, through torch.autograd.graph.saved_tensors_hooks.

    census = SavedTensorCensus()
    with census.hooks:
        loss = model(batch)          # every tensor saved for the backward passes through the census
    census.held_bytes()              # bytes those saved tensors hold right now (unique storages)
    census.peak                      # the most they held at once while packing
    release = census.hold(tensors)   # count tensors kept outside autograd too (until release())

Bytes are counted per storage, once however many saved tensors view it. ``held_bytes()`` reads each
storage's size when called, so a storage freed in place after the forward (l3plugin's CP attention with
cp_kv="regather" frees its gathered K/V until the backward) counts as what it holds then. A saved tensor
leaves the census when autograd drops it (after its backward), which a finalizer on its handle observes.
"""

from __future__ import annotations

import weakref

import torch


def _storage_key(tensor) -> int:
    return tensor.untyped_storage()._cdata  # the storage object itself: stable when it is resized


class SavedTensorCensus:
    """``hooks``: the context manager to run the forward in; ``live``/``peak``: bytes at pack time."""

    def __init__(self):
        self.live, self.peak = 0, 0
        self._refs = {}  # storage key -> [saved tensors packed, bytes at pack time]
        self._handles = weakref.WeakSet()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    class _Handle:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def _count(self, tensor) -> int:
        """Count one more reference to ``tensor``'s storage; its key."""
        key = _storage_key(tensor)
        entry = self._refs.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return key

    def _pack(self, tensor):
        key = self._count(tensor)
        # A detached alias, not the tensor itself: Megatron's deallocate_output_tensor swaps an output's
        # .data after sending it, and autograd's own saving keeps the old storage alive the same way.
        handle = self._Handle(tensor.detach())
        self._handles.add(handle)
        weakref.finalize(handle, self._release, key)
        return handle

    @staticmethod
    def _unpack(handle):
        return handle.tensor

    def _release(self, key):
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live -= entry[1]

    def hold(self, tensors):
        """Count ``tensors`` too, tensors the backward keeps outside autograd's saved ones (a split backward's
        kept gradients, from B to W), each storage once with everything counted, until the returned
        ``release()`` is called."""
        keys = [self._count(tensor) for tensor in tensors]

        def release():
            for key in keys:
                self._release(key)
        return release

    def held_bytes(self) -> int:
        """Bytes the saved tensors still alive hold now, each storage once."""
        sizes = {}
        for handle in list(self._handles):
            storage = handle.tensor.untyped_storage()
            sizes[storage._cdata] = storage.nbytes()
        return sum(sizes.values())
