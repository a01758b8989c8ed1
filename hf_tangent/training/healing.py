"""Healing: distil a patched model back towards its unpatched self, with the Trainer.

The student is the patched model. The teacher is the same model with the patch (and any LoRA
adapters) switched off, inside a context manager, so LoRA healing keeps one copy in memory; for
full fine-tuning the teacher is a frozen copy of the unpatched model (the weights themselves move).
The loss is T^2 KL(teacher || student) on the next-token distributions at temperature T, optionally
mixed with the LM loss. A homotopy moves the patch from the identity (lambda = 0, bit-identical to
the unpatched model) to the target (lambda = 1) over the first steps (patching.set_homotopy).
"""

from __future__ import annotations

import contextlib
import math

import torch
from transformers import TrainerCallback

from ..analysis.evaluation import eval_mode
from ..core.gather import peft_model_of
from ..core.patching import HomotopySchedule, disabled, set_homotopy, tangent_layers
from ..ranges import Range, at_least, check_values, validated

# Distillation temperatures: > 0, and at most 100 (Hinton et al. use up to 20): the loss is scaled by T^2 and the
# softmaxes at T flatten towards uniform, so at a huge T (1e308: T^2 = inf) the loss is NaN or all rounding.
TEMPERATURE = Range(0, 100, open_low=True)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """T^2 KL(softmax(teacher / T) || softmax(student / T)), summed over the vocabulary and averaged
    over tokens, in float32."""
    t = temperature
    student = torch.log_softmax(student_logits.float() / t, dim=-1)
    teacher = torch.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return kl.mean() * t * t


@contextlib.contextmanager
def teacher_of(model):
    """The unpatched model inside the block: the patch off, dropout off (eval mode; the training
    flags come back on exit) and, for a PEFT model (also inside a DDP / FSDP / DeepSpeed wrapper, as
    the Trainer hands it to compute_loss), the adapters off."""
    peft = peft_model_of(model)
    adapters = peft.disable_adapter() if peft is not None else contextlib.nullcontext()
    with disabled(model), adapters, eval_mode(model), torch.no_grad():
        yield model


def homotopy_value(step: int, steps: int, schedule: str = "linear") -> float:
    """lambda at `step` of a homotopy that reaches 1 after `steps` steps (linear or cosine)."""
    if steps <= 0:
        return 1.0
    t = min(max(step / steps, 0.0), 1.0)
    return t if schedule == "linear" else 0.5 - 0.5 * math.cos(math.pi * t)


class HomotopyCallback(TrainerCallback):
    """Sets the patch's lambda before every step from the global step, so a run resumed from a
    checkpoint continues the schedule where it stopped. With `stages` > 1 the homotopy is
    progressive: the patched layers, in depth order, form `stages` contiguous groups, and group g
    moves from 0 to 1 during the g-th of `stages` equal parts of the `steps` (later groups stay
    unpatched until their turn, earlier ones stay at the target)."""

    @validated({"steps": at_least(0), "stages": at_least(1)})  # steps 0: the target from step 0; stages 1: all at once
    def __init__(self, steps: int, schedule: HomotopySchedule = "linear", stages: int = 1):
        self.steps, self.schedule, self.stages = steps, schedule, stages
        self.values: list[tuple[int, float | dict[int, float]]] = []  # (step, lambda) as set

    def lambdas(self, step: int, layers: list[int]) -> float | dict[int, float]:
        """lambda at `step`: one number, or {layer: lambda} for a progressive homotopy."""
        if self.stages == 1:
            return homotopy_value(step, self.steps, self.schedule)
        if self.stages > len(layers):
            raise ValueError(f"homotopy stages={self.stages} > the {len(layers)} patched layers; accepted: at most "
                             f"{len(layers)}.")
        part = self.steps / self.stages
        bounds = [round(g * len(layers) / self.stages) for g in range(self.stages + 1)]
        return {i: homotopy_value(step - g * part, part, self.schedule) if part > 0 else 1.0
                for g in range(self.stages) for i in layers[bounds[g]:bounds[g + 1]]}

    def _set(self, model, step: int) -> None:
        value = self.lambdas(step, [child.index for child in tangent_layers(model)])
        set_homotopy(model, value, schedule=self.schedule, steps=self.steps)
        self.values.append((step, value))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._set(model, state.global_step)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._set(model, state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._set(model, state.global_step)


def heal_trainer_class():
    """A Trainer whose compute_loss is the distillation loss (imported lazily: it pulls in the Trainer)."""
    from transformers import Trainer

    class HealTrainer(Trainer):
        def __init__(self, *args, temperature: float = 1.0, lm_weight: float = 0.0, teacher=None, **kwargs):
            check_values({"temperature": TEMPERATURE}, temperature=temperature)
            if not 0.0 <= lm_weight <= 1.0:
                raise ValueError(f"lm_weight={lm_weight!r}; accepted: a number in [0, 1].")
            super().__init__(*args, **kwargs)
            # Our loss is a mean over the micro-batch's tokens, not a sum over num_items_in_batch: the
            # Trainer must divide it by the accumulation steps (it skips that for models that accept
            # loss kwargs, which would double the loss and the gradients at accumulation 2).
            self.model_accepts_loss_kwargs = False
            if teacher is not None:  # a frozen copy (full fine-tuning): on the student's device, dropout off
                teacher.to(self.args.device).eval().requires_grad_(False)
            self.temperature, self.lm_weight, self.teacher = temperature, lm_weight, teacher

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            student_inputs = inputs if self.lm_weight > 0 else {k: v for k, v in inputs.items() if k != "labels"}
            outputs = model(**student_inputs)
            teacher_inputs = {k: v for k, v in inputs.items() if k != "labels"}
            if self.teacher is not None:
                with torch.no_grad():
                    teacher_logits = self.teacher(**teacher_inputs).logits
            else:
                with teacher_of(model) as teacher:
                    teacher_logits = teacher(**teacher_inputs).logits
            loss = distillation_loss(outputs.logits, teacher_logits, self.temperature)
            if self.lm_weight > 0:
                loss = (1 - self.lm_weight) * loss + self.lm_weight * outputs.loss
            return (loss, outputs) if return_outputs else loss

    return HealTrainer


@torch.no_grad()
def held_out_kl(model, windows: torch.Tensor, *, teacher=None, batch_size: int = 4) -> float:
    """Mean KL(teacher || model) per token on `windows` (T = 1); teacher: the model unpatched."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with eval_mode(model):
        for i in range(0, len(windows), batch_size):
            batch = windows[i:i + batch_size].to(device)
            student = model(input_ids=batch).logits
            if teacher is not None:
                reference = teacher(input_ids=batch).logits
            else:
                with teacher_of(model) as t:
                    reference = t(input_ids=batch).logits
            total += distillation_loss(student, reference).item() * batch.numel()
            count += batch.numel()
    return total / count
