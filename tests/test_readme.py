"""The README's first example runs as written (a new user pastes it first)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_first_example_runs_as_written() -> None:
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "README.md has no python block"
    scope: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    opt, model = scope["opt"], scope["model"]
    # 100 train steps, each one optimizer step on every param (no OOM on a small MLP)
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [100.0] * 4
    # CosineAnnealingLR(T_max=100) after 100 steps: eta_min + (lr - eta_min)(1 + cos(pi))/2 = 0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
