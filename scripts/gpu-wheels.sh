#!/usr/bin/env bash
# Wheels for the GPU machine (issue 24): scripts/gpu-wheels.sh [--python-version X.Y] [--dest DIR] [--skip N,N]
#
# The lent GPU machine has PyTorch with CUDA but no network, and its image may lack some of
# nowait's pure-Python and binary dependencies. Run here (a machine that reaches PyPI), this
# downloads into DIR (default .gpu-wheels/, ignored by git) the x86-64 manylinux wheels, for the
# device's CPython (3.12 by the device docs), of every run-time dependency of nowait, at exactly
# the versions installed in this checkout's .venv (the ones CI tests), torch and its nvidia-* and
# triton wheels excepted: the device's own CUDA build is used (scripts/gpu_pins.py picks them).
# DIR/pins.txt lists them. --skip names packages left to the device image instead (default: the
# large compiled ones its docs list as installed, about 50 MB, which would not fit the 64 MiB that
# travels; --skip '' carries all); DIR/skipped.txt lists those with the version CI tests. The run
# on the device names DIR in `carry`; scripts/gpu-check.sh installs from it when `import
# nowait.cli` fails there. Prints the wheels' total size and the repo's travelling size (the
# device tool takes at most 64 MiB in all, carried folders included).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
version=3.12
dest="$root/.gpu-wheels"
skip=numpy,matplotlib,pillow,fonttools,kiwisolver,contourpy,uvloop,hf-xet,huggingface-hub
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) version=$2; shift 2 ;;
        --dest) dest=$2; shift 2 ;;
        --skip) skip=$2; shift 2 ;;
        *) echo "usage: scripts/gpu-wheels.sh [--python-version X.Y] [--dest DIR] [--skip N,N]" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$dest"
rm -f "$dest"/*.whl

# The closure of pyproject's run-time requirements as installed here (scripts/gpu_pins.py).
"$python" "$root/scripts/gpu_pins.py" --python-version "$version" --skip "$skip" --skipped "$dest/skipped.txt" \
    "$root/pyproject.toml" > "$dest/pins.txt"

# pip matches each manylinux tag exactly: name the ones current wheels are built for.
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
# PIP_CONSTRAINT: this machine's pip config caps torch; an empty constraint keeps it out of a
# download that names no torch.
PIP_CONSTRAINT= "$python" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "$version" "${platforms[@]}" -d "$dest" -r "$dest/pins.txt" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "$(wc -l < "$dest/pins.txt") wheels (and $(wc -l < "$dest/skipped.txt") left to the device image) for CPython $version in $dest:" >&2
du -ch "$dest"/*.whl | tail -1 >&2
echo "repo's travelling size (tracked + untracked-not-ignored files):" >&2
(cd "$root" && { git ls-files -z; git ls-files -z --others --exclude-standard; } | du --files0-from=- -ch | tail -1) >&2
