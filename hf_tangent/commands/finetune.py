"""`hf-tangent finetune`: the same fine-tuning for the unpatched model and each update rule."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis.evaluation import update_variants
from ..experiments.finetune import DEFAULT_RULES, FinetuneTrainingArguments, LoraSettings, finetune
from .arguments import Checked, options_dataclass, prefixed, training_command


@dataclass
class FinetuneUpdatesArguments(Checked):
    updates: list[str] = field(default_factory=lambda: list(DEFAULT_RULES), metadata={
        "help": "update variants trained besides the unpatched model: " + "; ".join(update_variants()),
        "choices": list(update_variants()), "metavar": "NAME"})


FinetuneArguments = options_dataclass(finetune, __name__, names=("seeds", "method", "save_models"))
LoraSettingsArguments = prefixed(LoraSettings, "lora_", __name__)


def finetune_command_parser(subparsers):
    return training_command(subparsers, "finetune", (FinetuneUpdatesArguments, FinetuneArguments,
                                                            LoraSettingsArguments),
                            FinetuneTrainingArguments,
                            "the same fine-tuning for the unpatched model and each update rule; perplexity deltas",
                            finetune, lambda updates, own, lora, training: dict(rules=updates.updates, **vars(own),
                                                                                lora=lora.settings()))
