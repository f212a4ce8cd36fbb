"""``optladder plan``: the numbers it prints, the rung it picks, its JSON, its errors.

The CLI runs in-process through ``optladder.cli.main``. Expected bytes are by hand from the
architectures' tensor shapes (DESIGN.md's rules): fp32 8 bytes/param, bf16 4 bytes/param;
8bit: tensors of >= 4,096 elements keep 2 bytes/param of uint8 codes plus one float32
absmax per 256-element block per moment (8 bytes a block), smaller tensors keep two
float32 moments (8 bytes/param), plus 2,048 bytes of code books.

GPT-2 (n_embd 768, 12 layers, vocab 50,257, 1,024 positions; lm_head tied to wte):
    wte 50,257 x 768 = 38,597,376    wpe 1,024 x 768 = 786,432    ln_f 2 x 768 = 1,536
    per layer: c_attn 768 x 2,304 = 1,769,472 + bias 2,304; attn c_proj 768 x 768 =
    589,824 + bias 768; c_fc 768 x 3,072 = 2,359,296 + bias 3,072; mlp c_proj 3,072 x 768
    = 2,359,296 + bias 768; ln_1, ln_2 4 x 768 = 3,072  ->  7,087,872 in 12 tensors
    total 38,597,376 + 786,432 + 12 x 7,087,872 + 1,536 = 124,439,808 in 2 + 144 + 2 = 148
    fp32 8 x 124,439,808 = 995,518,464;  bf16 4 x 124,439,808 = 497,759,232
    8bit small (< 4,096): per layer the 8 biases/norm vectors, 9,984 elements, x 12 =
        119,808, + ln_f 1,536 = 121,344 elements -> 8 x 121,344 = 970,752 bytes
    8bit large: 124,439,808 - 121,344 = 124,318,464 elements, all multiples of 256:
        blocks 150,771 (wte) + 3,072 (wpe) + 12 x (6,912 + 2,304 + 9,216 + 9,216) =
        485,619 = 124,318,464 / 256 -> 2 x 124,318,464 + 8 x 485,619 = 252,521,880 bytes
    8bit total 252,521,880 + 970,752 + 2,048 = 253,494,680

Llama-2-7B (hidden 4,096, intermediate 11,008, 32 layers, vocab 32,000, untied):
    embed and lm_head 2 x 32,000 x 4,096 = 262,144,000; per layer q, k, v, o 4 x 4,096^2
    = 67,108,864, gate/up/down 3 x 4,096 x 11,008 = 135,266,304, 2 RMSNorms 8,192 ->
    202,383,360; total 262,144,000 + 32 x 202,383,360 + 4,096 = 6,738,415,616
    fp32 53,907,324,928; bf16 26,953,662,464; 8bit: every tensor has >= 4,096 elements
    (an RMSNorm weight has exactly 4,096) and a multiple of 256, so
    2 x N + 8 x N / 256 + 2,048 = 13,476,831,232 + 210,575,488 + 2,048 = 13,687,408,768
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from optladder import Decision
from optladder.cli import main
from optladder.plan import PlanError, make_plan, min_free_memory, parse_count, shipped_configs
from optladder.units import format_bytes

pytest.importorskip("transformers")

GPT2 = {"params": 124_439_808, "fp32": 995_518_464, "bf16": 497_759_232, "8bit": 253_494_680}
LLAMA2_7B = {
    "params": 6_738_415_616,
    "fp32": 53_907_324_928,
    "bf16": 26_953_662_464,
    "8bit": 13_687_408_768,
}
CODEBOOKS = 2_048
NO_PROACTIVE = ("--proactive-min-params", "1e15")  # fp32 stays first whatever is fused


def plan_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``optladder plan ARGV`` in-process; the exit status, stdout and stderr."""
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def row(out: str, rung: str) -> list[str]:
    """The cells of the table row of ``rung``."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].split()[0] == rung:
            return cells
    raise AssertionError(f"no {rung} row in:\n{out}")


def cell_bytes(cell: str) -> int:
    """``"995,518,464 (949.40 MiB)"`` -> 995518464."""
    return int(cell.split()[0].replace(",", ""))


def test_gpt2_counts_and_state_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(capsys, "--model-config", "gpt2", "--free-memory", "80GiB")
    assert code == 0
    assert "124,439,808 trainable params in 148 tensors (float32)" in out
    for rung in ("fp32", "bf16", "8bit"):
        cells = row(out, rung)
        assert cell_bytes(cells[1]) == GPT2[rung]  # state bytes
        assert cell_bytes(cells[2]) == GPT2[rung]  # per rank, world size 1
        assert cells[3] == f"{GPT2[rung] / (80 * 2**30):.1%}"
        assert cells[4] == "yes"
    assert "decision:" in out
    from optladder.optimizers.spec import bf16_fused_miss

    if bf16_fused_miss("cuda") is None:  # triton installed: 124M >= 50M params, proactive bf16
        assert row(out, "bf16")[0] == "bf16 <- chosen"
        assert "start at bf16 (fused on this device)" in out
    else:
        assert row(out, "fp32")[0] == "fp32 <- chosen"
        assert "- fp32 state 949.40 MiB is within the gate" in out


def test_llama_2_7b(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(capsys, "--model-config", "llama-2-7b", "--free-memory", "24GiB")
    assert code == 1  # nothing fits: the exit status says so
    assert "6,738,415,616 trainable params in 291 tensors" in out
    for rung in ("fp32", "bf16", "8bit"):
        assert cell_bytes(row(out, rung)[1]) == LLAMA2_7B[rung]
    # gate 6 GiB: even 8bit (12.75 GiB) is over it
    assert row(out, "8bit")[0] == "8bit <- chosen" and row(out, "8bit")[4] == "no"
    assert "does NOT fit" in out and "InsufficientMemoryError" in out


@pytest.mark.parametrize(
    ("name", "params"),
    [
        # 2 x 32,000 x 4,096 + 32 x (2 x 4,096^2 + 2 x 4,096 x 1,024 + 3 x 4,096 x 14,336
        # + 2 x 4,096) + 4,096
        ("mistral-7b", 7_241_732_096),
        # 151,936 x 896 (tied) + 24 x (896 x 896 + 896 + 2 x (896 x 128 + 128) + 896 x 896
        # + 3 x 896 x 4,864 + 2 x 896) + 896
        ("qwen2.5-0.5b", 494_032_768),
        ("gpt2", GPT2["params"]),
        ("llama-2-7b", LLAMA2_7B["params"]),
    ],
)
def test_shipped_configs(name: str, params: int) -> None:
    assert name in shipped_configs()
    plan = make_plan(model_config=name, free_memory="80GiB")
    assert plan.trainable_params == params
    assert plan.decision.footprint.trainable_params == params
    assert plan.rows[0].state_bytes == 8 * params


def test_config_file_and_folder(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(shipped_configs()["gpt2"].read_text())
    for spec in (folder, folder / "config.json", str(folder)):
        assert make_plan(model_config=spec, free_memory="1GiB").trainable_params == GPT2["params"]


def test_world_size_divides_state_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(
        capsys, "--model-config", "gpt2", "--free-memory", "80GiB", "--world-size", "7"
    )
    assert code == 0
    # moments ceil(bytes / 7); 8bit: its code books stay whole on every rank
    expected = {
        "fp32": math.ceil(995_518_464 / 7),  # 142,216,924
        "bf16": math.ceil(497_759_232 / 7),  # 71,108,462
        "8bit": math.ceil((253_494_680 - CODEBOOKS) / 7) + CODEBOOKS,  # 36,215,282
    }
    assert expected == {"fp32": 142_216_924, "bf16": 71_108_462, "8bit": 36_215_282}
    for rung, per_rank in expected.items():
        cells = row(out, rung)
        assert cell_bytes(cells[1]) == GPT2[rung]
        assert cell_bytes(cells[2]) == per_rank
    assert "per rank (/7)" in out and "sharded across 7 ranks" in out


def test_world_size_moves_the_gate(capsys: pytest.CaptureFixture[str]) -> None:
    """7e9 params on an 80 GiB device (gate 20 GiB = 21,474,836,480 bytes): alone, fp32
    (56e9) and bf16 (28e9) are over it and 8bit (14,218,752,048) passes; on 8 ranks fp32
    needs 7e9 bytes per rank and passes."""
    base = ("--params", "7e9", "--free-memory", "80GiB", *NO_PROACTIVE, "--json")
    code, out, _ = plan_cli(capsys, *base)
    assert code == 0
    alone = Decision.model_validate_json(out)
    assert alone.rung == "8bit" and alone.fits
    assert alone.state_bytes["8bit"] == 2 * 7 * 10**9 + 8 * math.ceil(7e9 / 256) + CODEBOOKS
    code, out, _ = plan_cli(capsys, *base, "--world-size", "8")
    assert code == 0
    sharded = Decision.model_validate_json(out)
    assert sharded.rung == "fp32" and sharded.fits
    assert sharded.state_bytes["fp32"] == 7 * 10**9
    assert sharded.footprint.trainable_params == 7 * 10**9  # the count stays global
    assert "one of 8 ranks" in sharded.free_memory_source


@pytest.mark.parametrize(
    ("free", "rung", "fits"),
    [
        # gate = 25% of free: 8 GiB -> 2 GiB: fp32 (949.40 MiB) within
        ("8GiB", "fp32", True),
        # 2 GiB -> 512 MiB: fp32 over, bf16 (474.70 MiB) within
        ("2GiB", "bf16", True),
        # 1 GiB -> 256 MiB: bf16 over, 8bit (241.75 MiB) within
        ("1GiB", "8bit", True),
        # 100 MiB -> 25 MiB: nothing passes; the cheapest
        ("100MiB", "8bit", False),
    ],
)
def test_rung_chosen_for_free_memory(
    capsys: pytest.CaptureFixture[str], free: str, rung: str, fits: bool
) -> None:
    code, out, _ = plan_cli(capsys, "--model-config", "gpt2", "--free-memory", free, *NO_PROACTIVE)
    assert code == (0 if fits else 1)
    assert row(out, rung)[0] == f"{rung} <- chosen"
    assert sum("<- chosen" in line for line in out.splitlines()) == 1
    assert row(out, rung)[4] == ("yes" if fits else "no")
    assert f"rung {rung} (policy)" in out
    assert ("does NOT fit" in out) is not fits


def test_json_is_a_decision(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(
        capsys, "--model-config", "gpt2", "--free-memory", "2GiB", "--rung", "8bit", "--json"
    )
    assert code == 0
    decision = Decision.model_validate_json(out)  # stdout is the JSON and nothing else
    assert decision.rung == "8bit" and decision.origin == "fixed"
    assert decision.state_bytes == {k: v for k, v in GPT2.items() if k != "params"}
    assert decision.free_memory == 2 * 2**30
    assert decision.capabilities.device == "cuda"


def test_policy_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(
        capsys,
        "--params",
        "124439808",
        "--free-memory",
        "1GiB",
        "--policy-fraction",
        "0.5",
        "--proactive-min-params",
        "200M",
        "--json",
    )
    assert code == 0
    decision = Decision.model_validate_json(out)
    assert decision.budget_bytes == 2**29
    assert decision.policy.proactive_bf16_min_params == 200_000_000
    # gate 512 MiB: fp32 (995,518,464 bytes) over, bf16 (497,759,232) within
    assert decision.rung == "bf16"


def test_params_alone_states_its_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(capsys, "--params", "7B", "--device", "cpu", "--free-memory", "1TiB")
    assert code == 0
    assert "7,000,000,000 trainable params in 1 tensor (float32)" in out
    assert "params assumed float32" in out and "every tensor assumed >= 4,096 elements" in out
    # 2 x 7e9 + 8 x ceil(7e9 / 256) + 2,048
    assert cell_bytes(row(out, "8bit")[1]) == 14_000_000_000 + 8 * 27_343_750 + CODEBOOKS
    assert cell_bytes(row(out, "fp32")[1]) == 56_000_000_000


def test_cpu_free_memory_is_probed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_cli(capsys, "--params", "1e6", "--device", "cpu")
    assert code == 0
    assert "probed on cpu" in out


def test_model_factory_built_on_meta(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plan_factory_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            DEVICES = []

            def mlp():
                DEVICES.append(torch.empty(1).device.type)
                return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

            NOT_CALLABLE = 3

            def not_a_module():
                return [1]

            def needs_width(width):
                return nn.Linear(width, width)

            def raises():
                raise RuntimeError("no config here")
            """
        )
    )
    monkeypatch.chdir(tmp_path)  # the current folder is searched, as `python -m` would
    monkeypatch.delitem(sys.modules, "plan_factory_mod", raising=False)
    code, out, _ = plan_cli(capsys, "--model", "plan_factory_mod:mlp", "--free-memory", "1GiB")
    assert code == 0, out
    assert sys.modules["plan_factory_mod"].DEVICES == ["meta"]
    # 64 x 256 + 256 + 256 x 10 + 10 = 19,210 params
    assert "19,210 trainable params in 4 tensors" in out
    # 8bit: the 16,384-element weight: 2 x 16,384 + 8 x 64 = 33,280; the 2,826 elements of
    # the others (< 4,096) 8 x 2,826 = 22,608; code books 2,048
    assert cell_bytes(row(out, "8bit")[1]) == 33_280 + 22_608 + CODEBOOKS
    assert cell_bytes(row(out, "fp32")[1]) == 8 * 19_210

    for spec, words in [
        ("plan_factory_mod:NOT_CALLABLE", "not a callable"),
        ("plan_factory_mod:not_a_module", "not a torch.nn.Module"),
        ("plan_factory_mod:missing", "has no attribute"),
        ("plan_factory_mod:needs_width", "needs_width needs arguments"),
        ("plan_factory_mod:raises", "failed (RuntimeError: no config here)"),
    ]:
        code, _, err = plan_cli(capsys, "--model", spec, "--free-memory", "1GiB")
        assert code == 2 and "--model=" in err and words in err, err
        # the no-arguments rule is named only for a factory that needs arguments
        assert ("taking no arguments" in err) is (spec.endswith(("needs_width", "CALLABLE"))), err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("124439808", 124_439_808),
        ("7e9", 7_000_000_000),
        ("1.5e9", 1_500_000_000),
        ("7B", 7_000_000_000),
        ("350M", 350_000_000),
        ("125k", 125_000),
        ("1_000", 1_000),
        ("124,439,808", 124_439_808),
    ],
)
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["0", "2.5", "-1", "abc", "7X", "1e-3", "", "nan", True])
def test_parse_count_rejects(text: object) -> None:
    with pytest.raises(PlanError, match=r"--params=.* expected a whole number >= 1"):
        parse_count(text)


BAD_INPUTS = [
    (
        ["--free-memory", "1GiB"],
        "give exactly one of --params, --model-config, --model to describe the model; got none",
    ),
    (
        ["--params", "1e6", "--model-config", "gpt2", "--free-memory", "1GiB"],
        "got --params and --model-config",
    ),
    (["--params", "1e6", "--free-memory", "1GiB", "--world-size", "0"], "--world-size=0"),
    (["--params", "1e6", "--world-size", "two"], "argument --world-size"),
    (["--params", "1e6", "--free-memory", "lots"], "--free-memory='lots' is not a byte count"),
    (["--params", "2.5", "--free-memory", "1GiB"], "--params='2.5' is not a count"),
    (
        ["--model-config", "/nonexistent/config.json", "--free-memory", "1GiB"],
        "--model-config='/nonexistent/config.json' is not a file, nor a shipped config",
    ),
    (["--model-config", "gpt3", "--free-memory", "1GiB"], "or one of: gpt2, llama-2-7b"),
    (["--model", "no_colon_here", "--free-memory", "1GiB"], "--model='no_colon_here' is not"),
    (
        ["--model", "optladder_no_such_module:build", "--free-memory", "1GiB"],
        "module 'optladder_no_such_module' does not import",
    ),
    (["--params", "1e6", "--device", "nonsense", "--free-memory", "1GiB"], "--device='nonsense'"),
    (
        ["--params", "1e6", "--free-memory", "1GiB", "--policy-fraction", "1.5"],
        "--policy-fraction=1.5",
    ),
    (
        ["--params", "1e6", "--free-memory", "1GiB", "--proactive-min-params", "x"],
        "--proactive-min-params='x'",
    ),
    (["--params", "1e6", "--free-memory", "1GiB", "--rung", "fp8"], "argument --rung"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS)
def test_bad_input_exits_2_naming_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = plan_cli(capsys, *argv)
    assert code == 2
    assert message in err, err
    assert out == ""


def test_bad_config_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cases = {
        "broken.json": ("{not json", "is not a readable JSON file"),
        "no_type.json": ('{"hidden_size": 8}', "has no 'model_type' key"),
        "unknown.json": ('{"model_type": "optladder-no-such-arch"}', "cannot read it"),
    }
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        code, _, err = plan_cli(
            capsys, "--model-config", str(tmp_path / name), "--free-memory", "1GiB"
        )
        assert code == 2 and f"--model-config='{tmp_path / name}'" in err and words in err, err


@pytest.mark.parametrize(
    ("edit", "words"),
    [({"n_embd": 0}, "cannot build"), ({"n_layer": "12"}, "cannot read it")],
)
def test_a_config_transformers_fails_on_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, edit: dict[str, object], words: str
) -> None:
    """A config.json edited by hand (a width of 0, a layer count as a string) made
    transformers raise what plan did not catch (ZeroDivisionError, huggingface_hub's
    StrictDataclassFieldValidationError): a traceback and exit status 1, which the plan's
    contract reads as 'the rung does not fit'. Bad input is 2, naming the option."""
    config = json.loads((shipped_configs()["gpt2"]).read_text())
    config.update(edit)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = plan_cli(capsys, "--model-config", str(path), "--free-memory", "80GiB")
    assert code == 2, err
    assert f"--model-config={str(path)!r}" in err and words in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_a_config_whose_dtype_is_auto_plans_float32_params(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, key: str
) -> None:
    """'auto' names no dtype (config_dtype's rule, and plan's note says so), but
    transformers' AutoConfig failed on it ('module torch has no attribute auto'), so such
    a config could not be planned at all. It plans GPT-2's params as float32."""
    config = json.loads((shipped_configs()["gpt2"]).read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    config[key] = "auto"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = plan_cli(
        capsys, "--model-config", str(path), "--free-memory", "80GiB", *NO_PROACTIVE
    )
    assert code == 0, err
    assert f"{GPT2['params']:,} trainable params" in out and "(float32)" in out, out
    for rung in ("fp32", "bf16", "8bit"):
        assert cell_bytes(row(out, rung)[1]) == GPT2[rung]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present here")
def test_absent_device_needs_free_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan_cli(capsys, "--params", "1e6")  # --device cuda by default
    assert code == 3  # no decision, but no failure: the estimates and how to plan
    assert "--device='cuda' is not present" in err and "pass --free-memory" in err
    assert "Traceback" not in err and "free memory unknown" in out
    # fp32 8 bytes/param; bf16 4; 8bit 2 + 8 per 256-element block (3,907 blocks) + 2,048
    state = {"fp32": 8_000_000, "bf16": 4_000_000, "8bit": 2_000_000 + 8 * 3_907 + CODEBOOKS}
    for rung, n in state.items():
        cells = row(out, rung)
        assert cells[0] == rung and cell_bytes(cells[1]) == n
        # needs free: the gate is 25% of free memory, so 4x the state
        assert cells[3] == format_bytes(4 * n)


def test_override_variables_act(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPTLADDER_RUNG", "bf16")
    code, out, _ = plan_cli(capsys, "--params", "1e6", "--free-memory", "1TiB", "--json")
    assert code == 0 and Decision.model_validate_json(out).origin == "fixed"
    monkeypatch.setenv("OPTLADDER_RUNG", "fp64")
    code, _, err = plan_cli(capsys, "--params", "1e6", "--free-memory", "1TiB")
    assert code == 2 and "OPTLADDER_RUNG='fp64'" in err


def test_min_free_memory_is_the_least_free_memory_that_passes_the_gate() -> None:
    assert min_free_memory(8_000_000, 0.25) == 32_000_000  # 4x the state
    assert min_free_memory(10, 0.3) == 34  # int(0.3 * 34) = 10, int(0.3 * 33) = 9
    assert min_free_memory(0, 0.25) == 0
    for fraction in (0.1, 0.25, 0.3, 0.7, 1.0):
        for state in range(200):
            free = min_free_memory(state, fraction)
            # the gate as decide() computes it: int(fraction * free)
            assert int(fraction * free) >= state
            assert free == 0 or int(fraction * (free - 1)) < state


def test_sharded_bytes_are_exact_for_huge_counts() -> None:
    n = 2**60 - 1  # the largest count: fp32 state 2**63 - 8 bytes, past float precision
    plan = make_plan(params=n, device="cpu", free_memory="1TiB", world_size=3)
    fp32 = {row.rung: row for row in plan.rows}["fp32"]
    assert fp32.state_bytes == 8 * n
    assert fp32.per_rank_bytes == (8 * n + 2) // 3  # ceil by integers
