"""Case 17 (huggingface/transformers#21521; PRs #24521, #24758): after an out-of-memory
rerun (auto_find_batch_size), the LR scheduler was not reset/kept in step with the
optimizer, so the learning rate decayed to zero before training ended.

Adapted to optladder's own rerun: the README's HF Trainer recipe (examples/hf_trainer.py,
LadderTrainer with optimizers=(opt, cosine-with-warmup scheduler)), 12 optimizer steps.
Injected: one OOM in forward at the 4th micro-batch (the Ladder reruns the micro-batch one
rung down) and one OOM in the optimizer's prepare phase at the 8th step (retried inside
step()). Expected vs an identical run without OOMs: the learning rate used by every
optimizer step is identical, the scheduler's last_epoch == 12 == global_step, each param's
optimizer step count == 12, and the run ends on 8bit after two moves.
"""

import importlib.util
import logging
import os
import tempfile
import warnings

import torch

import optladder.selector.optimizer as opt_mod

logging.getLogger("optladder").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for k in [k for k in os.environ if k.startswith("OPTLADDER_")]:
    del os.environ[k]

spec = importlib.util.spec_from_file_location("hf_example", os.path.join(os.getcwd(), "examples", "hf_trainer.py"))
hf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf)

# adapted: prepare_step's signature is now (engine, group_names=None, memo=None)
# (optimizers/transaction.py; issue 11: checks moved into prepare, memoized per engine), and
# selector/optimizer.py calls it as prepare_step(engine, names, memo). The fake below takes the
# new signature and passes every argument through to the real one; its injection is unchanged.
MAX_STEPS = 12


def run(inject):
    with tempfile.TemporaryDirectory() as tmp:
        trainer, history = hf.build_trainer(tmp, max_steps=MAX_STEPS, batch_size=8, warmup_steps=3,
                                            free_memory="64GiB")
        opt = trainer.ladder.optimizer
        model = trainer.model
        calls = {"fwd": 0, "prep": 0}

        def pre_hook(module, args, kwargs):
            if module.training:
                calls["fwd"] += 1
                if inject and calls["fwd"] == 4:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected in forward)")

        handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        real = opt_mod.prepare_step

        def prep(engine, names=None, memo=None):  # adapted: new signature (see above)
            if engine is opt.engine:
                calls["prep"] += 1
                if inject and calls["prep"] == 8:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected in the optimizer step)")
            return real(engine, names, memo)  # adapted: pass memo through

        opt_mod.prepare_step = prep
        try:
            trainer.train()
        finally:
            opt_mod.prepare_step = real
            handle.remove()
        steps = sorted({int(float(s["step"])) for s in opt.state.values()})
        return {
            "lrs": list(history.lrs),
            "global_step": trainer.state.global_step,
            "last_epoch": trainer.lr_scheduler.last_epoch,
            "param_steps": steps,
            "rung": opt.rung,
            "moves": [(e.from_rung, e.to_rung) for e in opt.escalations],
            "fwd_calls": calls["fwd"],
        }


clean = run(inject=False)
oom = run(inject=True)
problems, facts = [], []
facts.append(f"clean: global_step {clean['global_step']}, scheduler last_epoch {clean['last_epoch']}, param steps "
             f"{clean['param_steps']}, rung {clean['rung']}, forward calls {clean['fwd_calls']}")
facts.append(f"with 2 OOMs: global_step {oom['global_step']}, scheduler last_epoch {oom['last_epoch']}, param steps "
             f"{oom['param_steps']}, rung {oom['rung']} via {oom['moves']}, forward calls {oom['fwd_calls']}")
facts.append("lr per step, clean : " + " ".join(f"{x:.2e}" for x in clean["lrs"]))
facts.append("lr per step, w/ OOM: " + " ".join(f"{x:.2e}" for x in oom["lrs"]))
if oom["lrs"] != clean["lrs"]:
    problems.append("the learning rates used by the optimizer steps differ from the run without OOMs")
if not (oom["global_step"] == oom["last_epoch"] == MAX_STEPS and oom["param_steps"] == [MAX_STEPS]):
    problems.append(f"global_step {oom['global_step']}, last_epoch {oom['last_epoch']}, param steps {oom['param_steps']}")
if oom["moves"] != [("fp32", "bf16"), ("bf16", "8bit")]:
    problems.append(f"moves {oom['moves']}")
for f in facts:
    print(f)
for p in problems:
    print("  -", p)
if problems:
    print(f"FAIL: {len(problems)} problem(s); first: {problems[0]}")
else:
    print(f"PASS: with a forward OOM rerun and an optimizer-step OOM retry, the {MAX_STEPS} LRs equal the clean run's, "
          f"scheduler last_epoch = global_step = per-param steps = {MAX_STEPS}, fp32->bf16->8bit")
