"""Checkpoint faults give clear errors on EVERY rank, before the model is touched.

A 2-rank DeepSpeed engine with the "l3plugin" key saves one checkpoint; each test copies it, injects one fault
(bytes flipped inside a tensor, partitions swapped, a partition cut short, a file replaced by text or by
another checkpoint's, a NaN, a model file unreadable on one rank only) and loads it on both ranks. Every
rank must raise: the rank that read the bad file its own error naming the file, the other ``PeerFailed``
naming that rank, instead of waiting in the next collective. The model must be unchanged after a refused
load. The control (an untouched copy) must load bit-exact.
"""

import os
import shutil
import time
import traceback
import zipfile

import pytest
import torch

from ds_models import ds_config, engine_for, train

TIMEOUT = 180
TAG = "t"


def _config(**plugin):
    # One bucket: each rank's shard is then its own partition file, so only the rank whose file is damaged reads the
    # fault (with the default, buckets of 1/16 of the model, every rank reads part of every file).
    return ds_config(2, plugin={"fp32_reduce_zero": True, "wait_timeout": 120, "bucket_numel": 10**6, **plugin},
                     clip=1.0)


def _partition(folder, rank):
    return os.path.join(folder, TAG, f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def save_leg(folder, steps):
    engine = engine_for(_config())
    train(engine, steps)
    engine.save_checkpoint(folder, tag=TAG)
    return _params(engine)


def load_leg(folders, **plugin):
    """Load ``folders[rank]`` into a fresh engine; return what happened and whether the model changed."""
    import torch.distributed as dist

    engine = engine_for(_config(**plugin), seed=7)
    before = _params(engine)
    start = time.monotonic()
    try:
        engine.load_checkpoint(folders[dist.get_rank()], tag=TAG)
        error = None
    except Exception as exc:  # noqa: BLE001 - the message is what we check
        error = f"{type(exc).__name__}: {exc}"
        trace = traceback.format_exc()
    after = _params(engine)
    return {"error": error, "trace": trace if error else "", "seconds": time.monotonic() - start, "params": after,
            "unchanged": all(torch.equal(before[n], after[n]) for n in before)}


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """One checkpoint of 2 steps, and a foreign one (1 step) of the same model and config."""
    root = tmp_path_factory.mktemp("ckpt")
    good, foreign = str(root / "good"), str(root / "foreign")
    params = ranks.run(2, save_leg, good, 2, timeout=TIMEOUT)[0]
    ranks.run(2, save_leg, foreign, 1, timeout=TIMEOUT)
    return {"good": good, "foreign": foreign, "params": params}


def _copy(saved, tmp_path, name="copy"):
    """A copy without l3plugin's save manifests: these faults test the partition reader on what it meets
    in a checkpoint that cannot be verified by manifest (saved by stock DeepSpeed). With manifests, a file
    of the wrong size is refused before reading (tests/zero/test_checkpoint_crash.py)."""
    dst = str(tmp_path / name)
    shutil.copytree(saved["good"], dst, ignore=shutil.ignore_patterns("l3plugin-manifest-rank*.json"))
    return dst


def _rewrite(path, edit):
    """Load a partition, let ``edit`` change it, save it back (what a buggy tool or a stale copy does)."""
    sd = torch.load(path, weights_only=False)
    edit(sd["optimizer_state_dict"] if "optimizer_state_dict" in sd else sd)
    torch.save(sd, path)


def _load_both(ranks, folder, **plugin):
    return ranks.run(2, load_leg, [folder, folder], **plugin, timeout=TIMEOUT)


def _assert_failed_together(legs, bad_rank, *patterns, unchanged=True):
    """The rank(s) reading the fault name it; every other rank raises PeerFailed quoting them."""
    import re

    for rank, leg in enumerate(legs):
        assert leg["error"] is not None, f"rank {rank} loaded without an error"
        assert not leg["error"].startswith("TypeError"), leg["trace"]
        assert leg["unchanged"] or not unchanged, f"rank {rank}: the model changed although the load was refused"
        assert "CommTimeout" not in leg["error"], f"rank {rank} waited instead of failing: {leg['error']}"
        for pattern in patterns:
            assert re.search(pattern, leg["error"], re.S), f"rank {rank}: {pattern!r} not in {leg['error']!r}"
        if rank != bad_rank and bad_rank is not None:
            assert leg["error"].startswith("PeerFailed") and f"rank {bad_rank}:" in leg["error"], leg["error"]
    print("seconds to the error per rank:", [round(leg["seconds"], 2) for leg in legs])


def test_control_copy_loads_bit_exact(ranks, saved, tmp_path):
    legs = _load_both(ranks, _copy(saved, tmp_path))
    for leg in legs:
        assert leg["error"] is None
        assert all(torch.equal(saved["params"][n], leg["params"][n]) for n in saved["params"])


def _largest_data_entry(path):
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        with open(path, "rb") as f:  # the local header is 30 bytes plus the name and extra fields
            f.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        return info.header_offset + 30 + name_len + extra_len, info.file_size


def test_flipped_bytes_inside_a_tensor(ranks, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    path = _partition(folder, 1)
    offset, size = _largest_data_entry(path)
    with open(path, "r+b") as f:
        f.seek(offset + size // 2)
        data = f.read(8)
        f.seek(offset + size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    legs = _load_both(ranks, folder)
    _assert_failed_together(legs, 1, "rank_1_mp_rank_00_optim_states.pt is corrupted", "CRC32")


def test_swapped_partitions(ranks, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    a, b = _partition(folder, 0), _partition(folder, 1)
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    legs = _load_both(ranks, folder)
    _assert_failed_together(legs, None, "written by rank 1 but is loaded as the partition of rank 0")


def test_swapped_stock_partitions_caught_by_the_layout(ranks, saved, tmp_path):
    """Without our record (stock DeepSpeed writes none), the fragments' places still give the swap away."""
    folder = _copy(saved, tmp_path)
    for rank in (0, 1):
        _rewrite(_partition(folder, rank), lambda sd: sd.pop("l3plugin_zero"))
    a, b = _partition(folder, 0), _partition(folder, 1)
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    legs = _load_both(ranks, folder)
    _assert_failed_together(legs, None, "rank_0_mp_rank_00_optim_states.pt, loaded as the partition of rank 0",
                            "swapped")


def test_partition_truncated_to_half(ranks, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    path = _partition(folder, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    legs = _load_both(ranks, folder)
    _assert_failed_together(legs, None, "cannot read ZeRO checkpoint partition .*rank_1_mp_rank_00_optim_states.pt")


@pytest.mark.parametrize("record", ["ours", "stock"])
def test_fp32_partition_40_elements_short(ranks, saved, tmp_path, record):
    folder = _copy(saved, tmp_path)

    def cut(sd):
        sd["single_partition_of_fp32_groups"][0] = sd["single_partition_of_fp32_groups"][0][:-40].clone()
        if record == "stock":
            sd.pop("l3plugin_zero")
    _rewrite(_partition(folder, 1), cut)
    legs = _load_both(ranks, folder)
    expect = "written with" if record == "ours" else "param_slice_mappings reach element"
    _assert_failed_together(legs, None, "rank_1_mp_rank_00_optim_states.pt: param group 0 holds", expect)


def test_file_replaced_by_text(ranks, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    with open(_partition(folder, 0), "w") as f:
        f.write("this is not a checkpoint\n")
    legs = _load_both(ranks, folder)
    _assert_failed_together(legs, None, "cannot read ZeRO checkpoint partition .*rank_0_mp_rank_00_optim_states.pt",
                            "not a checkpoint")


def test_partition_from_another_checkpoint(ranks, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    shutil.copy(_partition(saved["foreign"], 1), _partition(folder, 1))
    legs = _load_both(ranks, folder)
    _assert_failed_together(legs, None, "rank_1_mp_rank_00_optim_states.pt belongs to another checkpoint")


def _nan_with_consistent_record(folder):
    """A NaN written by the training run itself: the checksums record it, so only the NaN check can object."""
    from l3plugin.checkpoint.partition_files import KEY, checksum

    paths = [_partition(folder, r) for r in (0, 1)]
    sums = []
    for path in paths:
        sd = torch.load(path, weights_only=False)
        inner = sd["optimizer_state_dict"]
        if path == paths[1]:
            inner["single_partition_of_fp32_groups"][0][5] = float("nan")
        states = [inner["base_optimizer_state"]["state"].get(g, {})
                  for g in range(len(inner["single_partition_of_fp32_groups"]))]
        sums.append(checksum(inner["single_partition_of_fp32_groups"], states))
        torch.save(sd, path)
    for rank, path in enumerate(paths):
        _rewrite(path, lambda sd, r=rank: sd[KEY].update(checksum=sums[r], checksums=sums))


def test_nan_in_partition_is_refused_unless_allowed(ranks, saved, tmp_path):
    folder = _copy(saved, tmp_path)
    _nan_with_consistent_record(folder)
    legs = _load_both(ranks, folder)
    _assert_failed_together(legs, 1, "rank_1_mp_rank_00_optim_states.pt: fp32 master weights of .* non-finite",
                            "checkpoint_allow_nonfinite")
    legs = _load_both(ranks, folder, checkpoint_allow_nonfinite=True)
    assert [leg["error"] for leg in legs] == [None, None]
    assert all(any(torch.isnan(p).any() for p in leg["params"].values()) for leg in legs)


def test_model_file_unreadable_on_one_rank_fails_both(ranks, saved, tmp_path):
    """DeepSpeed's own part raising on rank 1 meets rank 0 in the agreement before the first collective.
    The partitions were verified first, so rank 0 has its model file loaded by DeepSpeed by then."""
    good, bad = _copy(saved, tmp_path, "good"), _copy(saved, tmp_path, "bad")
    with open(os.path.join(bad, TAG, "mp_rank_00_model_states.pt"), "w") as f:
        f.write("garbage")
    legs = ranks.run(2, load_leg, [good, bad], timeout=TIMEOUT)
    _assert_failed_together(legs, 1, unchanged=False)
    assert legs[1]["unchanged"]
    assert "mp_rank_00_model_states.pt" in legs[1]["error"] or "Unpickling" in legs[1]["error"] or \
        "PytorchStreamReader" in legs[1]["error"], legs[1]["error"]


def test_checkpoint_missing_on_one_rank_fails_both(ranks, saved, tmp_path):
    """Stock DeepSpeed returns (None, None) with a warning when the tag is missing; if the other rank did
    load, their states would differ and the next collective would not match: both raise instead, before
    either touched its model."""
    good = _copy(saved, tmp_path, "good")
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    legs = ranks.run(2, load_leg, [good, empty], timeout=TIMEOUT)
    for leg in legs:
        assert leg["error"] is not None and leg["error"].startswith("PeerFailed"), leg["error"]
        assert "ended differently" in leg["error"] and "found no ZeRO partitions" in leg["error"]
        assert leg["unchanged"]
