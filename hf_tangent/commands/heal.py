"""`hf-tangent heal`: distil a patched model back towards its unpatched self."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..analysis.evaluation import update_variants
from ..experiments.finetune import LoraSettings
from ..experiments.heal import HealSettings, HealTrainingArguments, heal
from .arguments import Checked, options_dataclass, prefixed, training_command

_RULES = [name for name, config in update_variants().items() if config is not None]


@dataclass
class HealPatchArguments(Checked):
    """The patch healed (heal's `tangent`): a rule of `hf-tangent eval`'s, on these layers."""

    update: str = field(default="projected", metadata={"help": "the update rule to heal: " + "; ".join(_RULES),
                                                        "choices": _RULES, "metavar": "NAME"})
    layers: list[int] | None = field(default=None, metadata={"help": "layers that get the rule (default: all)"})
    parallel_layers: list[int] | None = field(default=None, metadata={
        "help": "layers converted to parallel-residual form (with --update add: conversion only)"})


HealArguments = options_dataclass(heal, __name__, names=("seeds", "save_models", "save_full_models", "prompt"))
LoraSettingsArguments = prefixed(LoraSettings, "lora_", __name__)


def heal_command_parser(subparsers):
    return training_command(subparsers, "heal", (HealPatchArguments, HealSettings, HealArguments, LoraSettingsArguments),
                            HealTrainingArguments,
                            "distil a patched model from its unpatched self (KL, homotopy); NLL before / after",
                            heal, _options)


def _options(patch, settings, own, lora, training) -> dict:
    tangent = dataclasses.replace(update_variants()[patch.update], layers=patch.layers,
                                  parallel_layers=tuple(patch.parallel_layers or ()))
    return dict(tangent=tangent, settings=settings, lora=lora.settings(), **vars(own))
