"""The ``optladder`` command: what it imports, its exit codes, and its bad-input messages.

Expected bytes by hand (DESIGN.md's rules) for ``--params 1e6``: fp32 8 bytes/param =
8,000,000; 8bit 2 bytes/param + 8 bytes per 256-element block (3,907 blocks) + 2,048
bytes of code books = 2,033,304. The gate is 25% of free memory.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import optladder
from optladder.cli import (
    EXIT_BAD_INPUT,
    EXIT_DOES_NOT_FIT,
    EXIT_FITS,
    RUNG_CHOICES,
    _attach_negative_values,
    _seed,
    main,
)
from optladder.rungs import RUNGS

HEAVY = ("torch", "pydantic", "bitsandbytes", "transformers", "numpy", "rich")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``optladder ARGV`` in-process: the exit status, stdout and stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: --help, --version, bad command lines
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with this tree first on the path (and a
    misspelled ``OPTLADDER_8BIT`` set, which nothing may read at import)."""
    return subprocess.run(
        [sys.executable, *args, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OPTLADDER_8BIT": "1"},
        check=False,
    )


@pytest.mark.parametrize(
    "argv", [["--help"], ["--version"], ["plan", "--help"], ["demo", "--help"]]
)
def test_help_and_version_import_no_heavy_module(argv: list[str]) -> None:
    proc = python(
        "import sys\n"
        "from optladder.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print('RESULT', code, heavy)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "RESULT 0 []"


def test_a_reader_that_closes_the_pipe_ends_the_plan_quietly() -> None:
    """``optladder plan --json | head -1``: the reader is gone before the plan is
    printed; the command stops with 141 (128 + SIGPIPE, as a shell says) and no
    BrokenPipeError traceback."""
    argv = ["plan", "--params", "7B", "--device", "cuda", "--free-memory", "80GiB", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "optladder", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the interpreter has imported torch and printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"optladder {optladder.__version__}\n"
    assert out.split()[1].count(".") == 2  # MAJOR.MINOR.PATCH


def test_rung_choices_are_the_rungs() -> None:
    assert RUNG_CHOICES == RUNGS


def test_plan_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0
    text = " ".join(out.split())
    for words in ("0 the rung fits", "1 it does not", "2 bad input", "3 no decision"):
        assert words in text


@pytest.mark.parametrize(
    ("free", "code", "rung"),
    [
        ("32000000", EXIT_FITS, "fp32"),  # gate 8,000,000 == fp32 state
        ("8133216", EXIT_FITS, "8bit"),  # gate 2,033,304 == 8bit state
        ("8133215", EXIT_DOES_NOT_FIT, "8bit"),  # gate 2,033,303: nothing fits
        ("0", EXIT_DOES_NOT_FIT, "8bit"),
    ],
)
def test_plan_exit_status_says_whether_it_fits(
    capsys: pytest.CaptureFixture[str], free: str, code: int, rung: str
) -> None:
    args = ("plan", "--params", "1e6", "--free-memory", free, "--device", "cpu")
    got, out, _ = run(capsys, *args)
    assert got == code
    assert f"rung {rung} (policy): {'fits' if code == 0 else 'does NOT fit'}" in out
    got, out, _ = run(capsys, *args, "--json")
    assert got == code and json.loads(out)["rung"] == rung


def test_plan_fixed_rung_over_the_gate_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    # fp32 fixed: 8,000,000 bytes against a gate of 250,000,000 / 4 = 62,500,000: fits;
    # against 1,000,000 / 4 = 250,000 it does not, and the status says so
    base = ("plan", "--params", "1e6", "--device", "cpu", "--rung", "fp32", "--free-memory")
    assert run(capsys, *base, "250000000")[0] == EXIT_FITS
    assert run(capsys, *base, "1000000")[0] == EXIT_DOES_NOT_FIT


@pytest.mark.parametrize("spelling", [["--free-memory", "-5GiB"], ["--free-memory=-5GiB"]])
def test_negative_free_memory_says_what_is_accepted(
    capsys: pytest.CaptureFixture[str], spelling: list[str]
) -> None:
    code, out, err = run(capsys, "plan", "--params", "1e6", *spelling)
    assert code == EXIT_BAD_INPUT and out == ""
    assert "optladder plan: error: --free-memory='-5GiB' is not a byte count: negative" in err
    assert "from 0 to 2**63 - 1" in err and "KiB, MiB, GiB, TiB (powers of 1024)" in err
    assert "expected one argument" not in err


@pytest.mark.parametrize(
    ("text", "iec", "iec_bytes", "si", "si_bytes"),
    [
        ("24G", "24GiB", "1,073,741,824", "24GB", "1,000,000,000"),
        ("24g", "24GiB", "1,073,741,824", "24GB", "1,000,000,000"),
        ("512M", "512MiB", "1,048,576", "512MB", "1,000,000"),
        ("8K", "8KiB", "1,024", "8kB", "1,000"),
        ("1.5Ti", "1.5TiB", "1,099,511,627,776", "1.5TB", "1,000,000,000,000"),
    ],
)
def test_an_ambiguous_unit_suggests_both_readings(
    capsys: pytest.CaptureFixture[str], text: str, iec: str, iec_bytes: str, si: str, si_bytes: str
) -> None:
    code, _, err = run(capsys, "plan", "--params", "1e6", "--free-memory", text)
    assert code == EXIT_BAD_INPUT
    assert f"--free-memory={text!r} is not a byte count: unit" in err
    assert f"write {iec} ({iec_bytes} bytes per" in err and f"or {si} ({si_bytes} bytes per" in err


def test_demo_free_memory_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "demo", "--free-memory", "24G", "--epochs", "1")
    assert code == EXIT_BAD_INPUT
    assert "optladder demo: error: --free-memory='24G' is not a byte count" in err
    assert "24GiB" in err and "24GB" in err


@pytest.mark.parametrize("params", ["1e308", "1e400", "1e999999999", "1152921504606846976"])
def test_huge_params_is_a_clean_error(capsys: pytest.CaptureFixture[str], params: str) -> None:
    code, out, err = run(capsys, "plan", "--params", params, "--free-memory", "80GiB")
    assert code == EXIT_BAD_INPUT and out == ""
    assert err.startswith(f"optladder plan: error: --params={params!r} is not a count")
    assert "at most 1,152,921,504,606,846,975 (2**60 - 1)" in err


def test_the_largest_params_count_is_planned(capsys: pytest.CaptureFixture[str]) -> None:
    n = 2**60 - 1  # fp32 state 8 * n = 2**63 - 8 bytes: still a byte count
    code, out, _ = run(
        capsys, "plan", "--params", str(n), "--free-memory", "80GiB", "--device", "cpu", "--json"
    )
    assert code == EXIT_DOES_NOT_FIT
    assert json.loads(out)["state_bytes"]["fp32"] == 8 * n


def test_bad_numbers_are_answered_before_torch_loads() -> None:
    proc = python(
        "import sys; from optladder.cli import main\n"
        "codes = [main(['plan', '--params', '1e400', '--free-memory', '80GiB']),\n"
        "         main(['plan', '--params', '7B', '--free-memory', '24G']),\n"
        "         main(['plan', '--params', '7B', '--proactive-min-params', '1e400'])]\n"
        "print('RESULT', codes, 'torch' in sys.modules)\n"
    )
    assert proc.stdout.splitlines()[-1] == "RESULT [2, 2, 2] False"
    assert "Traceback" not in proc.stderr and "--params='1e400' is not a count" in proc.stderr
    assert "--free-memory='24G'" in proc.stderr and "--proactive-min-params='1e400'" in proc.stderr


@pytest.mark.parametrize("seed", ["1e23", "-1", "18446744073709551616", "1.5", "zero"])
def test_demo_seed_out_of_range_is_an_argparse_error(
    capsys: pytest.CaptureFixture[str], seed: str
) -> None:
    code, out, err = run(capsys, "demo", f"--seed={seed}")
    assert code == EXIT_BAD_INPUT and out == ""
    last = err.strip().splitlines()[-1]
    assert last == (
        f"optladder demo: error: argument --seed: invalid seed {seed!r}: expected a whole "
        "number from 0 to 2**64 - 1 (18,446,744,073,709,551,615), e.g. 0 or 1234"
    )


def test_seed_accepts_its_whole_range() -> None:
    assert _seed("0") == 0 and _seed("18446744073709551615") == 2**64 - 1


@pytest.mark.parametrize("option", ["--epochs", "--steps"])
def test_demo_counts_must_be_positive(capsys: pytest.CaptureFixture[str], option: str) -> None:
    code, _, err = run(capsys, "demo", option, "0")
    assert code == EXIT_BAD_INPUT
    assert f"argument {option}: invalid value '0': expected a whole number >= 1" in err


@pytest.mark.parametrize(
    ("argv", "option", "applies_to"),
    [
        (["--oom", "--rung", "bf16"], "--rung", "--oom"),
        (["--oom", "--free-memory", "2MiB"], "--free-memory", "--oom"),
        (["--oom", "--epochs", "3"], "--epochs", "--oom"),
        (["--oom", "--seed", "7"], "--seed", "--oom"),
        (["--rung", "bf16", "--steps", "5"], "--steps", "--rung"),
        (["--free-memory", "2MiB", "--steps", "5"], "--steps", "--free-memory"),
    ],
)
def test_demo_options_that_would_be_ignored_are_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str, applies_to: str
) -> None:
    """``--oom`` runs only the OOM child (its own model, rung and steps): ``--rung``,
    ``--free-memory``, ``--epochs`` and ``--seed`` did nothing there; ``--rung`` or
    ``--free-memory`` run only the digits run, where ``--steps`` did nothing. Refused
    before anything runs, naming the option and the one it does not combine with."""
    code, out, err = run(capsys, "demo", *argv)
    assert code == EXIT_BAD_INPUT and out == ""
    assert err.startswith(f"optladder demo: error: {option} has no effect with {applies_to}")


def test_attach_negative_values() -> None:
    assert _attach_negative_values(["plan", "--free-memory", "-5GiB", "--params", "7B"]) == [
        "plan",
        "--free-memory=-5GiB",
        "--params",
        "7B",
    ]
    assert _attach_negative_values(["--params", "-.5"]) == ["--params=-.5"]
    # an option after a value option stays an option; a lone "-" is left alone
    assert _attach_negative_values(["--free-memory", "--json"]) == ["--free-memory", "--json"]
    assert _attach_negative_values(["--seed", "-"]) == ["--seed", "-"]
    assert _attach_negative_values(["--rung", "-1"]) == ["--rung", "-1"]  # not a value option


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="plans for an absent CUDA device"
)
def test_plan_without_cuda_and_json_says_how_to_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--params", "1e6", "--json")
    assert code == 3 and out == ""
    assert "optladder plan: no decision: --device='cuda' is not present on this machine" in err
    assert "--free-memory 80GiB" in err


def test_imports_are_lazy_and_bitsandbytes_comes_only_with_the_8bit_rung() -> None:
    # One fresh interpreter (each costs seconds of torch import): importing optladder with a
    # misspelled variable set, under -W error, reads no environment and loads no torch;
    # then bitsandbytes stays out until the 8bit rung is built.
    proc = python(
        "import os, sys\n"
        "import optladder, optladder.cli\n"
        "from optladder import choose_optimizer, OptladderWarning\n"
        "import optladder.policies, optladder.selector\n"
        "seen = [OptladderWarning.__module__]\n"
        "del os.environ['OPTLADDER_8BIT']\n"
        "import torch\n"
        "from optladder.cli import main\n"
        "for rung in ('fp32', 'bf16', None):\n"
        "    m = torch.nn.Linear(64, 64)\n"
        "    opt = choose_optimizer(m, lr=1e-3, rung=rung, free_memory='1GiB')\n"
        "    m(torch.ones(2, 64)).sum().backward(); opt.step()\n"
        "    seen.append('bitsandbytes' in sys.modules)\n"
        "main(['plan', '--params', '7e9', '--free-memory', '80GiB', '--json'])\n"
        "seen.append('bitsandbytes' in sys.modules)\n"
        "seen.append('transformers' in sys.modules)\n"
        "choose_optimizer(torch.nn.Linear(64, 64), lr=1e-3, rung='8bit')\n"
        "seen.append('bitsandbytes' in sys.modules)\n"
        "print('SEEN', seen)\n",
        "-W",
        "error",
    )
    assert proc.returncode == 0, proc.stderr
    pytest.importorskip("bitsandbytes")
    # fp32, bf16, the policy's choice (fp32), plan, plan (transformers), then 8bit built
    assert proc.stdout.splitlines()[-1] == (
        "SEEN ['optladder.errors', False, False, False, False, False, True]"
    )


def test_package_names_resolve_lazily() -> None:
    proc = python(
        "import sys, optladder\n"
        "print('RESULT', 'torch' in sys.modules, sorted(optladder.__all__)[:2])\n"
    )
    assert proc.stdout.splitlines()[-1] == "RESULT False ['AdamW', 'Capabilities']"
    assert sorted(optladder.__all__) == sorted(optladder._WHERE)  # `import *`: all lazy
    for name in optladder.__all__:
        assert getattr(optladder, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = optladder.nope  # type: ignore[attr-defined]


def _message_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module that can reach a user (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    ]


def test_runtime_messages_point_only_to_what_an_installed_package_has() -> None:
    package = Path(optladder.__file__).parent
    found = [
        f"{path.relative_to(package)}:{line}: {text!r}"
        for path in sorted(package.rglob("*.py"))
        for line, text in _message_strings(path)
        if any(word in text for word in ("bench/", "examples/", "tests/", "optladder["))
    ]
    assert found == []
