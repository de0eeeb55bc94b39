"""Reading and verifying the ZeRO-1/2 partition files of a checkpoint, whoever wrote them.

``load_file`` reads one file with ``weights_only=True``; ``PartitionFiles`` gives every saved rank's param
groups in one normal form (l3plugin format 2 and 1, stock DeepSpeed rigid or elastic); the ``check_*``
functions are what ``checkpoint.read_partitions`` verifies before anything is changed: each file's place
(our record of rank and world size, and for any writer where DeepSpeed's layout puts each fragment), its
sizes, its checksum, membership in the same checkpoint, parameter shapes and finite values. Errors are
``ValueError``s naming the file and what is wrong. No collective, no model.
"""

from __future__ import annotations

import os
import zlib
from collections import OrderedDict

import torch

FORMAT = 2
KEY = "l3plugin_zero"


def checksum(masters, states_per_group) -> int:
    """CRC32 of a partition's tensors: per group the fp32 part, then its 1-D state tensors by key."""
    crc = 0
    for part, state in zip(masters, states_per_group):
        for t in [part, *(state[k] for k in sorted(state) if torch.is_tensor(state[k]) and state[k].dim() == 1)]:
            crc = zlib.crc32(t.detach().contiguous().cpu().view(torch.uint8).numpy(), crc)
    return crc


def _allowed_globals() -> list:
    """Non-tensor classes DeepSpeed puts into its partition files (for ``weights_only=True`` loading)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # files without DeepSpeed's classes still load
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_file(path, what: str = "checkpoint file"):
    """``torch.load(path, weights_only=True)`` (memory-mapped when possible) with DeepSpeed's checkpoint
    classes allowed; any failure is a ValueError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} does not exist")
    with torch.serialization.safe_globals(_allowed_globals()):
        try:
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
        except Exception as exc:  # noqa: BLE001 - re-raised with the file name
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if "Unsupported global" in str(exc) or "weights_only" in str(exc).lower():
                reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line),
                              reason)
            raise ValueError(f"cannot read {what} {path} ({type(exc).__name__}: {reason[:300]}). It must be a "
                             "complete torch.save file holding only tensors, containers and DeepSpeed's "
                             "checkpoint classes (read with weights_only=True); is it truncated or "
                             "not a checkpoint?") from exc


def _address(value) -> tuple[int, int]:
    """(start, numel) of a param_slice_mappings entry: DeepSpeed's fragment_address or our dict."""
    if isinstance(value, dict):
        return int(value["start"]), int(value["numel"])
    return int(value.start), int(value.numel)


class _Group:
    """One saved rank's view of one param group, whatever wrote it."""

    def __init__(self, fp32, size, mapping, tensors, scalars, hyper):
        self.fp32, self.size, self.mapping = fp32, size, mapping
        self.tensors, self.scalars, self.hyper = tensors, scalars, hyper

    def source(self, key):
        return self.fp32 if key is None else self.tensors[key]


def _normalize(sd, label: str, rank: int) -> list[_Group]:
    if not isinstance(sd, dict):
        raise ValueError(f"{label} holds a {type(sd).__name__}, not a ZeRO-1/2 optimizer partition (a dict)")
    if isinstance(sd.get("optimizer_state_dict"), dict):
        sd = sd["optimizer_state_dict"]  # a DeepSpeed zero_pp_rank_*_optim_states.pt file
    if "single_partition_of_fp32_groups" not in sd:
        raise ValueError(f"{label} is not a ZeRO-1/2 optimizer partition: no 'single_partition_of_fp32_groups' "
                         f"(keys: {sorted(map(str, sd))[:12]}); ZeRO-3 and non-ZeRO checkpoints are not supported")
    fp32 = list(sd["single_partition_of_fp32_groups"])
    meta = sd.get(KEY)
    if isinstance(meta, dict) and meta.get("format") == 1:
        return _normalize_format1(sd, meta, fp32, label, rank)
    if isinstance(meta, dict) and meta.get("format") != FORMAT:
        raise ValueError(f"{label}: l3plugin checkpoint format {meta.get('format')} is not supported "
                         f"(this version reads 1 and {FORMAT})")
    if "param_slice_mappings" not in sd:
        raise ValueError(f"{label} has no 'param_slice_mappings' (written by a DeepSpeed older than 0.10?): "
                         "cannot tell which parameter is where")
    paddings = sd.get("group_paddings") or [0] * len(fp32)
    base = sd.get("base_optimizer_state")
    out = []
    for g, part in enumerate(fp32):
        size = part.numel() + int(paddings[g])
        mapping = OrderedDict((name, _address(v)) for name, v in sd["param_slice_mappings"][g].items())
        hyper, state = None, {}
        if isinstance(base, dict) and "state" in base:  # rigid: a torch optimizer state dict
            pid = base["param_groups"][g]["params"][0] if base.get("param_groups") else g
            state = base["state"].get(pid, {})
            hyper = {k: v for k, v in base["param_groups"][g].items() if k != "params"} if base.get(
                "param_groups") else None
        elif isinstance(base, (list, tuple)):  # elastic: per group, padding already cut
            state = dict(base[g])
            if "base_optimizer_state_step" in sd and "step" not in state:
                state["step"] = sd["base_optimizer_state_step"]
        tensors, scalars = {}, {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() in (part.numel(), size):
                tensors[key] = value
            else:
                scalars[key] = value
        out.append(_Group(part, size, mapping, tensors, scalars, hyper))
    return out


def _normalize_format1(sd, meta, fp32, label, rank) -> list[_Group]:
    """l3plugin before format 2: padded to a multiple of W, states under KEY, no slice mappings."""
    out = []
    for g, part in enumerate(fp32):
        size = part.numel()
        lo, offset, mapping = rank * size, 0, OrderedDict()
        for name, shape in meta["param_shapes"][g]:
            numel = 1
            for d in shape:
                numel *= d
            s, e = max(lo, offset), min(lo + size, offset + numel)
            if s < e:
                mapping[name] = (s - lo, e - s)
            offset += numel
        out.append(_Group(part, size, mapping, dict(meta["optimizer_states"][g]),
                          dict(meta["optimizer_scalars"][g]), dict(meta["param_groups"][g])))
    return out


class PartitionFiles:
    """Lazy access to the saved partitions of every old rank (paths are memory-mapped on first use)."""

    def __init__(self, sources):
        self.sources = list(sources)
        if not self.sources:
            raise ValueError("no checkpoint partitions given")
        self.cache = {}
        self.inner = {}  # rank -> the partition dict (DeepSpeed's optimizer_state_dict unwrapped)

    def __len__(self):
        return len(self.sources)

    def label(self, rank) -> str:
        src = self.sources[rank]
        return f"checkpoint file {os.fspath(src)}" if isinstance(src, (str, os.PathLike)) else \
            f"partition {rank} of {len(self.sources)}"

    def __getitem__(self, rank) -> list[_Group]:
        if rank not in self.cache:
            raw = self.sources[rank]
            if isinstance(raw, (str, os.PathLike)):
                raw = load_file(raw, "ZeRO checkpoint partition")
            self.cache[rank] = _normalize(raw, self.label(rank), rank)
            self.inner[rank] = raw["optimizer_state_dict"] if isinstance(raw.get("optimizer_state_dict"), dict) \
                else raw
        return self.cache[rank]

    def ours(self, rank) -> dict:
        """Our KEY entry of a partition (empty for stock DeepSpeed's files and our format 1)."""
        self[rank]
        meta = self.inner[rank].get(KEY)
        return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else {}


def _folder_of(src: PartitionFiles) -> str:
    first = src.sources[0]
    return f" in {os.path.dirname(os.fspath(first))} (the checkpoint tag's folder)" \
        if isinstance(first, (str, os.PathLike)) else ""


def check_set(src: PartitionFiles) -> None:
    """Every file is in its place and belongs to the same checkpoint (our files record both)."""
    src[0]  # reads the first partition
    counts = src.inner[0].get("partition_count")
    counts = counts[0] if isinstance(counts, (list, tuple)) and counts else counts
    if isinstance(counts, int) and counts != len(src):
        raise ValueError(f"{src.label(0)} records a checkpoint saved by {counts} data-parallel ranks, but "
                         f"{len(src)} partition file(s) were found{_folder_of(src)}: "
                         + (f"the partition(s) of rank(s) {list(range(len(src), counts))} are missing (a save "
                            f"that did not finish, or files not copied)" if counts > len(src) else
                            "more partitions than the checkpoint has: files of another checkpoint are mixed in"))
    reference = None
    for q in range(len(src)):
        meta = src.ours(q)
        if "rank" not in meta:
            continue
        if meta["world_size"] != len(src):
            raise ValueError(f"{src.label(q)} was written by a job of {meta['world_size']} data-parallel ranks, "
                             f"but {len(src)} partitions were given: it belongs to another checkpoint")
        if meta["rank"] != q:
            raise ValueError(f"{src.label(q)} was written by rank {meta['rank']} but is loaded as the partition "
                             f"of rank {q}: partition files swapped or renamed?")
        if reference is None:
            reference = (q, meta["checksums"], meta["stage"])
        elif (meta["checksums"], meta["stage"]) != reference[1:]:
            raise ValueError(f"{src.label(q)} belongs to another checkpoint than {src.label(reference[0])}: their "
                             f"records of the partitions (checksums {meta['checksums']} vs {reference[1]}, ZeRO "
                             f"stage {meta['stage']} vs {reference[2]}) differ")
        if meta["checksums"][q] != meta["checksum"]:
            raise ValueError(f"{src.label(q)} is not the partition its checkpoint recorded for rank {q}: a stale "
                             f"or foreign file")


def check_sizes(src: PartitionFiles, q: int) -> None:
    """The tensors of one partition are as long as its mappings and our record say (a short file is caught
    here, named, instead of as a shape error inside the copy)."""
    numels = src.ours(q).get("numels")
    for g, group in enumerate(src[q]):
        part = group.fp32.numel()
        if numels is not None and [part, group.size] != list(numels[g]):
            raise ValueError(f"{src.label(q)}: param group {g} holds {part} fp32 elements (padded {group.size}), "
                             f"it was written with {numels[g][0]} (padded {numels[g][1]}): the file is short or "
                             f"was altered")
        end = max((start + numel for start, numel in group.mapping.values()), default=0)
        if end > part:
            raise ValueError(f"{src.label(q)}: param group {g} holds {part} fp32 elements but its "
                             f"param_slice_mappings reach element {end}: the file is short or was altered")
        for key, value in group.scalars.items():  # a 1-D state of another length was set aside as a scalar
            if torch.is_tensor(value) and value.dim() == 1:
                raise ValueError(f"{src.label(q)}: optimizer state {key!r} of param group {g} holds "
                                 f"{value.numel()} elements, the partition {part} (padded {group.size}): the "
                                 f"file is short or was altered")


def check_checksum(src: PartitionFiles, q: int) -> None:
    meta = src.ours(q)
    if "checksum" not in meta:
        return  # stock DeepSpeed records none; our sizes and places were checked
    base = src.inner[q]["base_optimizer_state"]
    states = [base["state"].get(g, {}) for g in range(len(src[q]))]
    got = checksum([group.fp32 for group in src[q]], states)
    if got != meta["checksum"]:
        raise ValueError(f"{src.label(q)} is corrupted: the CRC32 of its tensors is {got:#010x}, it was "
                         f"written with {meta['checksum']:#010x}")


def fragments(src: PartitionFiles, names_by_group, offsets_by_group):
    """{name: [(old rank, start in its part, numel, offset in the parameter)]} from every file's mapping.

    Needs every file's (small) mapping; tensors are only touched later, for the ranges this rank owns. Each
    fragment must sit where its file's rank range says: rank q's part is elements [q * P, (q + 1) * P) of
    the param group (DeepSpeed's layout, whoever wrote it), which also catches swapped stock files."""
    frags = {}
    for q in range(len(src)):
        groups = src[q]
        if len(groups) != len(names_by_group):
            raise ValueError(f"checkpoint does not match the model: {src.label(q)} holds {len(groups)} param "
                             f"groups, the optimizer has "
                             f"{len(names_by_group)}")
        for g, group in enumerate(groups):
            for name, (start, numel) in group.mapping.items():
                if name not in names_by_group[g]:
                    where = [i for i, names in enumerate(names_by_group) if name in names]
                    raise ValueError(f"checkpoint does not match the model: {src.label(q)}: parameter {name!r} "
                                     f"of saved param group {g} is "
                                     + (f"in param group {where[0]} now" if where else "not in the model") +
                                     "; the same trainable parameters, names and param groups are needed")
                done = sum(f[2] for f in frags.get(name, []))
                # P from rank 0's file: DeepSpeed's bf16 optimizer keeps the last rank's padding inside its
                # part and still records it in group_paddings, so only rank 0's part + padding is P for all.
                size = src[0][g].size
                if q * size + start != offsets_by_group[g][name] + done:
                    raise ValueError(f"{src.label(q)}, loaded as the partition of rank {q}, holds elements "
                                     f"{done}.. of parameter {name!r} at element {q * size + start} of "
                                     f"param group {g}, where the model's layout puts them at "
                                     f"{offsets_by_group[g][name] + done}: partition files swapped, renamed or "
                                     "from another model")
                frags.setdefault(name, []).append((q, start, numel, done))
    return frags


def check_finite(piece: torch.Tensor, src: PartitionFiles, q: int, what: str) -> None:
    if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
        bad = piece[~torch.isfinite(piece)]
        raise ValueError(f"{src.label(q)}: {what} holds {bad.numel()} non-finite values (first: {bad[0].item()}); "
                         "refusing to resume from them. If they are intended, load with allow_nonfinite=True "
                         '(DeepSpeed: "l3plugin": {"checkpoint_allow_nonfinite": true})')


def check_shapes(src: PartitionFiles, names_by_group) -> None:
    """Files written by l3plugin carry parameter shapes: same element counts but other shapes is an error."""
    meta = src.inner[0].get(KEY)
    if not isinstance(meta, dict):
        return
    for g, group in enumerate(meta.get("param_shapes", [])):
        for name, shape in group:
            p = names_by_group[g].get(name)
            if p is not None and tuple(shape) != tuple(p.shape):
                raise ValueError(f"checkpoint does not match the model: parameter {name!r} was saved with shape "
                                 f"{tuple(shape)}, the model has {tuple(p.shape)}")
