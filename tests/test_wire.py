"""The emulated wire's option parsing and its refusals (the namespace itself needs root: used by bench/)."""

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # bench/wire.py, imported as the benches do
import wire  # noqa: E402


@pytest.mark.parametrize("text, bits", [("4gbit", 4_000_000_000), ("500mbit", 500_000_000), ("62.5mbps", 500_000_000),
                                        ("2.5GBIT", 2_500_000_000), ("off", None)])
def test_parse_rate(text, bits):
    assert wire.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["4gbt", "fast", "-1gbit", "0bit", "2tbit"])
def test_bad_rate_names_the_option_and_the_valid_forms(text):
    with pytest.raises(ValueError, match=r"--wire .*" + text.replace("-", r"\-")):
        wire.parse_rate(text)


def test_bad_rate_from_enter_is_a_clean_exit():
    with pytest.raises(SystemExit, match="tc unit"):
        wire.enter("4gbt")


def test_off_stays_here():
    link = wire.enter("off")
    assert link.mode == "off" and not link.on and link.rate is None and "off" in link.describe()
    assert link.pool_options(2) == {} and link.traffic() == {}
    with pytest.raises(wire.WireError, match="--wire RATE"):
        link.set_rate(1_000_000)


def test_preset_keeps_the_gpu_ratio(monkeypatch):
    monkeypatch.setattr(wire, "matmul_flops", lambda dtype_name: 50e9)
    bits, note = wire.preset_rate("h100", "float32")
    gpu_flops, gpu_bytes, _ = wire.PRESETS["h100"]
    assert bits / 8 == pytest.approx(50e9 * gpu_bytes / gpu_flops, rel=1e-6)
    assert "50.0 GFLOP/s" in note and "989" in note


def test_not_root_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(wire.os, "geteuid", lambda: 1000)
    monkeypatch.delenv(wire.ENV_RATE, raising=False)
    with pytest.raises(SystemExit, match="needs root"):
        wire.enter("4gbit")


def test_missing_tools_are_named(monkeypatch):
    monkeypatch.setattr(wire.os, "geteuid", lambda: 0)
    monkeypatch.setattr(wire.shutil, "which", lambda tool: None if tool == "tc" else "/usr/bin/" + tool)
    assert "tc not found" in wire.why_not_here()


def test_rate_for_time_solves_cpu_time_plus_bytes_over_rate():
    # A transfer of 10 Mbit costing 2 ms of CPU: 7 ms at 2 Gbit/s; 12 ms wanted -> 1 Gbit/s.
    assert wire.rate_for_time(0.012, 0.002, 0.007, 2 * 10**9) == 10**9
    assert wire.rate_for_time(0.001, 0.002, 0.007, 2 * 10**9) == 10**11  # unreachable target: fastest rate
    assert wire.rate_for_time(1e6, 0.002, 0.007, 2 * 10**9) == 10**7     # and the slowest


def test_bad_mode_names_the_option_and_the_modes():
    with pytest.raises(SystemExit, match=r"--wire-mode 'bus': expected one of per-rank, shared"):
        wire.enter("4gbit", mode="bus")
