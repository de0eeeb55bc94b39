#!/usr/bin/env bash
# The DeepSpeed / Hugging Face compat run: one virtualenv per version set (compat/deepspeed_sets.txt) under
# $COMPAT_VENVS (default .compat/venvs), then the named test subset against each.
#   compat/deepspeed.sh                 every set
#   compat/deepspeed.sh ds0.16-hf4.57   one set (names from the sets file)
#   COMPAT_ONLY_VENV=1 compat/deepspeed.sh NAME   build the venv only
#   COMPAT_TESTS="tests/hf/test_hf_deepspeed_cp.py" compat/deepspeed.sh NAME   other test files
# The venvs reuse pip's cache; torch==2.13.0 is the CPU wheel on these machines (users pick their own torch).
# l3plugin is not installed into the venv: the checkout goes first on PYTHONPATH and the autoload .pth is copied
# into site-packages, as the wheel would put it, after a path file naming the checkout (_l3plugin_checkout.pth:
# .pth files run in name order), so that the venv's interpreter started without PYTHONPATH (pip, for one) finds
# the module the hook imports instead of printing "Error processing line 1 of ...l3plugin-autoload.pth".
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venvs="${COMPAT_VENVS:-$here/.compat/venvs}"
python="${PYTHON:-python3}"
torch_spec="${COMPAT_TORCH:-torch==2.13.0}"
results="${COMPAT_RESULTS:-$here/results/compat}"
mkdir -p "$venvs" "$results"

# The named subset: the key's engines (ZeRO-1/2, PipelineEngine), stock checkpoints crossing both ways,
# every config form with and without the key, the HF Trainer / accelerate CP route, the autoload hook.
# The HF files run first: accelerate's data-loader hook is patched only if accelerate is imported before deepspeed
# (in a worker process reused across files, an earlier DeepSpeed test would import deepspeed first).
subset=(
  tests/hf/test_hf_deepspeed_cp.py
  tests/hf/test_hf_trainer_accelerate.py
  tests/zero/test_zero_deepspeed.py
  tests/zero/test_zero_deepspeed_pipe.py
  tests/zero/test_zero_checkpoint_interop.py
  tests/zero/test_zero_deepspeed_config_forms.py
  tests/test_autoload.py
)

# COMPAT_TESTS="file ..." runs those files instead (a shorter leg).
if [[ -n "${COMPAT_TESTS:-}" ]]; then read -r -a subset <<<"$COMPAT_TESTS"; fi

make_venv() {  # name ds tf acc
  local dir="$venvs/$1"
  if [[ -f "$dir/.installed" ]]; then return; fi
  rm -rf "$dir"
  "$python" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip
  "$dir/bin/python" -m pip install --quiet "$torch_spec" "deepspeed==$2" "transformers==$3" "accelerate==$4" \
    "megatron-core==0.16.1" numpy "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
  touch "$dir/.installed"
}

link_checkout() {  # name: the checkout's path, then the hook (refreshed on every run: venvs built before have no path file)
  local site
  site="$(PYTHONPATH="$here" "$venvs/$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"  # the hook importable even before the path file
  echo "$here" >"$site/_l3plugin_checkout.pth"
  cp "$here/l3plugin-autoload.pth" "$site/"
}

run_set() {  # name ds tf acc
  make_venv "$@"
  link_checkout "$1"
  [[ -n "${COMPAT_ONLY_VENV:-}" ]] && return 0
  local dir="$venvs/$1" log="$results/$1.log"
  echo "== $1: deepspeed $2, transformers $3, accelerate $4 (log: $log)"
  ( cd "$here" && PYTHONPATH="$here" OMP_NUM_THREADS=1 timeout "${COMPAT_TIMEOUT:-3600}" \
      "$dir/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$results/$1.xml" "${subset[@]}" ) >"$log" 2>&1 \
      && status=passed || status=FAILED
  echo "   $status: $(tail -n 1 "$log")"
  "$python" "$here/compat/junit_counts.py" "$results/$1.xml" | sed 's/^/   /'
}

while read -r name ds tf acc; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  if [[ $# -gt 0 && " $* " != *" $name "* ]]; then continue; fi
  run_set "$name" "$ds" "$tf" "$acc"
done <"$here/compat/deepspeed_sets.txt"
