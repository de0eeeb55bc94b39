"""Carrying Transformer Engine to a device machine in parts (bench/te_carry.py, bench/te_device.sh; issue 57),
on small fake files; and bench/gpu_check.py's TE sections where TE cannot be imported."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import gpu_check  # noqa: E402
import te_carry  # noqa: E402

DEVICE_SH = BENCH / "te_device.sh"


def fake_download(tmp_path, big_size=300_000):
    """A 'wheel' of random bytes and three small files, as prepare's download folder holds them."""
    download = tmp_path / "download"
    download.mkdir()
    big = download / "transformer_engine_cu13-9.9.9-py3-none-manylinux_2_28_x86_64.whl"
    big.write_bytes(os.urandom(big_size))
    for name, size in (("transformer_engine_torch-9.9.9.tar.gz", 5_000), ("a-1-py3-none-any.whl", 2_000),
                       ("b-1-py3-none-any.whl", 70_000)):
        (download / name).write_bytes(os.urandom(size))
    return download, big


def prepared(tmp_path, budget=100_000):
    download, big = fake_download(tmp_path)
    small = sorted((p for p in download.iterdir() if p != big), key=lambda p: (not p.name.endswith(".tar.gz"), p.name))
    calls = te_carry.pack([(p.name, p.stat().st_size) for p in small], big.name, big.stat().st_size, budget)
    out = tmp_path / "carry"
    return te_carry.split(big, calls, download, out), out, big


def test_pack_fills_each_call_up_to_the_budget_and_covers_the_file():
    calls = te_carry.pack([("s.tar.gz", 10), ("w.whl", 50)], "big.whl", 250, budget=100)
    assert [c["files"] for c in calls] == [["s.tar.gz", "w.whl"], [], [], []]
    parts = [p for c in calls for p in c["parts"]]
    assert [p[0] for p in parts] == [0, 1, 2, 3]  # indices in order
    assert parts[0][1] == 0 and all(a[1] + a[2] == b[1] for a, b in zip(parts, parts[1:]))  # contiguous
    assert parts[-1][1] + parts[-1][2] == 250
    for c in calls:
        assert sum({"s.tar.gz": 10, "w.whl": 50}[f] for f in c["files"]) + sum(p[2] for p in c["parts"]) <= 100
    with pytest.raises(ValueError, match="does not fit one call"):
        te_carry.pack([("huge.whl", 101)], "big.whl", 1, budget=100)


def test_split_store_join_round_trip(tmp_path):
    manifest, out, big = prepared(tmp_path)
    assert len(manifest["calls"]) >= 4 and manifest["wheel"]["sha256"] == hashlib.sha256(big.read_bytes()).hexdigest()
    root = tmp_path / "device_parts"
    for c in manifest["calls"][:-1]:
        state = te_carry.store(out / c["dir"], root)
        assert not state["complete"]
    with pytest.raises(SystemExit) as missing:
        te_carry.join(root, tmp_path / "wheels")
    assert missing.value.code == 3
    assert te_carry.store(out / manifest["calls"][-1]["dir"], root)["complete"]
    wheel = te_carry.join(root, tmp_path / "wheels")
    assert wheel.read_bytes() == big.read_bytes()
    assert (tmp_path / "wheels" / "transformer_engine_torch-9.9.9.tar.gz").exists()


def test_a_damaged_part_and_another_download_are_refused(tmp_path):
    manifest, out, _ = prepared(tmp_path)
    last = out / manifest["calls"][-1]["dir"]
    part = next(last.glob("*.part*"))
    data = bytearray(part.read_bytes())
    data[0] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="damaged"):
        te_carry.store(last, tmp_path / "root")
    other = json.loads((last / "manifest.json").read_text())
    other["wheel"]["sha256"] = "0" * 64
    (last / "manifest.json").write_text(json.dumps(other))
    te_carry.store(out / "call1", tmp_path / "root")
    with pytest.raises(SystemExit, match="another download"):
        te_carry.store(last, tmp_path / "root")


def device_sh(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(DEVICE_SH), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_device_script_parses_and_refuses_bad_arguments(tmp_path):
    assert subprocess.run(["bash", "-n", str(DEVICE_SH)]).returncode == 0
    assert device_sh("--budget", "ten", "x").returncode == 2
    assert "one of:" in device_sh("x", "--stop-after", "nowhere").stderr
    assert "manifest.json is missing" in device_sh(tmp_path / "nothing").stderr


def test_device_script_stores_joins_and_stops_within_its_budget(tmp_path):
    manifest, out, big = prepared(tmp_path)
    root, env = tmp_path / "machine", {"OUT": str(tmp_path / "out")}
    for c in manifest["calls"]:
        got = device_sh(out / c["dir"], "--root", root, "--no-build", "--stop-after", "join", "--budget", "60",
                        env=env)
        assert got.returncode == 0, got.stdout + got.stderr
    assert "joined" in got.stdout and "not done: install build_wait import tests gpu_check" in got.stdout
    assert (root / "te_wheels" / big.name).read_bytes() == big.read_bytes()
    assert "parts still to come" in (tmp_path / "out" / "te_device.log").read_text()
    # No budget left: a clean stop that names what it skipped.
    got = device_sh(out / "call1", "--root", root, "--budget", "0", env=env)
    assert got.returncode == 0 and "stopping before it" in got.stdout
    assert "not done: store build_start join install build_wait import tests gpu_check" in got.stdout
    # A dry run prints every stage's command, the build's environment among them, and runs none.
    got = device_sh(out / "call1", "--root", tmp_path / "dry", "--dry-run", "--budget", "600", env=env)
    assert got.returncode == 0 and "NVTE_CUDA_ARCHS=90" in got.stdout and "gpu_check.py --sections te_attention" in got.stdout
    assert not (tmp_path / "dry" / "te_parts").exists()
    # --checks-only: no call folder; the build's wheel installed if not yet, then the checks.
    got = device_sh("--checks-only", "--root", tmp_path / "dry", "--dry-run", "--budget", "600", env=env)
    assert got.returncode == 0 and "store" not in got.stdout.split("done:")[-1].split(";")[0]
    assert "test_te_backend.py" in got.stdout and "would wait for" in got.stdout


def test_te_split_section_records_that_te_is_not_importable():
    if gpu_check.te_skip_reason() is None:
        pytest.skip("Transformer Engine imports here")
    out = gpu_check.te_split_check(torch.device("cpu"), hidden=32, heads=4, kv_heads=2, ffn=48, tokens=16)
    assert out["skipped"].startswith("transformer_engine not importable")


def te_attention_small():
    return gpu_check.te_attention_check(torch.device("cpu"), tokens=64)


def te_cp_small():
    return gpu_check.te_cp_check(torch.device("cpu"), tokens=64, timeout=60)


def test_te_attention_section_on_cpu(ranks):
    """Without TE the TE layers are recorded as skipped; l3plugin's local path still runs against the fp32
    reference, in both formats (a rank worker: the section sets up Megatron's parallel state)."""
    out = ranks.run(1, te_attention_small, timeout=180)[0]
    if gpu_check.te_skip_reason() is not None:
        assert out["te"].startswith("skipped: transformer_engine not importable")
    for fmt in ("sbhd", "thd"):
        assert out[fmt]["te_own"].startswith("skipped: ") or "relative_error" in out[fmt]["te_own"]
        errors = out[fmt]["l3plugin_local"]["relative_error"]
        assert max(errors.values()) < 0.05, (fmt, errors)  # bf16 against fp32
    assert out["thd"]["documents"] > 1


def test_te_cp_section_harness_on_cpu(ranks):
    """Without TE: skipped, and the ranks-as-threads harness runs l3plugin's local attention at cp 2 and 4 and
    all_gather_attention with overlap on and off: outputs and dq match the cp 1 run at bf16 level; with overlap
    off, dK/dV too."""
    if gpu_check.te_skip_reason() is None:
        pytest.skip("Transformer Engine imports here")
    out = ranks.run(1, te_cp_small, timeout=180)[0]
    assert out["skipped"].startswith("transformer_engine not importable")
    for cp in (2, 4):
        got = out["local_attention"][f"cp{cp}"]["relative_difference_from_cp1"]
        assert got["out"] < 0.02 and got["dq"] < 0.02, got
        got = out["all_gather_attention_overlap"][f"overlap_False_cp{cp}"]["relative_difference_from_cp1"]
        assert max(got.values()) < 0.02, got


def guard_small():
    return gpu_check.guard_cost_check(torch.device("cpu"), sizes=(16,), calls=20, rounds=2, layer=(32, 4, 2, 48, 16))


def test_guard_cost_section_on_cpu(ranks):
    out = ranks.run(1, guard_small, timeout=120)[0]
    for key in ("linear_16", "llama_layer_forward"):
        assert {"plain_us", "guarded_us", "added_us", "ratio"} <= out[key].keys(), out
