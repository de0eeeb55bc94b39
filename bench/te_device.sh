#!/usr/bin/env bash
# Transformer Engine on the device machine, from carried parts (issue 57). One command per device call:
#
#   bash bench/te_device.sh .te_carry/callK --budget SECONDS      (plan: .venv/bin/python bench/te_carry.py plan)
#   bash bench/te_device.sh --checks-only --budget SECONDS         (machine still warm: the checks again)
#   bash bench/te_device.sh .te_carry/call1 --root /tmp/x --no-build --stop-after join   (CPU: store/join only)
#   bash bench/te_device.sh .te_carry/call1 --dry-run              (print the stages and their commands)
#
# Every call stores its carried files under ROOT/te_parts (verified against the manifest; kept while the machine
# stays warm). The call that carries the sdist starts the transformer_engine_torch build in the background (setsid:
# it outlives the call and runs while the next calls carry the parts). The call that completes the parts joins
# them (sha256 of the whole wheel), installs the wheels into ROOT/te_site, waits for the build, installs it,
# imports TE, then runs tests/megatron/test_te_backend.py and bench/gpu_check.py's TE sections. Each stage prints
# its elapsed time; before each stage the remaining budget is checked, and a stage runs under `timeout` of what is
# left: when the budget runs out the script says what it did and what it skipped, and exits 0.
# Results under $OUT (the device tool brings them back): te_device.log, gpu_check_te.json, te_build.log (tail).
set -u -o pipefail

CALL_DIR=""
BUDGET=540
ROOT_DIR=/tmp
DRY=0
CHECKS_ONLY=0
STOP_AFTER=""
JOBS=16
NO_BUILD=0
usage() { sed -n 2,8p "$0"; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
    --root) ROOT_DIR="${2:?--root needs a folder}"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --checks-only) CHECKS_ONLY=1; shift ;;
    --stop-after) STOP_AFTER="${2:?--stop-after needs a stage}"; shift 2 ;;
    --jobs) JOBS="${2:?--jobs needs a number}"; shift 2 ;;
    --no-build) NO_BUILD=1; shift ;;
    -h|--help) usage ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) [ -z "$CALL_DIR" ] || { echo "one call folder only (got $CALL_DIR and $1)" >&2; exit 2; }; CALL_DIR="$1"; shift ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "--budget must be whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
STAGES="store build_start join install build_wait import tests gpu_check"
if [ -n "$STOP_AFTER" ] && ! [[ " $STAGES " == *" $STOP_AFTER "* ]]; then
  echo "--stop-after: one of: $STAGES" >&2; exit 2
fi
if [ "$CHECKS_ONLY" = 0 ] && [ -z "$CALL_DIR" ]; then echo "a call folder (or --checks-only) is needed" >&2; usage; fi
if [ -n "$CALL_DIR" ] && [ "$DRY" = 0 ] && [ ! -f "$CALL_DIR/manifest.json" ]; then
  echo "$CALL_DIR/manifest.json is missing: carry the call's folder (run's carry=[\"$CALL_DIR\"])" >&2; exit 2
fi

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
PARTS="$ROOT_DIR/te_parts"; WHEELS="$ROOT_DIR/te_wheels"; SITE="$ROOT_DIR/te_site"; BUILD="$ROOT_DIR/te_build"
OUT_DIR="${OUT:-$ROOT_DIR/te_out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/te_device.log"
START=$SECONDS
DONE=()
SKIPPED=()

say() { echo "[te_device +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - (SECONDS - START))); }
finish() {  # what was done, what was not, and exit 0: a budget stop is a clean end
  say "done: ${DONE[*]:-nothing}; not done: ${SKIPPED[*]:-nothing}; $(($SECONDS - START)) s of budget $BUDGET s"
  [ -f "$BUILD/build.log" ] && tail -c 200000 "$BUILD/build.log" > "$OUT_DIR/te_build.log" 2>/dev/null
  exit "${1:-0}"
}
# stage NAME MIN_SECONDS: whether to run it (budget left >= MIN_SECONDS); records it as skipped if not
stage() {
  local name="$1" need="$2"
  if [ "$(left)" -lt "$need" ]; then
    say "budget: $(left) s left < $need s that $name needs: stopping before it"
    local s skipping=0
    for s in $STAGES; do [ "$s" = "$name" ] && skipping=1; [ $skipping = 1 ] && SKIPPED+=("$s"); done
    finish 0
  fi
  say "stage $name (budget left $(left) s)"
  STAGE_BEGAN=$SECONDS
}
staged() {  # a stage ended: its time, and stop here if --stop-after names it
  DONE+=("$1")
  say "stage $1 took $((SECONDS - STAGE_BEGAN)) s"
  if [ "$STOP_AFTER" = "$1" ]; then
    local s after=0
    for s in $STAGES; do [ $after = 1 ] && SKIPPED+=("$s"); [ "$s" = "$1" ] && after=1; done
    finish 0
  fi
}
run() {  # run a command under what the budget has left (dry run: print it)
  run_for "$BUDGET" "$@"
}
run_for() {  # run_for CAP command...: under CAP seconds or what the budget has left, the less
  local cap="$1"; shift
  if [ "$DRY" = 1 ]; then echo "  would run: $*" | tee -a "$LOG"; return 0; fi
  local t; t=$(left); [ "$t" -le "$cap" ] || t=$cap; [ "$t" -gt 1 ] || t=1
  timeout --kill-after=10 "$t" "$@"
}

# The build's environment. TE's own variables (transformer_engine_torch-2.20.2 sdist):
#   NVTE_PYTORCH_FORCE_BUILD=TRUE  setup.py:25,126: else bdist_wheel first tries a prebuilt wheel from GitHub
#                                  (setup.py:130-152; no network there)
#   NVTE_NO_LOCAL_VERSION=1        build_tools/te_version.py: no '+<git commit>' suffix, so the version equals the
#                                  core wheel's, which transformer_engine/common/__init__.py asserts at import
#   NVTE_CUDA_ARCHS=90             build_tools/utils.py:360-370 (sm_90 only); for this extension it is read only by
#                                  nccl_ep_enabled (utils.py:373-401): transformer_engine_torch is a CppExtension
#                                  (build_tools/pytorch.py:118-127) of 33 .cpp files and no .cu, host code only; the
#                                  kernels are in the core wheel's libtransformer_engine.so, built by NVIDIA
#   NVTE_WITH_NCCL_EP=0            no expert-parallel NCCL bindings (pytorch.py:93-98; ep.cpp no-ops): not needed
#                                  here, and ep.cpp needs torch's symmetric-memory headers
#   MAX_JOBS                       torch.utils.cpp_extension's ninja parallelism (NVTE_BUILD_MAX_JOBS / MAX_JOBS of
#                                  build_tools/utils.py:54-57 feed the CMake builds, which this extension has none of)
#   CUDA_HOME                      build_tools/utils.py nvcc_path / cuda_home_path: else the toolkit's include
#                                  is nvcc's grandparent's, /usr/local/include for a /usr/local/bin/nvcc wrapper
#                                  (seen here: the first TUs then missed cuda_runtime_api.h)
#   CPLUS_INCLUDE_PATH             cudnn.h, nccl.h, cublasLt.h, nvrtc.h, cusparse.h (csrc/common.h,
#                                  csrc/extensions.h, torch's ATen/cuda headers) from the nvidia-* wheels, after the
#                                  toolkit's include (build_tools/utils.py get_cuda_include_dirs uses the toolkit's
#                                  only when nvcc is found)
build_script() {
  cat <<EOF
set -o pipefail
cd "$BUILD/src/$1" || exit 1
export NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 NVTE_CUDA_ARCHS=90 NVTE_WITH_NCCL_EP=0 MAX_JOBS=$JOBS
# CUDA_HOME: the toolkit whose include holds cuda_runtime_api.h (utils.py takes nvcc's parent's parent, which is
# /usr/local for a wrapper script at /usr/local/bin/nvcc, as on the machine this was written on)
for c in "\${CUDA_HOME:-}" /usr/local/cuda "\$(dirname "\$(dirname "\$(readlink -f "\$(command -v nvcc)")")")"; do
  if [ -n "\$c" ] && [ -f "\$c/include/cuda_runtime_api.h" ]; then export CUDA_HOME="\$c"; break; fi
done
echo "CUDA_HOME=\${CUDA_HOME:-unset} nvcc=\$(command -v nvcc) \$(nvcc --version 2>/dev/null | tail -n 1)"
export CPLUS_INCLUDE_PATH="\$($PY -c 'import glob, nvidia; print(":".join(sorted({d for r in nvidia.__path__ for d in glob.glob(r + "/*/include")})))')\${CPLUS_INCLUDE_PATH:+:\$CPLUS_INCLUDE_PATH}"
echo "CPLUS_INCLUDE_PATH=\$CPLUS_INCLUDE_PATH"
began=\$(date +%s)
$PY -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$BUILD/dist" .
rc=\$?
echo "build rc=\$rc in \$((\$(date +%s) - began)) s"
echo \$rc > "$BUILD/rc"
EOF
}

say "te_device.sh ${CALL_DIR:-(checks only)} budget=${BUDGET}s root=$ROOT_DIR out=$OUT_DIR dry_run=$DRY host=$(hostname)"

if [ "$CHECKS_ONLY" = 0 ]; then
  stage store 5
  run "$PY" "$REPO/bench/te_carry.py" store "$CALL_DIR" --root "$PARTS" 2>&1 | tee -a "$LOG" || { say "store failed"; finish 1; }
  staged store

  stage build_start 2
  SDIST=$(ls "$PARTS"/transformer_engine_torch-*.tar.gz 2>/dev/null | head -1)
  if [ "$NO_BUILD" = 1 ]; then
    say "--no-build: the sdist is not built"
  elif [ "$DRY" = 1 ]; then
    echo "  would start (setsid, in the background) the build of the sdist in $BUILD/src:" | tee -a "$LOG"
    build_script transformer_engine_torch-VERSION | sed 's/^/    /' | tee -a "$LOG"
  elif [ -f "$BUILD/started" ]; then
    say "build already started $(( $(date +%s) - $(cat "$BUILD/started") )) s ago; $(ls "$BUILD"/src/*/build 2>/dev/null | head -1)"
    [ -f "$BUILD/rc" ] && say "build finished: rc=$(cat "$BUILD/rc")" || say "build running: $(grep -c '\.o$\|Building\|\[[0-9]*/[0-9]*\]' "$BUILD/build.log" 2>/dev/null) progress lines; last: $(tail -n 1 "$BUILD/build.log" 2>/dev/null | cut -c1-160)"
  elif [ -n "$SDIST" ]; then
    mkdir -p "$BUILD/src" "$BUILD/dist"
    tar -xzf "$SDIST" -C "$BUILD/src"
    NAME=$(basename "$SDIST" .tar.gz)
    build_script "$NAME" > "$BUILD/build.sh"
    date +%s > "$BUILD/started"
    setsid nohup bash "$BUILD/build.sh" > "$BUILD/build.log" 2>&1 < /dev/null &
    say "build of $NAME started in the background (pid $!), log $BUILD/build.log"
  else
    say "no sdist held yet: the build starts with the call that carries it"
  fi
  staged build_start

  stage join 20
  if [ "$DRY" = 1 ]; then
    run "$PY" "$REPO/bench/te_carry.py" join --root "$PARTS" --out "$WHEELS"
  else
    "$PY" "$REPO/bench/te_carry.py" join --root "$PARTS" --out "$WHEELS" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if [ "$rc" = 3 ]; then
      say "parts still to come (above); this call's work is done"
      DONE+=("join(waiting)"); SKIPPED+=("install build_wait import tests gpu_check: later call"); finish 0
    fi
    [ "$rc" = 0 ] || { say "join failed rc=$rc"; finish 1; }
  fi
  staged join

  stage install 20
  run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      $(ls "$WHEELS"/*.whl 2>/dev/null || echo "$WHEELS/*.whl") 2>&1 | tail -n 5 | tee -a "$LOG"
  staged install
fi

if [ "$CHECKS_ONLY" = 0 ] || [ ! -f "$BUILD/installed" ]; then  # --checks-only: a build that finished since
  stage build_wait 10
  if [ "$DRY" = 0 ]; then
    [ -f "$BUILD/started" ] || { say "no build was started on this machine (fresh machine? send the calls again)"; finish 1; }
    while [ ! -f "$BUILD/rc" ] && [ "$(left)" -gt 60 ]; do sleep 5; done
    tail -n 3 "$BUILD/build.log" 2>/dev/null | tee -a "$LOG"
    if [ ! -f "$BUILD/rc" ]; then
      say "build still running with $(left) s left: stopping (the machine stays warm 30 s: call again with --checks-only)"
      SKIPPED+=("build_wait import tests gpu_check"); finish 0
    fi
    [ "$(cat "$BUILD/rc")" = 0 ] || { say "build failed rc=$(cat "$BUILD/rc"): see te_build.log"; finish 1; }
    run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUILD"/dist/*.whl 2>&1 | tail -n 5 | tee -a "$LOG" \
      && touch "$BUILD/installed"
  else
    echo "  would wait for $BUILD/rc, then pip install --target $SITE $BUILD/dist/*.whl" | tee -a "$LOG"
  fi
  staged build_wait
fi

export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
stage import 20
run "$PY" -c "
import time; t = time.perf_counter()
import torch, transformer_engine, transformer_engine.pytorch as te
from megatron.core.extensions import transformer_engine as mte
from l3plugin.megatron.te_backend import te_unavailable_reason
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'TE', transformer_engine.__version__,
      'HAVE_TE', mte.HAVE_TE, 'l3plugin reason', te_unavailable_reason(), 'import %.1f s' % (time.perf_counter() - t))
" 2>&1 | tee -a "$LOG" || { say "TE does not import"; finish 1; }
staged import

stage tests 30
run_for 120 "$PY" -m pytest -q -p no:cacheprovider "$REPO/tests/megatron/test_te_backend.py" 2>&1 | tail -n 15 | tee -a "$LOG"
staged tests

stage gpu_check 60
run "$PY" "$REPO/bench/gpu_check.py" --sections te_attention te_cp te_split guard_cost \
    --out "$OUT_DIR/gpu_check_te.json" 2>&1 | tee -a "$LOG"
staged gpu_check
finish 0
