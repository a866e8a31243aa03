#!/usr/bin/env bash
# One prepared check for a CUDA machine (no network): the test suite, every notebook under nbval,
# and the benchmark, each under `timeout`, all within about 8 minutes. Logs and JSON go to one
# folder: $OUT if set, else ./gpu_check_out. Exit status: 0 when every step passed.
#
#   bash scripts/gpu_check.sh
#
# Triton must run on the GPU, not in its interpreter: tests/conftest.py only *setdefault*s
# TRITON_INTERPRET=1, so exporting 0 here wins everywhere (pytest, notebook kernels, bench children),
# and the kernel tests then make their tensors on the GPU (conftest.kernel_device).
#
# Without a GPU the same script is a rehearsal of itself: Triton stays in its interpreter, and
# GPU_CHECK_TIME_SCALE (default 1) multiplies every timeout, as a 2-core machine needs (about 4).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
SCALE=${GPU_CHECK_TIME_SCALE:-1}
[[ $SCALE =~ ^[1-9][0-9]*$ ]] || { echo "GPU_CHECK_TIME_SCALE must be a positive integer, got '$SCALE'" >&2; exit 2; }
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export TRITON_INTERPRET=0 MODE=gpu
else
    export TRITON_INTERPRET=1 MODE=cpu-rehearsal
fi
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
START=$(date +%s)
FAILED=()
SUMMARY=$DEST/summary.txt
: > "$SUMMARY"
note() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }

# step NAME SECONDS CMD...: run CMD under timeout, log to $DEST/NAME.log, record pass/fail
step() {
    local name=$1 secs=$(( $2 * SCALE )); shift 2
    note "$name: start (timeout ${secs}s): $*"
    timeout -k 15 "$secs" "$@" > "$DEST/$name.log" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then note "$name: PASS"
    else
        case $rc in
            124|137) note "$name: TIMEOUT after ${secs}s (rc $rc)" ;;
            *) note "$name: FAIL (rc $rc)" ;;
        esac
        FAILED+=("$name")
    fi
    tail -n 15 "$DEST/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
}

# --- environment: what is installed, nothing fetched --------------------------------------------
{
    nvidia-smi || true
    "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
for m in ("pytest", "nbval", "matplotlib", "safetensors", "depyf"):
    try:
        __import__(m); print(m, "ok")
    except ImportError as e:
        print(m, "MISSING", e)
EOF
} > "$DEST/env.txt" 2>&1
note "mode: $MODE (TRITON_INTERPRET=$TRITON_INTERPRET, timeouts x$SCALE)"
note "environment: $(grep -E '^(python|device)' "$DEST/env.txt" | tr '\n' ' ')"

# --- the package: already importable, or an editable install without network, or a shim ---------
importable() { (cd /tmp && "$PY" -c "import minivllm_compile.ops" >/dev/null 2>&1); }
if ! importable; then
    timeout 120 "$PY" -m pip install -e . --no-deps --no-build-isolation --no-index > "$DEST/install.log" 2>&1
    if ! importable; then
        # PYTHONPATH=. alone is not enough: pyproject maps minivllm_compile.kernels to ./kernels.
        # A sitecustomize on PYTHONPATH adds that mapping for every process (notebook kernels too).
        mkdir -p "$DEST/shim"
        cat > "$DEST/shim/sitecustomize.py" <<EOF
import importlib.abc, importlib.util, sys
class _Kernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "minivllm_compile.kernels":
            return importlib.util.spec_from_file_location(
                name, "$ROOT/kernels/__init__.py", submodule_search_locations=["$ROOT/kernels"])
        return None
sys.meta_path.insert(0, _Kernels())
EOF
        export PYTHONPATH="$DEST/shim:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
        note "package: not installable offline; using PYTHONPATH=$PYTHONPATH (see install.log)"
    else
        note "package: installed editable (no deps, no network)"
    fi
else
    note "package: already importable"
fi
importable || { note "package: still not importable, giving up"; exit 1; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }

# --- 1. tests (Triton kernels on the GPU) -------------------------------------------------------
if has pytest; then
    step tests 200 "$PY" -m pytest -p no:cacheprovider -q tests --junitxml="$DEST/tests.xml"
else
    note "tests: SKIPPED (pytest not installed)"; FAILED+=("tests-skipped")
    # without pytest, the tour still runs the Triton kernels (eager generate and the selfcheck)
    # and the compiled model on this device
    step tour 240 "$PY" -m minivllm_compile.tour
fi

# --- 2. every notebook under nbval ----------------------------------------------------------------
if has pytest && has nbval; then
    step notebooks 150 "$PY" -m pytest -p no:cacheprovider -q --nbval-lax --nbval-current-env \
        --sanitize-with notebooks/sanitize.cfg notebooks --junitxml="$DEST/notebooks.xml"
else
    note "notebooks: SKIPPED (pytest or nbval not installed)"; FAILED+=("notebooks-skipped")
fi

# --- 3. the benchmark: the in-process parts, the most telling first ------------------------------
# bench.json is rewritten after each benchmark, so a timeout still leaves the finished ones. Start-up
# and compile scaling (minutes of fresh-process compiles) are left to a longer run.
LEFT=$(( 450 - ($(date +%s) - START) / SCALE ))
[ $LEFT -lt 60 ] && LEFT=60
step bench "$LEFT" "$PY" -m minivllm_compile.bench --out "$DEST/bench" --only overhead generate fix_functionalization

note "done in $(( $(date +%s) - START ))s; failed: ${FAILED[*]:-none}; logs in $DEST"
[ ${#FAILED[@]} -eq 0 ]
