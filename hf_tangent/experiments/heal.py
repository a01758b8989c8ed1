"""`heal`: distil a patched model back towards its unpatched self (heal.py), per seed, with the
held-out NLL and KL before and after, loss curves, a generated sample, and the healed model saved."""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
from typing import ClassVar, Literal

import torch

from ..analysis.evaluation import perplexity
from ..analysis.stats import paired_permutation_test
from ..artifacts.hub import save_hub_folder
from ..artifacts.identity import scored_weights
from ..artifacts.patch_repo import patch_record, write_patch_repo
from ..core.config import TangentConfig
from ..core.destinations import check_destination
from ..core.discovery import decoder_layers
from ..core.gather import peft_model_of
from ..core.install import CONFIG_KEY
from ..core.patching import HomotopySchedule, get_homotopy, patch, tangent_layers
from ..core.wrappers import unwrap
from ..ranges import DType, Range, at_least, check_ranges, validated
from ..training.data import TextSource
from ..training.healing import TEMPERATURE, HomotopyCallback, heal_trainer_class, held_out_kl
from ..training.trainer import TangentTrainingArguments, lm_dataset, loss_curve, train, training_summary
from . import plots
from .common import (
    Clock,
    Model,
    Text,
    Tokenizer,
    check_domain_shares,
    domain_slices,
    entry_point,
    environment,
    interval,
    paired_window_difference,
    provenance_line,
    refuse_patched,
    resolve_model,
    run_inputs,
    stacked,
    text_windows,
    versions,
)
from .finetune import LoraSettings
from .report import Report, register_report
from .runs import RunFolder, claim_run_folder

SAMPLE_PROMPT = "It is a truth universally acknowledged, that"


@dataclasses.dataclass
class HealTrainingArguments(TangentTrainingArguments):
    """TangentTrainingArguments with healing's defaults: 60 steps, lr 1e-3, cosine schedule."""

    max_steps: int = dataclasses.field(default=60, metadata={"help": "Optimizer steps."})
    learning_rate: float = dataclasses.field(default=1e-3, metadata={"help": "Peak learning rate (AdamW)."})
    lr_scheduler_type: str = dataclasses.field(default="cosine", metadata={"help": "Trainer scheduler name."})


@dataclasses.dataclass
class HealSettings:
    """What healing does: the loss (KL at `temperature`, mixed with the LM loss by `lm_weight`) and
    the homotopy (lambda 0 -> 1 over `homotopy_fraction` of the steps; 0: the target from step 0),
    all layers at once or progressively in `stages` groups (heal.HomotopyCallback)."""

    RANGES: ClassVar[dict[str, Range]] = {"temperature": TEMPERATURE, "lm_weight": Range(0, 1),
                                          "homotopy_fraction": Range(0, 1), "stages": at_least(1)}

    method: Literal["lora", "full"] = dataclasses.field(default="lora", metadata={
        "help": "LoRA (teacher: the same model, patch and adapters off) or full fine-tuning (teacher: a frozen copy)"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "distillation temperature T (loss T^2 KL)"})
    lm_weight: float = dataclasses.field(default=0.0, metadata={
        "help": "weight of the LM loss mixed with the KL, in [0, 1]"})
    homotopy_fraction: float = dataclasses.field(default=0.5, metadata={
        "help": "fraction of the steps over which the patch moves from the identity to the target (0: direct)"})
    schedule: HomotopySchedule = dataclasses.field(default="linear", metadata={"help": "homotopy schedule"})
    stages: int = dataclasses.field(default=1, metadata={
        "help": "progressive healing: the patched layers in this many groups (depth order), each moved to the "
                "target in turn during the homotopy (1: all layers at once)"})

    def __post_init__(self):
        check_ranges(self)  # method and schedule are choices (Literal), the numbers ranges: core/options.py
        if self.stages > 1 and self.homotopy_fraction == 0:
            raise ValueError(f"stages={self.stages} with homotopy_fraction=0: the stages divide the homotopy's steps, and "
                             "there are none; accepted: homotopy_fraction > 0 with stages > 1, or stages=1.")


def _check_schedule(settings: HealSettings, tangent: TangentConfig, args, num_layers: int) -> None:
    """A progressive homotopy needs a layer group and at least one homotopy step per stage: refused
    before any work, so that no report describes a schedule that could not have run."""
    if settings.stages == 1:
        return
    layers = sorted(set(tangent.resolve_layers(num_layers)) | set(tangent.resolve_parallel_layers(num_layers)))
    steps = round(settings.homotopy_fraction * args.max_steps)
    if settings.stages > len(layers):
        raise ValueError(f"stages={settings.stages} > the {len(layers)} patched layers; accepted: at most {len(layers)}.")
    if steps < settings.stages:
        raise ValueError(f"stages={settings.stages} needs at least {settings.stages} homotopy steps, and "
                         f"homotopy_fraction {settings.homotopy_fraction} of max_steps {args.max_steps} gives {steps}; "
                         "accepted: more steps, a larger homotopy_fraction or fewer stages.")


def _base_of(model) -> str:
    """The base's name or folder (protected from being written over)."""
    return model if isinstance(model, str) else str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")


def _generate(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    if tokenizer is None:
        return ""
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _nll(model, held_out: torch.Tensor) -> dict:
    """The held-out NLL (token mean) and each window's (the per-domain figures pair them)."""
    result = perplexity(model, held_out)
    return {"nll": result["nll"], "window_nll": result["window_nll"]}


def domain_summary(runs: list[dict], unpatched_windows: list[float], domains: dict[str, int], bootstrap: int = 2000,
                   seed: int = 0) -> dict:
    """Per held-out domain and seed: the NLL of the unpatched model, of the untrained patch and of the
    healed model, and each patched one's difference from the unpatched model over the same windows
    with its 95 % paired bootstrap interval (the domain's windows resampled). `domains`: name ->
    number of windows, in the order the windows were stacked."""
    if sum(domains.values()) != len(unpatched_windows) or any(len(r[s]["window_nll"]) != len(unpatched_windows)
                                                              for r in runs for s in ("untrained", "healed")):
        raise ValueError(f"domain_summary: the domains' windows {domains} do not add up to the {len(unpatched_windows)} "
                         "windows scored.")
    out = {}
    for name, window in domain_slices(domains).items():
        base = unpatched_windows[window]
        entry = {"windows": domains[name], "unpatched_nll": sum(base) / len(base), "runs": [
            {"seed": run["seed"], **{stage: paired_window_difference(run[stage]["window_nll"][window], base, bootstrap, seed)
                                     for stage in ("untrained", "healed")}} for run in runs]}
        entry["healed_delta_nll"] = sum(r["healed"]["delta_nll"] for r in entry["runs"]) / len(runs)
        entry["untrained_delta_nll"] = sum(r["untrained"]["delta_nll"] for r in entry["runs"]) / len(runs)
        out[name] = entry
    return out


def _run(first, tokenizer, tangent, seed, settings, lora, dataset, held_out, args, save_model, save_full_model,
         base_name, prompt, max_new_tokens, unpatched, provenance: str):
    model = copy.deepcopy(first)
    teacher = None
    if settings.method == "full":  # the weights move: the teacher is a frozen unpatched copy
        teacher = copy.deepcopy(first).eval().requires_grad_(False)
    patch(model, tangent)
    record = patch_record(model, base_model=base_name) if save_model and settings.method == "lora" else None
    untrained = {**_nll(model, held_out), "kl": held_out_kl(model, held_out, teacher=teacher),
                 "sample": _generate(model, tokenizer, prompt, max_new_tokens)}
    if settings.method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                                                 lora_dropout=0.0))
    run_dir = os.path.join(args.output_dir, "runs", f"seed{seed}")
    run_args = dataclasses.replace(args, output_dir=run_dir, seed=seed, data_seed=seed)
    homotopy = HomotopyCallback(round(settings.homotopy_fraction * run_args.max_steps), settings.schedule,
                                settings.stages)
    trainer = train(model, dataset, run_args, callbacks=[homotopy], trainer_class=heal_trainer_class(),
                    temperature=settings.temperature, lm_weight=settings.lm_weight, teacher=teacher)
    model.eval()
    healed = {**_nll(model, held_out), "kl": held_out_kl(model, held_out, teacher=teacher)}
    card = {"title": f"{tangent.update} patch, healed by distillation",
            "training": (f"hf-tangent heal ({settings.method}, KL at T={settings.temperature}, lm_weight "
                         f"{settings.lm_weight}, {settings.schedule} homotopy over {homotopy.steps} of "
                         f"{run_args.max_steps} steps), seed {seed}. {provenance}").strip(),
            "results": (f"Held-out NLL: unpatched {unpatched:.4f}, patch untrained {untrained['nll']:.4f} "
                        f"({untrained['nll'] - unpatched:+.4f}), healed {healed['nll']:.4f} "
                        f"({healed['nll'] - unpatched:+.4f}) nats/token.")}
    saved = {}
    if record is not None:  # LoRA: the patch and its adapters, unmerged, beside the untouched base
        record["patch"] = getattr(unwrap(model).config, CONFIG_KEY)  # the final lambda
        gates = {c.index: c.gate.detach().float().cpu() for c in tangent_layers(model) if c.gate is not None}
        saved["patch"] = str(write_patch_repo(os.path.join(run_dir, "patch"), record, gates, peft_model_of(model), card))
    if settings.method == "lora":
        model = model.merge_and_unload()
    healed["sample"] = _generate(model, tokenizer, prompt, max_new_tokens)
    curve = loss_curve(trainer)
    if save_full_model or (save_model and settings.method == "full"):  # full fine-tuning moved the base weights
        saved["model"] = os.path.join(run_dir, "model")
        save_hub_folder(model, saved["model"], tokenizer=tokenizer, card=card)
    final = get_homotopy(model)
    del model, trainer, teacher
    gc.collect()
    return {"seed": seed, "untrained": untrained, "healed": healed, "loss_curve": curve, "saved": saved or None,
            "homotopy": final if not isinstance(final, dict) else {str(i): v for i, v in final.items()}}


@validated({"max_new_tokens": at_least(1)})
@entry_point(patched_model="refused")
def heal(model: Model, tangent: TangentConfig, tokenizer: Tokenizer = None, *, text: Text = None, settings: HealSettings | None = None,
         lora: LoraSettings | None = None, seeds: list[int] = (0,), seq_len: int = 256, max_windows: int = 8,
         train_windows: int = 64, training_args: TangentTrainingArguments | None = None, dtype: DType = "float32",
         save_models: bool = False, save_full_models: bool = False, prompt: str = SAMPLE_PROMPT,
         max_new_tokens: int = 20) -> Report:
    """Patch `model` with `tangent` and heal it by distillation from its unpatched self, once per
    seed (each run a fresh copy); the `heal` report: held-out NLL and KL untrained vs healed, with
    the unpatched NLL as reference and a paired sign-flip test over seeds, pooled and per held-out
    domain (with paired bootstrap intervals over each domain's windows).

    Args:
        model: a model name or a loaded (unpatched) model; tangent: the patch to heal.
        text: a TextSource or documents; by default the offline mixed corpus (TextSource(corpus="mixed"):
            the Austen novels and Debian's English prose), `TextSource(corpus="austen")` for the novels
            only. With the offline corpus, evaluation is on every domain's held-out documents whatever
            trains; with text of your own, on its held-out part ("text").
        seq_len, max_windows: held-out windows of seq_len tokens, max_windows per held-out domain;
            train_windows: training windows in all, shared equally by the training domains.
        settings: method (lora / full), loss (temperature, lm_weight) and homotopy.
        seeds: one run per seed
        training_args: Trainer settings; run k writes to output_dir/runs/seed<k>.
        save_models: write every healed model's patch: with LoRA a patch repo (the patch and the adapters,
            unmerged, runs/seed<k>/patch); with full fine-tuning, whose weights moved, the complete folder
            (runs/seed<k>/model). Its card states the measured NLL.
        save_full_models: also write every healed model as a complete folder (LoRA merged, remote code) in
            runs/seed<k>/model
        prompt: prompt of the generated sample before / after
    """
    if not isinstance(tangent, TangentConfig):
        raise TypeError(f"heal expects a TangentConfig to heal, got {type(tangent).__name__}.")
    settings = settings or HealSettings()
    lora = lora or LoraSettings()
    args = training_args or HealTrainingArguments()
    text = TextSource.of(text).with_default_corpus("mixed")
    base_name = model if isinstance(model, str) else None  # what a patch repo records as its base
    claim_run_folder(args.output_dir, writer="hf_tangent.heal(training_args.output_dir=)",
                     inputs=run_inputs(model, text, args))
    for seed in seeds:  # every folder a run will write, checked before any work
        run_dir = os.path.join(args.output_dir, "runs", f"seed{seed}")
        if save_models and settings.method == "lora":
            check_destination(os.path.join(run_dir, "patch"), protected=[_base_of(model)], writer="hf_tangent.heal")
        if save_full_models or (save_models and settings.method == "full"):
            check_destination(os.path.join(run_dir, "model"), protected=[_base_of(model)], writer="hf_tangent.heal")
    check_domain_shares(text, train_windows)
    first, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype)
    refuse_patched(first, "heal")  # a saved patched folder, loaded by name
    _check_schedule(settings, tangent, args, len(decoder_layers(first)))
    read = {}  # the text as read, for the report's provenance
    held_out_domains, train_domains = text_windows(first, tokenizer, text, seq_len, max_windows, train_windows,
                                                   every_domain=True, read=read)
    provenance = {"versions": versions(), "weights": scored_weights(first),  # the model every run starts from
                  "text_provenance": text.provenance(read=read)}
    held_out, dataset = stacked(held_out_domains), lm_dataset(stacked(train_domains))
    clock = Clock()
    unpatched_windows = _nll(first, held_out)
    unpatched = unpatched_windows["nll"]
    with RunFolder(args.output_dir, writer="hf_tangent.heal",
                   active=args.process_index == 0):  # runs/seed<k>: checkpoints, saved models
        runs = [_run(first, tokenizer, tangent, seed, settings, lora, dataset, held_out, args, save_models,
                     save_full_models, base_name, prompt, max_new_tokens, unpatched, provenance_line(provenance))
                for seed in seeds]
    gains = [r["healed"]["nll"] - r["untrained"]["nll"] for r in runs]
    domains = domain_summary(runs, unpatched_windows["window_nll"], {n: len(w) for n, w in held_out_domains.items()},
                             seed=args.seed)
    return Report("heal", {
        "command": "heal", "model": name, "patch": tangent.to_dict(), "settings": dataclasses.asdict(settings),
        "seeds": list(seeds), "text": text.describe(training=True, every_domain=True), "seq_len": seq_len, "eval_windows": len(held_out),
        "train_windows": len(dataset), "corpus": text.corpus,
        "train_domains": {n: len(w) for n, w in train_domains.items()},
        "training": training_summary(args) | {
            "lora": {"r": lora.r, "alpha": lora.alpha, "targets": list(lora.targets)} if settings.method == "lora" else None},
        "unpatched_nll": unpatched, "prompt": prompt,
        "summary": {
            "untrained_delta_nll": sum(r["untrained"]["nll"] for r in runs) / len(runs) - unpatched,
            "healed_delta_nll": sum(r["healed"]["nll"] for r in runs) / len(runs) - unpatched,
            "untrained_kl": sum(r["untrained"]["kl"] for r in runs) / len(runs),
            "healed_kl": sum(r["healed"]["kl"] for r in runs) / len(runs),
            "p_value": paired_permutation_test(gains) if len(runs) > 1 else None},
        "domains": domains,
        "runs": runs, "seconds": clock.seconds,
        **environment(args.device.type, dtype, args.seed), **provenance,
    })


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

def heal_markdown(report: dict) -> str:
    t, st, s = report["training"], report["settings"], report["summary"]
    lines = [
        f"# hf-tangent heal: {report['model']} ({report['patch']['update']}, {st['method']})",
        "",
        f"Distillation from the unpatched model: KL at T={st['temperature']}, LM weight {st['lm_weight']}, "
        f"{st['schedule']} homotopy over {st['homotopy_fraction']:.0%} of {t['max_steps']} steps"
        f"{'' if st.get('stages', 1) == 1 else ', progressive in ' + str(st['stages']) + ' layer groups'} (AdamW, lr "
        f"{t['learning_rate']}, {t['lr_scheduler']}); seeds {report['seeds']}; {report['train_windows']} training and "
        f"{report['eval_windows']} held-out windows of {report['seq_len']} tokens; {report['seconds']} s.",
        "",
        f"Unpatched held-out NLL {report['unpatched_nll']:.4f}.",
        "",
        "| seed | delta NLL untrained | delta NLL healed | KL untrained | KL healed |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        lines.append(f"| {r['seed']} | {r['untrained']['nll'] - report['unpatched_nll']:+.4f} | "
                     f"{r['healed']['nll'] - report['unpatched_nll']:+.4f} | {r['untrained']['kl']:.4f} | {r['healed']['kl']:.4f} |")
    p = "" if s["p_value"] is None else f" (paired sign-flip p = {s['p_value']:.3f})"
    lines += [f"| mean | {s['untrained_delta_nll']:+.4f} | {s['healed_delta_nll']:+.4f}{p} | {s['untrained_kl']:.4f} | "
              f"{s['healed_kl']:.4f} |", "", f"Sample (greedy, seed {report['runs'][0]['seed']}), prompt: "
              f"\"{report['prompt']}\"", "",
              f"- untrained patch: \"{report['runs'][0]['untrained']['sample']}\"",
              f"- healed: \"{report['runs'][0]['healed']['sample']}\""]
    if report.get("domains"):  # reports before the per-domain evaluation have the pooled figures only
        lines += ["", "Per held-out domain (the table above pools them): NLL of the unpatched model, and the patched "
                  "model's difference from it over the same windows with a 95% paired bootstrap interval (the "
                  f"domain's windows of {report['seq_len']} tokens resampled)"
                  + (f"; trained on {', '.join(f'{n} {k}' for n, k in report['train_domains'].items())} windows."
                     if report.get("train_domains") else "."), "",
                  "| held-out domain | windows | unpatched NLL | seed | delta NLL untrained [95% CI] | delta NLL healed [95% CI] |",
                  "|---|---:|---:|---|---:|---:|"]
        for name, d in report["domains"].items():
            for r in d["runs"]:
                u, h = r["untrained"], r["healed"]
                lines.append(f"| {name} | {d['windows']} | {d['unpatched_nll']:.4f} | {r['seed']} | "
                             f"{interval(u)} | {interval(h)} |")
    lines += ["", "![heal loss](loss_curves.png)"]
    return "\n".join(lines) + "\n"


def _plot_heal(data, folder):
    curves = {"KL (heal)": [[tuple(p) for p in run["loss_curve"]] for run in data["runs"]]}
    return [plots.loss_curves(curves, os.path.join(folder, "loss_curves.png"),
                              title=f"heal {data['patch']['update']}, {data['model']}")]


register_report('heal', heal_markdown, _plot_heal)
