"""Adversarial checks of the fp32 rung's direct fused commit
(:mod:`optladder.optimizers.fusedstep`) against ``torch.optim.AdamW(fused=True)`` stepped
side by side on cloned params: edits of ``param_groups`` that torch takes between steps
must give torch's bits, and a step that cannot run must change nothing."""

from __future__ import annotations

from typing import Any

import torch

from optladder import choose_optimizer
from snapshots import assert_steps_as_torch

SIZES = ((7, 3), (11,), (5, 5), (300,))


def _pair() -> tuple[list[Any], list[Any], Any, Any]:
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SIZES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(ps: list[Any]) -> list[dict[str, Any]]:
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.3}]

    opt = choose_optimizer(
        groups(ours), lr=1e-2, weight_decay=0.1, rung="fp32", free_memory="1GiB", environ={}
    )
    reference = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1, fused=True)
    return ours, ref, opt, reference


def _grads(ours: list[Any], ref: list[Any], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p, q in zip(ours, ref):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g, g.clone()


def test_params_moved_between_groups_step_as_torch_does() -> None:
    """The same params in the same flat order, with the boundary between two groups
    moved (a param handed to the group with the other lr): torch steps it with its new
    group's options. The fused lists cached per group must follow the new groups, not
    be reused because the flat list of params and the state are unchanged."""
    ours, ref, opt, reference = _pair()
    for s in range(5):
        _grads(ours, ref, s)
        if s == 2:
            for o, ps in ((opt, ours), (reference, ref)):
                o.param_groups[0]["params"] = ps[:1]
                o.param_groups[1]["params"] = ps[1:]
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, ours, reference, ref)
