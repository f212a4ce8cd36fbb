"""The main job: the digits demo reaches >= 95% test accuracy on every rung."""

from __future__ import annotations

import pytest

from optladder.cli import main
from optladder.demo import ladder_budgets, load_digits_split, make_model, train_digits
from optladder.policies import measure_footprint


def test_digits_split_sizes() -> None:
    x_train, _, x_test, y_test = load_digits_split(0)
    # load_digits has 1,797 images of 8x8 pixels; a fifth (359) is held out
    assert x_train.shape == (1797 - 359, 64) and x_test.shape == (359, 64)
    assert float(x_train.max()) == 1.0 and float(x_train.min()) == 0.0  # pixels 0..16 / 16
    assert set(y_test.tolist()) == set(range(10))


def test_model_quantizes_on_the_8bit_rung() -> None:
    sizes = [p.numel() for p in make_model().parameters()]
    # 64*256 and 256*256 weights are above bitsandbytes' 4,096-element minimum
    assert sizes == [64 * 256, 256, 256 * 256, 256, 256 * 10, 10]
    assert sum(1 for n in sizes if n >= 4096) == 2


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_each_rung_learns_digits(rung: str) -> None:
    lines: list[str] = []
    result = train_digits(rung=rung, free_memory="1GiB", epochs=8, log=lines.append)
    assert result.rung == rung
    assert result.test_accuracy >= 0.95
    assert result.state_bytes == measure_footprint(make_model()).state_bytes[rung]
    assert sum(1 for line in lines if "test accuracy" in line) == 8


def test_ladder_budgets_make_the_policy_choose_each_rung() -> None:
    lines: list[str] = []
    for rung, budget in ladder_budgets().items():
        result = train_digits(free_memory=budget, epochs=1, log=lines.append)
        assert result.rung == rung


def test_cli_demo_pinned(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--rung", "bf16", "--epochs", "1", "--free-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "rung bf16 (fixed)" in out and "epoch  1" in out and "measured optimizer state" in out


def test_cli_demo_bad_free_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--free-memory=-2MiB", "--epochs", "1"]) == 2
    assert "--free-memory='-2MiB' is not a byte count: negative" in capsys.readouterr().err


def test_bf16_autocast_learns_digits() -> None:
    result = train_digits(
        rung="bf16", free_memory="1GiB", epochs=8, autocast=True, log=lambda s: None
    )
    assert result.test_accuracy >= 0.95
