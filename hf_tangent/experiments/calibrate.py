"""`calibrate_gates`: one scalar FFN gate per layer trained with every weight frozen (math.md section 5)."""

from __future__ import annotations

import json
import os
import sys

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..analysis.evaluation import evaluate_variants, perplexity
from ..artifacts.hub import save_hub_folder
from ..artifacts.identity import scored_weights
from ..artifacts.patch_repo import patch_record, push_patch, write_patch_repo
from ..core.config import TangentConfig
from ..core.destinations import check_destination
from ..core.discovery import decoder_layers
from ..core.patching import patch
from ..ranges import DType, validated
from ..training.data import TextSource
from ..training.trainer import (
    TangentTrainingArguments,
    freeze_all_but_gates,
    gate_summary,
    gate_values,
    lm_dataset,
    loss_curve,
    train,
    training_summary,
)
from . import plots
from .common import (
    Clock,
    Model,
    Text,
    Tokenizer,
    check_domain_shares,
    environment,
    progress_bar,
    provenance_line,
    refuse_patched,
    resolve_model,
    run_inputs,
    spread,
    stacked,
    text_windows,
)
from .report import PAPER_MEAN_GATES, Report, perplexity_text, register_report, variants_table
from .runs import RunFolder, claim_run_folder


def _check_destinations(model, named, args, save_patch, save_model, push_to_hub, inputs) -> None:
    """Everything calibrate_gates writes, checked before it loads, patches or trains anything: the
    patch repo's base name, the repo id, the run folder (runs.claim_run_folder) and each folder
    (destinations.check_destination, with the base's own folder protected)."""
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
    claim_run_folder(args.output_dir, writer="hf_tangent.calibrate_gates(training_args.output_dir=)", inputs=inputs)
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
    _check_destinations(model, named, args, save_patch, save_model, push_to_hub,  # before any work
                        run_inputs(model, text, args))
    check_domain_shares(text, train_windows)
    model, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype, seed=args.seed)
    refuse_patched(model, "calibrate_gates")  # a model object is calibrated in place: patched with the gates
    weights = scored_weights(model)  # the weights the gates are calibrated on (the report holds the gates)
    tangent.resolve_layers(len(decoder_layers(model)))
    read = {}  # the text as read, for the report's provenance
    held_out_domains, train_domains = text_windows(model, tokenizer, text, seq_len, max_windows, train_windows,
                                                   read=read)
    held_out, train_set = stacked(held_out_domains), stacked(train_domains)
    batch = eval_batch_size if eval_batch_size is not None else args.per_device_eval_batch_size
    clock = Clock()
    probe = spread(train_domains, 8)  # calibration loss before/after, same windows, from every domain
    model.to(args.device)
    # what the run is doing, in the order it does it: the untrained baseline comes first and takes a while
    if progress:
        print(f"calibrate: 1/3 before training: held-out NLL of the unpatched model and {len(compare_rules)} "
              f"untrained update rules ({len(held_out)} windows each); 2/3 training the gates "
              f"({args.max_steps} steps); 3/3 held-out NLL with the calibrated gates", file=sys.stderr, flush=True)
    with progress_bar(progress, (len(compare_rules) + 1) * len(held_out) + len(probe),
                      f"before training: unpatched + {len(compare_rules)} untrained rules") as bar:
        table = evaluate_variants(model, held_out, list(compare_rules), batch_size=batch, progress=bar)
        for row in table:  # the report keeps the pooled figures
            del row["window_nll"]
        before = perplexity(model, probe, batch_size=batch, progress=bar)
    patch(model, tangent)
    record = patch_record(model, base_model=named) if writes_patch else None  # before any wrapping: unsharded
    freeze_all_but_gates(model)
    with RunFolder(args.output_dir, writer="hf_tangent.calibrate_gates",
                   active=args.process_index == 0):  # the Trainer's checkpoints, maybe the patch
        trainer = train(model, lm_dataset(train_set), args)
        model.eval()  # every rank evaluates: a ZeRO-3 / FSDP forward is a collective
        with progress_bar(progress, len(held_out) + len(probe),
                          "after training: the calibrated gates") as bar:
            gated = perplexity(model, held_out, batch_size=batch, progress=bar)
            after = perplexity(model, probe, batch_size=batch, progress=bar)
        gates = gate_values(trainer.model_wrapped)  # gathered: a collective too
        report = Report("calibrate", {
            "command": "calibrate", "model": name, "tangent_config": tangent.to_dict(),
            "text": text.describe(training=True), "seq_len": seq_len, "eval_windows": len(held_out),
            "train_windows": len(train_set), "training": training_summary(args) | {"world_size": args.world_size},
            "gates": {str(k): v for k, v in gates.items()}, "gate_summary": gate_summary(gates),
            "heldout": {"natural_nll": table[0]["nll"], "gated_nll": gated["nll"],
                        "delta_nll": gated["nll"] - table[0]["nll"], "natural_perplexity": table[0]["perplexity"],
                        "gated_perplexity": gated["perplexity"]},
            "calibration": {"natural_nll": before["nll"], "gated_nll": after["nll"], "windows": len(probe)},
            "update_variants": table, "loss_curve": loss_curve(trainer), "seconds": clock.seconds,
            **environment(args.device.type, dtype, args.seed, model=weights, text=text, read=read),
        })
        card = {"title": f"{report['model']} with calibrated FFN gates (hf_tangent)",
                "training": training_card(report.data), "results": calibrate_results_markdown(report.data),
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


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

def training_card(report: dict) -> str:
    """The model card's training paragraph of a calibrate (or heal) report."""
    t = report["training"]
    return (f"Text: {json.dumps(report['text'])}. {report['train_windows']} training windows of {report['seq_len']} "
            f"tokens; {t['max_steps']} optimizer steps, learning rate {t['learning_rate']}, batch "
            f"{t['batch_size']} x {t['grad_accum']} accumulation x {t['world_size']} processes; bf16 {t['bf16']}; "
            f"seed {report['seed']}; hf_tangent {report['hf_tangent_version']}, torch {report['torch']}."
            + (f" {provenance_line(report)}" if report.get("versions") else ""))


def calibrate_markdown(report: dict) -> str:
    s = report["gate_summary"]
    gates = ", ".join(f"{int(k)}: {v:.3f}" for k, v in report["gates"].items())
    lines = [
        f"# hf-tangent calibrate: {report['model']}",
        "",
        f"{report['train_windows']} calibration windows, {report['training']['max_steps']} steps, "
        f"{report['eval_windows']} held-out windows of {report['seq_len']} tokens; {report['seconds']} s on "
        f"{report['device']}.",
        "",
        "## Gate profile",
        "",
        f"mean gate **{s['mean']:.3f}**, min {s['min']:.3f} (layer {s['argmin']}) .. max {s['max']:.3f} "
        f"(layer {s['argmax']}). Paper: {PAPER_MEAN_GATES}.",
        "",
        f"Gates by layer: {gates}",
        "",
        "![gate profile](gate_profile.png)",
        "",
        "## Held-out loss",
        calibrate_results_markdown(report),
    ]
    if plots.drawn_rules(report["update_variants"]):
        lines += ["![delta NLL per update rule](rule_deltas.png)", ""]
    return "\n".join(lines)


def calibrate_results_markdown(report: dict) -> str:
    """The held-out results of a calibrate report (its report.md section and the model card's)."""
    h, c = report["heldout"], report["calibration"]
    lines = [
        "",
        "| | NLL | perplexity |",
        "|---|---:|---:|",
        f"| natural (gates = 1) | {h['natural_nll']:.4f} | {perplexity_text(h['natural_perplexity'])} |",
        f"| calibrated gates | {h['gated_nll']:.4f} | {perplexity_text(h['gated_perplexity'])} |",
        f"| **Delta L** | **{h['delta_nll']:+.4f}** | |",
        "",
        f"Calibration windows ({c['windows']}): NLL {c['natural_nll']:.4f} natural -> {c['gated_nll']:.4f} gated.",
    ]
    if len(report["update_variants"]) > 1:
        lines += ["", "## Update rules, untrained, every layer", "", variants_table(report["update_variants"])]
    return "\n".join(lines) + "\n"


def _plot_calibrate(data, folder):
    curve, c = [tuple(point) for point in data["loss_curve"]], data["calibration"]
    # the per-batch loss moves by more than calibration changes: the same calibration windows before and
    # after training, drawn beside it, show the change
    levels = {f"{c['windows']} calibration windows, gates = 1": c["natural_nll"],
              "the same windows, calibrated gates": c["gated_nll"]}
    paths = [plots.gate_profile({int(k): v for k, v in data["gates"].items()}, os.path.join(folder, "gate_profile.png"),
                                title=f"Calibrated FFN gates: {data['model']}"),
             plots.loss_curves({"per-batch training loss": [curve]}, os.path.join(folder, "loss_curve.png"),
                               title="Calibration loss", levels=levels)]
    if plots.drawn_rules(data["update_variants"]):
        paths.append(plots.rule_deltas(data["update_variants"], os.path.join(folder, "rule_deltas.png"),
                                       title=f"Update rules, untrained, every layer: {data['model']}"))
    return paths


register_report('calibrate', calibrate_markdown, _plot_calibrate)
