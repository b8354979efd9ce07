#!/usr/bin/env bash
# Configures and builds into ${BUILD_DIR:-build} with ${MAX_JOBS:-all cores} jobs. Extra args go to cmake.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/install_deps.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j "${MAX_JOBS:-$(nproc)}"
