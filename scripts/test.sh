#!/usr/bin/env bash
# Builds everything and runs the test suite (GPU-labelled tests only where a GPU is present).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/build.sh"
exclude=(-LE gpu)
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && exclude=()
ctest --test-dir "$build" --output-on-failure -j "${MAX_JOBS:-$(nproc)}" "${exclude[@]}"
