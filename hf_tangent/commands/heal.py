"""`hf-tangent heal`: distil a patched model back towards its unpatched self."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..analysis.evaluation import update_variants
from ..experiments.finetune import LoraSettings
from ..experiments.heal import SAMPLE_PROMPT, HealSettings, HealTrainingArguments, heal
from ..ranges import Range, at_least
from .arguments import Checked, CommandError, training_command

_RULES = [name for name, config in update_variants().items() if config is not None]


@dataclass
class HealArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = HealSettings.RANGES | {"lora_r": at_least(1), "lora_alpha": at_least(1)}

    update: str = field(default="projected", metadata={"help": "the update rule to heal: " + "; ".join(_RULES),
                                                        "choices": _RULES, "metavar": "NAME"})
    layers: list[int] | None = field(default=None, metadata={"help": "layers that get the rule (default: all)"})
    parallel_layers: list[int] | None = field(default=None, metadata={
        "help": "layers converted to parallel-residual form (with --update add: conversion only)"})
    method: Literal["lora", "full"] = field(default=HealSettings.method, metadata={
        "help": "LoRA (teacher: the same model, patch and adapters off) or full fine-tuning (teacher: a frozen copy)"})
    temperature: float = field(default=HealSettings.temperature, metadata={"help": "distillation temperature T (loss T^2 KL)"})
    lm_weight: float = field(default=HealSettings.lm_weight, metadata={"help": "weight of the LM loss mixed with the KL, in [0, 1]"})
    homotopy_fraction: float = field(default=HealSettings.homotopy_fraction, metadata={
        "help": "fraction of the steps over which the patch moves from the identity to the target (0: direct)"})
    schedule: Literal["linear", "cosine"] = field(default=HealSettings.schedule, metadata={"help": "homotopy schedule"})
    stages: int = field(default=HealSettings.stages, metadata={
        "help": "progressive healing: the patched layers in this many groups (depth order), each moved to the "
                "target in turn during the homotopy (1: all layers at once)"})
    seeds: list[int] = field(default_factory=lambda: [0], metadata={"help": "one run per seed"})
    lora_r: int = field(default=LoraSettings.r, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=LoraSettings.alpha, metadata={"help": "LoRA alpha"})
    lora_targets: list[str] = field(default_factory=lambda: list(LoraSettings.targets), metadata={
        "help": "LoRA target modules (names of the model's Linear layers)"})
    save_models: bool = field(default=False, metadata={
        "help": "write every healed model's patch: a patch repo (patch + LoRA adapters, kilobytes to megabytes) in "
                "runs/seed<k>/patch; with --method full, whose weights move, the complete folder in runs/seed<k>/model"})
    save_full_models: bool = field(default=False, metadata={
        "help": "also write every healed model as a complete folder (LoRA merged, remote code) in runs/seed<k>/model"})
    prompt: str = field(default=SAMPLE_PROMPT, metadata={"help": "prompt of the generated sample before / after"})


def heal_command_parser(subparsers):
    return training_command(subparsers, "heal", HealArguments, HealTrainingArguments,
                            "distil a patched model from its unpatched self (KL, homotopy); NLL before / after",
                            heal, _options)


def _options(own, training) -> dict:
    try:
        tangent = dataclasses.replace(update_variants()[own.update], layers=own.layers,
                                      parallel_layers=tuple(own.parallel_layers or ()))
        settings = HealSettings(own.method, own.temperature, own.lm_weight, own.homotopy_fraction, own.schedule,
                                own.stages)
    except ValueError as err:
        raise CommandError(str(err)) from err
    return dict(tangent=tangent, settings=settings, seeds=own.seeds, save_models=own.save_models,
                lora=LoraSettings(own.lora_r, own.lora_alpha, tuple(own.lora_targets)),
                save_full_models=own.save_full_models, prompt=own.prompt)
