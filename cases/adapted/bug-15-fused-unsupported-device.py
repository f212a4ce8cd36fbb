"""Case 15 (deepmodeling/deepmd-kit#4667, fixed in PR#4669; pytorch PR#148666;
pytorch#100707): `fused=True` hard-coded for a device/torch version without the kernel
("`fused=True` requires all the params to be floating point Tensors of supported devices:
['cuda', 'xpu', 'privateuseone']"); complex params crashing Adam with weight decay > 0.

Adapted to optladder:
 (a) this torch 2.13 CPU build: the probe runs a fused step and the fp32 rung is fused;
     10 steps equal torch.optim.AdamW(foreach=False) within 1e-6;
 (b) an older torch simulated by patching torch's fused-device list to
     ['cuda', 'xpu', 'privateuseone'] (AdamW(fused=True) on CPU then raises exactly the
     report's error): choose_optimizer must not crash; the fp32 rung falls back to a
     non-fused path, the decision says why, a warning is logged, 10 steps run and equal
     AdamW(foreach=False) within 1e-6;
 (c) complex params with weight_decay=0.1: fp32 rung, not fused, steps run and equal
     torch.optim.AdamW(foreach=False) within 1e-6; bf16/8bit refused with a clear error.
"""

import logging

import torch
import torch.optim.optimizer as torch_optimizer
import torch.utils._foreach_utils as foreach_utils

from optladder import choose_optimizer

problems, facts = [], []


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


cap = Capture()
logging.getLogger("optladder").addHandler(cap)
logging.getLogger("optladder").propagate = False


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def train(m, opt, steps=10):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
        opt.step()


def reference(steps=10):
    m = model()
    train(m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, foreach=False), steps)
    return m


ref = reference()

# (a) real probe
m = model()
opt = choose_optimizer(m, lr=1e-2, weight_decay=0.01, free_memory="64GiB", environ={})
train(m, opt)
diff = max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
facts.append(f"(a) torch {torch.__version__}: rung {opt.rung}, decision.fused {opt.decision.fused}, engine "
             f"fused={opt.engine.param_groups[0].get('fused')}; max |param - AdamW(foreach=False)| after 10 steps {diff:.3g}")
if not (opt.decision.fused and opt.engine.param_groups[0].get("fused")) or diff > 1e-6:
    problems.append(f"(a) CPU fp32 not fused or off the reference by {diff:.3g}")

# (b) simulated older torch without CPU in the fused list
old_list = foreach_utils._get_fused_kernels_supported_devices


def old_torch_list():
    return ["cuda", "xpu", "privateuseone"]


foreach_utils._get_fused_kernels_supported_devices = old_torch_list
torch_optimizer._get_fused_kernels_supported_devices = old_torch_list
try:
    try:
        ctl = model()
        ctl_opt = torch.optim.AdamW(ctl.parameters(), fused=True)
        ctl(torch.randn(2, 32)).sum().backward()
        ctl_opt.step()
        facts.append("(b) control: AdamW(fused=True) on CPU did NOT raise under the patched list")
    except RuntimeError as exc:
        facts.append(f"(b) control: AdamW(fused=True) on CPU raises at its first step: {str(exc)[:110]}")
    cap.records.clear()
    m = model()
    try:
        opt = choose_optimizer(m, lr=1e-2, weight_decay=0.01, free_memory="64GiB", environ={})
        train(m, opt)
        diff = max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
        warned = [r for r in cap.records if "fused" in r]
        facts.append(f"(b) simulated old torch: rung {opt.rung}, decision.fused {opt.decision.fused}, engine "
                     f"{type(opt.engine).__name__} fused={opt.engine.param_groups[0].get('fused')} "
                     f"foreach={opt.engine.param_groups[0].get('foreach')}; reason: {opt.decision.unfused_reason!r}; "
                     f"warnings logged: {len(warned)}; max |param - reference| {diff:.3g}")
        if opt.decision.fused or opt.engine.param_groups[0].get("fused") or diff > 1e-6 or not warned:
            problems.append(f"(b) fallback wrong: fused={opt.decision.fused}, diff {diff:.3g}, warnings {len(warned)}")
    except Exception as exc:
        problems.append(f"(b) choose_optimizer/steps crashed under an old torch: {type(exc).__name__}: {exc}")
finally:
    foreach_utils._get_fused_kernels_supported_devices = old_list
    torch_optimizer._get_fused_kernels_supported_devices = old_list

# (c) complex params with weight decay
torch.manual_seed(0)
z0 = torch.randn(64, 16, dtype=torch.complex64)


def zrun(make):
    z = torch.nn.Parameter(z0.clone())
    opt = make([z])
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        opt.zero_grad()
        t = torch.randn(64, 16, dtype=torch.complex64, generator=g)
        (z - t).abs().pow(2).sum().backward()
        opt.step()
    return z, opt


zr, _ = zrun(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False))
try:
    zo, zopt = zrun(lambda ps: choose_optimizer(ps, lr=1e-2, weight_decay=0.1, free_memory="64GiB", environ={}))
    diff = (zo - zr).abs().max().item()
    facts.append(f"(c) complex64 + weight_decay 0.1: rung {zopt.rung}, decision.fused {zopt.decision.fused}, engine "
                 f"foreach={zopt.engine.param_groups[0].get('foreach')}; max |z - AdamW(foreach=False)| {diff:.3g}")
    if zopt.rung != "fp32" or diff > 1e-6:
        problems.append(f"(c) complex: rung {zopt.rung}, diff {diff:.3g}")
except Exception as exc:
    problems.append(f"(c) complex params crashed: {type(exc).__name__}: {exc}")
for rung in ("bf16", "8bit"):
    try:
        choose_optimizer([torch.nn.Parameter(z0.clone())], rung=rung, free_memory="64GiB", environ={})
        problems.append(f"(c) complex params accepted on {rung}")
    except ValueError as exc:
        facts.append(f"(c) complex on {rung}: refused: {str(exc)[:100]}")

for f in facts:
    print(f)
for p in problems:
    print("  -", p)
if problems:
    print(f"FAIL: {len(problems)} problem(s); first: {problems[0]}")
else:
    print("PASS: fused chosen by probing (CPU fused on torch 2.13; with the old device list: foreach fallback, "
          "reason + warning, no crash); fp32 = AdamW(foreach=False) within 1e-6; complex+wd on fp32 matches, "
          "refused on bf16/8bit")
