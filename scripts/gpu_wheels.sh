#!/usr/bin/env bash
# Run HERE (with network) before a GPU session: fills <repo>/.whl/ (git-ignored) with the wheels
# that the test suite and the notebooks need and that the GPU machine's image lacks, for its
# Python 3.12 on manylinux x86_64. The GPU session then names `.whl` in the device tool's `carry`,
# and scripts/gpu_check.sh installs them there offline (pip --no-index --no-deps --target) before
# anything imports them.
#
#   bash scripts/gpu_wheels.sh            # download the pinned set (reuses what .whl/ holds)
#   bash scripts/gpu_wheels.sh --resolve  # print what a fresh resolution would pin today
#
# What it checks, offline, after downloading: one wheel per pinned name and nothing else in .whl/;
# every requirement (Requires-Dist, markers read for CPython 3.12 on Linux x86_64) of the roots below
# and of every carried wheel is either carried, at a version that satisfies it, or in the device
# image; every carried wheel is reached from the roots; the total stays under GPU_WHEELS_MAX_MIB
# (default 40; the device tool carries at most 64 MiB with the repository included).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHL=$ROOT/.whl
PY=${PYTHON:-python3}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-40}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The GPU machine's Python packages, from the device tool's KINDS.md ("Python packages already
# there", nvidia-h200, image 'cuda', as read on a machine running it on 2026-11-17; copied here
# 2026-11-29). Its python3 is 3.12.3 (/opt/torch/.venv/bin/python3), torch 2.11.0+cu130, triton 3.6.0.
# Versions seen there: numpy 2.5.2, safetensors 0.8.0, transformers 5.17.0, huggingface_hub 1.33.0.
DEVICE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

# What must import there: the `test` extra of pyproject.toml (read below) plus these. pytest-xdist
# is on the image; it is named so that the check covers it.
EXTRA_ROOTS="ipywidgets pytest-xdist"

# The closure of the roots minus DEVICE_HAS, resolved 2026-11-29 by `--resolve` (pip, CPython 3.12,
# manylinux x86_64). Pinned so that a rerun gives the same set.
PINS="astor==0.8.1 asttokens==3.0.2 comm==0.2.3 debugpy==1.8.22 depyf==0.20.0 dill==0.4.1
executing==2.3.0 fastjsonschema==2.22.3 ipykernel==7.4.0 ipython==9.18.1
ipython-pygments-lexers==1.1.1 ipywidgets==8.1.9 jedi==0.20.1 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 jupyter-client==8.10.0 jupyter-core==5.9.1
jupyterlab-widgets==3.0.17 matplotlib-inline==0.2.2 nbclient==0.11.0 nbformat==5.11.1 nbval==0.11.0
nest-asyncio2==1.7.4 parso==0.8.7 pexpect==4.9.0 platformdirs==4.14.8 prompt-toolkit==3.0.53
ptyprocess==0.7.0 pure-eval==0.2.4 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1
stack-data==0.6.3 tornado==6.6.1 traitlets==5.16.1 wcwidth==0.9.4 widgetsnbextension==4.0.16"

TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# roots: the `test` extra's requirements (as written in pyproject.toml) and EXTRA_ROOTS, one a line
roots() {
    "$PY" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["test"]))
EOF
    printf '%s\n' $EXTRA_ROOTS
}

# pip here reads a config with find-links folders that this machine lacks: drop its warnings about them
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ "${1:-}" = "--resolve" ]; then
    # A fresh resolution with dependencies, for updating PINS: the roots the image lacks, and what
    # they need that the image lacks (not descending into the image's own packages, whose versions
    # there may need less than the newest here).
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mapfile -t reqs < <(roots | "$PY" -c '
import re, sys
device = {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[1].split()}
for line in sys.stdin:
    if re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", line).group()).lower() not in device:
        print(line.strip())' "$DEVICE_HAS")
    quiet_pip download -q "${TARGET[@]}" -d "$tmp" "${reqs[@]}"
    "$PY" - "$tmp" "$DEVICE_HAS" "${reqs[@]}" <<'EOF'
import re, sys, zipfile, pathlib
try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
device = {norm(n) for n in sys.argv[2].split()}
ENV = dict(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
           platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
           platform_machine="x86_64", os_name="posix", extra="")
wheels = {norm(w.name.split("-")[0]): w for w in pathlib.Path(sys.argv[1]).glob("*.whl")}
seen, todo = set(), list(sys.argv[3:])
while todo:
    req = Requirement(todo.pop())
    key = norm(req.name)
    if (req.marker and not req.marker.evaluate(ENV)) or key in device or key in seen:
        continue
    seen.add(key)
    with zipfile.ZipFile(wheels[key]) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    todo += [l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Requires-Dist:")]
print(" ".join(f"{k}=={wheels[k].name.split('-')[1]}" for k in sorted(seen)))
EOF
    exit 0
fi

mkdir -p "$WHL"
# 1. download each pin unless .whl/ already holds that name and version (no network then)
for pin in $PINS; do
    name=${pin%%==*} version=${pin#*==}
    # wheel file names spell the project with underscores (some older ones with the original case)
    if compgen -G "$WHL/${name//-/_}-$version-*.whl" > /dev/null \
        || ls "$WHL" | grep -qiE "^${name//-/[-_.]}-${version//./\\.}-.*\.whl$"; then
        continue
    fi
    echo "downloading $pin"
    quiet_pip download -q --no-deps "${TARGET[@]}" -d "$WHL" "$pin"
done

# 2. the offline check: exactly the pins, one version each, and the closure complete
mapfile -t reqs < <(roots)
"$PY" - "$WHL" "$DEVICE_HAS" "$PINS" "${reqs[@]}" <<'EOF'
import re, sys, zipfile, pathlib
try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

whl_dir, device, pins, roots = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
device = {norm(n) for n in device.split()}
pins = dict(p.split("==") for p in pins.split())
pins = {norm(n): v for n, v in pins.items()}
# the device machine: CPython 3.12.3 on Linux x86_64
ENV = dict(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
           platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
           platform_machine="x86_64", os_name="posix", extra="")
problems = []

wheels = {}
for w in sorted(whl_dir.glob("*.whl")):
    name, version = w.name.split("-")[:2]
    key = norm(name)
    if pins.get(key) != version:
        print(f"removing {w.name}: not pinned (pinned: {key}=={pins.get(key)})")
        w.unlink()
        continue
    wheels[key] = w
for key in pins:
    if key in device:
        problems.append(f"{key} is pinned but the device image has it: carry one only for another version")
    if key not in wheels:
        problems.append(f"{key}=={pins[key]}: no wheel in {whl_dir}")

def requires(w):
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("Requires-Dist:")]

needed_from_device = {}
reached, todo = set(), [(r, "the roots") for r in roots]
while todo:
    spec, who = todo.pop()
    req = Requirement(spec)
    if req.marker and not req.marker.evaluate(ENV):
        continue
    key = norm(req.name)
    if key in pins:
        if not req.specifier.contains(Version(pins[key]), prereleases=True):
            problems.append(f"{who} needs {spec}, pinned {key}=={pins[key]}")
        if key not in reached and key in wheels:
            reached.add(key)
            todo += [(r, f"{key}=={pins[key]}") for r in requires(wheels[key])]
    elif key in device:
        needed_from_device.setdefault(key, set()).add(f"{str(req.specifier) or 'any'} ({who})")
    else:
        problems.append(f"{who} needs {spec}: neither carried nor on the device image")
for key in sorted(set(pins) - reached):
    problems.append(f"{key}=={pins[key]} is carried but nothing needs it")

print(f"{len(wheels)} wheels for CPython 3.12 / manylinux x86_64 in {whl_dir}:")
for key, w in sorted(wheels.items()):
    print(f"  {key}=={pins[key]}  ({w.stat().st_size / 2**20:.2f} MiB)")
print("taken from the device image (its versions are checked there, by scripts/gpu_check.sh):")
for key, why in sorted(needed_from_device.items()):
    print(f"  {key}: " + "; ".join(sorted(why)))
if problems:
    print("PROBLEMS:", *problems, sep="\n  ", file=sys.stderr)
    sys.exit(1)
print("closure complete: every requirement is carried or on the device image")
EOF

# 3. size: the wheels, and the wheels with the tracked files (the device tool carries at most 64 MiB)
bytes=$(du -cb "$WHL"/*.whl | tail -n 1 | cut -f1)
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
echo "total: $(( bytes / 1024 )) KiB in .whl/ ($(( (bytes + tracked) / 1048576 )) MiB with the tracked files; limit 64 MiB)"
if [ "$bytes" -gt $(( MAX_MIB * 1048576 )) ]; then
    echo "ERROR: .whl/ holds more than ${MAX_MIB} MiB: too much to carry beside the repository" >&2
    exit 1
fi
