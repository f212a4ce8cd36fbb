"""Case 23 (ray-project/ray#61937; deepspeedai/DeepSpeed PR#8496): a restored optimizer
state whose per-param `step` comes back in another form -- a Python float/int (after a
numpy/Python round trip), a bfloat16/float16 tensor (a state cast to half precision) --
and the step counter then freezes (an immutable float is incremented out of the dict; a
bf16 counter stops at 256) or bias correction uses a wrong count.

Adapted to optladder: a checkpoint after 3 steps, whose `step` entries are rewritten as:
Python float 3.0, Python int 3, numpy float64, numpy int64, a shape-(1,) float tensor
(older capturable AdamW), 0-d float64 / int64 / bfloat16 tensors; loaded into each rung.
Expected: accepted (or refused with a clear error -- never silently wrong), step lands in the
engine's own form (fp32 0-d float32 tensor, bf16 0-d float32 CPU tensor, 8bit int), the next
3 steps equal a resume from the canonical checkpoint bit for bit, and step reads 6.
Second part: a bf16 counter saved at 256 (where a bf16 counter freezes): after load the
counter must keep counting (256 -> 259 after 3 steps).
"""

import copy
import logging
import warnings

import numpy as np
import torch

from optladder import choose_optimizer

logging.getLogger("optladder").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
problems, facts = [], []


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 4))


def grads(m, s):
    for i, p in enumerate(m.parameters()):
        p.grad = 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + i))


def build(m, rung):
    return choose_optimizer(m, lr=1e-2, rung=rung, free_memory="64GiB", environ={})


VARIANTS = {
    "python float": lambda n: float(n),
    "python int": lambda n: int(n),
    "numpy float64": lambda n: np.float64(n),
    "numpy int64": lambda n: np.int64(n),
    "tensor shape (1,)": lambda n: torch.tensor([float(n)]),
    "0-d float64": lambda n: torch.tensor(float(n), dtype=torch.float64),
    "0-d int64": lambda n: torch.tensor(int(n)),
    "0-d bfloat16": lambda n: torch.tensor(float(n), dtype=torch.bfloat16),
}


# adapted: optladder now keeps Adam-layout step counts as float64 tensors (README "Step
# counts are float64 tensors", steps.STEP_DTYPE; issue 11 item 5: exact past 2**24), where
# torch keeps float32. The engine's own form is thus a 0-d float64 tensor (fp32: on the
# param's device; bf16: on the CPU); 8bit still a Python int. Exactness checks unchanged.
STEP_DTYPE = torch.float64  # adapted: was torch.float32 (see above)


def form_ok(rung, step, p):
    if rung == "8bit":
        return type(step) is int
    return isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == STEP_DTYPE and \
        (step.device == p.device if rung == "fp32" else step.device.type == "cpu")  # adapted: float64


def val(step):
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


for src in ("fp32", "bf16", "8bit"):
    m = make()
    opt = build(m, src)
    for s in range(3):
        grads(m, s)
        opt.step()
    base_ckpt = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(m.state_dict())
    for dst in ("fp32", "bf16", "8bit"):
        # reference: canonical checkpoint
        mr = make()
        mr.load_state_dict(weights)
        ref = build(mr, dst)
        ref.load_state_dict(copy.deepcopy(base_ckpt))
        for s in range(3, 6):
            grads(mr, s)
            ref.step()
        for name, conv in VARIANTS.items():
            ck = copy.deepcopy(base_ckpt)
            for st in ck["state"].values():
                st["step"] = conv(val(st["step"]))
            m2 = make()
            m2.load_state_dict(weights)
            opt2 = build(m2, dst)
            label = f"{src}->{dst} step as {name}"
            try:
                opt2.load_state_dict(ck)
            except ValueError as exc:
                facts.append(f"{label}: refused ({str(exc)[:90]})")
                continue
            bad_form = [p for p in m2.parameters() if not form_ok(dst, opt2.state[p]["step"], p)]
            for s in range(3, 6):
                grads(m2, s)
                opt2.step()
            steps = sorted({val(opt2.state[p]["step"]) for p in m2.parameters()})
            diff = max((p - q).abs().max().item() for p, q in zip(m2.parameters(), mr.parameters()))
            if bad_form or steps != [6.0] or diff != 0:
                problems.append(f"{label}: form ok {not bad_form}, steps {steps}, off the canonical resume by {diff:.3g}")
facts.append(f"{3 * 3 * len(VARIANTS)} (rung pair, step form) loads tried; accepted ones checked for engine form, "
             "step == 6 after 3 more steps and bit-equality with the canonical resume")

# bf16 counter saved at 256
for dst in ("fp32", "bf16", "8bit"):
    m = make()
    opt = build(m, dst)
    grads(m, 0)
    opt.step()
    ck = copy.deepcopy(opt.state_dict())
    for st in ck["state"].values():
        st["step"] = torch.tensor(256.0, dtype=torch.bfloat16)
    opt.load_state_dict(ck)
    for s in range(3):
        grads(m, s)
        opt.step()
    steps = sorted({val(opt.state[p]["step"]) for p in m.parameters()})
    facts.append(f"bf16 step counter 256 loaded into {dst}: after 3 steps {steps}")
    if steps != [259.0]:
        problems.append(f"bf16 counter 256 -> {dst}: after 3 steps {steps}, want [259]")

for f in facts:
    print(f)
for p in problems[:12]:
    print("  -", p)
if problems:
    print(f"FAIL: {len(problems)} problem(s); first: {problems[0]}")
else:
    refused = sum("refused" in f for f in facts)
    print(f"PASS: every step form loads into every rung in the engine's own form (or is refused: {refused}), resumes "
          "bit-equal to the canonical checkpoint with step 6; a bf16 counter at 256 keeps counting (259)")
