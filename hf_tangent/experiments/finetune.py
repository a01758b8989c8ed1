"""`finetune`: the same fine-tuning (LoRA or full) for the unpatched model and each update rule."""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
import statistics
from typing import ClassVar, Literal

from ..analysis.evaluation import perplexity, update_variants
from ..analysis.stats import paired_summary
from ..artifacts.hub import save_hub_folder
from ..artifacts.identity import scored_weights
from ..artifacts.patch_repo import patch_record, write_patch_repo
from ..core.destinations import check_destination
from ..core.gather import peft_model_of
from ..core.patching import patch
from ..ranges import DType, Range, at_least, check_ranges, validated
from ..training.data import TextSource
from ..training.trainer import TangentTrainingArguments, lm_dataset, loss_curve, train, training_summary
from . import plots
from .common import (
    Clock,
    Model,
    Text,
    Tokenizer,
    check_domain_shares,
    entry_point,
    environment,
    resolve_model,
    run_inputs,
    stacked,
    text_windows,
)
from .report import Report, perplexity_text, register_report
from .runs import RunFolder, claim_run_folder

DEFAULT_RULES = ("projected", "soft beta=0.5", "norm_preserving", "retract p=2 (cayley)")


@dataclasses.dataclass
class FinetuneTrainingArguments(TangentTrainingArguments):
    """TangentTrainingArguments with fine-tuning's defaults: lr 2e-4, cosine schedule."""

    learning_rate: float = dataclasses.field(default=2e-4, metadata={"help": "Peak learning rate (AdamW)."})
    lr_scheduler_type: str = dataclasses.field(default="cosine", metadata={"help": "Trainer scheduler name."})


@dataclasses.dataclass
class LoraSettings:
    """PEFT LoRA settings: rank `r`, scale `alpha`, the Linear layers it adapts (`targets`)."""

    RANGES: ClassVar[dict[str, Range]] = {"r": at_least(1), "alpha": at_least(1)}

    r: int = dataclasses.field(default=8, metadata={"help": "LoRA rank"})
    alpha: int = dataclasses.field(default=16, metadata={"help": "LoRA alpha"})
    targets: tuple[str, ...] = dataclasses.field(default=("q_proj", "v_proj", "up_proj", "down_proj"), metadata={
        "help": "LoRA target modules (names of the model's Linear layers)"})

    def __post_init__(self):
        check_ranges(self)
        self.targets = tuple(self.targets)  # a list given (the command line's) is kept as the tuple it means


def finetune_summary(runs: list[dict], baseline: str = "unpatched") -> list[dict]:
    """Per variant: mean held-out NLL / perplexity over seeds and the paired delta vs the baseline."""
    by = {(r["variant"], r["seed"]): r for r in runs}
    rows = []
    for row in paired_summary(runs, baseline, "nll"):
        seeds = [s for (v, s) in by if v == row["variant"]]
        ppl = [math.exp(by[(row["variant"], s)]["nll"]) - math.exp(by[(baseline, s)]["nll"]) for s in seeds if (baseline, s) in by]
        rows.append({"variant": row["variant"], "seeds": row["seeds"], "nll_mean": row["mean"], "nll_std": row["sd"],
                     "perplexity_mean": statistics.fmean(math.exp(by[(row["variant"], s)]["nll"]) for s in seeds),
                     "delta_nll_mean": row["delta_mean"], "delta_perplexity_mean": statistics.fmean(ppl) if ppl else math.nan,
                     "p_value": row["p_value"]})
    return rows


def _run_dir(args, rule: str, seed: int) -> str:
    return os.path.join(args.output_dir, "runs", f"{rule.split(' (')[0].replace(' ', '_')}-seed{seed}")


def _run(model, first, tokenizer, rule, seed, tangent, method, lora, dataset, held_out, args, eval_batch_size, dtype,
         save_models) -> dict:
    """One (rule, seed) run: a fresh copy of the model, patched, (LoRA,) trained, evaluated."""
    run_model = resolve_model(model, tokenizer, dtype=dtype)[0] if isinstance(model, str) else copy.deepcopy(first)
    record = None
    if tangent is not None:
        patch(run_model, tangent)
        if save_models and method == "lora":  # before training: the base's fingerprint (LoRA leaves it as it is)
            record = patch_record(run_model, base_model=model if isinstance(model, str) else None)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        run_model = get_peft_model(run_model, LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                                         target_modules=list(lora.targets), lora_dropout=0.0))
    run_dir = _run_dir(args, rule, seed)
    trainer = train(run_model, dataset, dataclasses.replace(args, output_dir=run_dir, seed=seed, data_seed=seed))
    run_model.eval()
    batch = eval_batch_size if eval_batch_size is not None else args.per_device_eval_batch_size
    result = perplexity(run_model, held_out, batch_size=batch)
    curve = loss_curve(trainer)
    if record is not None:  # LoRA: a patch repo (the patch and the adapters, unmerged)
        write_patch_repo(os.path.join(run_dir, "patch"), record, {}, peft_model_of(run_model))
    elif save_models and tangent is not None:  # full fine-tuning moved the base weights: the complete folder
        save_hub_folder(run_model, os.path.join(run_dir, "model"), tokenizer=tokenizer)
    del run_model, trainer
    gc.collect()
    return {"variant": rule, "seed": seed, "nll": result["nll"], "perplexity": result["perplexity"],
            "final_train_loss": curve[-1][1] if curve else None, "loss_curve": curve}


@validated()
@entry_point(patched_model="refused")
def finetune(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, rules: list[str] = DEFAULT_RULES, seeds: list[int] = (0, 1),
             method: Literal["lora", "full"] = "lora", lora: LoraSettings | None = None, seq_len: int = 512, max_windows: int = 8,
             train_windows: int = 64, training_args: TangentTrainingArguments | None = None,
             eval_batch_size: int | None = None, dtype: DType = "float32", save_models: bool = False) -> Report:
    """Fine-tune the unpatched model and every rule's patched model with the same data order, steps
    and optimizer, for every seed; held-out perplexity with paired statistics (the `finetune` report).

    Args:
        model: a model name (loaded afresh for every run) or a loaded model (deep-copied per run).
        rules: update variants trained besides the unpatched model.
        seeds: one run per seed and variant
        method: LoRA (PEFT; its settings: `lora`, on the command line --lora_*) or full fine-tuning
        training_args: Trainer settings; each run writes to output_dir/runs/<rule>-seed<seed>.
        save_models: write every patched run's final model: with LoRA a patch repo (runs/<rule>-seed<k>/patch,
            adapters unmerged), with full fine-tuning the complete folder (runs/<rule>-seed<k>/model)
    """
    variants = update_variants()
    unknown = [r for r in rules if r not in variants]
    if unknown:
        raise ValueError(f"unknown update variants {unknown}; accepted: {', '.join(variants)}.")
    args = training_args or FinetuneTrainingArguments()
    lora = lora or LoraSettings()
    text = TextSource.of(text)
    names = ["unpatched", *[r for r in rules if r != "unpatched"]]
    claim_run_folder(args.output_dir, writer="hf_tangent.finetune(training_args.output_dir=)",
                     inputs=run_inputs(model, text, args))
    if save_models:  # every folder a run will write, checked before any work
        base = model if isinstance(model, str) else str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        for seed in seeds:
            for rule in names[1:]:
                folder = os.path.join(_run_dir(args, rule, seed), "patch" if method == "lora" else "model")
                check_destination(folder, protected=[base], writer="hf_tangent.finetune")
    check_domain_shares(text, train_windows)
    first, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype)
    weights = scored_weights(first)  # the model every run starts from
    read = {}  # the text as read, for the report's provenance
    held_out, training = map(stacked, text_windows(first, tokenizer, text, seq_len, max_windows, train_windows,
                                                   read=read))
    dataset = lm_dataset(training)
    clock = Clock()
    with RunFolder(args.output_dir, writer="hf_tangent.finetune",
                   active=args.process_index == 0):  # runs/<rule>-seed<k>: checkpoints, saved models
        runs = [_run(model, first, tokenizer, rule, seed, variants[rule], method, lora, dataset, held_out, args,
                     eval_batch_size, dtype, save_models) for seed in seeds for rule in names]
    return Report("finetune", {
        "command": "finetune", "model": name, "method": method, "variants": names, "seeds": list(seeds),
        "text": text.describe(training=True), "seq_len": seq_len, "eval_windows": len(held_out),
        "train_windows": len(dataset),
        "training": training_summary(args) | {
            "lora": {"r": lora.r, "alpha": lora.alpha, "targets": list(lora.targets)} if method == "lora" else None},
        "summary": finetune_summary(runs), "runs": runs, "seconds": clock.seconds,
        **environment(args.device.type, dtype, args.seed, model=weights, text=text, read=read),
    })


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

def finetune_markdown(report: dict) -> str:
    t = report["training"]
    lines = [
        f"# hf-tangent finetune: {report['model']} ({report['method']})",
        "",
        f"Same data order, steps ({t['max_steps']}), optimizer (AdamW, lr {t['learning_rate']}, {t['lr_scheduler']}) "
        f"for every variant; seeds {report['seeds']}; {report['train_windows']} training and "
        f"{report['eval_windows']} held-out windows of {report['seq_len']} tokens; {report['seconds']} s.",
        "",
        "| variant | seeds | delta NLL vs unpatched (nats) | held-out NLL (mean +- sd) | perplexity | "
        "p (paired permutation) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in report["summary"]:
        p = "" if s["variant"] == "unpatched" else f"{s['p_value']:.3f}"
        lines.append(f"| {s['variant']} | {s['seeds']} | {s['delta_nll_mean']:+.4f} | {s['nll_mean']:.4f} +- "
                     f"{s['nll_std']:.4f} | {perplexity_text(s['perplexity_mean'])} | {p} |")
    lines += ["", "With n seeds the exact sign-flip test cannot go below p = 2 / 2^n.", "",
              "![training loss](loss_curves.png)"]
    return "\n".join(lines) + "\n"


def _plot_finetune(data, folder):
    curves = {}
    for run in data["runs"]:
        curves.setdefault(run["variant"], []).append([tuple(p) for p in run["loss_curve"]])
    return [plots.loss_curves(curves, os.path.join(folder, "loss_curves.png"),
                              title=f"{data['method']} fine-tuning, {data['model']}")]


register_report('finetune', finetune_markdown, _plot_finetune)
