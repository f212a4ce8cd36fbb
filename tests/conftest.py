"""Shared fixtures: a clean environment for the override variables."""

from __future__ import annotations

import pytest

_VARS = ("OPTLADDER_BF16_ADAM", "OPTLADDER_8BIT_ADAM", "OPTLADDER_RUNG")


@pytest.fixture(autouse=True)
def _no_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without optladder variables, whatever the caller's shell has set."""
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)
