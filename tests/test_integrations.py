"""The integrations in examples/: a plain loop, a Hugging Face Trainer, a Lightning module.

Each runs the example's own functions on the digits or a tiny GPT-2, injects an OOM in
the optimizer step or in forward, and checks that the run escalates, keeps the SAME
optimizer object in the trainer and the scheduler, keeps the schedule, takes exactly one
optimizer step per batch, and learns.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import optladder.selector.optimizer as ladder_optimizer
from memtools import FailNthAllocation
from optladder import LadderOptimizer

pytestmark = pytest.mark.filterwarnings(
    # raised by torch when lightning builds a LeafSpec; nothing optladder can change
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FREE = "1GiB"  # the policy picks fp32 for these small models: a known starting rung


@cache
def _example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` once (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"optladder_examples_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look classes up here
    spec.loader.exec_module(module)
    return module


def _oom_in_optimizer_step(monkeypatch: pytest.MonkeyPatch, at_call: int) -> list[int]:
    """Make the ``at_call``-th prepare phase of ``LadderOptimizer.step`` (1-based; a retry
    is a call too) run out of memory: the first allocation it makes fails
    (``FailNthAllocation(1)``), and if it allocates nothing (moments already exist),
    ``torch.OutOfMemoryError`` is raised as a real allocation failure would be.

    Returns:
        A list that gets one item per prepare call.
    """
    real = ladder_optimizer.prepare_step
    calls: list[int] = []

    def prepare(engine: torch.optim.Optimizer, *args: Any) -> list[torch.Tensor]:
        calls.append(1)
        if len(calls) == at_call:
            with FailNthAllocation(1):
                real(engine, *args)
            raise torch.OutOfMemoryError(f"injected: optimizer step, prepare call {at_call}")
        return real(engine, *args)

    monkeypatch.setattr(ladder_optimizer, "prepare_step", prepare)
    return calls


def _oom_in_forward(module: torch.nn.Module, at_call: int) -> list[int]:
    """Make ``module``'s ``at_call``-th forward (1-based) raise ``torch.OutOfMemoryError``
    before it runs. Returns a list that gets one item per forward call."""
    calls: list[int] = []

    def hook(mod: torch.nn.Module, args: Any) -> None:
        calls.append(1)
        if len(calls) == at_call:
            raise torch.OutOfMemoryError(f"injected: forward call {at_call}")

    module.register_forward_pre_hook(hook)
    return calls


def _steps(opt: LadderOptimizer) -> set[int]:
    """The distinct per-param step counts in the optimizer's state."""
    return {int(s["step"]) for s in opt.state.values()}


def _moment_dtypes(opt: LadderOptimizer) -> set[torch.dtype]:
    """The dtypes of the first moments (``exp_avg``, or bitsandbytes' ``state1``)."""
    return {s["exp_avg" if "exp_avg" in s else "state1"].dtype for s in opt.state.values()}


MOMENT_DTYPES = {
    "fp32": {torch.float32},
    "bf16": {torch.bfloat16},
    "8bit": {torch.uint8, torch.float32},  # bitsandbytes keeps small tensors in float32
}


# ---------------------------------------------------------------------------- plain loop
def test_plain_loop_oom_in_step_escalates_and_keeps_the_schedule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = _example("plain_loop")
    calls = _oom_in_optimizer_step(monkeypatch, at_call=5)  # fp32 moments exist by then
    result = plain.train(epochs=2, lr=1e-2, warmup_steps=6, free_memory=FREE)
    opt = result.optimizer

    assert isinstance(opt, LadderOptimizer)
    assert result.scheduler.optimizer is opt
    steps = 2 * math.ceil(1437 / 64)  # 46
    assert len(result.losses) == steps
    assert len(calls) == steps + 1  # one retry
    assert [(e.from_rung, e.to_rung, e.step) for e in result.escalations] == [("fp32", "bf16", 4)]
    assert result.rungs == ["fp32"] * 4 + ["bf16"] * (steps - 4)
    assert _moment_dtypes(opt) == {torch.bfloat16}
    assert _steps(opt) == {steps}  # the retried step was taken once
    # warmup 1/6 .. 6/6 of 1e-2, then a cosine over 40 steps: half way at step 26, 0 at 46
    assert result.lrs[0] == pytest.approx(1e-2 / 6)
    assert result.lrs[5] == pytest.approx(1e-2)
    assert result.lrs[26] == pytest.approx(5e-3)
    assert result.lrs == pytest.approx(
        [1e-2 * plain.warmup_cosine(k, 6, steps) for k in range(steps)]
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert sum(result.losses[-5:]) / 5 < 0.3 * result.losses[0]
    assert result.test_accuracy > 0.9


def test_plain_loop_oom_in_forward_reruns_the_step_one_rung_down() -> None:
    plain = _example("plain_loop")
    model = plain.make_model()
    forwards = _oom_in_forward(model, at_call=3)
    result = plain.train(epochs=1, model=model, free_memory=FREE)
    opt = result.optimizer

    steps = math.ceil(1437 / 64)
    assert len(result.losses) == steps  # the failed batch was rerun, not skipped
    assert len(forwards) == steps + 1 + 1  # + the failed one + the test-set forward
    assert [(e.from_rung, e.to_rung, e.step) for e in result.escalations] == [("fp32", "bf16", 2)]
    assert "forward/backward" in result.escalations[0].reason
    assert result.scheduler.optimizer is opt
    assert _steps(opt) == {steps}
    assert result.losses[-1] < 0.5 * result.losses[0]


# ---------------------------------------------------------------------------- HF Trainer
@pytest.fixture(scope="module")
def hf() -> ModuleType:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _example("hf_trainer")


def _hf_scheduler(trainer: Any) -> torch.optim.lr_scheduler.LRScheduler:
    """The torch scheduler inside the Trainer's (possibly accelerate-wrapped) one."""
    return getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)


def test_hf_trainer_oom_in_step_escalates_with_the_same_optimizer(
    hf: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, history = hf.build_trainer(
        tmp_path, max_steps=12, batch_size=8, lr=3e-3, warmup_steps=3, free_memory=FREE
    )
    opt = trainer.ladder.optimizer
    calls = _oom_in_optimizer_step(monkeypatch, at_call=3)
    trainer.train()

    assert isinstance(opt, LadderOptimizer)
    assert trainer.optimizer.optimizer is opt  # accelerate's wrapper holds the same object
    assert _hf_scheduler(trainer).optimizer is opt
    assert len(calls) == 13
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 2)]
    assert [r for _, r in history.rungs] == ["fp32"] * 2 + ["bf16"] * 10
    assert trainer.state.global_step == 12
    assert _steps(opt) == {12}
    assert _moment_dtypes(opt) == {torch.bfloat16}
    # warmup 0, 1/3, 2/3 of 3e-3, then half a cosine over 9 steps
    assert history.lrs[:4] == pytest.approx([0.0, 1e-3, 2e-3, 3e-3])
    assert history.lrs == pytest.approx([3e-3 * hf.cosine_with_warmup(k, 3, 12) for k in range(12)])
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0  # from ~5.5 nats per byte


def test_hf_trainer_oom_in_forward_reruns_the_micro_batch(hf: ModuleType, tmp_path: Path) -> None:
    model = hf.make_model()
    forwards = _oom_in_forward(model, at_call=4)
    trainer, history = hf.build_trainer(
        tmp_path, max_steps=8, batch_size=8, warmup_steps=2, model=model, free_memory=FREE
    )
    trainer.train()
    opt = trainer.ladder.optimizer

    assert len(forwards) == 9  # 8 steps + the failed forward
    assert trainer.state.global_step == 8
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 3)]
    assert "forward/backward" in opt.escalations[0].reason
    assert [r for _, r in history.rungs] == ["fp32"] * 3 + ["bf16"] * 5
    assert _steps(opt) == {8}
    assert trainer.optimizer.optimizer is opt and _hf_scheduler(trainer).optimizer is opt


def test_hf_ladder_trainer_refuses_gradient_accumulation(hf: ModuleType, tmp_path: Path) -> None:
    from transformers import TrainingArguments

    model = hf.make_model()
    opt = hf.choose_optimizer(model, free_memory=FREE)
    args = TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=2, report_to="none", use_cpu=True
    )
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        hf.LadderTrainer(model=model, args=args, optimizers=(opt, None))
    with pytest.raises(TypeError, match="choose_optimizer"):
        hf.LadderTrainer(
            model=model,
            args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True),
            optimizers=(torch.optim.AdamW(model.parameters()), None),
        )


def test_hf_trainer_resume_moves_to_the_checkpoints_rung(
    hf: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common: dict[str, Any] = dict(max_steps=8, batch_size=8, warmup_steps=2, free_memory=FREE)
    first, _ = hf.build_trainer(tmp_path, save_steps=4, **common)
    _oom_in_optimizer_step(monkeypatch, at_call=2)
    first.train()
    monkeypatch.undo()
    assert first.ladder.optimizer.rung == "bf16"

    resumed, history = hf.build_trainer(tmp_path, **common)
    opt = resumed.ladder.optimizer
    assert opt.rung == "fp32"  # the policy's choice, before the checkpoint is loaded
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))

    assert opt.rung == "bf16" and opt.decision.origin == "checkpoint"
    assert opt.escalations == []  # moved by the checkpoint, not by an OOM
    assert resumed.state.global_step == 8
    assert _steps(opt) == {8}
    assert _hf_scheduler(resumed).optimizer is opt
    assert history.lrs == pytest.approx(
        [3e-3 * hf.cosine_with_warmup(k, 2, 8) for k in range(4, 8)]
    )
    # the resumed run ends where the uninterrupted one did
    for a, b in zip(first.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_hf_trainer_runs_every_rung(hf: ModuleType, tmp_path: Path, rung: str) -> None:
    trainer, history = hf.build_trainer(tmp_path, max_steps=3, batch_size=4, rung=rung)
    trainer.train()
    opt = trainer.ladder.optimizer
    assert opt.rung == rung and opt.decision.origin == "fixed"
    assert trainer.optimizer.optimizer is opt
    assert _moment_dtypes(opt) == MOMENT_DTYPES[rung]
    assert [r for _, r in history.rungs] == [rung] * 3


# ---------------------------------------------------------------------------- Lightning
@pytest.fixture(scope="module")
def lit() -> ModuleType:
    pytest.importorskip("lightning")
    return _example("lightning_module")


def _one_cycle_lrs(max_lr: float, total_steps: int) -> list[float]:
    """OneCycleLR's learning rate at each step, from a throwaway SGD."""
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=max_lr, total_steps=total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(sgd.param_groups[0]["lr"])
        sgd.step()
        sched.step()
    return lrs


def _count_calls(module: Any, name: str) -> list[int]:
    """Count calls of ``module.<name>`` (an instance-level wrapper)."""
    calls: list[int] = []
    original: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return calls


def test_lightning_oom_in_step_escalates_inside_step_closure(
    lit: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = lit.DigitsModule(lr=1e-2, total_steps=12, free_memory=FREE)
    training_steps = _count_calls(module, "training_step")
    calls = _oom_in_optimizer_step(monkeypatch, at_call=4)
    trainer = lit.fit(module, epochs=1, limit_train_batches=12)
    opt = module.opt

    assert isinstance(opt, LadderOptimizer)
    assert trainer.optimizers[0] is opt
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is opt
    wrapped = module.optimizers()  # Lightning's LightningOptimizer around it
    assert wrapped.optimizer is opt
    assert wrapped.rung == "bf16" and wrapped.param_groups is opt.param_groups
    assert len(calls) == 13
    assert len(training_steps) == 12  # the closure ran once per step; the retry reused it
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 3)]
    assert module.rungs == ["fp32"] * 3 + ["bf16"] * 9
    assert trainer.global_step == 12
    assert _steps(opt) == {12}
    assert module.lrs == pytest.approx(_one_cycle_lrs(1e-2, 12))
    assert module.losses[-1] < 0.7 * module.losses[0]


def test_lightning_resume_moves_to_the_checkpoints_rung(
    lit: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = lit.DigitsModule(lr=1e-2, total_steps=12, free_memory=FREE)
    _oom_in_optimizer_step(monkeypatch, at_call=2)
    trainer = lit.fit(first, epochs=1, limit_train_batches=6)
    monkeypatch.undo()
    assert first.opt.rung == "bf16"
    trainer.save_checkpoint(tmp_path / "first.ckpt")

    resumed = lit.DigitsModule(lr=1e-2, total_steps=12, free_memory=FREE)
    trainer = lit.fit(resumed, epochs=2, limit_train_batches=6, ckpt_path=tmp_path / "first.ckpt")
    opt = resumed.opt
    assert opt.rung == "bf16" and opt.decision.origin == "checkpoint"
    assert opt.escalations == []  # moved by the checkpoint, not by an OOM
    assert resumed.rungs == ["bf16"] * 6
    assert trainer.global_step == 12
    assert _steps(opt) == {12}
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is opt
    assert first.lrs + resumed.lrs == pytest.approx(_one_cycle_lrs(1e-2, 12))


@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit"])
def test_lightning_runs_every_rung(lit: ModuleType, rung: str) -> None:
    module = lit.DigitsModule(lr=1e-2, total_steps=8, rung=rung)
    trainer = lit.fit(module, epochs=1, limit_train_batches=8)
    assert trainer.optimizers[0] is module.opt and module.opt.rung == rung
    assert _moment_dtypes(module.opt) == MOMENT_DTYPES[rung]
    assert _steps(module.opt) == {8}
    assert module.losses[-1] < 0.8 * module.losses[0]


def test_lightning_oom_in_forward_reruns_the_closure_one_rung_down(lit: ModuleType) -> None:
    module = lit.DigitsModule(lr=1e-2, total_steps=10, free_memory=FREE)
    forwards = _oom_in_forward(module.net, at_call=5)
    trainer = lit.fit(module, epochs=1, limit_train_batches=10)
    opt = module.opt

    assert len(forwards) == 11  # 10 steps + the failed forward
    assert trainer.global_step == 10
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 4)]
    assert "forward/backward" in opt.escalations[0].reason
    assert module.rungs == ["fp32"] * 4 + ["bf16"] * 6
    assert _steps(opt) == {10}
    assert module.lrs == pytest.approx(_one_cycle_lrs(1e-2, 10))
    assert module.losses[-1] < 0.7 * module.losses[0]
    assert lit.evaluate_accuracy(module) > 0.5


# ------------------------------------------------- optladder.integrations, by import
def test_import_optladder_imports_no_framework() -> None:
    code = (
        "import sys, optladder; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', "
        "'optladder.integrations') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def _tiny_gpt2(seed: int = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=32,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


class _Cycles(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token blocks that count up modulo 32 from a per-example start: learnable."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) + i) % 32
        return {"input_ids": ids, "labels": ids}


def _hf_args(out: Path, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        logging_steps=1,
        seed=0,
    )
    return TrainingArguments(**(base | kw))


def test_hf_trainer_takes_optladder_adamw_as_a_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Trainer(optimizer_cls_and_kwargs=(optladder.AdamW, {...}))``: the Trainer's
    no-decay grouping reaches the optimizer; it trains, escalates on an OOM in the step,
    saves, and a resumed run moves to the checkpoint's rung and ends where the first did."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer

    from optladder import AdamW
    from optladder.integrations import unwrap_optimizer

    cls_and_kwargs = (AdamW, {"lr": 1e-2, "free_memory": FREE})
    args = _hf_args(tmp_path, max_steps=8, save_strategy="steps", save_steps=4, weight_decay=0.1)
    model = _tiny_gpt2()
    first = Trainer(
        model=model, args=args, train_dataset=_Cycles(), optimizer_cls_and_kwargs=cls_and_kwargs
    )
    _oom_in_optimizer_step(monkeypatch, at_call=2)
    first.train()
    monkeypatch.undo()
    opt = unwrap_optimizer(first.optimizer)
    assert type(opt) is AdamW and first.optimizer.optimizer is opt
    assert unwrap_optimizer(_hf_scheduler(first).optimizer) is opt  # the Trainer's schedule

    # HF's grouping: biases and LayerNorm params in a group with weight_decay 0
    norms = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()
    }
    no_decay = {id(p) for n, p in model.named_parameters() if n.endswith("bias") or id(p) in norms}
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert {id(p) for p in opt.param_groups[1]["params"]} == no_decay
    assert {id(p) for p in opt.param_groups[0]["params"]} == {
        id(p) for p in model.parameters()
    } - no_decay

    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 1)]
    assert opt.rung == "bf16" and _steps(opt) == {8}
    losses = [e["loss"] for e in first.state.log_history if "loss" in e]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5

    resumed = Trainer(
        model=_tiny_gpt2(),
        args=_hf_args(tmp_path, max_steps=8, weight_decay=0.1),
        train_dataset=_Cycles(),
        optimizer_cls_and_kwargs=cls_and_kwargs,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    opt2 = unwrap_optimizer(resumed.optimizer)
    assert opt2.rung == "bf16" and opt2.decision.origin == "checkpoint"
    assert opt2.escalations == [] and _steps(opt2) == {8}
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.1, 0.0]
    for a, b in zip(first.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_hf_ladder_trainer_builds_optladder_adamw_from_the_arguments(tmp_path: Path) -> None:
    """Without an optimizer, LadderTrainer builds optladder.AdamW from the
    TrainingArguments, and reruns a micro-batch whose forward ran out of memory."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from optladder import AdamW
    from optladder.integrations import unwrap_optimizer
    from optladder.integrations.hf import LadderTrainer

    model = _tiny_gpt2()
    forwards = _oom_in_forward(model, at_call=3)
    args = _hf_args(
        tmp_path,
        max_steps=5,
        learning_rate=2e-3,
        adam_beta1=0.8,
        adam_epsilon=1e-7,
        weight_decay=0.05,
    )
    trainer = LadderTrainer(model=model, args=args, train_dataset=_Cycles())
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is AdamW and trainer.ladder.optimizer is opt
    assert (opt.defaults["lr"], opt.defaults["betas"], opt.defaults["eps"]) == (
        2e-3,
        (0.8, 0.999),
        1e-7,
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert len(forwards) == 6 and trainer.state.global_step == 5
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 2)]
    assert _steps(opt) == {5}
    with pytest.raises(TypeError, match=r"optimizer_cls_and_kwargs=\(optladder\.AdamW"):
        LadderTrainer(
            model=model,
            args=args,
            optimizer_cls_and_kwargs=(torch.optim.AdamW, {}),
        )


@pytest.mark.parametrize("mode", ["fp32", "bf16", "8bit", "pinned"])
def test_accelerate_reports_an_amp_overflow_step_skipped(mode: str) -> None:
    """accelerate's AcceleratedOptimizer (what HF Trainer uses) with a GradScaler: an
    overflow step is reported skipped, changes nothing, and the scheduler stays; a
    finite step is not skipped. (accelerate learns of a skip only from ``step()`` not
    being called.)"""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    from optladder import AdamW

    Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 4))
    if mode == "pinned":
        groups = [
            {"params": list(model[0].parameters())},
            {"params": list(model[1].parameters()), "rung": "8bit"},
        ]
        opt = AdamW(groups, 1e-2, free_memory=FREE)
    else:
        opt = AdamW(model.parameters(), 1e-2, rung=mode, free_memory=FREE)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    wrapped = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
    wrapped_sched = AcceleratedScheduler(
        sched, wrapped, step_with_optimizer=True, split_batches=True
    )
    skipped = []
    for overflow in (False, True, False):
        wrapped.zero_grad()
        scaler.scale(model(torch.ones(2, 64)).square().mean()).backward()
        if overflow:
            model[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        wrapped.step()
        wrapped_sched.step()
        skipped.append(wrapped.step_was_skipped)
        if overflow:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert opt.last_step_skipped
    assert skipped == [False, True, False]
    assert sched.last_epoch == 2  # two real steps
    assert _steps(opt) == {2}


@pytest.mark.filterwarnings("ignore::UserWarning")
def _quiet_trainer(lightning: Any) -> Any:
    """A Lightning ``Trainer`` for one epoch on the CPU, with no logger, checkpoints,
    progress bar or model summary."""
    return lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_lightning_ladder_step_mixin_reruns_one_rung_down() -> None:
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from optladder import AdamW
    from optladder.integrations import unwrap_optimizer
    from optladder.integrations.lightning import LadderStep

    class Net(LadderStep, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 1))
            self.opt: AdamW | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            self.opt = AdamW(self.parameters(), 1e-2, free_memory=FREE)
            return self.opt

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )
    module = Net()
    forwards = _oom_in_forward(module.net, at_call=3)
    trainer = _quiet_trainer(L)
    trainer.fit(module, loader)
    opt = module.opt
    assert opt is not None
    assert len(forwards) == 9 and trainer.global_step == 8
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 2)]
    assert _steps(opt) == {8}
    # Lightning's wrapper is an instance of the optimizer's class: unwrap past it
    assert isinstance(trainer.optimizers[0], AdamW)
    assert unwrap_optimizer(LightningOptimizer(opt)) is opt
    with pytest.raises(TypeError, match="got SGD holding SGD"):
        unwrap_optimizer(torch.optim.SGD(module.parameters()))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ladder_over_lightnings_optimizer_moves_the_real_one() -> None:
    """Manual optimization: ``Ladder(self.optimizers())`` is given Lightning's
    ``LightningOptimizer``, an instance of the optimizer's class holding a copy of its
    attributes. The Ladder works on the optimizer inside: a forward OOM moves the real
    optimizer down (it moved the copy, and the real one's next step refused the groups
    the copy had marked bf16), every batch steps once, and the params end bit for bit
    where a run that escalates by hand before the same batch ends."""
    pytest.importorskip("lightning")
    import lightning as L

    from optladder import AdamW, Ladder

    class Net(L.LightningModule):
        def __init__(self, oom_at: int | None, escalate_at: int | None) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 1))
            self.automatic_optimization = False
            self.oom_at, self.escalate_at, self.forwards = oom_at, escalate_at, 0
            self.ladder: Ladder | None = None
            self.opt: AdamW | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            wrapped = self.optimizers()
            if self.ladder is None:
                self.ladder = Ladder(wrapped)
            if batch_idx == self.escalate_at:
                assert self.opt is not None
                self.opt.escalate("by hand")

            def step() -> torch.Tensor:
                wrapped.zero_grad()
                self.forwards += 1
                if self.forwards == self.oom_at:
                    raise torch.OutOfMemoryError("injected: forward")
                x, y = batch
                loss = torch.nn.functional.mse_loss(self.net(x), y)
                self.manual_backward(loss)
                wrapped.step()
                return loss

            loss = self.ladder.run(step)
            assert loss is not None
            return loss

        def configure_optimizers(self) -> Any:
            self.opt = AdamW(self.parameters(), 1e-2, free_memory=FREE)
            return self.opt

    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def fit(module: Net) -> Any:
        trainer = _quiet_trainer(L)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
        return trainer

    module = Net(oom_at=3, escalate_at=None)
    fit(module)
    opt = module.opt
    assert opt is not None and module.ladder is not None and module.ladder.optimizer is opt
    assert module.forwards == 7  # 6 batches and the failed forward
    assert [(e.from_rung, e.to_rung, e.step) for e in opt.escalations] == [("fp32", "bf16", 2)]
    assert opt.rung == "bf16" and _moment_dtypes(opt) == {torch.bfloat16}
    assert _steps(opt) == {6}
    by_hand = Net(oom_at=None, escalate_at=2)
    fit(by_hand)
    for a, b in zip(module.net.parameters(), by_hand.net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_ladder_over_accelerates_optimizer_moves_the_real_one() -> None:
    """``Ladder(accelerator.prepare(opt))`` takes the optladder optimizer inside
    accelerate's ``AcceleratedOptimizer``; a wrapper of anything else is refused, naming
    what it holds."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from optladder import AdamW, Ladder

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = AdamW(model.parameters(), 1e-2, free_memory=FREE)
    model, wrapped = Accelerator(cpu=True).prepare(model, opt)
    ladder = Ladder(wrapped)
    assert ladder.optimizer is opt
    forwards = _oom_in_forward(model, at_call=1)

    def step() -> None:
        wrapped.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        wrapped.step()

    ladder.run(step)
    assert len(forwards) == 2 and opt.rung == "bf16" and _steps(opt) == {1}
    with pytest.raises(TypeError, match=r"optimizer: .*got SGD holding SGD"):
        Ladder(torch.optim.SGD(model.parameters()))


def test_moves_and_counts_through_lightnings_wrapper_reach_the_optimizer() -> None:
    """Lightning's ``LightningOptimizer`` (what ``self.optimizers()`` returns) is an
    instance of a subclass of the optimizer's class that reads missing attributes from
    the optimizer: ``zero_grad``, ``escalate``, ``migrate_to``, ``add_param_group`` and
    ``load_state_dict`` called on it act on the optimizer itself (their writes had stayed
    on the wrapper: the optimizer Lightning steps kept its fp32 engine beside groups
    marked bf16, and Ladder never saw the wrapper's zero_grad calls)."""
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from optladder import choose_optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128)  # 8,192 weights: 8-bit codes on 8bit
    opt = choose_optimizer(model, lr=1e-2, free_memory="1GiB", environ={})
    wrapper = LightningOptimizer(opt)
    assert isinstance(wrapper, LadderOptimizer)
    wrapper.zero_grad()
    assert opt.zero_grad_calls == 1 and "_zero_grad_calls" not in wrapper.__dict__
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    wrapper.escalate("asked through the wrapper")
    assert opt.rung == wrapper.rung == "bf16" and "_decision" not in wrapper.__dict__
    assert opt.state[model.weight]["exp_avg"].dtype == torch.bfloat16
    opt.step()  # the optimizer's engine is the bf16 one its groups say
    wrapper.migrate_to("8bit", "again through the wrapper")
    assert opt.rung == "8bit" and [g["rung"] for g in opt.param_groups] == ["8bit"]
    wrapper.load_state_dict(saved)  # an fp32 checkpoint of the policy: converted to 8bit
    assert opt.rung == "8bit" and opt.state[model.weight]["state1"].dtype == torch.uint8
    extra = torch.nn.Parameter(torch.zeros(3))
    wrapper.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["params"][0] is extra
    assert not {"_engine", "param_groups", "state"} & set(wrapper.__dict__)
