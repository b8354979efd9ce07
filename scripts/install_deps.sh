#!/usr/bin/env bash
# Installs the build dependencies by package name (Debian). Skips what is already there. Python 3 with its
# headers and venv is needed for the Python package (the system's python3-dev / python3-venv unless the
# python3 on PATH already has them, e.g. a pyenv build).
set -euo pipefail
packages=(cmake g++ make libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libpng-dev zlib1g-dev
          libopenmpi-dev openmpi-bin)
if ! python3 -c 'import os, sysconfig, venv, ensurepip; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null; then
  packages+=(python3 python3-dev python3-venv)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  echo "installing: ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The Hopper kernels' CUTLASS / CuTe headers (pinned PyPI wheel); a build without them leaves that family out.
"$(dirname "$0")/fetch_cutlass.sh" || echo "warning: CUTLASS headers not fetched; the sm_90a kernels will not be built" >&2
