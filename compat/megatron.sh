#!/usr/bin/env bash
# Run l3plugin's Megatron tests against another Megatron-Core / Megatron-LM than the one CI installs.
#
#   compat/megatron.sh core_v0.19.0          # a tag of NVIDIA/Megatron-LM, exported from a git mirror
#   compat/megatron.sh /path/to/Megatron-LM  # a source checkout (its megatron/core and megatron/training)
#   compat/megatron.sh pypi                  # the megatron-core the project venv has (CI's, from PyPI)
#   (extra arguments go to pytest, e.g. -k flexible)
#
# A checkout is put first on PYTHONPATH (after this repository), so its megatron.core is the one imported
# (`l3plugin doctor` prints which). Megatron-Core 0.17 and later need Python >= 3.12: the checkout runs in a
# venv this script makes or reuses (COMPAT_VENV), with torch (the version constraints.txt pins), triton and
# Megatron-LM's few extra packages from the package index; pip's cache is reused.
#
# Environment: MEGATRON_LM_GIT   git directory or URL of Megatron-LM (default: a bare clone in COMPAT_DIR)
#              COMPAT_DIR        where tags are exported and results written (default: .compat)
#              COMPAT_PYTHON     interpreter for the venv (default: python3.12)
#              COMPAT_VENV       the venv (default: $COMPAT_DIR/venv-<python version>)
#              PROJECT_PYTHON    the interpreter for "pypi" (default: .venv/bin/python)
#              COMPAT_TESTS      the test files (default: the list below)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET="${1:?usage: compat/megatron.sh <tag|checkout|pypi> [pytest args]}"
shift
COMPAT_DIR="$(mkdir -p "${COMPAT_DIR:-$ROOT/.compat}" && cd "${COMPAT_DIR:-$ROOT/.compat}" && pwd)"
TESTS="${COMPAT_TESTS:-tests/megatron tests/zero/test_zero_megatron_dist_checkpoint.py tests/test_patches.py
  tests/test_patch_versions.py tests/test_megatron_cpu_shim.py
  tests/test_examples.py::test_megatron_example_trains_with_the_flexible_schedule
  tests/test_examples.py::test_patch_adds_only_existing_l3plugin_calls
  tests/test_examples.py::test_there_is_a_pretrain_gpt_patch_for_every_verified_tag}"

if [ "$TARGET" = pypi ]; then
    PY="${PROJECT_PYTHON:-$ROOT/.venv/bin/python}"
    CHECKOUT=""
    LABEL=pypi
else
    if [ -d "$TARGET" ]; then
        CHECKOUT="$(cd "$TARGET" && pwd)"
        LABEL="$(basename "$CHECKOUT")"
    else
        GIT="${MEGATRON_LM_GIT:-$COMPAT_DIR/Megatron-LM.git}"
        if [ ! -e "$GIT" ] && [[ "$GIT" != *://* ]]; then
            git clone --bare https://github.com/NVIDIA/Megatron-LM "$GIT"
        fi
        CHECKOUT="$COMPAT_DIR/megatron-$TARGET"
        LABEL="$TARGET"
        if [ ! -d "$CHECKOUT/megatron/core" ]; then
            mkdir -p "$CHECKOUT.partial"
            git --git-dir="$GIT" archive "$TARGET" | tar -x -C "$CHECKOUT.partial"
            mv "$CHECKOUT.partial" "$CHECKOUT"
        fi
    fi
    [ -f "$CHECKOUT/megatron/core/package_info.py" ] || { echo "no megatron/core in $CHECKOUT" >&2; exit 2; }
    BASE_PY="${COMPAT_PYTHON:-python3.12}"
    PYVER="$("$BASE_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    VENV="${COMPAT_VENV:-$COMPAT_DIR/venv-py$PYVER}"
    PY="$VENV/bin/python"
    if [ ! -f "$VENV/.compat-installed" ]; then
        "$BASE_PY" -m venv "$VENV"
        TORCH="$(grep -E '^torch==' "$ROOT/constraints.txt" || echo torch)"
        DEEPSPEED="$(grep -E '^deepspeed==' "$ROOT/constraints.txt" || echo deepspeed)"
        # torch and triton from the package index (triton: megatron.core.pipeline_parallel imports it from
        # 0.18); six, regex, pyyaml, einops: Megatron-LM's training code; psutil: dist_checkpointing from 0.19
        # (not declared by megatron-core); deepspeed (no ops built): tests/test_patches.py checks every patch
        # set, the DeepSpeed adapter's too; the rest: l3plugin's tests.
        DS_BUILD_OPS=0 "$PY" -m pip install --quiet "$TORCH" "$DEEPSPEED" triton numpy packaging six regex pyyaml \
            einops psutil "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
        touch "$VENV/.compat-installed"
    fi
fi

export PYTHONPATH="$ROOT${CHECKOUT:+:$CHECKOUT}"
export NO_VCS_VERSION=1  # Megatron-Core >= 0.18 would run git to append a commit to its version
mkdir -p "$COMPAT_DIR/results"
OUT="$COMPAT_DIR/results/$LABEL"
cd "$ROOT"
"$PY" -m l3plugin doctor > "$OUT.doctor.txt" 2>&1 || true
grep -E "^l3plugin\.megatron: " "$OUT.doctor.txt" || true
# shellcheck disable=SC2086
set +e
"$PY" -m pytest -q -rfEs -p no:cacheprovider --junitxml="$OUT.xml" $TESTS "$@" 2>&1 | tee "$OUT.log"
STATUS=${PIPESTATUS[0]}
set -e
echo "compat $LABEL: $(tail -n 1 "$OUT.log")  (log: $OUT.log, doctor: $OUT.doctor.txt)"
exit "$STATUS"
