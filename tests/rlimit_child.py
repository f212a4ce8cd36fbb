"""Child process of ``test_ladder.py::test_a_real_oom_with_a_pinned_8bit_group_...``.

A model with an embedding whose param group pins the 8bit rung and eight 768x768
layers whose groups follow the decision (fp32) trains two steps; then the process caps
its own address space (``RLIMIT_AS``) below what the third step's backward needs for its
grads, but above it once the decided groups' moments move from fp32 (8 bytes a param)
to bf16 (4 bytes). The third step runs out of memory for real in backward (the CPU
allocator's "can't allocate memory"); the Ladder escalates the decided groups and reruns
it; two more steps follow. Then the cap is lifted and a reference run, built the same
way, takes the same five steps with no cap, escalating at the same point (after step 2).

Prints one JSON line: what the capped run saw, and whether params and the whole
optimizer state equal the reference's bit for bit.
"""

from __future__ import annotations

import copy
import gc
import json
import resource
import sys

import torch

from snapshots import flat_state

LAYERS, WIDTH, VOCAB = 8, 768, 2048


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 64)  # 131,072 elements: 8-bit codes
        self.inp = torch.nn.Linear(64, WIDTH)
        self.body = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.emb(idx))
        for layer in self.body:
            h = torch.relu(layer(h))
        return h.square().mean()


def build():  # type: ignore[no-untyped-def]
    from optladder import choose_optimizer

    net = Net()
    groups = [
        {"params": [net.emb.weight], "rung": "8bit"},
        {"params": list(net.inp.parameters())},
        {"params": [p for layer in net.body for p in layer.parameters()], "lr": 5e-4},
    ]
    opt = choose_optimizer(groups, lr=1e-3, free_memory="64GiB")
    return net, opt


def batch(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(i))


def train_step(net, opt, idx):  # type: ignore[no-untyped-def]
    opt.zero_grad()
    loss = net(idx)
    loss.backward()
    opt.step()
    return float(loss.detach())


def vms() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def main() -> int:
    from optladder import Ladder

    torch.set_num_threads(1)
    net, opt = build()
    ladder = Ladder(opt)
    for i in range(2):
        ladder.run(train_step, net, opt, batch(i))
    opt.zero_grad()
    gc.collect()
    n_all = sum(p.numel() for p in net.parameters())
    n_decided = n_all - net.emb.weight.numel()
    # headroom: half the grads the backward needs (4 bytes a param), less than the
    # 4 bytes a param that fp32 -> bf16 frees from the decided groups
    headroom = 2 * n_all
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vms() + headroom, hard))
    seen = []
    try:
        for i in range(2, 5):
            try:
                ladder.run(train_step, net, opt, batch(i))
            except BaseException as exc:  # reported to the test
                seen.append(f"raised {type(exc).__name__}: {exc}"[:400])
                break
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    out = {
        "escalations": [[e.from_rung, e.to_rung, e.step, e.reason[:300]] for e in opt.escalations],
        "rung": opt.rung,
        "pinned_rung": opt.param_groups[0]["rung"],
        "pinned_keys": sorted(opt.state[net.emb.weight]),
        "committed_steps": opt.committed_steps,
        "steps": sorted({int(float(opt.state[p]["step"])) for p in net.parameters()}),
        "seen": seen,
        "n_decided": n_decided,
        "headroom": headroom,
    }
    # the reference: no cap, the same steps, the same move after step 2
    ref_net, ref = build()
    for i in range(5):
        if i == 2:
            ref.escalate("as the capped run did")
        train_step(ref_net, ref, batch(i))
    out["params_equal"] = all(
        torch.equal(p, q) for p, q in zip(net.parameters(), ref_net.parameters())
    )
    a, b = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())
    for sd in (a, b):
        for g in sd["param_groups"]:
            g.pop("rung_reason", None)
    out["groups_equal"] = a["param_groups"] == b["param_groups"]
    same = a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        flat_a, flat_b = flat_state(a["state"][k]), flat_state(b["state"][k])
        same = same and flat_a.keys() == flat_b.keys()
        for name, va in flat_a.items():
            vb = flat_b[name]
            if isinstance(va, torch.Tensor):
                same = same and va.dtype == vb.dtype and torch.equal(va, vb)
            else:
                same = same and va == vb
    out["state_equal"] = same
    out["oom_was_real"] = any("can't allocate memory" in e[3] for e in out["escalations"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
