#!/usr/bin/env bash
# Puts the CUTLASS / CuTe headers of the pinned `nvidia-cutlass` PyPI wheel into build-deps/cutlass/include (the
# Hopper kernels' build dependency; build-deps travels to the device with its calls). Skips what is there.
set -euo pipefail
version=4.2.0.0
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/build-deps/cutlass
stamp=$dest/VERSION
[[ -f $stamp && $(cat "$stamp") == "$version" && -f $dest/include/cute/tensor.hpp ]] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==$version"
python3 - "$tmp" "$dest/include.new" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("nvidia_cutlass-*.whl"))
prefix = "cutlass_library/source/include/"
out = pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = out / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
PY
rm -rf "$dest/include"
mv "$dest/include.new" "$dest/include"
echo "$version" > "$stamp"
echo "CUTLASS $version headers in $dest/include"
