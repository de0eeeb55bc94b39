"""CHECK TOOL, not product code: run Megatron-DeepSpeed's pretrain_gpt.py (deepspeedai/Megatron-DeepSpeed, checked
at 4efb479) on CPU / gloo with DeepSpeed 0.19.8, so l3plugin's "l3plugin" DeepSpeed config key can be checked
against the real script on a machine without a GPU. l3plugin itself needs none of this.

    torchrun --nproc-per-node 4 cpu_run.py pretrain_gpt.py <args> --deepspeed --deepspeed_config ds.json

Run it from the Megatron-DeepSpeed checkout (its directory goes first on sys.path, as for `python pretrain_gpt.py`).
Unlike Megatron-LM, Megatron-DeepSpeed asks DeepSpeed's accelerator for its devices, and DeepSpeed picks its CPU
accelerator where there is no GPU, so little is needed:
- torchrun instead of DeepSpeed's launcher: the launcher passes --local_rank and sets LOCAL_SIZE (the CPU
  accelerator's device count; Megatron-DeepSpeed asserts local rank == rank % device count); this does the same
  from torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE.
- megatron/training.py imports `deepspeed.compression.compress` (gone from DeepSpeed 0.19.8) for
  --compression-training / --mos / --kd only: a stand-in module whose functions raise.
- megatron/training.py imports the vision k-NN monitor, which imports torchvision, for the vision tasks only: a
  stand-in module (no torchvision needed).
- The dataset helpers' `make` (initialize.py runs it on rank 0 at every start) builds for this interpreter
  (pybind11 must be importable: pip install pybind11; `six` too, for Megatron-DeepSpeed's BERT tokenizer module).
- Pass --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
  --no-bias-dropout-fusion (CUDA/apex kernels) on the command line; check.py does.
After `deepspeed.initialize` every rank prints one line "[check] rank R: <engine>, optimizer <class>, zero stage S",
the evidence of which optimizer the config selected, and rank 0 prints each iteration's loss and gradient norm in
full precision ("[check] iteration I: lm loss L, grad norm G").
"""
import importlib.util
import os
import runpy
import sys
import sysconfig
import types


def launched_like_deepspeed():
    if "LOCAL_RANK" in os.environ and not any(a.startswith("--local_rank") for a in sys.argv):
        sys.argv += ["--local_rank", os.environ["LOCAL_RANK"]]
    if "LOCAL_WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])


def _stand_in(name, functions, why):
    module = types.ModuleType(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"{name} is a stand-in of examples/megatron_deepspeed/cpu_run.py: {why}")

    for function in functions:
        setattr(module, function, unavailable)
    sys.modules[name] = module


def no_compression():
    if importlib.util.find_spec("deepspeed.compression.compress") is None:
        _stand_in("deepspeed.compression.compress", ("init_compression", "redundancy_clean"),
                  "gone from this DeepSpeed (compression training, --mos, --kd)")


def no_vision():
    if importlib.util.find_spec("torchvision") is None:
        _stand_in("megatron.model.vision.knn_monitor", ("compute_feature_bank",), "vision tasks need torchvision")


def helpers_for_this_interpreter():
    import pybind11

    os.environ["MAKEFLAGS"] = (f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')} "  # "\\ ": a space in a value
                               f"CPPFLAGS=-I{sysconfig.get_paths()['include']}\\ -I{pybind11.get_include()}")


def report_engine():
    import deepspeed  # with l3plugin installed, its autoload has patched DeepSpeed by now

    initialize = deepspeed.initialize

    def initialize_and_report(*args, **kwargs):
        result = initialize(*args, **kwargs)
        engine = result[0]
        optimizer = getattr(engine, "optimizer", None)
        print(f"[check] rank {os.environ.get('RANK')}: {type(engine).__name__}, optimizer "
              f"{type(optimizer).__module__}.{type(optimizer).__name__}, "
              f"zero stage {engine._config.zero_config.stage}", flush=True)
        return result

    deepspeed.initialize = initialize_and_report  # megatron/training.py calls deepspeed.initialize(...)


def report_losses():
    """Rank 0 prints every iteration's loss and gradient norm in full (repr) precision, "[check] iteration I: lm
    loss L, grad norm G": Megatron's own log line rounds the loss to 7 digits, too few to tell bit-equal runs."""
    from megatron import training

    training_log = training.training_log

    def training_log_and_report(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        if os.environ.get("RANK", "0") == "0":
            losses = ", ".join(f"{key} {float(value)!r}" for key, value in loss_dict.items())
            norm = args[3] if args[3] is None else float(args[3])
            print(f"[check] iteration {iteration}: {losses}, grad norm {norm!r}", flush=True)
        return training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)

    training.training_log = training_log_and_report  # train() calls the module global


def main():
    script = sys.argv[1]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python pretrain_gpt.py` would
    sys.argv = sys.argv[1:]
    launched_like_deepspeed()
    no_compression()
    no_vision()
    helpers_for_this_interpreter()
    report_engine()
    report_losses()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
