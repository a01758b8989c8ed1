"""`calibrate_gates`: one scalar FFN gate per layer trained with every weight frozen (math.md section 5)."""

from __future__ import annotations

import os

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..adapters.repo import patch_record, push_patch, write_patch_repo
from ..config import TangentConfig
from ..data import TextSource
from ..destinations import check_destination
from ..discovery import decoder_layers
from ..evaluation import evaluate_variants, perplexity
from ..hub import save_hub_folder
from ..patching import patch
from ..ranges import DType, validated
from ..reports import Report, calibrate_results_markdown, training_card
from ..training import (
    TangentTrainingArguments,
    freeze_all_but_gates,
    gate_summary,
    gate_values,
    lm_dataset,
    loss_curve,
    train,
    training_summary,
)
from .common import Clock, Model, Text, Tokenizer, environment, progress_bar, refuse_patched, resolve_model, windows


def _check_destinations(model, named, args, save_patch, save_model, push_to_hub) -> None:
    """Everything calibrate_gates writes, checked before it loads, patches or trains anything: the
    patch repo's base name, the repo id, and each folder (destinations.check_destination, with the
    base's own folder protected)."""
    base = named or str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    if (save_patch or push_to_hub) and not base:
        raise ValueError("hf_tangent.calibrate_gates: save_patch= / push_to_hub= write a patch repo, which records its "
                         "base model by name, and this model does not say which checkpoint it was loaded from "
                         "(config._name_or_path is empty); pass the model by name, set model.config._name_or_path to "
                         "its hub id or folder, or leave save_patch and push_to_hub unset.")
    if push_to_hub:
        try:
            validate_repo_id(push_to_hub)
        except HFValidationError as err:
            raise ValueError(f"hf_tangent.calibrate_gates: push_to_hub={push_to_hub!r} is not a hub repo id ({err}); "
                             "accepted: 'name' or 'namespace/name' (letters, digits, '-', '_', '.').") from None
    patch_folder = save_patch or (os.path.join(args.output_dir, "patch") if push_to_hub else None)
    for option, folder in (("save_patch", patch_folder), ("save_model", save_model)):
        if folder:
            check_destination(folder, protected=[base], writer=f"hf_tangent.calibrate_gates({option}=)")


@validated()
def calibrate_gates(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, update: str = "add", layers: list[int] | None = None,
                    compare_rules: list[str] = (), seq_len: int = 512, max_windows: int = 8, train_windows: int = 64,
                    training_args: TangentTrainingArguments | None = None, eval_batch_size: int | None = None,
                    dtype: DType = "float32", save_patch: str | os.PathLike | None = None,
                    save_model: str | os.PathLike | None = None, push_to_hub: str | None = None,
                    hub_private: bool = False, progress: bool = True) -> Report:
    """Train one FFN gate per layer on calibration text, all model weights frozen, and report the
    gate profile and the held-out loss change (the `calibrate` report). Runs on every rank of a
    distributed run (DDP, FSDP, ZeRO-3 through the Trainer); every rank returns the same report.

    Args:
        model, tokenizer: a model name, or a loaded model with its tokenizer.
        text: a `TextSource` (evaluation and calibration text; default: the Austen split).
        update: the update rule the gates scale ("add": x + g_l * FFN(Norm(x))); layers: which (None = all).
        compare_rules: update variants also evaluated, untrained, on the held-out text.
        seq_len, max_windows, train_windows: held-out and calibration windows.
        training_args: Trainer settings (default `TangentTrainingArguments()`: 50 steps at lr 1e-2).
        save_patch: a folder for the calibrated gates as a patch repo (kilobytes; hf_tangent.save_patch);
        save_model: a folder for the complete model (weights, gates, remote code; hf_tangent.save_hub_folder);
        push_to_hub: a repo id to push the patch repo to (the patch repo written to save_patch, else to
            output_dir/patch).
    The destinations (and the repo id) are checked before any work. A model object with no
    config._name_or_path can be calibrated; only a patch repo (save_patch / push_to_hub), which
    records its base by name, needs one. A model object is calibrated in place: patched with the
    gates, which are trained.
    """
    tangent = TangentConfig(update=update, layers=layers, gates=True)  # validated before any work
    named = model if isinstance(model, str) else None  # the base a patch repo records (else the model's own path)
    args = training_args or TangentTrainingArguments()
    text = TextSource.of(text)
    writes_patch = bool(save_patch or push_to_hub)  # a patch repo, which records its base by name
    _check_destinations(model, named, args, save_patch, save_model, push_to_hub)  # before any work
    model, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype, seed=args.seed)
    refuse_patched(model, "calibrate_gates")  # a model object is calibrated in place: patched with the gates
    tangent.resolve_layers(len(decoder_layers(model)))
    held_out = windows(model, tokenizer, text.evaluation_documents(training=True), seq_len, max_windows)
    train_set = windows(model, tokenizer, text.training_documents(), seq_len, train_windows)
    batch = eval_batch_size if eval_batch_size is not None else args.per_device_eval_batch_size
    clock = Clock()
    probe = train_set[: min(len(train_set), 8)]  # calibration loss before/after, same windows
    model.to(args.device)
    with progress_bar(progress, (len(compare_rules) + 1) * len(held_out) + len(probe), "held-out evaluation") as bar:
        table = evaluate_variants(model, held_out, list(compare_rules), batch_size=batch, progress=bar)
        before = perplexity(model, probe, batch_size=batch, progress=bar)
    patch(model, tangent)
    record = patch_record(model, base_model=named) if writes_patch else None  # before any wrapping: unsharded
    freeze_all_but_gates(model)
    trainer = train(model, lm_dataset(train_set), args)
    model.eval()  # every rank evaluates: a ZeRO-3 / FSDP forward is a collective
    gated = perplexity(model, held_out, batch_size=batch)
    after = perplexity(model, probe, batch_size=batch)
    gates = gate_values(trainer.model_wrapped)  # gathered: a collective too
    report = Report("calibrate", {
        "command": "calibrate", "model": name, "tangent_config": tangent.to_dict(), "text": text.describe(training=True),
        "seq_len": seq_len, "eval_windows": len(held_out), "train_windows": len(train_set),
        "training": training_summary(args) | {"world_size": args.world_size},
        "gates": {str(k): v for k, v in gates.items()}, "gate_summary": gate_summary(gates),
        "heldout": {"natural_nll": table[0]["nll"], "gated_nll": gated["nll"], "delta_nll": gated["nll"] - table[0]["nll"],
                    "natural_perplexity": table[0]["perplexity"], "gated_perplexity": gated["perplexity"]},
        "calibration": {"natural_nll": before["nll"], "gated_nll": after["nll"], "windows": len(probe)},
        "update_variants": table, "loss_curve": loss_curve(trainer), "seconds": clock.seconds,
        **environment(args.device.type, dtype, args.seed),
    })
    card = {"title": f"{report['model']} with calibrated FFN gates (hf_tangent)", "training": training_card(report.data),
            "results": calibrate_results_markdown(report.data),
            "notes": "Gates trained with all model weights frozen (hf_tangent `calibrate`)."}
    if save_model:  # every rank: gathering a sharded model is a collective
        folder = save_hub_folder(trainer.model_wrapped, save_model, tokenizer=tokenizer, card=card)
        if folder is not None:
            report.data["model_folder"] = str(folder)
    if writes_patch and args.process_index == 0:
        folder = write_patch_repo(save_patch or os.path.join(args.output_dir, "patch"), record, gates, card=card)
        report.data["patch_folder"] = str(folder)
        if push_to_hub:
            push_patch(folder, push_to_hub, private=hub_private)
            report.data["pushed_to"] = push_to_hub
    return report
