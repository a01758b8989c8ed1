"""`hf-tangent calibrate`: one scalar FFN gate per layer, every weight frozen (math.md section 5).

Trainer settings are `TrainingArguments` fields (--max_steps, --learning_rate,
--per_device_train_batch_size, --deepspeed, --fsdp, --bf16, ...), with hf_tangent's defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis.evaluation import update_variants
from ..experiments.calibrate import calibrate_gates
from ..training.trainer import TangentTrainingArguments
from .arguments import Checked, CommandError, training_command


@dataclass
class CalibrateArguments(Checked):
    update: str = field(default="add", metadata={"help": "update rule the gates scale (add: x + g_l * FFN)"})
    layers: list[int] | None = field(default=None, metadata={"help": "layers to gate (default all)"})
    compare_updates: list[str] = field(default_factory=list, metadata={
        "help": "also evaluate these update variants, untrained, on the held-out text: " + "; ".join(update_variants()),
        "choices": list(update_variants()), "metavar": "NAME"})
    save_patch: bool = field(default=True, metadata={
        "help": "write the calibrated gates as a patch repo in OUTPUT_DIR/patch (kilobytes; it records the base model, "
                "which is loaded from its own repo)"})
    save_full_model: bool = field(default=False, metadata={
        "help": "also write the complete model (weights, gates, remote code) in OUTPUT_DIR/model, for users "
                "without hf_tangent"})


def calibrate_command_parser(subparsers):
    return training_command(subparsers, "calibrate", (CalibrateArguments,), TangentTrainingArguments,
                            "train one scalar FFN gate per layer, all weights frozen", calibrate_gates, _options,
                            docs="math.md#5-layerwise-ffn-gates")


def hub_target(training) -> str | None:
    """The repo to publish to: the Trainer's --push_to_hub / --hub_model_id, published by hf_tangent
    (the patch repo with its card) instead of the Trainer's checkpoint pushes."""
    if not training.push_to_hub:
        return None
    if not training.hub_model_id:
        raise CommandError("--push_to_hub needs --hub_model_id (the repository to publish to).")
    repo, training.push_to_hub = training.hub_model_id, False
    return repo


def _options(own, training) -> dict:
    repo = hub_target(training)
    return dict(update=own.update, layers=own.layers, compare_rules=own.compare_updates, push_to_hub=repo,
                hub_private=bool(training.hub_private_repo),
                save_patch=f"{training.output_dir}/patch" if own.save_patch or repo else None,
                save_model=f"{training.output_dir}/model" if own.save_full_model else None)
