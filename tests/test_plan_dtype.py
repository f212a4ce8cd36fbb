"""``optladder plan`` and the decision know param dtypes.

The config's ``dtype`` / ``torch_dtype`` is the params' dtype, ``--dtype`` takes the usual
spellings, and the decision says which kernel steps which dtype on each rung.

A tiny GPT-2 (n_embd 8, 1 layer, 2 heads, vocab 16, 8 positions; lm_head tied to wte),
counted by hand:
    wte 16 x 8 = 128; wpe 8 x 8 = 64; ln_f 2 x 8 = 16
    layer: ln_1, ln_2 4 x 8 = 32; c_attn 8 x 24 + 24 = 216; attn c_proj 8 x 8 + 8 = 72;
    c_fc 8 x 32 + 32 = 288; mlp c_proj 32 x 8 + 8 = 264  ->  872
    total 128 + 64 + 872 + 16 = 1,080 params in 2 + 12 + 2 = 16 tensors
    param bytes: float32 4 x 1,080 = 4,320; bfloat16/float16 2 x 1,080 = 2,160
    state bytes do not move with the param dtype: fp32 8 x 1,080 = 8,640 (float32
    moments for bf16/fp16 params too), bf16 4 x 1,080 = 4,320, 8bit (every tensor under
    4,096 elements: two float32 moments) 8,640
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optladder.cli import main
from optladder.dtype_names import canonical_dtype
from optladder.optimizers import kernels
from optladder.optimizers.spec import kernel_routes
from optladder.plan import PlanError, make_plan

pytest.importorskip("transformers")

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 8,
    "n_layer": 1,
    "n_head": 2,
    "vocab_size": 16,
    "n_positions": 8,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TINY_PARAMS = 1_080
ALL_SPELLINGS = "float32 (fp32, float), bfloat16 (bf16), float16 (fp16, half)"


def write_config(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_GPT2, **extra}))
    return path


def plan_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_config_torch_dtype_sets_the_param_bytes(tmp_path: Path) -> None:
    f32 = make_plan(model_config=write_config(tmp_path), device="cpu", free_memory="1GiB")
    bf16 = make_plan(
        model_config=write_config(tmp_path, torch_dtype="bfloat16"),
        device="cpu",
        free_memory="1GiB",
    )
    assert (f32.trainable_params, f32.param_tensors) == (TINY_PARAMS, 16)
    assert f32.dtypes == ("float32",) and f32.param_bytes == 4_320
    assert bf16.dtypes == ("bfloat16",) and bf16.param_bytes == 2_160
    assert f32.param_bytes - bf16.param_bytes == TINY_PARAMS * (4 - 2)
    # the optimizer state keeps its bytes: float32 moments on fp32 for bf16 params too
    for plan in (f32, bf16):
        assert [r.state_bytes for r in plan.rows] == [8_640, 4_320, 8_640]
    assert bf16.decision.footprint.dtypes == ("bfloat16",)
    assert "params taken as bfloat16, the config's torch_dtype" in " ".join(bf16.notes)
    assert "the config names no dtype" in " ".join(f32.notes)


def test_newer_dtype_key_wins_and_null_names_none(tmp_path: Path) -> None:
    both = write_config(tmp_path, dtype="float16", torch_dtype="float32")
    plan = make_plan(model_config=both, device="cpu", free_memory="1GiB")
    assert plan.dtypes == ("float16",) and plan.param_bytes == 2_160
    assert "the config's dtype" in " ".join(plan.notes)
    none = make_plan(
        model_config=write_config(tmp_path, torch_dtype=None, dtype=None),
        device="cpu",
        free_memory="1GiB",
    )
    assert none.dtypes == ("float32",) and none.param_bytes == 4_320


def test_dtype_option_overrides_the_config(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    path = write_config(tmp_path, torch_dtype="bfloat16")
    code, out, err = plan_cli(
        capsys, "--model-config", str(path), "--dtype", "fp32", "--device", "cpu",
        "--free-memory", "1GiB",
    )  # fmt: skip
    assert code == 0, err
    assert "1,080 trainable params in 16 tensors (float32): 4,320 (4.22 KiB) of params" in out
    assert "params taken as float32 (--dtype; the config's torch_dtype is bfloat16)" in out


def test_config_dtype_that_no_rung_is_sized_for(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write_config(tmp_path, torch_dtype="float64")
    with pytest.raises(PlanError) as info:
        make_plan(model_config=path, device="cpu", free_memory="1GiB")
    assert f"--model-config '{path}': torch_dtype='float64'" in str(info.value)
    assert ALL_SPELLINGS in str(info.value) and "give --dtype" in str(info.value)
    code, out, err = plan_cli(capsys, "--model-config", str(path), "--free-memory", "1GiB")
    assert (code, out) == (2, "") and "torch_dtype='float64'" in err
    # --dtype names the dtype: the config's is not read
    plan = make_plan(model_config=path, dtype="half", device="cpu", free_memory="1GiB")
    assert plan.dtypes == ("float16",)


@pytest.mark.parametrize(
    ("spelling", "name", "itemsize"),
    [
        ("bf16", "bfloat16", 2),
        ("BF16", "bfloat16", 2),
        ("bfloat16", "bfloat16", 2),
        ("torch.bfloat16", "bfloat16", 2),
        ("fp16", "float16", 2),
        ("half", "float16", 2),
        ("float16", "float16", 2),
        ("fp32", "float32", 4),
        ("float", "float32", 4),
        (" float32 ", "float32", 4),
    ],
)
def test_dtype_spellings(
    capsys: pytest.CaptureFixture[str], spelling: str, name: str, itemsize: int
) -> None:
    assert canonical_dtype(spelling, "--dtype") == name
    plan = make_plan(params="1000", dtype=spelling, device="cpu", free_memory="1GiB")
    assert plan.dtypes == (name,) and plan.param_bytes == 1_000 * itemsize
    code, out, err = plan_cli(
        capsys, "--params", "1000", "--dtype", spelling, "--device", "cpu", "--free-memory", "1GiB"
    )
    assert code == 0, err
    assert f"1,000 trainable params in 1 tensor ({name}): {1_000 * itemsize:,}" in out


@pytest.mark.parametrize("bad", ["fp8", "float64", "bfloat", ""])
def test_bad_dtype_exits_2_naming_the_option_and_the_spellings(
    capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    code, out, err = plan_cli(capsys, "--params", "1e6", "--dtype", bad, "--free-memory", "1GiB")
    assert (code, out) == (2, "")
    assert f"--dtype={bad!r}" in err and ALL_SPELLINGS in err, err
    with pytest.raises(PlanError, match=f"--dtype={bad!r}"):
        make_plan(params="1e6", dtype=bad, free_memory="1GiB")


def test_the_decision_names_the_kernel_of_each_rung_and_dtype(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = plan_cli(
        capsys, "--params", "1e6", "--dtype", "bf16", "--device", "cpu", "--free-memory", "1GiB"
    )
    assert code == 0
    if kernels.cpu_unavailable_reason() is None:
        assert "- fp32 rung: bfloat16 params on the C kernel (fused)" in out
        assert "- bf16 rung: bfloat16 params on the C kernel (fused)" in out
        assert "- 8bit rung: bfloat16 params on the 8-bit C kernel (fused)" in out
    # float32 params on the fp32 rung: torch's fused AdamW (it runs on the CPU in torch 2.x)
    code, out, _ = plan_cli(capsys, "--params", "1e6", "--device", "cpu", "--free-memory", "1GiB")
    assert "- fp32 rung: float32 params on torch's fused AdamW (fused)" in out


def test_an_unfused_combination_has_its_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    why = "no C compiler (cc, gcc, clang) was found"
    monkeypatch.setattr(kernels, "cpu_unavailable_reason", lambda: why)
    plan = make_plan(params="1e6", dtype="bf16", device="cpu", free_memory="1GiB")
    route = plan.decision.capabilities.kernels["bf16"]["bfloat16"]
    assert (route.kernel, route.fused, route.reason) == ("the eager path", False, why)
    summary = plan.decision.summary()
    assert f"- bf16 rung: bfloat16 params on the eager path (not fused: {why})" in summary
    # a device without any of optladder's kernels
    routes = kernel_routes("mps", False, ("bfloat16", "float32"), False)
    assert routes["bf16"]["float32"].reason == "no fused kernel of optladder's AdamW for mps"
    assert not routes["fp32"]["bfloat16"].fused and not routes["8bit"]["bfloat16"].fused


def test_kernel_routes_follow_the_engines_dispatch() -> None:
    """Mixed dtypes on the CPU, as LadderAdamW and the fp32 engine route them."""
    if kernels.cpu_unavailable_reason() is not None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    routes = kernel_routes("cpu", True, ("float32", "float64"), False)
    assert routes["fp32"]["float32"].kernel == "torch's fused AdamW"
    assert routes["fp32"]["float64"].kernel == "torch's fused AdamW"
    assert routes["bf16"]["float32"].kernel == "the C kernel"
    assert routes["bf16"]["float64"].kernel == "the eager path"
    assert "float64 params run the eager path" in (routes["bf16"]["float64"].reason or "")
    assert routes["8bit"]["float64"].kernel == "no engine"
    # a bf16 param among them: float32 moments for it on the C kernel, the float32
    # param on torch's fused kernel (the fp32 state format of optladder's AdamW)
    mixed = kernel_routes("cpu", True, ("bfloat16", "float32"), False)
    assert {d: r.kernel for d, r in mixed["fp32"].items()} == {
        "bfloat16": "the C kernel",
        "float32": "torch's fused AdamW",
    }
    cplx = kernel_routes("cuda", True, ("float32",), True)
    assert cplx["fp32"]["complex64"].kernel == "torch's foreach AdamW"
    assert "complex" in (cplx["fp32"]["complex64"].reason or "")
    assert cplx["bf16"]["complex64"].kernel == "no engine"
