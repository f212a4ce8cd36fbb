"""Test tools that build an optimizer and train it a few steps."""

from __future__ import annotations

from typing import Any

import torch

from optladder import choose_optimizer


def trained(
    sizes: tuple[int, ...], env: dict[str, str], steps: int
) -> tuple[list[torch.nn.Parameter], Any]:
    """Float32 params of ``sizes`` elements (``torch.manual_seed(0)``), an optimizer chosen
    for them with 8 GiB free and the variables ``env`` (lr 1e-2), and ``steps`` steps on
    random grads; returns the params and the optimizer."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(k)) for k in sizes]
    opt = choose_optimizer(ps, lr=1e-2, free_memory="8GiB", environ=env)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt
