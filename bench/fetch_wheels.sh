#!/usr/bin/env bash
# Fill ./wheels (git-ignored) with what bench/gpu_check.sh installs offline on a GPU
# machine: binary wheels for the GPU machine's Python (PY_VERSIONS, default 3.10-3.13),
# without torch (the GPU machine brings its own CUDA build) and without dependency
# resolution (every package is named; bitsandbytes would otherwise pull torch).
#
#   bash bench/fetch_wheels.sh                     # all listed Python versions
#   PY_VERSIONS=3.12 bash bench/fetch_wheels.sh    # just the GPU machine's
#   WHEELS=h200 bash bench/fetch_wheels.sh         # the device tool's H200 (below)
#
# WHEELS=h200: only what that machine's image lacks (its package list:
# /work/.library/device/KINDS.md; it has torch, triton, numpy, pytest, matplotlib, psutil,
# rich, nvidia-ml-py, packaging), for its Python 3.12: pydantic and its needs (typing-extensions
# too: pydantic 2.14 needs >= 4.16, newer than the image may have), pydantic-settings,
# python-dotenv, bitsandbytes; about 46 MB, inside the 64 MiB that the device tool carries
# with the working tree (carry: ["wheels"]); all of the list below for four Pythons is over
# 200 MB and cannot travel. Empty wheels/ of other wheels first: the whole folder travels.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
case ${WHEELS:-all} in
    all)
        PKGS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
              pydantic-settings python-dotenv nvidia-ml-py psutil rich markdown-it-py mdurl
              pygments bitsandbytes packaging numpy pytest iniconfig pluggy matplotlib contourpy
              cycler fonttools kiwisolver pillow pyparsing python-dateutil six) ;;
    h200)
        PKGS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
              pydantic-settings python-dotenv bitsandbytes)
        PY_VERSIONS=${PY_VERSIONS:-3.12} ;;
    *) echo "WHEELS must be 'all' or 'h200', got '${WHEELS}'" >&2; exit 2 ;;
esac
# Pin to the versions of this checkout's .venv where it has them: a tested, consistent set
# (pydantic needs its exact pydantic-core).
pins=()
for pkg in "${PKGS[@]}"; do
    v=$("$PIP" show "$pkg" 2>/dev/null | sed -n 's/^Version: //p' || true)
    pins+=("$pkg${v:+==$v}")
done
mkdir -p wheels
for py in ${PY_VERSIONS:-3.10 3.11 3.12 3.13}; do
    "$PIP" download -q -d wheels --no-deps --only-binary=:all: -c constraints.txt \
        --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any "${pins[@]}"
done
echo "$(ls wheels | wc -l) wheels, $(du -sm wheels | cut -f1) MiB in wheels/"
