#!/usr/bin/env bash
# verl's own Megatron engine (verl 0.9.1, MegatronEngineWithLMHead) as a client of l3plugin's flexible schedule,
# switched on by environment variables only: compat/verl_engine.py (what it runs and compares: its docstring;
# the result: docs/verified.md, section "verl as a client").
#
#   compat/verl.sh                      build or reuse the venv, run, print the table (exit 1 on a mismatch)
#   COMPAT_ONLY_VENV=1 compat/verl.sh   build the venv only
#   compat/verl.sh --layouts pp1 pp2    extra arguments go to `verl_engine.py all`
#
# The venv ($COMPAT_VERL_VENV, default .compat/verl-venv) gets the versions constraints.txt pins (torch 2.13.0,
# the CPU wheel on these machines; megatron-core 0.16.1; transformers 5.18.0, although verl 0.9.1 declares
# transformers<5.11: its Megatron engine runs with 5.18), verl and mbridge (verl's Megatron bridge, its
# `vanilla_mbridge` path) with --no-deps, and only the packages importing verl's engine needs; pip's cache is reused.
# l3plugin is not installed into it: a path file names this checkout and the start-up hook is copied into
# site-packages, as the wheel installs it (see compat/deepspeed.sh). Results: $COMPAT_RESULTS/verl (default
# results/compat/verl): each layout's log, the per-rank tensors, verl.log (what this printed).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${COMPAT_VERL_VENV:-$here/.compat/verl-venv}"
python="${PYTHON:-python3}"
results="${COMPAT_RESULTS:-$here/results/compat}/verl"
start=$SECONDS

if [[ ! -f "$venv/.installed" ]]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --no-compile --upgrade pip
  # What importing verl's engine and mbridge needs (verl/protocol.py: ray, tensordict; workers/config: omegaconf;
  # engine_workers: codetiming; utils/dataset: PIL, datasets; peft, accelerate: verl.utils; mbridge: safetensors,
  # einops). hydra-core, wandb, vllm, flash-attn, TE, apex and Megatron-Bridge are not needed for the engine.
  "$venv/bin/python" -m pip install --quiet --no-compile -c "$here/constraints.txt" torch==2.13.0 \
    megatron-core==0.16.1 transformers accelerate datasets "tensordict==0.10.0" omegaconf codetiming ray peft \
    pillow einops safetensors numpy packaging
  "$venv/bin/python" -m pip install --quiet --no-compile --no-deps verl==0.9.1 mbridge==0.15.1
  touch "$venv/.installed"
fi
site="$(PYTHONPATH="$here" "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$here" >"$site/_l3plugin_checkout.pth"  # before l3plugin-autoload.pth: .pth files run in name order
cp "$here/l3plugin-autoload.pth" "$site/"
echo "verl compat venv ready: $venv ($((SECONDS - start)) s)"
[[ -n "${COMPAT_ONLY_VENV:-}" ]] && exit 0

mkdir -p "$results"
# PYTHONDONTWRITEBYTECODE unset: the venv is installed without byte-compiling (see the Makefile's RUN).
cd "$here"
set +e
env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 "$venv/bin/python" compat/verl_engine.py all --out "$results" "$@" \
  2>&1 | tee "$results/verl.log"
status=${PIPESTATUS[0]}
set -e
echo "compat verl: exit $status, $((SECONDS - start)) s with the venv (log: $results/verl.log)"
exit "$status"
