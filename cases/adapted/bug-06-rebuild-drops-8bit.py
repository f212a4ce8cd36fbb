"""Case 6 (huggingface/accelerate#1902): a wrapper rebuilt the optimizer from its class
and defaults; the 8-bit specific settings were dropped and the "8-bit" optimizer quietly
kept float32 state (4x the memory).

Adapted to optladder: every way the library itself rebuilds or re-wraps the 8bit engine
must end with uint8 state for params >= 4096 elements and ~2 B/param:
  1. escalation fp32 -> bf16 -> 8bit after steps on each rung,
  2. adopt(torch.optim.AdamW) with rung="8bit" (state converted),
  3. load_state_dict of an fp32 checkpoint into an 8bit optimizer,
  4. add_param_group on the 8bit rung (a new 8192-element param),
  5. accelerate.Accelerator(cpu=True).prepare(model, opt) and stepping through the wrapper,
  6. the engine's own min_8bit_size/optim_bits after each move.
Also probed (reported, not judged): what a wrapper that rebuilds with
`type(opt)(params, **opt.defaults)` gets.
"""

import logging
import warnings

import torch

from optladder import adopt, choose_optimizer, measure_footprint, measure_state_bytes

logging.getLogger("optladder").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))


def grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = 0.1 * torch.randn(p.shape, generator=g)


def check(label, opt, params, problems, facts):
    big = [p for p in params if p.numel() >= 4096]
    dtypes = {str(opt.state[p]["state1"].dtype) for p in big if p in opt.state and "state1" in opt.state[p]}
    missing = [p for p in big if p not in opt.state or "state1" not in opt.state[p]]
    eng = opt.engine
    # adapted: the 8bit rung is LadderAdamW's 8bit state format; its bitsandbytes arguments
    # are its 8bit groups' (EightBitGroups.args), no longer the engine's own
    args = getattr(eng.eightbit_groups(), "args", None) if hasattr(eng, "eightbit_groups") else getattr(eng, "args", None)
    n = sum(p.numel() for p in params)
    real = measure_state_bytes(opt)
    est = measure_footprint(params).state_bytes["8bit"]
    bpp = real / n
    facts.append(f"{label}: rung {opt.rung}, engine {type(eng).__name__}, optim_bits "
                 f"{getattr(args, 'optim_bits', None)}, min_8bit_size {getattr(args, 'min_8bit_size', None)}, "
                 f"big-param state1 {sorted(dtypes)}, {real} B = {bpp:.3f} B/param (8bit estimate {est} B)")
    if missing or dtypes != {"torch.uint8"}:
        problems.append(f"{label}: big params have state1 {sorted(dtypes)} (missing {len(missing)})")
    if getattr(args, "optim_bits", None) != 8 or getattr(args, "min_8bit_size", None) != 4096:
        problems.append(f"{label}: engine optim_bits={getattr(args, 'optim_bits', None)}, "
                        f"min_8bit_size={getattr(args, 'min_8bit_size', None)}")
    if real != est:
        problems.append(f"{label}: {real} B allocated != 8bit estimate {est} B")


problems, facts = [], []

# 1. escalation
m = make_model()
opt = choose_optimizer(m, free_memory="64GiB", environ={})
grads(m.parameters(), 0)
opt.step()
opt.escalate("case 6")
grads(m.parameters(), 1)
opt.step()
opt.escalate("case 6")
grads(m.parameters(), 2)
opt.step()
check("1 escalation fp32->bf16->8bit", opt, list(m.parameters()), problems, facts)

# 2. adopt
m = make_model()
base = torch.optim.AdamW(m.parameters(), lr=1e-3)
grads(m.parameters(), 0)
base.step()
opt = adopt(base, rung="8bit", free_memory="64GiB", environ={})
check("2 adopt(AdamW) rung=8bit", opt, list(m.parameters()), problems, facts)
grads(m.parameters(), 1)
opt.step()
check("2 adopt + step", opt, list(m.parameters()), problems, facts)

# 3. fp32 checkpoint into 8bit
m = make_model()
src = choose_optimizer(m, rung="fp32", free_memory="64GiB", environ={})
grads(m.parameters(), 0)
src.step()
m2 = make_model()
opt = choose_optimizer(m2, rung="8bit", free_memory="64GiB", environ={})
opt.load_state_dict(src.state_dict())
check("3 fp32 ckpt -> 8bit load", opt, list(m2.parameters()), problems, facts)

# 4. add_param_group on 8bit
m = make_model()
opt = choose_optimizer(m, rung="8bit", free_memory="64GiB", environ={})
extra = torch.nn.Parameter(torch.zeros(8192))
opt.add_param_group({"params": [extra], "lr": 5e-4})
grads(list(m.parameters()) + [extra], 0)
opt.step()
check("4 add_param_group on 8bit", opt, list(m.parameters()) + [extra], problems, facts)

# 5. accelerate prepare
try:
    from accelerate import Accelerator

    m = make_model()
    opt = choose_optimizer(m, free_memory="64GiB", environ={})
    grads(m.parameters(), 0)
    opt.step()
    opt.escalate("case 6")
    opt.escalate("case 6")
    acc = Accelerator(cpu=True)
    pm, popt = acc.prepare(m, opt)
    x = torch.randn(8, 64)
    popt.zero_grad()
    acc.backward(pm(x).pow(2).mean())
    popt.step()
    facts.append(f"5 accelerate: wrapper {type(popt).__name__}, wraps the same object: {popt.optimizer is opt}")
    if popt.optimizer is not opt:
        problems.append("5 accelerate: prepare() replaced the optladder optimizer")
    check("5 accelerate.prepare after 2 escalations", opt, list(m.parameters()), problems, facts)
except ImportError as exc:
    facts.append(f"5 accelerate not importable: {exc}")

# probe: rebuild from class + defaults
m = make_model()
opt = choose_optimizer(m, rung="8bit", free_memory="64GiB", environ={})
try:
    rebuilt = type(opt)(list(m.parameters()), **opt.defaults)
    facts.append(f"probe type(opt)(params, **defaults): built {type(rebuilt).__name__}")
except Exception as exc:
    facts.append(f"probe type(opt)(params, **defaults): {type(exc).__name__}: {str(exc)[:100]} (loud, not silent)")

for f in facts:
    print(f)
for p in problems:
    print("  -", p)
if problems:
    print(f"FAIL: {len(problems)} problem(s); first: {problems[0]}")
else:
    print("PASS: after escalation, adopt, fp32->8bit load, add_param_group and accelerate.prepare every "
          ">=4096-element param has uint8 state, engine optim_bits=8/min_8bit_size=4096, allocated bytes == 8bit estimate (2.224 B/param incl. small fp32 biases)")
