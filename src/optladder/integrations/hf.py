"""Hugging Face ``transformers.Trainer`` with an optladder optimizer.

Two ways in, both keeping the Trainer's own no-decay grouping (biases and norm weights
get ``weight_decay=0``):

- A plain ``Trainer(..., optimizer_cls_and_kwargs=(optladder.AdamW, {"lr": 3e-4,
  "free_memory": "24GiB"}))``: the Trainer builds the optimizer over its param groups once
  the model is on its device. An OOM inside ``optimizer.step()`` is retried by the
  optimizer itself (its state moves one rung down); the Trainer's scheduler and
  accelerate's wrapper keep pointing at the same object.
- :class:`LadderTrainer`: the same, and an OOM in forward or backward
  (``training_step``) reruns the micro-batch one rung down instead of ending ``train()``.
  Without ``optimizers``/``optimizer_cls_and_kwargs`` it builds ``optladder.AdamW`` from
  the ``TrainingArguments`` (``learning_rate``, ``adam_beta1``/``adam_beta2``,
  ``adam_epsilon``; ``weight_decay`` through the grouping).

Resuming (``trainer.train(resume_from_checkpoint=...)``) loads the optimizer's
``state_dict``, which records the rung: a policy-chosen optimizer moves to the rung the
checkpoint had escalated to. Under fp16 AMP an overflow step is reported skipped
(``accelerator.optimizer_step_was_skipped``), so the scheduler does not advance.

Importing this module imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from optladder.integrations import unwrap_optimizer
from optladder.selector.adamw import AdamW
from optladder.selector.ladder import Ladder
from optladder.selector.optimizer import LadderOptimizer

__all__ = ["LadderTrainer"]


class LadderTrainer(Trainer):
    """A ``transformers.Trainer`` whose ``training_step`` (forward and backward of one
    micro-batch) is rerun one rung down when it runs out of memory.

    Takes the Trainer's arguments. The optimizer is optladder's: passed built
    (``optimizers=(opt, scheduler)``), as a class (``optimizer_cls_and_kwargs=
    (optladder.AdamW, {...})``), or, with neither, ``optladder.AdamW`` with the
    ``TrainingArguments``' hyperparameters (``args.optim`` is not read).

    A rerun starts from zeroed grads, so it must cover the whole accumulation window;
    ``training_step`` covers one micro-batch, hence ``gradient_accumulation_steps=1``.

    Raises:
        TypeError: if the optimizer (or the class in ``optimizer_cls_and_kwargs``) is not
            optladder's.
        ValueError: if ``args.gradient_accumulation_steps > 1``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.optimizer is not None:
            unwrap_optimizer(self.optimizer)  # raises TypeError naming what it found
        elif self.optimizer_cls_and_kwargs is not None:
            cls = self.optimizer_cls_and_kwargs[0]
            if not (isinstance(cls, type) and issubclass(cls, LadderOptimizer)):
                raise TypeError(
                    "LadderTrainer needs optladder's optimizer: optimizer_cls_and_kwargs="
                    f"(optladder.AdamW, {{...}}), got {getattr(cls, '__name__', cls)!r}"
                )
        accumulation = self.args.gradient_accumulation_steps
        if accumulation > 1:
            raise ValueError(
                "LadderTrainer reruns one micro-batch on OOM, which would drop the grads of "
                "the accumulation window's earlier micro-batches; got "
                f"gradient_accumulation_steps={accumulation}. Use 1, or a plain Trainer "
                "(OOMs in the optimizer step are still handled)."
            )
        self._ladder: Ladder | None = None

    @staticmethod
    def get_optimizer_cls_and_kwargs(
        args: TrainingArguments, model: torch.nn.Module | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``optladder.AdamW`` with ``learning_rate``, ``(adam_beta1, adam_beta2)`` and
        ``adam_epsilon`` (the Trainer passes ``weight_decay`` per group)."""
        return AdamW, {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
        }

    @property
    def ladder(self) -> Ladder:
        """The :class:`optladder.Ladder` over the Trainer's optimizer (made once the
        Trainer has built it).

        Raises:
            RuntimeError: before the optimizer exists (``train()`` builds it).
        """
        if self.optimizer is None:
            raise RuntimeError("the Trainer has not built its optimizer yet (train() does)")
        optimizer = unwrap_optimizer(self.optimizer)
        if self._ladder is None or self._ladder.optimizer is not optimizer:
            self._ladder = Ladder(optimizer)
        return self._ladder

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """``Trainer.training_step`` through :meth:`optladder.Ladder.run`."""
        loss = self.ladder.run(super().training_step, model, inputs, num_items_in_batch)
        assert loss is not None  # None only after an optimizer step; training_step has none
        return loss
