"""Carry Transformer Engine to a device machine that has no network, one call's worth at a time (issue 57).

Here (a machine with the package index), once:

    .venv/bin/python bench/te_carry.py prepare        # download, split, manifest, print the call plan
    .venv/bin/python bench/te_carry.py plan           # the plan again, the working tree re-measured

There (bench/te_device.sh runs these; stdlib only, Python 3.8+):

    python3 bench/te_carry.py store .te_carry/call3 --root /tmp/te_parts   # verify and keep one call's files
    python3 bench/te_carry.py join --root /tmp/te_parts --out /tmp/te_wheels  # all parts -> the wheel, verified

What travels: the TE core wheel ``transformer-engine-cu13`` (276.5 MB: libtransformer_engine.so, 343 MB unpacked,
holds fatbins that are already compressed: gzip, xz -6 and zstd -19 each save under 2 % of a 16 MiB slice, so the
parts are raw byte ranges), the ``transformer_engine_torch`` sdist (built there against that machine's torch), the
``transformer-engine`` wheel (the pure-Python package that TE's import checks for, version for version), and the
small wheels the device image lacks (KINDS.md's list): pydantic (+ pydantic-core, annotated-types,
typing-inspection, typing-extensions new enough for it), importlib-metadata, and megatron-core (the TE spec and
l3plugin's TE backend need it). A device call carries at most 64 MiB of working tree, so the files are packed into
calls: each call's folder ``.te_carry/callK`` holds whole small files and/or one byte range ("part") of the big
wheel, sized so that the working tree (measured: tracked and untracked-not-ignored files) plus the folder stays
under the limit with a margin. Each call's folder also holds the manifest (names, sizes, sha256 of every file and
part and of the whole wheel), so each call verifies what it carried on its own.

pip cannot download the sdist (``pip download`` prepares its metadata, and TE's setup.py:170 parses
``torch.version.cuda``, None on a CPU torch): it is fetched from the index's simple API (PEP 691 JSON) and checked
against the sha256 the index gives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TE_VERSION = "2.20.2"
CORE = "transformer-engine-cu13"
SDIST = "transformer_engine_torch"
# Pinned to what this checkout's .venv holds (tests pass with them); none is on the device image (KINDS.md).
SMALL = ("transformer-engine=={te}", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
         "typing-inspection==0.4.5", "typing-extensions==4.16.0", "importlib-metadata==10.2.0",
         "megatron-core==0.16.1")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
CALL_LIMIT = 64 * 2**20  # the device tool's working-tree limit per call
MARGIN = 2 * 2**20  # room for the tree to grow between `plan` and the calls
INDEX = "https://pypi.org/simple"
CHUNK = 8 * 2**20


def sha256(path: Path, start: int = 0, size: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = os.path.getsize(path) - start if size is None else size
        while left > 0:
            block = f.read(min(CHUNK, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def tree_bytes(root: Path = ROOT) -> int:
    """What a device call sends besides ``carry``: tracked and untracked-not-ignored files (the tool's rule)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum(os.path.getsize(root / p) for p in out.decode().split("\0") if p and (root / p).is_file())


# -- packing: whole small files first, then the big file in byte ranges, call by call -----------------------
def pack(small: list[tuple[str, int]], big_name: str, big_size: int, budget: int) -> list[dict]:
    """Calls as [{"call": k, "files": [name...], "parts": [(index, start, size)]}], each carrying at most
    ``budget`` bytes. The small files go first (call 1: the sdist among them, so the build can start early)."""
    if budget <= 0:
        raise ValueError(f"no room in a call: budget {budget} bytes")
    calls, room = [], 0
    for name, size in small:
        if size > budget:
            raise ValueError(f"{name} ({size} bytes) does not fit one call ({budget} bytes)")
        if size > room:
            calls.append({"call": len(calls) + 1, "files": [], "parts": []})
            room = budget
        calls[-1]["files"].append(name)
        room -= size
    offset = 0
    while offset < big_size:
        if room <= 0:
            calls.append({"call": len(calls) + 1, "files": [], "parts": []})
            room = budget
        size = min(room, big_size - offset)
        calls[-1]["parts"].append((sum(len(c["parts"]) for c in calls), offset, size))
        offset += size
        room -= size
    return calls


def part_name(big_name: str, index: int) -> str:
    return f"{big_name}.part{index:02d}"


def split(big: Path, calls: list[dict], small_dir: Path, out: Path) -> dict:
    """Write each call's folder out/callK (its small files, its parts, the manifest); returns the manifest."""
    manifest = {"wheel": {"name": big.name, "size": big.stat().st_size, "sha256": sha256(big)},
                "files": [], "parts": [], "calls": []}
    for c in calls:
        folder = out / f"call{c['call']}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        carried = 0
        for name in c["files"]:
            shutil.copyfile(small_dir / name, folder / name)
            size = (folder / name).stat().st_size
            manifest["files"].append({"name": name, "size": size, "sha256": sha256(folder / name), "call": c["call"]})
            carried += size
        for index, start, size in c["parts"]:
            name = part_name(big.name, index)
            with open(big, "rb") as src, open(folder / name, "wb") as dst:
                src.seek(start)
                left = size
                while left:
                    block = src.read(min(CHUNK, left))
                    dst.write(block)
                    left -= len(block)
            manifest["parts"].append({"name": name, "index": index, "start": start, "size": size,
                                      "sha256": sha256(folder / name), "call": c["call"]})
            carried += size
        manifest["calls"].append({"call": c["call"], "dir": f"call{c['call']}", "bytes": carried})
    for c in calls:
        (out / f"call{c['call']}" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# -- the device side: store one call's files, join the parts -----------------------------------------------
def load_manifest(path: Path) -> dict:
    return json.loads(path.read_text())


def store(call_dir: Path, root: Path) -> dict:
    """Verify the files of one call's folder against its manifest and copy them under ``root``. Refuses a
    manifest other than the one ``root`` already holds (parts of two downloads never mix)."""
    manifest = load_manifest(call_dir / "manifest.json")
    root.mkdir(parents=True, exist_ok=True)
    held = root / "manifest.json"
    if held.exists() and load_manifest(held)["wheel"] != manifest["wheel"]:
        raise SystemExit(f"{root} holds parts of another download ({load_manifest(held)['wheel']['name']} "
                         f"{load_manifest(held)['wheel']['sha256'][:12]}): remove {root} first")
    shutil.copyfile(call_dir / "manifest.json", held)
    stored = []
    for entry in manifest["files"] + manifest["parts"]:
        src = call_dir / entry["name"]
        if not src.exists():
            continue
        got = sha256(src)
        if got != entry["sha256"] or src.stat().st_size != entry["size"]:
            raise SystemExit(f"{src}: sha256 {got[:12]}, size {src.stat().st_size}; manifest says "
                             f"{entry['sha256'][:12]}, {entry['size']}: the carry is damaged")
        shutil.copyfile(src, root / entry["name"])
        stored.append(entry["name"])
    return {"stored": stored, **status(root)}


def status(root: Path) -> dict:
    manifest = load_manifest(root / "manifest.json")
    entries = manifest["files"] + manifest["parts"]
    missing = [e for e in entries if not (root / e["name"]).exists() or (root / e["name"]).stat().st_size != e["size"]]
    return {"held": len(entries) - len(missing), "of": len(entries),
            "missing_calls": sorted({e["call"] for e in missing}), "complete": not missing}


def join(root: Path, out: Path) -> Path:
    """The wheel from its parts, verified whole; the small files beside it. SystemExit(3) when parts are missing."""
    manifest = load_manifest(root / "manifest.json")
    st = status(root)
    if not st["complete"]:
        print(f"not all calls have arrived: missing calls {st['missing_calls']}", flush=True)
        raise SystemExit(3)
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / manifest["wheel"]["name"]
    with open(wheel, "wb") as dst:
        for part in sorted(manifest["parts"], key=lambda p: p["index"]):
            with open(root / part["name"], "rb") as src:
                shutil.copyfileobj(src, dst, CHUNK)
    got = sha256(wheel)
    if got != manifest["wheel"]["sha256"]:
        wheel.unlink()
        raise SystemExit(f"joined wheel sha256 {got[:12]} != manifest {manifest['wheel']['sha256'][:12]}")
    for entry in manifest["files"]:
        shutil.copyfile(root / entry["name"], out / entry["name"])
    return wheel


# -- here: download -------------------------------------------------------------------------------------------
def pip_download(specs, dest: Path) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *specs],
                   check=True)


def fetch_sdist(name: str, version: str, dest: Path) -> Path:
    """The sdist through the index's simple API (PEP 691), sha256 checked against the index's."""
    request = urllib.request.Request(f"{INDEX}/{name.replace('_', '-')}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    want = f"{name}-{version}.tar.gz"
    entry = next((f for f in files if f["filename"] == want), None)
    if entry is None:
        raise SystemExit(f"{want} is not on {INDEX}")
    path = dest / want
    with urllib.request.urlopen(entry["url"], timeout=300) as response, open(path, "wb") as f:
        shutil.copyfileobj(response, f, CHUNK)
    if sha256(path) != entry["hashes"]["sha256"]:
        raise SystemExit(f"{want}: sha256 differs from the index's")
    return path


def plan_text(manifest: dict, out: Path, tree: int) -> tuple[str, list[str]]:
    rel = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    lines = [f"working tree {tree / 2**20:.1f} MiB; device call limit {CALL_LIMIT / 2**20:.0f} MiB; "
             f"wheel {manifest['wheel']['name']} {manifest['wheel']['size'] / 2**20:.1f} MiB "
             f"sha256 {manifest['wheel']['sha256'][:16]}; {len(manifest['parts'])} parts in "
             f"{len(manifest['calls'])} calls", ""]
    problems = []
    last = len(manifest["calls"])
    for c in manifest["calls"]:
        k = c["call"]
        names = [e["name"] for e in manifest["files"] + manifest["parts"] if e["call"] == k]
        total = tree + c["bytes"] + (out / c["dir"] / "manifest.json").stat().st_size
        if total > CALL_LIMIT:
            problems.append(f"call {k}: {total / 2**20:.1f} MiB > {CALL_LIMIT / 2**20:.0f} MiB: prepare again "
                            f"(the tree grew; --budget-mib less)")
        timeout = 600 if k == last else 240
        lines += [f"call {k} of {last}: {c['bytes'] / 2**20:.1f} MiB carried, {total / 2**20:.1f} MiB sent: "
                  f"{', '.join(names)}",
                  f"  run(carry=[\"{rel}/{c['dir']}\"], timeout_s={timeout},",
                  f"      command=\"bash bench/te_device.sh {rel}/{c['dir']} --budget {timeout - 30}\")"]
    lines += ["", "Each call must come within 30 s of the last one's end (the machine stays warm 30 s; /tmp is lost "
              "with it). A call that finds earlier parts missing says which calls to send again."]
    return "\n".join(lines + problems) + "\n", problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prepare", help="download, split, write the manifest, print the plan")
    p.add_argument("--dir", type=Path, default=ROOT / ".te_carry")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="bytes a call may carry (default: 64 MiB - the working tree - 2 MiB)")
    p.add_argument("--no-download", action="store_true", help="split what --dir/download holds")
    p = sub.add_parser("plan", help="print the call plan of a prepared --dir, the tree measured now")
    p.add_argument("--dir", type=Path, default=ROOT / ".te_carry")
    p = sub.add_parser("store", help="(device) verify one call's folder and keep its files under --root")
    p.add_argument("call_dir", type=Path)
    p.add_argument("--root", type=Path, default=Path("/tmp/te_parts"))
    p = sub.add_parser("join", help="(device) join the parts under --root into --out, verified")
    p.add_argument("--root", type=Path, default=Path("/tmp/te_parts"))
    p.add_argument("--out", type=Path, default=Path("/tmp/te_wheels"))
    args = parser.parse_args(argv)

    if args.what == "store":
        print(json.dumps(store(args.call_dir, args.root)), flush=True)
        return 0
    if args.what == "join":
        print(f"joined {join(args.root, args.out)}", flush=True)
        return 0
    out = args.dir.resolve()
    if args.what == "plan":
        text, problems = plan_text(load_manifest(out / "manifest.json"), out, tree_bytes())
        print(text, end="")
        return 1 if problems else 0

    download = out / "download"
    download.mkdir(parents=True, exist_ok=True)
    timings = {}
    if not args.no_download:
        began = time.perf_counter()
        pip_download([f"{CORE}=={TE_VERSION}"], download)
        timings["download_core_s"] = round(time.perf_counter() - began, 1)
        began = time.perf_counter()
        fetch_sdist(SDIST, TE_VERSION, download)
        pip_download([s.format(te=TE_VERSION) for s in SMALL], download)
        timings["download_small_s"] = round(time.perf_counter() - began, 1)
    big = next(download.glob(f"{CORE.replace('-', '_')}-{TE_VERSION}-*.whl"))
    small = sorted((p for p in download.iterdir() if p != big), key=lambda p: (not p.name.endswith(".tar.gz"), p.name))
    tree = tree_bytes()
    budget = int(args.budget_mib * 2**20) if args.budget_mib else CALL_LIMIT - tree - MARGIN
    began = time.perf_counter()
    calls = pack([(p.name, p.stat().st_size) for p in small], big.name, big.stat().st_size, budget)
    manifest = split(big, calls, download, out)
    timings["split_and_hash_s"] = round(time.perf_counter() - began, 1)
    manifest.update(te_version=TE_VERSION, budget_bytes=budget, tree_bytes=tree, measured=timings)
    for c in calls:
        (out / f"call{c['call']}" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({"measured": timings, "budget_mib": round(budget / 2**20, 2),
                      "tree_mib": round(tree / 2**20, 2)}), flush=True)
    text, problems = plan_text(manifest, out, tree)
    print(text, end="")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
