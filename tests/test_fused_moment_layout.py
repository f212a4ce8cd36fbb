"""Moments laid out unlike their param on the fp32 rung. torch's fused kernel pairs a
param's elements with its moments' by memory order, so a param laid out unlike the
contiguous default (a ``channels_last`` conv weight, a transposed weight) needs moments
laid out like it, as torch creates them (``zeros_like``, preserve format). A checkpoint
load and a move between rungs make contiguous moments; the step must still equal torch's
``AdamW(fused=True)`` bit for bit."""

from __future__ import annotations

import copy

import torch

from optladder import choose_optimizer
from snapshots import assert_steps_as_torch


def test_a_channels_last_weight_resumed_from_a_checkpoint_steps_as_torch() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
    twin = copy.deepcopy(conv)
    assert not conv.weight.is_contiguous()
    opt = choose_optimizer(conv.parameters(), lr=1e-2, free_memory="1GiB", environ={})
    assert opt.rung == "fp32"
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 8, 10, 10).to(memory_format=torch.channels_last)
    for s in range(5):
        opt.zero_grad()
        conv(x * (s + 1)).square().sum().backward()  # grads laid out like the params
        for p, q in zip(conv.parameters(), twin.parameters()):
            q.grad = p.grad.clone()  # the same bits (a CPU conv's backward need not repeat)
        if s == 2:  # resume: the checkpoint of each, loaded back
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            reference.load_state_dict(copy.deepcopy(reference.state_dict()))
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, list(conv.parameters()), reference, list(twin.parameters()))


def test_a_transposed_weight_moved_back_to_fp32_steps_as_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(70, 90, generator=gen).t().requires_grad_()
    opt = choose_optimizer([p], lr=1e-2, free_memory="1GiB", environ={})

    def grad() -> torch.Tensor:
        return torch.empty_like(p).copy_(torch.randn(p.shape, generator=gen))

    p.grad = grad()
    opt.step()
    opt.escalate("test")
    p.grad = grad()
    opt.step()
    opt.migrate_to("fp32", "test", origin="checkpoint", force=True)
    # the reference: torch's fused AdamW from the same values, all laid out like the param
    # (its CPU kernel's vector and tail loops may round one element differently, so the
    # same element must sit at the same place in memory)
    q = torch.nn.Parameter(p.detach().clone())
    reference = torch.optim.AdamW([q], lr=1e-2, fused=True)
    st = opt.state[p]
    reference.state[q] = {
        "step": st["step"].float(),
        "exp_avg": torch.empty_like(q).copy_(st["exp_avg"]),
        "exp_avg_sq": torch.empty_like(q).copy_(st["exp_avg_sq"]),
    }
    assert q.stride() == p.stride() == reference.state[q]["exp_avg"].stride()
    for _ in range(2):
        p.grad = grad()
        q.grad = p.grad.clone()
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, [p], reference, [q])
