#!/usr/bin/env bash
# The main job on a fresh machine: build, then run the packed-documents demo on the best backend.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/build.sh"
"${BUILD_DIR:-$root/build}/src/cli/magi-attn" demo "$@"
