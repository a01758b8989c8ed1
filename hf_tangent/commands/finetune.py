"""`hf-tangent finetune`: the same fine-tuning for the unpatched model and each update rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..analysis.evaluation import update_variants
from ..experiments.finetune import DEFAULT_RULES, FinetuneTrainingArguments, LoraSettings, finetune
from ..ranges import Range, at_least
from .arguments import Checked, training_command


@dataclass
class FinetuneArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = {"lora_r": at_least(1), "lora_alpha": at_least(1)}

    updates: list[str] = field(default_factory=lambda: list(DEFAULT_RULES), metadata={
        "help": "update variants trained besides the unpatched model: " + "; ".join(update_variants()),
        "choices": list(update_variants()), "metavar": "NAME"})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "one run per seed and variant"})
    method: Literal["lora", "full"] = field(default="lora", metadata={"help": "LoRA (PEFT) or full fine-tuning"})
    lora_r: int = field(default=LoraSettings.r, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=LoraSettings.alpha, metadata={"help": "LoRA alpha"})
    lora_targets: list[str] = field(default_factory=lambda: list(LoraSettings.targets), metadata={
        "help": "LoRA target modules (names of the model's Linear layers)"})
    save_models: bool = field(default=False, metadata={
        "help": "write every patched run's final model: a patch repo with its LoRA adapters (--method lora), the "
                "complete folder (--method full)"})


def finetune_command_parser(subparsers):
    return training_command(subparsers, "finetune", FinetuneArguments, FinetuneTrainingArguments,
                            "the same fine-tuning for the unpatched model and each update rule; perplexity deltas",
                            finetune, lambda own, training: dict(
                                rules=own.updates, seeds=own.seeds, method=own.method, save_models=own.save_models,
                                lora=LoraSettings(own.lora_r, own.lora_alpha, tuple(own.lora_targets))))
