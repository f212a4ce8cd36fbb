"""The Triton kernel compiled for a Hopper GPU (sm_90, an H100/H200) on this machine,
without a GPU: Triton's NVIDIA backend and the ``ptxas`` its wheel carries build the
kernel as a launch on CUDA would, with the launch's own options
(``triton_adamw.LAUNCH_OPTIONS``).

What the interpreter tests cannot see: the compiler refuses what Python accepts (a plain
int global in a kernel; ``mask is None`` on a None argument, which arrives compiled as
``constexpr(None)``), and it may contract a multiply and an add into one fma (one
rounding instead of two), which changes the params' bits against the eager oracle. Both
happened (the kernel did not compile; ``p * decay`` plus the update became an fma).

The expected instruction counts are read off the kernel's source: each element update
has the two ``tl.fma`` written there (the first moment's lerp, the second moment's
addcmul) and a third with coupled weight decay (``g + wd * p``); two IEEE divisions
(``sqrt(v) / bc2_sqrt`` and ``step_size * m / denom``) and a third that unscales the grad
(``HAS_SCALE``); one IEEE square root; no float64 fma. Each thread updates
``CHUNK / (32 * num_warps)`` elements in each of the kernel's two branches (a whole
chunk, a partial one), so every count is per-update times ``2 * CHUNK / (32 * num_warps)``.

Runs in a fresh process: a kernel module imported compiled here would make the
interpreter tests of this session skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

# Each variant: the kernel's constexpr flags; together they take every branch.
VARIANTS = [
    # float32 params and grads, bfloat16 moments (the bf16 rung), stochastic moments
    {"GRAD_KIND": 0, "PARAM_KIND": 0, "MOMENT_F32": False},
    # bfloat16 params and grads, float32 moments (the fp32 rung), stochastic param writes
    {"GRAD_KIND": 1, "PARAM_KIND": 1, "MOMENT_F32": True},
    # float16 params and grads, every optional flag on and the large-weight lerp
    {
        "GRAD_KIND": 2,
        "PARAM_KIND": 2,
        "MOMENT_F32": False,
        "LR_TENSOR": True,
        "HAS_SCALE": True,
        "HAS_INF": True,
        "DECOUPLED": False,
        "COUPLED": True,
        "MAXIMIZE": True,
        "LERP_SMALL": False,
    },
    # float32 grads into bfloat16 params, nearest writes of moments and params
    {"GRAD_KIND": 0, "PARAM_KIND": 1, "MOMENT_F32": False, "STOCHASTIC": False, "PARAM_SR": False},
]

_COMPILE = r"""
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from optladder.optimizers.kernels import triton_adamw as k

fn = k._adamw_bf16_kernel
names = list(inspect.signature(fn.fn).parameters)
types = {"meta_ptr": "*i64", "chunks_ptr": "*i64", "lr_ptr": "*fp32", "scale_ptr": "*fp32",
         "found_inf_ptr": "*fp32", "lr_bits": "i64", "beta1_bits": "i64", "beta2_bits": "i64",
         "wd_bits": "i64", "lerp_w": "fp32", "beta2": "fp32", "omb2": "fp32", "eps": "fp32",
         "wd": "fp32", "seed_key": "i32"}
base = dict(LR_TENSOR=False, HAS_SCALE=False, HAS_INF=False, DECOUPLED=True, COUPLED=False,
            MAXIMIZE=False, STOCHASTIC=True, PARAM_SR=True, LERP_SMALL=True, ALIGNED=True,
            CHUNK_SIZE=k.CHUNK, BLOCK_SIZE=k.BLOCK)
patterns = {
    "fma_f32": r"\bfma\.rn(\.ftz)?(\.sat)?\.f32\b",
    "fma_f64": r"\bfma\.rn\.f64\b",
    "div_rn_f32": r"\bdiv\.rn(\.ftz)?\.f32\b",
    "div_other_f32": r"\bdiv\.(full|approx)(\.ftz)?\.f32\b",
    "sqrt_rn_f32": r"\bsqrt\.rn(\.ftz)?\.f32\b",
    "sqrt_approx_f32": r"\bsqrt\.approx(\.ftz)?\.f32\b",
}
out = []
for flags in json.loads(sys.argv[1]):
    const = {**base, **flags}
    sig = {a: types.get(a, "constexpr") for a in names}
    consts = {(names.index(a),): v for a, v in const.items()}
    compiled = triton.compile(
        ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=k.LAUNCH_OPTIONS
    )
    ptx = compiled.asm["ptx"]
    out.append({name: len(re.findall(p, ptx)) for name, p in patterns.items()})
out.append({"CHUNK": k.CHUNK, "num_warps": k.LAUNCH_OPTIONS["num_warps"]})
print(json.dumps(out))
"""


def test_the_kernel_compiles_for_sm90_with_only_its_written_fmas(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not an earlier one's files
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(VARIANTS)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=900,
    )
    if done.returncode != 0 and "CompilationError" not in done.stderr:
        missing = ("ptxas", "backend", "No module named")
        if any(word in done.stderr for word in missing):
            pytest.skip(f"Triton cannot build for CUDA here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    *counts, sizes = json.loads(done.stdout.strip().splitlines()[-1])
    per_thread = 2 * sizes["CHUNK"] // (32 * sizes["num_warps"])  # two branches
    for flags, got in zip(VARIANTS, counts, strict=True):
        want = {
            "fma_f32": (2 + flags.get("COUPLED", False)) * per_thread,
            "fma_f64": 0,
            "div_rn_f32": (2 + flags.get("HAS_SCALE", False)) * per_thread,
            "div_other_f32": 0,
            "sqrt_rn_f32": per_thread,
            "sqrt_approx_f32": 0,
        }
        assert got == want, flags
