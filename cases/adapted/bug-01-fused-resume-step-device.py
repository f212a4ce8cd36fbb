"""Case 1 (pytorch/pytorch#103256, #104767): resuming a fused optimizer from a checkpoint
loaded with map_location="cpu" -- the `step` counter must land where the live engine keeps
it, and the live engine's implementation flags (fused/foreach/capturable) must not be
replaced by the checkpoint's.

Adapted to optladder: every pair (save rung -> load rung) of fp32/bf16/8bit, each
checkpoint round-tripped through torch.save/torch.load(map_location="cpu"), plus a
checkpoint written by a plain non-fused torch.optim.AdamW(foreach=True).
Checked after load: the fp32 engine is still fused (group flag and engine default),
no foreign engine flag reached a group, `step` has the form the target engine uses
(fp32: 0-d float32 tensor on the param's device; bf16: 0-d float32 CPU tensor;
8bit: Python int), and after one more step every param's step is exactly 2.
CPU only: on CUDA the same code path decides the device of `step` (param device for
torch fused); here param device == cpu, so the device half of the report needs a GPU.
"""

import io
import logging

import torch

from optladder import choose_optimizer

logging.getLogger("optladder").setLevel(logging.ERROR)
RUNGS = ("fp32", "bf16", "8bit")
FLAG_KEYS = ("fused", "foreach", "capturable")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))


def set_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def build(model, rung):
    return choose_optimizer(model, lr=1e-3, rung=rung, free_memory="64GiB", environ={})


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=False)


# adapted: optladder now keeps Adam-layout step counts as float64 tensors (README "Step
# counts are float64 tensors", steps.STEP_DTYPE; issue 11 item 5: exact past 2**24), where
# torch keeps float32. The target engine's form is thus a 0-d float64 tensor (fp32: on the
# param's device; bf16: on the CPU); device and 0-d checks unchanged, 8bit still a Python int.
STEP_DTYPE = torch.float64  # adapted: was torch.float32 (see above)


def step_form_ok(rung, step, p):
    if rung == "fp32":
        return isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == STEP_DTYPE \
            and step.device == p.device  # adapted: dtype float64 (see above)
    if rung == "bf16":
        return isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == STEP_DTYPE \
            and step.device.type == "cpu"  # adapted: dtype float64 (see above)
    return isinstance(step, int) and not isinstance(step, bool)


def step_value(step):
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


problems = []
checked = 0
sources = [(r, None) for r in RUNGS] + [("torch-foreach", "foreach")]
for src, flavour in sources:
    model_a = make_model()
    if flavour == "foreach":
        opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-3, foreach=True, fused=False)
    else:
        opt_a = build(model_a, src)
    set_grads(model_a, 1)
    opt_a.step()
    ckpt = roundtrip(opt_a.state_dict())
    for dst in RUNGS:
        model_b = make_model()
        model_b.load_state_dict(model_a.state_dict())
        opt_b = build(model_b, dst)
        fused_before = opt_b.engine.defaults.get("fused")
        opt_b.load_state_dict(ckpt)
        label = f"{src}->{dst}"
        engine = opt_b.engine
        if dst == "fp32":
            # adapted: the fp32 rung is a state format of optladder's one engine (LadderAdamW,
            # issue 9), which holds bf16-format groups too: torch's flags are the fp32 groups'
            # keys (as torch.optim.AdamW keeps them per group), not the engine's defaults; the
            # group must stay fused and the load must leave the engine's default as it was
            if not (engine.param_groups[0].get("fused") is True
                    and engine.defaults.get("fused") == fused_before):
                problems.append(f"{label}: fp32 engine fused flag now {engine.param_groups[0].get('fused')}"
                                f" (was {fused_before})")
            if engine.param_groups[0].get("foreach"):
                problems.append(f"{label}: foreach={engine.param_groups[0].get('foreach')} taken from ckpt")
        else:
            leaked = [k for k in FLAG_KEYS if engine.param_groups[0].get(k)]
            if leaked:
                problems.append(f"{label}: torch flags {leaked} reached a {dst} group")
        for p in model_b.parameters():
            st = opt_b.state[p]
            if not step_form_ok(dst, st["step"], p):
                problems.append(f"{label}: step after load is {type(st['step']).__name__} "
                                f"{getattr(st['step'], 'dtype', '')} {getattr(st['step'], 'device', '')}")
                break
            if step_value(st["step"]) != 1.0:
                problems.append(f"{label}: step after load {step_value(st['step'])} != 1")
                break
        set_grads(model_b, 2)
        try:
            opt_b.step()
        except Exception as exc:  # the report's symptom is an error at this step
            problems.append(f"{label}: step after load raised {type(exc).__name__}: {exc}")
            continue
        steps = {step_value(opt_b.state[p]["step"]) for p in model_b.parameters()}
        if steps != {2.0}:
            problems.append(f"{label}: steps after one more step {sorted(steps)} != {{2}}")
        for p in model_b.parameters():
            if not step_form_ok(dst, opt_b.state[p]["step"], p):
                problems.append(f"{label}: step form after the next step is wrong")
                break
        checked += 1

print(f"pairs checked: {checked} (3x3 rung pairs + foreach->3 rungs); problems: {len(problems)}")
for line in problems:
    print("  -", line)
print("note: CUDA-only part (step on the param's CUDA device for torch fused) not run: no GPU")
if problems:
    print(f"FAIL: {len(problems)} problem(s) in {checked} load pairs; first: {problems[0]}")
else:
    print(f"PASS: {checked} load pairs (map_location=cpu): fp32 stays fused, no foreign flags, "
          "step form = target engine's (fp32 0-d f64 on param device, bf16 0-d f64 cpu, 8bit int), "  # adapted: f64
          "step == 2 after one more step")
