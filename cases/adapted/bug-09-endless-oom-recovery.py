"""Case 9 (facebookresearch/metaseq#304; pytorch#18853): every batch runs out of memory and
the trainer keeps "recovering" forever without making progress.

Adapted to optladder: a train step whose forward always raises OOM, and (separately) an
optimizer whose prepare phase always raises OOM. Expected: the ladder goes
fp32 -> bf16 -> 8bit, makes exactly 3 attempts, then raises OptimizerOutOfMemoryError with
the original OOM chained as __cause__; nothing was committed (params unchanged, no step
counted). A second call on the last rung must fail after exactly 1 attempt (no loop).
Also with OPTLADDER_8BIT_ADAM=0: 2 attempts (fp32 -> bf16), then the error.
"""

import logging

import torch

import optladder.selector.optimizer as opt_mod
from optladder import Ladder, OptimizerOutOfMemoryError, choose_optimizer

logging.getLogger("optladder").setLevel(logging.ERROR)
problems, facts = [], []


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))


def run_forward_always_oom(environ):
    m = make_model()
    before = [p.detach().clone() for p in m.parameters()]
    opt = choose_optimizer(m, free_memory="64GiB", environ=environ)
    ladder = Ladder(opt)
    attempts = {"n": 0, "rungs": []}

    def train_step(x):
        attempts["n"] += 1
        attempts["rungs"].append(opt.rung)
        opt.zero_grad()
        m(x).sum().backward()
        raise torch.OutOfMemoryError("CUDA out of memory (injected, every call)")

    err = None
    try:
        ladder.run(train_step, torch.randn(8, 64))
    except OptimizerOutOfMemoryError as exc:
        err = exc
    unchanged = all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    first = (attempts["n"], list(attempts["rungs"]), err)
    attempts["n"], attempts["rungs"] = 0, []
    err2 = None
    try:
        ladder.run(train_step, torch.randn(8, 64))
    except OptimizerOutOfMemoryError as exc:
        err2 = exc
    return first, (attempts["n"], err2), unchanged, opt


for env, want_rungs in (({}, ["fp32", "bf16", "8bit"]), ({"OPTLADDER_8BIT_ADAM": "0"}, ["fp32", "bf16"])):
    (n, rungs, err), (n2, err2), unchanged, opt = run_forward_always_oom(env)
    cause = type(err.__cause__).__name__ if err is not None else None
    facts.append(f"forward always OOM, env {env or '{}'}: attempts {n} on {rungs}; raised "
                 f"{type(err).__name__ if err else 'nothing'} (cause {cause}); params unchanged {unchanged}; "
                 f"next call: {n2} attempt(s), raised {type(err2).__name__ if err2 else 'nothing'}")
    if rungs != want_rungs or err is None or not isinstance(err.__cause__, torch.OutOfMemoryError):
        problems.append(f"forward OOM {env}: attempts on {rungs} (want {want_rungs}), error {err!r}")
    if n2 != 1 or err2 is None:
        problems.append(f"forward OOM {env}: second call made {n2} attempts")
    if not unchanged:
        problems.append(f"forward OOM {env}: params changed")

# adapted: prepare_step's signature is now (engine, group_names=None, memo=None)
# (optimizers/transaction.py; issue 11: checks moved into prepare, memoized per engine), and
# selector/optimizer.py calls it as prepare_step(engine, names, memo). The fake below takes the
# new signature and passes every argument through to the real one; its injection is unchanged.
# optimizer prepare always OOM
m = make_model()
before = [p.detach().clone() for p in m.parameters()]
opt = choose_optimizer(m, free_memory="64GiB", environ={})
calls = {"n": 0, "rungs": []}
real = opt_mod.prepare_step


def always_oom(engine, names=None, memo=None):  # adapted: new signature (see above)
    calls["n"] += 1
    calls["rungs"].append(opt.rung)
    raise torch.OutOfMemoryError("CUDA out of memory (injected in prepare)")


for p in m.parameters():
    p.grad = torch.ones_like(p)
opt_mod.prepare_step = always_oom
err = None
try:
    opt.step()
except OptimizerOutOfMemoryError as exc:
    err = exc
finally:
    opt_mod.prepare_step = real
unchanged = all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
facts.append(f"optimizer step always OOM: prepare attempts {calls['n']} on {calls['rungs']}; raised "
             f"{type(err).__name__ if err else 'nothing'} (cause {type(err.__cause__).__name__ if err else None}); "
             f"params unchanged {unchanged}; state entries {len(opt.state)}")
if calls["rungs"] != ["fp32", "bf16", "8bit"] or err is None or not isinstance(err.__cause__, torch.OutOfMemoryError):
    problems.append(f"optimizer OOM: attempts {calls['rungs']}, error {err!r}")
if not unchanged or any(len(s) for s in opt.state.values()):
    problems.append("optimizer OOM: something was committed")
if err is not None:
    facts.append(f"message: {str(err)[:220]}")

for f in facts:
    print(f)
for p in problems:
    print("  -", p)
if problems:
    print(f"FAIL: {len(problems)} problem(s); first: {problems[0]}")
else:
    print("PASS: always-OOM step stops after exactly 3 attempts (fp32, bf16, 8bit; 2 with 8bit disabled) with "
          "OptimizerOutOfMemoryError chaining the OOM; nothing committed; next call on the last rung: 1 attempt")
