"""Trainer-based recipes: FFN gate calibration (math.md section 5) and fine-tuning.

Everything distributed (DDP, FSDP, DeepSpeed) is the HF Trainer's and accelerate's job: run the
same code under `accelerate launch` or `torchrun`.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import statistics
import warnings

import torch

from .patching import CHILD_NAME, tangent_layers
from .wrappers import full_parameters, full_value

GATE_SUFFIX = f"{CHILD_NAME}.gate"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def lm_dataset(windows: torch.Tensor):
    """A `datasets.Dataset` of packed causal-LM examples (input_ids = labels) from (n, seq_len) windows."""
    import datasets

    rows = windows.tolist()
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})


def freeze_all_but_gates(model) -> list[torch.nn.Parameter]:
    """requires_grad only on the FFN gates; every model weight frozen. Returns the gates."""
    gates = []
    for name, param in model.named_parameters():
        trainable = name.endswith(GATE_SUFFIX)
        param.requires_grad_(trainable)
        if trainable:
            gates.append(param)
    if not gates:
        raise ValueError("no FFN gates on this model: patch it with TangentConfig(gates=True) first.")
    return gates


def gate_values(model) -> dict[int, float]:
    """Gate value by layer index, also through DDP / FSDP1 / FSDP2 / ZeRO-3 wrappers, where the
    gates are gathered: a collective, so call it on every rank."""
    children = [child for child in tangent_layers(model) if child.gate is not None]
    with full_parameters(model, [child.gate for child in children]):
        return {child.index: float(full_value(child.gate).detach().float().reshape(-1)[0]) for child in children}


def gate_summary(gates: dict[int, float]) -> dict:
    values = list(gates.values())
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "argmin": min(gates, key=gates.get), "argmax": max(gates, key=gates.get)}


def training_arguments(output_dir: str, *, max_steps: int, learning_rate: float, batch_size: int,
                       grad_accum: int = 1, seed: int = 0, save_steps: int = 0, logging_steps: int = 1,
                       bf16: bool = False, gradient_checkpointing: bool = False, device: str = "cpu",
                       report_to: str | list[str] = "none", lr_scheduler: str = "constant",
                       warmup_steps: int = 0, weight_decay: float = 0.0):
    """TrainingArguments for a fixed number of optimizer steps with a reproducible data order."""
    from transformers import TrainingArguments

    optional = {}
    if gradient_checkpointing:  # only when used: the argument is being renamed in transformers 5
        optional = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        optional |= {"ddp_backend": "gloo" if device == "cpu" else None, "ddp_find_unused_parameters": False}
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        learning_rate=learning_rate,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        lr_scheduler_type=lr_scheduler,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        seed=seed,
        data_seed=seed,
        logging_steps=logging_steps,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        save_total_limit=2,
        bf16=bf16,
        use_cpu=device == "cpu",
        report_to=report_to,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        **optional,
    )


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` folder in `output_dir` that the Trainer finished writing (it
    writes trainer_state.json last), or None. Newer, incomplete ones (a run killed while saving)
    are skipped with a warning."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted((int(m.group(1)), m.group(0)) for m in (_CHECKPOINT.fullmatch(n) for n in os.listdir(output_dir)) if m)
    skipped = []
    for _, name in reversed(steps):
        folder = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(folder, "trainer_state.json")):
            if skipped:
                warnings.warn(f"hf_tangent: skipping incomplete checkpoints {skipped} (no trainer_state.json: the run "
                              f"stopped while saving); resuming from {name}.", stacklevel=2)
            return folder
        skipped.append(name)
    return None


def check_sharding(model) -> None:
    """Refuse, before any work, a run that accelerate would shard with FSDP1 while the model holds
    parameters of more than one dtype (bf16 weights, float32 gates): FSDP1 flattens each unit into
    one tensor of one dtype and would fail at wrap time with a message that does not say what to do."""
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not fsdp or os.environ.get("FSDP_VERSION", "1") != "1":
        return
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    if len(dtypes) > 1:
        raise ValueError(
            f"FSDP1 flattens each wrapped unit into one tensor of one dtype, but this model holds {', '.join(dtypes)} "
            "parameters (hf_tangent's gates are float32). Either load the model in float32 and train in bf16 "
            "through mixed precision (accelerate `mixed_precision: bf16`, or TrainingArguments(bf16=True)), or use "
            "FSDP2 (accelerate config `fsdp_version: 2`), which keeps each parameter's dtype."
        )


def train(model, train_dataset, args, *, resume: bool = False, callbacks=None, trainer_class=None):
    """Run the HF Trainer; `resume` continues from the newest complete checkpoint in
    args.output_dir and is an error when there is none."""
    from transformers import Trainer, default_data_collator

    check_sharding(model)
    checkpoint = None
    if resume:
        checkpoint = last_complete_checkpoint(args.output_dir)
        if checkpoint is None:
            raise ValueError(f"--resume: no complete checkpoint (checkpoint-N/ with trainer_state.json) in "
                             f"{args.output_dir}; run without --resume to train from the start.")
    if getattr(args, "gradient_checkpointing", False) and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # frozen embeddings + checkpointing (peft #742)
    trainer = (trainer_class or Trainer)(model=model, args=args, train_dataset=train_dataset,
                                         data_collator=default_data_collator, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


def loss_curve(trainer) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in trainer.state.log_history if "loss" in row]


def paired_permutation_test(deltas: list[float]) -> float:
    """Two-sided p-value of mean(deltas) != 0 by exact sign flips (paired seeds); 1.0 for n < 1."""
    n = len(deltas)
    if n == 0:
        return 1.0
    observed = abs(sum(deltas)) / n
    count = total = 0
    for signs in itertools.product((1, -1), repeat=n):
        total += 1
        count += abs(sum(s * d for s, d in zip(signs, deltas, strict=True))) / n >= observed - 1e-15
    return count / total


def summarize_finetune(rows: list[dict], baseline: str = "unpatched") -> list[dict]:
    """Per variant: mean held-out NLL/perplexity over seeds and the paired delta vs the baseline."""
    by_seed = {(r["variant"], r["seed"]): r for r in rows}
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    summary = []
    for variant in variants:
        seeds = [s for (v, s) in by_seed if v == variant]
        nlls = [by_seed[(variant, s)]["nll"] for s in seeds]
        deltas = [by_seed[(variant, s)]["nll"] - by_seed[(baseline, s)]["nll"] for s in seeds if (baseline, s) in by_seed]
        summary.append({
            "variant": variant,
            "seeds": len(seeds),
            "nll_mean": statistics.fmean(nlls),
            "nll_std": statistics.stdev(nlls) if len(nlls) > 1 else 0.0,
            "perplexity_mean": statistics.fmean(math.exp(n) for n in nlls),
            "delta_nll_mean": statistics.fmean(deltas) if deltas else float("nan"),
            "delta_perplexity_mean": statistics.fmean(
                math.exp(by_seed[(variant, s)]["nll"]) - math.exp(by_seed[(baseline, s)]["nll"]) for s in seeds
            ),
            "p_value": paired_permutation_test(deltas) if variant != baseline else float("nan"),
        })
    return summary


def diagnostics_callback(windows: torch.Tensor, *, every_n_steps: int = 50, layers: list[int] | None = None,
                         quantities=("rho", "orthogonality_error", "norm_x", "ffn_angle", "diversity_after_ffn"),
                         batch_size: int = 1):
    """A TrainerCallback that runs the diagnostics on fixed `windows` every N steps and logs the
    per-layer means through `trainer.log` (so every `report_to` backend gets them). Attach with
    `callback.attach(trainer)`."""
    from transformers import TrainerCallback

    from .diagnostics import QUANTITIES, diagnose

    unknown = [q for q in quantities if q not in QUANTITIES]
    if unknown:
        raise ValueError(f"unknown diagnostics {unknown}; accepted: {', '.join(QUANTITIES)}.")

    class DiagnosticsCallback(TrainerCallback):
        trainer = None

        def attach(self, trainer):
            self.trainer = trainer
            trainer.add_callback(self)
            return self

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.trainer is None or state.global_step % every_n_steps or not state.is_world_process_zero:
                return
            records = diagnose(model, windows, layers=layers, batch_size=batch_size)
            self.trainer.log({f"diagnostics/layer_{r['layer']}/{q}": r[q]["mean"] for r in records for q in quantities})

    return DiagnosticsCallback()
