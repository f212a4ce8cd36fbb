"""Case 8 (pytorch/pytorch#27600, #26188): after a caught OOM, memory is not freed because
the exception's traceback keeps the failing frames -- and their tensors -- alive; a retry
run inside the `except` block (or with the exception kept) OOMs again.

Adapted to optladder (CPU): a tensor made in the failing attempt is watched with a weakref;
garbage collection is disabled, so only reference counting can free it (as a CUDA caching
allocator would need). The tensor must be dead before the retry starts:
 (a) OOM raised in the optimizer step's prepare phase (patched to allocate 4 MB, then raise
     torch.OutOfMemoryError): checked in on_escalate (after the move) and when the retry
     enters prepare again;
 (b) OOM raised in a forward inside Ladder.run (the activation tensor of the failed
     attempt): checked when the train step is re-entered;
 (c) the same as (b) but the OOM is a RuntimeError "...can't allocate memory" (the CPU
     allocator's message) rather than torch.OutOfMemoryError.
GPU part (memory_allocated() back at its baseline, empty_cache) needs a GPU.
"""

import gc
import logging
import weakref

import torch

import optladder.selector.optimizer as opt_mod
from optladder import Ladder, choose_optimizer

logging.getLogger("optladder").setLevel(logging.ERROR)
problems, facts = [], []


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


# adapted: prepare_step's signature is now (engine, group_names=None, memo=None)
# (optimizers/transaction.py; issue 11: checks moved into prepare, memoized per engine), and
# selector/optimizer.py calls it as prepare_step(engine, names, memo). The fake below takes the
# new signature and passes every argument through to the real one; its injection is unchanged.
# (a) optimizer-step OOM
watch = {}
real_prepare = opt_mod.prepare_step
calls = {"n": 0}


def failing_prepare(engine, names=None, memo=None):  # adapted: new signature (see above)
    calls["n"] += 1
    if calls["n"] == 1:
        scratch = torch.empty(1_000_000)  # 4 MB made by the failing attempt
        watch["a"] = weakref.ref(scratch)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB (injected)")
    if "a_retry" not in watch:
        watch["a_retry"] = watch["a"]() is None
    return real_prepare(engine, names, memo)  # adapted: pass memo through


gc.disable()
try:
    m = make_model()
    seen = {}
    opt = choose_optimizer(m, free_memory="64GiB", environ={},
                           on_escalate=lambda e: seen.setdefault("dead", watch["a"]() is None))
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt_mod.prepare_step = failing_prepare
    try:
        opt.step()
    finally:
        opt_mod.prepare_step = real_prepare
    facts.append(f"(a) step OOM: escalated to {opt.rung}; failed attempt's tensor dead in on_escalate: "
                 f"{seen.get('dead')}; dead when the retry entered prepare: {watch.get('a_retry')}")
    if not (seen.get("dead") and watch.get("a_retry")):
        problems.append("(a) the failed optimizer-step attempt's tensor was still alive at the retry")

    # (b)/(c) forward OOM in Ladder.run
    for label, make_exc in (("(b) torch.OutOfMemoryError", lambda: torch.OutOfMemoryError("CUDA out of memory.")),
                            ("(c) RuntimeError can't allocate memory",
                             # adapted: the ask is 262144 bytes, was 4194304. Issue 11 item 3 ("escalation only
                            # where it can help"): Ladder now reads the ask from the allocator's message and,
                            # when moving down would free less (this model's fp32 -> 8bit frees 389,120
                            # bytes), raises OptimizerOutOfMemoryError instead of rerunning. The case is about
                            # freeing the failed attempt's tensors before a rerun, so the failed allocation
                            # is one the move can cover (a later, smaller one than the 4 MB activation).
                            lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: "
                                                  "can't allocate memory: you tried to allocate 262144 bytes."))):
        m = make_model()
        opt = choose_optimizer(m, free_memory="64GiB", environ={})
        ladder = Ladder(opt)
        state = {"calls": 0}

        def train_step(x):
            state["calls"] += 1
            if state["calls"] == 2:
                state["dead_at_retry"] = state["ref"]() is None
            opt.zero_grad()
            h = m[0](x)  # activation of this attempt (4 MB)
            if state["calls"] == 1:
                state["ref"] = weakref.ref(h)
                raise make_exc()
            loss = m[2](m[1](h)).sum()
            loss.backward()
            opt.step()
            return loss.item()

        ladder.run(train_step, torch.randn(4096, 256))
        facts.append(f"{label}: {state['calls']} calls, rung {opt.rung}, failed attempt's activation dead "
                     f"at the rerun: {state.get('dead_at_retry')}")
        if not state.get("dead_at_retry"):
            problems.append(f"{label}: the failed attempt's activation was alive when the step was rerun")
finally:
    gc.enable()

for f in facts:
    print(f)
for p in problems:
    print("  -", p)
print("note: CUDA part (memory_allocated back to baseline before the retry) not run: no GPU")
if problems:
    print(f"FAIL: {len(problems)} problem(s); first: {problems[0]}")
else:
    print("PASS: with gc disabled, the failed attempt's tensors are freed (weakref dead) before every retry: "
          "optimizer-step OOM, forward OOM (torch.OutOfMemoryError and CPU 'can't allocate memory')")
