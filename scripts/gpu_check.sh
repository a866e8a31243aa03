#!/usr/bin/env bash
# One prepared check for a CUDA machine (no network): the test suite, every notebook under nbval,
# and the benchmark, each under `timeout`, all within about 8 minutes. Logs and JSON go to one
# folder, ./gpu_check_out. Exit status: 0 when every step passed.
#
#   bash scripts/gpu_check.sh
#
# The device tool brings back at most 8 files from $OUT (two folders deep), and this writes more
# (logs, junit XML, bench JSON and plots), so when $OUT is set the folder goes to /tmp instead and
# only summary.txt and gpu_check.tgz (the whole folder) land in $OUT. The command there is simply
# `bash scripts/gpu_check.sh`, with `.whl` carried (see below).
#
# What it needs there: python3 with torch (and Triton) as the machine has it, plus the packages its
# image lacks (nbval, nbclient, nbformat, ipykernel, ipywidgets, depyf and their closure). Nothing can
# be fetched there, so prepare them HERE first: `bash scripts/gpu_wheels.sh` writes those wheels to
# .whl/ (git-ignored); name `.whl` in the device tool's `carry`. This script then installs them
# offline (pip --no-index --no-deps --target, outside the repo) and puts them on PYTHONPATH for every
# process. Without .whl/ it still runs, and the notebooks are skipped (no nbval).
#
# Triton must run on the GPU, not in its interpreter: tests/conftest.py only *setdefault*s
# TRITON_INTERPRET=1, so exporting 0 here wins everywhere (pytest, notebook kernels, bench children),
# and the kernel tests then make their tensors on the GPU (conftest.kernel_device).
#
# Without a GPU the same script is a rehearsal of itself: Triton stays in its interpreter, and
# GPU_CHECK_TIME_SCALE (default 1) multiplies every timeout, as a 2-core machine needs (about 4).
#
# With pytest-xdist importable, the tests and the notebooks run on GPU_CHECK_WORKERS workers (default
# min(8, cores/2); 0 runs serially) with --dist loadfile: one file per worker, so a notebook's cells
# stay in one kernel, in order, and a test module's fixtures in one process.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SCALE=${GPU_CHECK_TIME_SCALE:-1}
[[ $SCALE =~ ^[1-9][0-9]*$ ]] || { echo "GPU_CHECK_TIME_SCALE must be a positive integer, got '$SCALE'" >&2; exit 2; }
if [ -n "${OUT:-}" ]; then DEST=$(mktemp -d /tmp/gpu_check_out.XXXXXX); else DEST=$ROOT/gpu_check_out; fi
mkdir -p "$DEST"
PY=${PYTHON:-python3}
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
# on any exit: the temporary site-packages go; under the device tool, the results come back
SITE_TMP=
finish() {
    [ -n "$SITE_TMP" ] && rm -rf "$SITE_TMP"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && cp "$SUMMARY" "$OUT/" && tar czf "$OUT/gpu_check.tgz" -C "$DEST" --exclude=shim .
    fi
}
trap finish EXIT
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

# --- 0. the carried wheels: installed offline, outside the repo, before anything imports them -------
WHEEL_LOG=$DEST/install-wheels.log
CARRIED="nbval nbclient nbformat ipykernel ipywidgets depyf"
if "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
        $CARRIED > /dev/null 2>&1; then
    echo "not needed: $CARRIED are installed already" > "$WHEEL_LOG"
    note "wheels: not needed ($CARRIED installed already)"
elif compgen -G "$ROOT/.whl/*.whl" > /dev/null \
        && ! "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
    # scripts/gpu_wheels.sh fetches them for the GPU machine's CPython 3.12 (some are compiled)
    echo "skipped: the wheels are for CPython 3.12; $PY is $("$PY" -V 2>&1)" > "$WHEEL_LOG"
    note "wheels: skipped, they are for CPython 3.12 and $PY is $("$PY" -V 2>&1)"
elif compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    SITE=${GPU_CHECK_SITE:-}
    [ -n "$SITE" ] || { SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX); SITE_TMP=$SITE; }
    if timeout 300 "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$ROOT"/.whl/*.whl > "$WHEEL_LOG" 2>&1; then
        # every process started from here on (pytest, xdist workers, notebook kernels, bench children)
        # inherits this
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        # what the carried wheels need from the image, at the versions they need (a report, not a gate)
        "$PY" - "$SITE" >> "$WHEEL_LOG" 2>&1 <<'EOF'
import sys, importlib.metadata as md
from packaging.requirements import Requirement
unmet = []
for dist in md.distributions(path=[sys.argv[1]]):
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{dist.metadata['Name']} needs {spec}: missing")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist.metadata['Name']} needs {spec}: found {have}")
print("requirements of the carried wheels:", "all met" if not unmet else f"{len(unmet)} unmet")
print(*unmet, sep="\n")
EOF
        n=$(ls "$ROOT"/.whl/*.whl | wc -l)
        note "wheels: installed $n from .whl into $SITE, on PYTHONPATH; $(grep '^requirements of the carried' "$WHEEL_LOG" || echo 'requirements not checked') (install-wheels.log)"
    else
        note "wheels: install FAILED (see install-wheels.log); carrying on without them"
        FAILED+=("wheels")
        tail -n 15 "$WHEEL_LOG" | sed 's/^/    /' | tee -a "$SUMMARY"
    fi
else
    echo "no wheels in $ROOT/.whl" > "$WHEEL_LOG"
    note "wheels: none ($ROOT/.whl absent or empty: run scripts/gpu_wheels.sh with network and carry .whl); the notebooks skip without nbval"
fi

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
for m in ("pytest", "xdist", "nbval", "nbclient", "nbformat", "ipykernel", "ipywidgets", "matplotlib",
          "safetensors", "depyf", "transformers", "yaml"):
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

# --- workers: pytest-xdist, one file per worker (--dist loadfile: nbval needs a notebook's cells in
# one kernel, in order; a test module's fixtures stay in one process) ------------------------------
XDIST=()
CORES=$(nproc 2>/dev/null || echo 2)
WORKERS=${GPU_CHECK_WORKERS:-$(( CORES / 2 < 8 ? CORES / 2 : 8 ))}
[[ $WORKERS =~ ^[0-9]+$ ]] || { note "GPU_CHECK_WORKERS must be a number, got '$WORKERS'"; exit 2; }
if [ "$WORKERS" -eq 0 ] && [ -z "${GPU_CHECK_WORKERS:-}" ]; then WORKERS=1; fi
if [ "$WORKERS" -eq 0 ]; then
    note "workers: serial (GPU_CHECK_WORKERS=0)"
elif has pytest && has xdist; then
    XDIST=(-n "$WORKERS" --dist loadfile)
    note "workers: $WORKERS pytest-xdist workers, --dist loadfile ($CORES cores)"
else
    note "workers: serial (pytest-xdist not installed)"
fi

# --- 1. tests (Triton kernels on the GPU) -------------------------------------------------------
if has pytest; then
    step tests 200 "$PY" -m pytest -p no:cacheprovider -q ${XDIST[@]+"${XDIST[@]}"} tests \
        --junitxml="$DEST/tests.xml"
else
    note "tests: SKIPPED (pytest not installed)"; FAILED+=("tests-skipped")
    # without pytest, the tour still runs the Triton kernels (eager generate and the selfcheck)
    # and the compiled model on this device
    step tour 240 "$PY" -m minivllm_compile.tour
fi

# --- 2. every notebook under nbval ----------------------------------------------------------------
if has pytest && has nbval; then
    step notebooks 200 "$PY" -m pytest -p no:cacheprovider -q ${XDIST[@]+"${XDIST[@]}"} \
        --nbval-lax --nbval-current-env \
        --nbval-sanitize-with notebooks/sanitize.cfg notebooks --junitxml="$DEST/notebooks.xml"
else
    note "notebooks: SKIPPED (pytest or nbval not installed)"; FAILED+=("notebooks-skipped")
fi

# --- 3. the benchmark: the in-process parts, the most telling first ------------------------------
# bench.json is rewritten after each benchmark, so a timeout still leaves the finished ones. Start-up
# and compile scaling (minutes of fresh-process compiles) are left to a longer run.
LEFT=$(( 450 - ($(date +%s) - START) / SCALE ))
[ $LEFT -lt 60 ] && LEFT=60
step bench "$LEFT" "$PY" -m minivllm_compile.bench --out "$DEST/bench" --only cuda_graphs ir_priority overhead generate fix_functionalization

note "done in $(( $(date +%s) - START ))s; failed: ${FAILED[*]:-none}; logs in $DEST"
[ ${#FAILED[@]} -eq 0 ]
