#!/usr/bin/env bash
# Builds everything and runs the test suite: the C++ tests (GPU-labelled ones only where a GPU is present),
# then the Python package, installed from this checkout with `pip install .` into a virtual environment
# (build/venv) with torch, JAX and pytest, and its tests (tests/python). Without a GPU the package is built
# without CUDA kernels, which nothing could run here (MAGI_ATTENTION_PREBUILD_FFA=0).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/build.sh"
exclude=(-LE gpu)
gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && gpu=1 && exclude=()
ctest --test-dir "$build" --output-on-failure -j "${MAX_JOBS:-$(nproc)}" "${exclude[@]}"

# torch's CUDA wheels alone unpack to ~6 GB: keep no second copy in pip's cache, and say what was free if it fails.
export PIP_NO_CACHE_DIR=1
echo "disk free before the Python step: $(df -h --output=avail "$build" | tail -1 | tr -d ' ')"
venv=$build/venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch jax numpy pytest
((gpu)) || export MAGI_ATTENTION_PREBUILD_FFA=0
"$venv/bin/python" -m pip install -q "$root"
cd "$build" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "$root/tests/python"
