"""Without the "l3plugin" key, the autoload hook keeps `import deepspeed` as light as stock: it imports only the
adapter's light modules (config parsing, the patches). What only the key's paths need (the ZeRO optimizer, the
parameter-gather guard and with it torch._dynamo, the checkpoint formats, CP, the Hugging Face adapter) is imported
when first used. Checked by module names in a fresh interpreter of this venv (no timings; the figures are
bench/autoload_startup.py's): the one tests/test_autoload.py's key test runs (a child forked from a fresh interpreter
that has imported torch only, which `import deepspeed` imports first itself; then `import deepspeed`, the hook on,
then an engine with the key), and for the stock modules the one of its opt-out test."""

from test_autoload import plain_import_run  # tests/test_autoload.py: one interpreter per session for both files

# Imported by the key's paths only: none may be loaded by `import deepspeed` with the hook on.
KEY_ONLY = ("l3plugin.deepspeed.optimizer", "l3plugin.zero.optimizer", "l3plugin.zero.param_gather",
            "l3plugin.zero.buffers", "l3plugin.zero.grad_sums", "l3plugin.zero.full_tensors")
KEY_ONLY_PACKAGES = ("l3plugin.checkpoint", "l3plugin.cp", "l3plugin.huggingface",
                     "l3plugin.megatron")  # (the Megatron adapter: no DeepSpeed path needs it)
# What param_gather's guard (torch.compiler.disable) pulls in: absent unless stock `import deepspeed` loads it too.
TORCH_HEAVY = ("torch._dynamo", "torch._inductor")


def modules_after_import_deepspeed(opt_out: bool):
    run = plain_import_run(opt_out=opt_out)  # by keyword, as test_autoload calls it: the same cache entry
    assert "l3plugin autoload" not in run["stderr"], run["stderr"][-3000:]  # the hook's failure warning
    modules, initialize = run["imported"]
    return set(modules), initialize


def test_import_deepspeed_loads_nothing_only_the_key_needs():
    modules, initialize = modules_after_import_deepspeed(opt_out=False)
    # The hook ran: l3plugin's deepspeed.initialize is in place (else this test would pass vacuously).
    assert "l3plugin.deepspeed" in modules and initialize == "initialize_with_key"
    loaded = sorted(m for m in modules if m in KEY_ONLY or any(m == p or m.startswith(p + ".")
                                                                  for p in KEY_ONLY_PACKAGES))
    assert not loaded, f"`import deepspeed` with the hook imported modules only the key needs: {loaded}"
    heavy = {m for m in TORCH_HEAVY if m in modules}
    if heavy:  # only a fault if stock `import deepspeed` (this torch and DeepSpeed) does not load them itself
        stock, initialize = modules_after_import_deepspeed(opt_out=True)
        assert "l3plugin.deepspeed" not in stock and initialize == "initialize"
        assert heavy <= stock, f"the hook made `import deepspeed` import {sorted(heavy - stock)}"
