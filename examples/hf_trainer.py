"""A Hugging Face ``transformers.Trainer`` running an optladder optimizer.

Trains a tiny GPT-2 (built from a ``GPT2Config``, nothing downloaded: 2 layers, 64-wide,
a 256-symbol byte vocabulary) as a byte-level language model on the source text of a few
Python standard-library modules. The optimizer comes from
:func:`optladder.choose_optimizer` and reaches the Trainer through
``optimizers=(opt, scheduler)`` with a warmup-then-cosine schedule. (To keep the Trainer's
no-decay grouping, pass ``optimizer_cls_and_kwargs=(optladder.AdamW, {...})`` instead; see
:mod:`optladder.integrations.hf`.)

How the ladder's retry fits the Trainer's loop:

- An OOM inside ``optimizer.step()`` needs nothing from the Trainer: the optladder
  optimizer rolls the step back, moves its state one rung down (fp32 -> bf16 -> 8bit) and
  retries the step with the same grads, all inside ``step()``. Accelerate wraps the
  optimizer (``AcceleratedOptimizer``) and the scheduler, but both keep pointing at the
  same optladder object, so the schedule goes on across the move. A plain ``Trainer``
  gets this.
- An OOM in forward or backward happens in ``Trainer.training_step``, which the Trainer
  does not rerun: the error would end ``train()``. ``LadderTrainer``
  (:mod:`optladder.integrations.hf`) overrides ``training_step`` to run it through
  :class:`optladder.Ladder`: on such an OOM the grads
  are zeroed, the RNG state restored, the optimizer moved one rung down (its state
  shrinks, leaving room for activations) and the micro-batch rerun. The Trainer's
  optimizer step, scheduler step and ``zero_grad`` follow as usual.
- A rerun starts from zeroed grads, so it must cover the whole gradient-accumulation
  window; ``training_step`` covers one micro-batch, so ``LadderTrainer`` requires
  ``gradient_accumulation_steps=1`` (with more, use a plain ``Trainer``: the optimizer
  step is still guarded).
- Put the model on the training device before building the optimizer: that device's
  free memory gates the rung.
- Checkpoints: ``state_dict()`` records the rung; resuming with
  ``trainer.train(resume_from_checkpoint=...)`` moves a policy-chosen optimizer to the
  rung the checkpoint had escalated to.

Needs ``transformers`` and ``accelerate`` (the ``integrations`` extra:
``pip install -c torch-pin.txt -e ".[integrations]"`` in the clone, ``torch-pin.txt`` as
README's "Install into your own environment" makes it; ``make test``'s venv has it).
Run it::

    python examples/hf_trainer.py --max-steps 60
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
    get_cosine_schedule_with_warmup,
)

from optladder import LadderOptimizer, choose_optimizer
from optladder.integrations.hf import LadderTrainer

TEXT_MODULES = (textwrap, json, argparse)
"""Standard-library modules whose source text is the training corpus."""


def load_byte_blocks(block_size: int = 64, modules: Sequence[Any] = TEXT_MODULES) -> torch.Tensor:
    """The UTF-8 bytes of the modules' source files, cut into ``(n, block_size)`` int64
    blocks (the tail that does not fill a block is dropped)."""
    data = b"\n".join(Path(m.__file__).read_bytes() for m in modules)
    n = len(data) // block_size
    codes = torch.frombuffer(bytearray(data[: n * block_size]), dtype=torch.uint8)
    return codes.long().view(n, block_size)


class ByteBlocks(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Language-modeling examples: ``input_ids`` and ``labels`` are the same block (GPT-2
    shifts the labels itself)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def make_model(block_size: int = 64, seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer, 64-wide GPT-2 over 256 byte values (120,576 params), built from a
    config (no download)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256,
        n_positions=block_size,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # GPT-2's class name does not say; silences a warning
    return model


class RungHistory(TrainerCallback):
    """Records, after every optimizer step, the optladder optimizer's rung and the
    learning rate the step ran with.

    Attributes:
        optimizer: the optladder optimizer watched.
        rungs: ``(global_step, rung)`` per step.
        lrs: the learning rate of each step (read before the scheduler moves it).
    """

    def __init__(self, optimizer: LadderOptimizer) -> None:
        self.optimizer = optimizer
        self.rungs: list[tuple[int, str]] = []
        self.lrs: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the learning rate the coming step uses."""
        self.lrs.append(self.optimizer.param_groups[0]["lr"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the rung the step ended on."""
        self.rungs.append((state.global_step, self.optimizer.rung))


def build_trainer(
    output_dir: str | Path,
    *,
    max_steps: int = 60,
    batch_size: int = 16,
    lr: float = 3e-3,
    warmup_steps: int = 6,
    block_size: int = 64,
    rung: str | None = None,
    free_memory: int | str | None = None,
    model: GPT2LMHeadModel | None = None,
    seed: int = 0,
    save_steps: int | None = None,
) -> tuple[LadderTrainer, RungHistory]:
    """A :class:`LadderTrainer` over the byte blocks, with the optladder optimizer and a
    cosine schedule, and the :class:`RungHistory` callback it reports to.

    Args:
        output_dir: the Trainer's output directory (checkpoints when ``save_steps``).
        max_steps: optimizer steps to train; the schedule ends there.
        batch_size: blocks per step.
        lr: the peak learning rate. warmup_steps: linear warmup before the cosine decay.
        block_size: bytes per example.
        rung: fix the rung; None lets the policy choose. free_memory: as in
            :func:`optladder.choose_optimizer`.
        model: the model (default :func:`make_model`).
        seed: model init and data order.
        save_steps: save a checkpoint every this many steps; None saves none.
    """
    model = make_model(block_size, seed) if model is None else model
    # The rung is gated on the params' device: put them where the Trainer trains first.
    use_cpu = not torch.cuda.is_available()
    model.to("cpu" if use_cpu else "cuda")  # type: ignore[arg-type]  # transformers types .to oddly
    dataset = ByteBlocks(load_byte_blocks(block_size))
    opt = choose_optimizer(model, lr=lr, weight_decay=0.01, rung=rung, free_memory=free_memory)
    scheduler = get_cosine_schedule_with_warmup(opt, warmup_steps, max_steps)
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        logging_steps=max(1, max_steps // 10),
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to="none",
        use_cpu=use_cpu,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
    )
    history = RungHistory(opt)
    trainer = LadderTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        optimizers=(opt, scheduler),
        callbacks=[history],
    )
    return trainer, history


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int) -> float:
    """The multiplier ``get_cosine_schedule_with_warmup`` applies at scheduler step
    ``step``: ``step / warmup_steps`` during warmup, then half a cosine down to 0."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: train and print the loss curve and the rung."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--rung", choices=("fp32", "bf16", "8bit"), default=None)
    parser.add_argument("--free-memory", default=None, help='e.g. "2MiB"; default: probed')
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = build_trainer(
            args.output_dir or tmp,
            max_steps=args.max_steps,
            rung=args.rung,
            free_memory=args.free_memory,
        )
        opt = trainer.ladder.optimizer
        opt.on_escalate = lambda e: print(f"escalated {e.from_rung} -> {e.to_rung}: {e.reason}")
        print(opt.decision.summary())
        trainer.train()
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    print("step  loss")
    for step, loss in losses:
        print(f"{step:4d}  {loss:.4f}")
    print(f"rung at the end: {opt.rung}; escalations: {len(opt.escalations)}")


if __name__ == "__main__":
    main()
