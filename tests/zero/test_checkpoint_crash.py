"""Crash-consistent saves (l3plugin/checkpoint/commit.py): a rank SIGKILLed at any point of a save never
leaves 'latest' naming a torn checkpoint, and a restart without a tag resumes the last complete one bit-exact.

A 2-rank DeepSpeed engine with the "l3plugin" key saves tag step3; a second run loads it, trains two steps and
saves step5 while one rank kills itself (SIGKILL) at a chosen point. Then 'latest' must still say step3, and
a fresh run's load_checkpoint(dir) with no tag must continue exactly as the first run did after step3.

A call in which a rank raises or dies makes the pool replace its workers, which then import DeepSpeed again: only the
kills do that here. Where every rank is to raise (a failed save, a torn or incomplete load), each rank returns its
error text instead (``error_of``), checked per rank.
"""

import os
import shutil
import signal
import traceback
import warnings

import pytest
import torch

from ds_models import ds_config, engine_for, train
from l3plugin.ranks.pool import RanksFailed

TIMEOUT = 180


def _config(**plugin):
    return ds_config(2, plugin={"fp32_reduce_zero": True, "wait_timeout": 60, **plugin}, clip=1.0)


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def save_step3(folder):
    """Train 3 steps, save step3; the parameters one step later are the reference of a resumed run."""
    engine = engine_for(_config())
    train(engine, 3)
    engine.save_checkpoint(folder, tag="step3")
    train(engine, 1, first_step=3)
    return _params(engine)


def error_of(fn, *args, **kwargs):
    """On a rank: what ``fn`` raised, as the pool reports it (type: message, then the traceback), or None."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads each rank's error
        return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return None


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def crash_during_save(folder, point, victim):
    """Load step3, train 2 steps, save step5; rank ``victim`` dies at ``point`` of that save (or raises)."""
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from l3plugin.checkpoint import commit

    engine = engine_for(_config())
    engine.load_checkpoint(folder, tag="step3")
    train(engine, 2, first_step=3)
    if dist.get_rank() == victim:
        stock_save, stock_manifest = TorchCheckpointEngine.save, commit.write_manifest

        def save(self, state_dict, path):
            if point == "disk error" and "optim_states" in path:
                raise OSError(28, "No space left on device", path)
            if point == "mid-partition" and "optim_states" in path:
                stock_save(self, state_dict, path)
                with open(path, "r+b") as fh:
                    fh.truncate(os.path.getsize(path) // 2)
                _die()
            stock_save(self, state_dict, path)

        def write_manifest(*args):
            stock_manifest(*args)
            if point == "after the partitions, before latest":
                _die()

        TorchCheckpointEngine.save = save
        commit.write_manifest = write_manifest
    try:
        engine.save_checkpoint(folder, tag="step5")
    finally:  # a rank that raised lives on in the pool: its next save is a normal one
        if dist.get_rank() == victim:
            TorchCheckpointEngine.save, commit.write_manifest = stock_save, stock_manifest
    return "saved"


def resume(folder, **plugin):
    """A fresh run: load_checkpoint(folder) with no tag, one more step; (tag loaded, parameters, warnings)."""
    engine = engine_for(_config(**plugin), seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, _ = engine.load_checkpoint(folder)
    train(engine, 1, first_step=3)
    return os.path.basename(os.path.dirname(path)), _params(engine), [str(w.message) for w in caught
                                                                 if "checkpoint tag" in str(w.message)]


@pytest.fixture(scope="module")
def step3(ranks, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("crash") / "ckpt")
    reference = ranks.run(2, save_step3, folder, timeout=TIMEOUT)
    return folder, reference


def _fresh_copy(step3, tmp_path):
    folder, reference = step3
    dst = str(tmp_path / "ckpt")
    shutil.copytree(folder, dst)
    return dst, reference


def _latest(folder):
    with open(os.path.join(folder, "latest")) as fh:
        return fh.read().strip()


def _assert_resumes_step3(ranks, folder, reference, **plugin):
    results = ranks.run(2, resume, folder, timeout=TIMEOUT, **plugin)
    for rank, ((tag, params, warned), ref) in enumerate(zip(results, reference)):
        assert tag == "step3", (rank, tag)
        assert all(torch.equal(params[n], ref[n]) for n in ref), f"rank {rank} did not resume step3 bit-exact"
    return [warned for _, _, warned in results]


# The save's two phases, rank 1 killed in each (every kill replaces the pool's workers): before its files are complete
# (mid-partition: a half-written partition; a kill before its first file leaves the same save behind without that
# half file: rank 0 waits in stock's closing barrier either way) and after every rank's files and manifest, before
# the agreement and 'latest'. Rank 1, not 0: the survivor is rank 0, the one that would move 'latest' (a kill of
# rank 0 there leaves nobody to write it).
@pytest.mark.parametrize("point,victim", [("mid-partition", 1), ("after the partitions, before latest", 1)])
def test_a_rank_killed_during_save_leaves_latest_on_the_last_complete_tag(ranks, step3, tmp_path, point, victim):
    folder, reference = _fresh_copy(step3, tmp_path)
    with pytest.raises(RanksFailed, match=f"rank {victim} died"):
        ranks.run(2, crash_during_save, folder, point, victim, timeout=TIMEOUT)
    assert _latest(folder) == "step3", f"latest moved to a torn tag after a kill {point}"
    if point == "mid-partition":  # the half-written file has a temporary name, never the partition's
        names = os.listdir(os.path.join(folder, "step5"))
        assert any("optim_states.pt.tmp-" in f for f in names), names
        assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" not in names, names
    assert _assert_resumes_step3(ranks, folder, reference) == [[], []]  # nothing torn on the way: no warning


def test_a_save_failing_on_one_rank_raises_on_all_and_keeps_latest(ranks, step3, tmp_path):
    folder, _ = _fresh_copy(step3, tmp_path)
    first, second = ranks.run(2, error_of, crash_during_save, folder, "disk error", 1, timeout=TIMEOUT)
    assert second is not None and "No space left on device" in second, second
    assert first is not None and first.startswith("PeerFailed") and "save of checkpoint tag 'step5'" in first, first
    assert _latest(folder) == "step3"


def complete_save_of_step5(folder):
    crash_during_save(folder, "none", -1)


@pytest.fixture(scope="module")
def step5(ranks, step3, tmp_path_factory):
    """step3's folder with a complete step5 saved after it (the tests below copy it and damage their copy)."""
    folder, reference = step3
    dst = str(tmp_path_factory.mktemp("step5") / "ckpt")
    shutil.copytree(folder, dst)
    ranks.run(2, complete_save_of_step5, dst, timeout=TIMEOUT)
    return dst, reference


def _torn_latest(step5, tmp_path, damage):
    """step3 and a complete step5 saved; then a step5 file damaged and 'latest' pointing at step5 (what a
    disk fault, or stock DeepSpeed's own save, can leave)."""
    folder, reference = _fresh_copy(step5, tmp_path)
    assert _latest(folder) == "step5"
    victim = os.path.join(folder, "step5", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    damage(victim)
    return folder, reference, victim


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 100)


def _flip(path):
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,why", [(_truncate, "cut short"), (_flip, "does not match its checksum"),
                                        (os.remove, "is missing")], ids=["truncated", "flipped", "missing"])
def test_a_torn_latest_falls_back_to_the_newest_complete_tag(ranks, step5, tmp_path, damage, why):
    folder, reference, victim = _torn_latest(step5, tmp_path, damage)
    warned = _assert_resumes_step3(ranks, folder, reference)
    for messages in warned:
        assert len(messages) == 1 and "'step5'" in messages[0] and "'step3'" in messages[0], messages
        assert why in messages[0] and victim in messages[0], messages


def load_explicit(folder, tag, **plugin):
    engine = engine_for(_config(**plugin), seed=7)
    engine.load_checkpoint(folder, tag=tag) if tag else engine.load_checkpoint(folder)


def test_an_explicit_tag_or_fallback_off_raises_naming_the_file(ranks, step5, tmp_path):
    folder, _, victim = _torn_latest(step5, tmp_path, _truncate)
    for tag, plugin in (("step5", {}), (None, {"checkpoint_fallback": False})):
        texts = ranks.run(2, error_of, load_explicit, folder, tag, timeout=TIMEOUT, **plugin)
        for text in texts:  # every rank raises
            assert text is not None and text.startswith("TornCheckpoint"), texts
            assert "checkpoint tag 'step5'" in text and victim in text, text
    assert all("checkpoint_fallback" in text for text in texts), texts


def load_without_partition(folder):
    engine_for(_config(), seed=7).load_checkpoint(folder, tag="step3")


@pytest.mark.parametrize("manifests", [True, False], ids=["ours", "stock-style"])
def test_a_missing_partition_names_the_file_and_the_tag(ranks, step3, tmp_path, manifests):
    folder, _ = _fresh_copy(step3, tmp_path)
    tag_dir = os.path.join(folder, "step3")
    os.remove(os.path.join(tag_dir, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    if not manifests:  # as stock DeepSpeed saves it: nothing to verify before reading
        for name in os.listdir(tag_dir):
            if name.startswith("l3plugin-manifest"):
                os.remove(os.path.join(tag_dir, name))
    texts = ranks.run(2, error_of, load_without_partition, folder, timeout=TIMEOUT)
    text = "\n".join(t or "(returned)" for t in texts)
    expected = (f"checkpoint tag 'step3' in {folder}: file {tag_dir}/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt "
                "(written by rank 1) is missing" if manifests else
                f"saved by 2 data-parallel ranks, but 1 partition file(s) were found in {tag_dir} (the checkpoint "
                "tag's folder): the partition(s) of rank(s) [1] are missing")
    assert expected in text, text
