# load_state_dict accepts any finite step >= 0, but the bf16 rung's random bits need step < 2**32
# and bitsandbytes needs an int32 step. A checkpoint whose group-1 param has step 5e9 loads fine;
# the next step() then fails in the COMMIT phase after group 0 was already written.
# adapted: issue 11 item 5 ("checkpoint steps outside what the rungs take are refused at load
# with nothing changed"): the load of step 5e9 on the bf16 rung is now refused up front with a
# ValueError naming the step, so the half-applied step can no longer happen. Same expectation
# (a bad checkpoint step never leaves a half-changed optimizer): the load must raise that
# ValueError, and params and optimizer state must be bit for bit as before the load; the next
# step then runs on every group (each param's step count 1 -> 2).
import copy, torch, logging; logging.disable(logging.WARNING)
from optladder import choose_optimizer
torch.manual_seed(0)
a, b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
opt = choose_optimizer([{"params": a.parameters()}, {"params": b.parameters()}], rung="bf16", lr=1e-2)
for p in [*a.parameters(), *b.parameters()]: p.grad = torch.randn_like(p)
opt.step()
sd = copy.deepcopy(opt.state_dict())
for i in (2, 3): sd["state"][i]["step"] = torch.tensor(5e9)     # group 1's params
params_before = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]  # adapted: all params
state_before = copy.deepcopy(opt.state_dict())                    # adapted: and the whole state


def same(x, y):  # adapted: bit-for-bit comparison of nested state dicts
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


refused = None
try:
    opt.load_state_dict(sd)                                       # adapted: now refused
    print("load accepted step=5e9")
except ValueError as e:
    refused = str(e)
    print(f"load raised ValueError: {e}")
named = refused is not None and "step" in refused and "5000000000" in refused
params_same = all(torch.equal(x, p) for x, p in zip(params_before, [*a.parameters(), *b.parameters()]))
state_same = same(state_before, opt.state_dict())
opt.step()                                                        # adapted: the next step runs on every group
steps = [int(opt.state[p]["step"]) for p in [*a.parameters(), *b.parameters()]]
ok = named and params_same and state_same and steps == [2, 2, 2, 2]
print(("PASS" if ok else "FAIL") + f": load of step=5e9 {'refused naming the step' if named else 'not refused as documented'}"
      f"; params unchanged {params_same}, state unchanged {state_same}; next step's counts {steps} (expected [2, 2, 2, 2])")
