"""Crash-consistent checkpoints: a tag becomes "the latest" only when every rank's files are complete.

Stock DeepSpeed writes each file in place and rank 0 writes ``latest`` without waiting for the other ranks'
files, so a rank killed mid-save leaves ``latest`` naming a torn checkpoint that no restart can load. Here:

- every file a rank saves goes to a temporary name, is fsynced, then renamed (``save_atomically``); its size
  and CRC-32 go into the rank's manifest ``<tag>/l3plugin-manifest-rank<R>.json`` (written the same way);
- the ranks agree that all of them saved (``l3plugin.collective.fail_together``); only then does rank 0 replace
  ``latest`` by rename;
- loading without a tag checks the tag ``latest`` names against its manifests (every rank's manifest
  present, every file there with its size and CRC-32) and, if it is torn, falls back to the newest tag that
  verifies, with a warning naming both tags and why. An explicit tag never falls back: it is checked for
  completeness (manifests, files, sizes) and raises naming the file; damage inside a file of the right size
  is left to the partition reader, whose messages name the tensor.

A tag without manifests (saved by stock DeepSpeed, or by l3plugin before this) cannot be verified and is
taken as it is. Verifying reads every file of the tag once on each rank (CRC-32 runs at GB/s).
"""

from __future__ import annotations

import glob
import json
import os
import zlib

MANIFEST_PREFIX = "l3plugin-manifest-rank"
LATEST = "latest"


class TornCheckpoint(RuntimeError):
    """A checkpoint tag whose files are missing, cut short or changed since they were saved."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not every file system lets a directory be opened (the rename is still atomic)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_record(path: str) -> dict:
    """{"size", "crc32"} of a file's bytes."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


def save_atomically(write, path: str) -> dict:
    """``write(temporary_path)``, fsync, rename to ``path``; the file's record. A crash leaves at most a
    temporary file, never a partial ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        record = file_record(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return record


def _write_text(path: str, text: str) -> None:
    def write(tmp):
        with open(tmp, "w") as fh:
            fh.write(text)
    save_atomically(write, path)


def write_manifest(tag_dir: str, rank: int, world_size: int, records: dict[str, dict]) -> str:
    """This rank's manifest: the files it wrote (paths relative to ``tag_dir``) and their records."""
    path = os.path.join(tag_dir, f"{MANIFEST_PREFIX}{rank}.json")
    _write_text(path, json.dumps({"rank": rank, "world_size": world_size, "files": records}, indent=1))
    return path


def write_latest(save_dir: str, tag: str, name: str = LATEST) -> None:
    """Point ``save_dir/name`` at ``tag`` by rename: readers see the old tag or the new one, never half."""
    _write_text(os.path.join(save_dir, name), str(tag))


def read_latest(load_dir: str, name: str = LATEST) -> str | None:
    path = os.path.join(load_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return fh.read().strip()


def has_manifests(tag_dir: str) -> bool:
    return bool(glob.glob(os.path.join(tag_dir, f"{MANIFEST_PREFIX}*.json")))


def verify_tag(load_dir: str, tag: str, checksums: bool = True) -> None:
    """Raise ``TornCheckpoint`` naming the tag and the file if checkpoint ``load_dir/tag`` is not complete
    as its manifests record it: every rank's manifest there, every file with its size and (``checksums``)
    its CRC-32. A tag without manifests passes (it cannot be checked)."""
    tag_dir = os.path.join(load_dir, str(tag))
    where = f"checkpoint tag {tag!r} in {load_dir}"
    if not os.path.isdir(tag_dir):
        raise TornCheckpoint(f"{where}: the folder {tag_dir} does not exist")
    manifests = sorted(glob.glob(os.path.join(tag_dir, f"{MANIFEST_PREFIX}*.json")))
    if not manifests:
        return
    seen = {}
    for path in manifests:
        try:
            with open(path) as fh:
                manifest = json.load(fh)
            seen[int(manifest["rank"])] = manifest
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TornCheckpoint(f"{where}: manifest {path} is unreadable ({type(exc).__name__}: {exc})") from None
    world = max(int(m["world_size"]) for m in seen.values())
    missing = [r for r in range(world) if r not in seen]
    if missing:
        names = ", ".join(os.path.join(tag_dir, f"{MANIFEST_PREFIX}{r}.json") for r in missing)
        raise TornCheckpoint(f"{where}: saved by {world} ranks but the manifest of rank(s) {missing} is missing "
                             f"({names}): those ranks did not finish the save")
    for rank in sorted(seen):
        for name, expected in seen[rank]["files"].items():
            path = os.path.join(tag_dir, name)
            if not os.path.isfile(path):
                raise TornCheckpoint(f"{where}: file {path} (written by rank {rank}) is missing")
            actual = file_record(path) if checksums else {"size": os.path.getsize(path)}
            if actual["size"] != expected["size"]:
                raise TornCheckpoint(f"{where}: file {path} has {actual['size']} bytes, {expected['size']} were "
                                     f"saved (cut short or replaced)")
            if checksums and actual["crc32"] != expected["crc32"]:
                raise TornCheckpoint(f"{where}: file {path} does not match its checksum (CRC-32 {actual['crc32']:08x}, "
                                     f"saved {expected['crc32']:08x}): changed since it was saved")


def _saved_order(load_dir: str, tag: str) -> float:
    """When a verifiable tag was saved: its newest manifest's modification time."""
    return max(os.path.getmtime(p) for p in glob.glob(os.path.join(load_dir, tag, f"{MANIFEST_PREFIX}*.json")))


def choose_tag(load_dir: str, fallback: bool = True, latest_name: str = LATEST) -> tuple[str | None, str | None]:
    """(tag to load, warning or None) for a load without a tag: the tag ``latest`` names if it verifies;
    else, with ``fallback``, the newest other tag that verifies completely (by its manifests). Raises
    ``TornCheckpoint`` when ``latest`` is torn and no fallback is possible or allowed. (None, None) when
    there is no ``latest`` (stock DeepSpeed then warns and loads nothing)."""
    latest = read_latest(load_dir, latest_name)
    if latest is None:
        return None, None
    try:
        verify_tag(load_dir, latest)
        return latest, None
    except TornCheckpoint as exc:
        why = str(exc)
        if not fallback:
            raise TornCheckpoint(f"{why}. Falling back to an older complete tag is off "
                                 f'("l3plugin": {{"checkpoint_fallback": false}}): load a tag explicitly') from None
    candidates = [t for t in os.listdir(load_dir) if t != latest and has_manifests(os.path.join(load_dir, t))]
    for tag in sorted(candidates, key=lambda t: _saved_order(load_dir, t), reverse=True):
        try:
            verify_tag(load_dir, tag)
        except TornCheckpoint:
            continue
        return tag, (f"'{latest_name}' names checkpoint tag {latest!r}, which is incomplete ({why}); "
                     f"loading {tag!r} instead, the newest tag that verifies completely")
    raise TornCheckpoint(f"{why}; and no other tag in {load_dir} verifies completely to fall back to")
