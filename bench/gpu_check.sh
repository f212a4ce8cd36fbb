#!/usr/bin/env bash
# GPU check of the bf16 rung: the kernel tests compiled on CUDA (no interpreter), then the
# step-time benchmark with bandwidth against the card's HBM peak, then the pinned-group
# step (bench/pinned_step.py) if time is left. Runs offline: the Python
# packages torch does not bring are installed from ./wheels (fill it with
# bench/fetch_wheels.sh on a machine with network; wheels/ is git-ignored).
#
#   bash bench/gpu_check.sh                 # H200: peak 4800 GB/s
#   PEAK_GBPS=3350 bash bench/gpu_check.sh  # H100 SXM
#
# Budget: under 4 minutes on an H200 with torch 2.11 and triton 3.6 (Triton compiles the
# kernel's variants once, ~1 minute; the benchmark ~1 minute).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
PEAK_GBPS=${PEAK_GBPS:-4800}
SIZES=${SIZES:-1M,16M,64M,256M}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
start=$(date +%s)

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    raise SystemExit(f"triton is missing: {exc}")
PY

echo "== offline installs from wheels/ (only what is missing; never torch)"
# import name:distribution name; --no-deps so that nothing asks pip for torch.
need=()
for pair in pydantic:pydantic pydantic_core:pydantic-core annotated_types:annotated-types \
    typing_inspection:typing-inspection typing_extensions:typing-extensions \
    pydantic_settings:pydantic-settings dotenv:python-dotenv pynvml:nvidia-ml-py \
    psutil:psutil rich:rich markdown_it:markdown-it-py mdurl:mdurl pygments:pygments \
    bitsandbytes:bitsandbytes packaging:packaging numpy:numpy pytest:pytest \
    iniconfig:iniconfig pluggy:pluggy _pytest:pytest matplotlib:matplotlib \
    contourpy:contourpy cycler:cycler fontTools:fonttools kiwisolver:kiwisolver \
    PIL:pillow pyparsing:pyparsing dateutil:python-dateutil six:six; do
    mod=${pair%%:*}; dist=${pair#*:}
    "$PY" -c "import $mod" 2>/dev/null || need+=("$dist")
done
if ((${#need[@]})); then
    if [[ ! -d wheels ]]; then
        echo "missing ${need[*]} and no wheels/ folder: run bench/fetch_wheels.sh first" >&2
        exit 2
    fi
    # shellcheck disable=SC2046
    "$PY" -m pip install -q --no-index --find-links wheels/ --no-deps $(printf '%s\n' "${need[@]}" | sort -u)
fi

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, not the interpreter

echo "== kernel tests on CUDA"
tests_rc=0
timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_kernels_triton.py tests/test_kernels_dtypes.py tests/test_stochastic_rounding.py \
    tests/test_kernels_cpu.py \
    || tests_rc=$?

echo "== step time (GB/s against ${PEAK_GBPS} GB/s HBM peak)"
left=$((230 - ($(date +%s) - start)))
bench_rc=0
timeout $((left > 30 ? left : 30)) "$PY" bench/step_time.py --device cuda --sizes "$SIZES" \
    --reps 7 --peak-gbps "$PEAK_GBPS" --json "$OUT/step_time_cuda.json" \
    --png "$OUT/step_time_cuda.png" || bench_rc=$?

echo "== a pinned fp32 embedding beside a bf16 body (if time is left)"
left=$((235 - ($(date +%s) - start)))
if ((left > 20)); then
    timeout "$left" "$PY" bench/pinned_step.py --device cuda --emb 64M --body 192M --reps 10 \
        || echo "pinned_step.py rc=$? (not counted)"
fi

echo "== done in $(($(date +%s) - start)) s: tests rc=$tests_rc, benchmark rc=$bench_rc"
exit $((tests_rc != 0 || bench_rc != 0))
