"""A model saved while l3plugin's CP attention is selected loads in a fresh process that has no l3plugin."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import transformers  # noqa: E402,F401 (the "hf" test extra, installed by make test: missing, it fails here, never skips)

from hf_models import tiny_model  # noqa: E402

from l3plugin.ranks.pool import run_command  # noqa: E402

LOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
folder, explicit = sys.stdin.readline().rstrip("\\n").split("\\t")  # once the test has written them
out = {}
model = AutoModelForCausalLM.from_pretrained(folder)
out["attn"] = model.config._attn_implementation
out["sum"] = float(sum(p.double().sum() for p in model.parameters()))
try:
    AutoModelForCausalLM.from_pretrained(explicit)
except ValueError as exc:
    out["explicit_error"] = str(exc)
out["l3plugin_imported"] = any(m == "l3plugin" or m.startswith("l3plugin.") for m in sys.modules)
print(json.dumps(out))
"""


def test_saved_cp_model_loads_without_l3plugin(tmp_path):
    from l3plugin.huggingface import enable_context_parallel

    # The fresh process starts first: its imports (seconds on one core) overlap the model's build and save here;
    # it reads the two folders from its stdin (an empty line, failing it, if this test fails before).
    env = dict(os.environ, L3PLUGIN_NO_AUTOLOAD="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    read_end, write_end = os.pipe()
    try:  # the read end closed only after the process ended (the executor waits for it)
        with ThreadPoolExecutor(1) as starter, os.fdopen(write_end, "w") as folders:
            loading = starter.submit(run_command, [sys.executable, "-c", LOAD], timeout=120, env=env, cwd=tmp_path,
                                     stdin=read_end)
            model = enable_context_parallel(tiny_model("llama"), None, "2cp")
            assert model.config._attn_implementation == "l3plugin_all_gather_cp"
            model.save_pretrained(tmp_path / "saved")
            # transformers does not write the attention choice to config.json: the plain load gets its default.
            config = json.loads((tmp_path / "saved" / "config.json").read_text())
            config["attn_implementation"] = "l3plugin_all_gather_cp"  # a hand-edited config naming it explicitly
            (tmp_path / "explicit").mkdir()
            (tmp_path / "explicit" / "config.json").write_text(json.dumps(config))
            (tmp_path / "explicit" / "model.safetensors").symlink_to(tmp_path / "saved" / "model.safetensors")
            folders.write(f"{tmp_path / 'saved'}\t{tmp_path / 'explicit'}\n")
        done = loading.result()
    finally:
        os.close(read_end)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["l3plugin_imported"]
    assert out["attn"] == "sdpa"
    assert abs(out["sum"] - float(sum(p.detach().double().sum() for p in model.parameters()))) < 1e-9
    # Named explicitly without l3plugin: transformers refuses, naming it (no silent fallback).
    assert "l3plugin_all_gather_cp" in out["explicit_error"]
