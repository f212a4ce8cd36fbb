#!/usr/bin/env bash
# GPU check of the bf16 rung: the kernel tests compiled on CUDA (no interpreter; every
# param dtype float32/bfloat16/float16 with every grad dtype on both rungs, the param
# writes' stochastic and nearest rounding, NaN/Inf bits against the eager oracle), then the
# step-time benchmark with bandwidth against the card's HBM peak on float32 params and on
# bfloat16 params (--param-dtype bfloat16), then the pinned-group step
# (bench/pinned_step.py) if time is left. Runs offline: the Python
# packages the machine lacks are installed from ./wheels into a folder of their own
# ($SITE, put on PYTHONPATH; the machine's own packages are left as they are). Fill
# wheels/ (git-ignored) with bench/fetch_wheels.sh on a machine with network.
#
#   bash bench/gpu_check.sh                 # H200: peak 4800 GB/s
#   PEAK_GBPS=3350 bash bench/gpu_check.sh  # H100 SXM
#
# Through the device tool's H200 (/work/.library/device/README.md): here, once,
# `WHEELS=h200 bash bench/fetch_wheels.sh` (only what its image lacks, ~46 MB: the tool
# carries at most 64 MiB with the tree); then run with carry ["wheels"] and the command
# `set -o pipefail; PYTHONUNBUFFERED=1 bash bench/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log`
# (its Python is python3; the JSON and PNG files land in $OUT and come back, 5 in all).
#
# Budget: under 4 minutes on an H200 with torch 2.11 and triton 3.6 (Triton compiles the
# kernel's variants once, ~1 minute; the benchmarks ~1.5 minutes). The budget counts from
# the start, installs included: each step runs under a timeout taken from what is left of
# 235 seconds (the tests at least 30 s), and a benchmark with under 20 s left is skipped
# and counted as failed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/optladder-gpu-check-site}
PEAK_GBPS=${PEAK_GBPS:-4800}
SIZES=${SIZES:-1M,16M,64M,256M}
BF16_SIZES=${BF16_SIZES:-16M,64M}
BUDGET_S=235
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
start=$(date +%s)
# seconds left of the budget, minus $1 kept for the steps after this one
left() { echo $((BUDGET_S - ($(date +%s) - start) - ${1:-0})); }

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
    # pydantic 2.14 needs typing-extensions >= 4.16, newer than a machine may have: the
    # wheels' one comes along (in $SITE, first on the path)
    if [[ " ${need[*]} " == *" pydantic "* ]]; then need+=(typing-extensions); fi
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    install() {
        "$PY" -m pip install -q --no-index --find-links wheels/ --no-deps --no-compile \
            --upgrade --target "$SITE" "$@"
    }
    # all at once; if one has no wheel, one by one, so that the others still install
    # (what optladder itself needs is checked by importing it below)
    if ! install "${need[@]}" 2>/dev/null; then
        for dist in "${need[@]}"; do install "$dist" || echo "no wheel installed for $dist"; done
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import optladder.optimizers.adamw" || {
    echo "optladder does not import (above): nothing to test" >&2
    exit 2
}
"$PY" -c "import bitsandbytes" || echo "bitsandbytes does not import (above): its runs are skipped"
unset TRITON_INTERPRET  # compiled kernels, not the interpreter

echo "== kernel tests on CUDA (every param and grad dtype; -rs lists what was skipped)"
# ~35 kernel variants compile (1-4 s each, one process: most of the tests' time, beside
# the C kernel's builds): spread over 8 workers where pytest-xdist is installed (the H200's
# image has it); Triton's and the C kernel's caches take concurrent writers
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
tests_rc=0
t=$(left 90)  # 90 s kept for the two benchmarks
timeout $((t < 140 ? (t > 30 ? t : 30) : 140)) "$PY" -m pytest -q -rs -p no:cacheprovider --durations=15 \
    ${workers[@]+"${workers[@]}"} \
    tests/test_kernels_triton.py tests/test_kernels_dtypes.py tests/test_stochastic_rounding.py \
    tests/test_kernels_cpu.py tests/test_bf16_rounding_bits.py \
    || tests_rc=$?

echo "== step time, float32 params (GB/s against ${PEAK_GBPS} GB/s HBM peak)"
bench_rc=0
t=$(left 45)  # 45 s kept for the bfloat16-param run
if ((t >= 20)); then
    timeout "$t" "$PY" bench/step_time.py --device cuda --sizes "$SIZES" \
        --reps 7 --peak-gbps "$PEAK_GBPS" --json "$OUT/step_time_cuda.json" \
        --png "$OUT/step_time_cuda.png" || bench_rc=$?
else
    echo "skipped: ${t} s left of the budget"; bench_rc=124
fi

echo "== step time, bfloat16 params and grads (torch fused keeps bf16 moments)"
bf16_rc=0
t=$(left 5)
if ((t >= 20)); then
    timeout "$t" "$PY" bench/step_time.py --device cuda --param-dtype bfloat16 \
        --sizes "$BF16_SIZES" --reps 5 --peak-gbps "$PEAK_GBPS" \
        --json "$OUT/step_time_cuda_bf16.json" --png "$OUT/step_time_cuda_bf16.png" \
        || bf16_rc=$?
else
    echo "skipped: ${t} s left of the budget"; bf16_rc=124
fi

echo "== a pinned fp32 embedding beside a bf16 body (if time is left)"
t=$(left)
if ((t > 20)); then
    timeout "$t" "$PY" bench/pinned_step.py --device cuda --emb 64M --body 192M --reps 10 \
        || echo "pinned_step.py rc=$? (not counted)"
fi

echo "== done in $(($(date +%s) - start)) s: tests rc=$tests_rc, benchmark rc=$bench_rc," \
    "bfloat16-param benchmark rc=$bf16_rc"
exit $((tests_rc != 0 || bench_rc != 0 || bf16_rc != 0))
