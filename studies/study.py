"""From-scratch studies: small GPT-2 / GPT-NeoX models trained with the update rules (`python -m studies study`).

    tangential  unpatched vs hard projection vs soft 0.5 vs norm-preserving  (math.md section 1)
    retraction  Euclidean residual vs retraction at p in {1, 2, 4, 8, inf}    (section 2)
    noise       tangent Brownian noise at gamma in {1e-3, 3e-3, 1e-2, 3e-2} vs residual dropout and
                isotropic Gaussian noise at the same expected noise energy, off at evaluation (section 3)

Every variant of a study starts from the same initial weights (seeded), sees the same batches in
the same order for the same number of steps with the same optimizer; the patches add no
parameters, so parameter counts and FLOPs match up to the update rule's few elementwise ops.
From-scratch residuals are small at initialisation, so the studies use eps_mode="relative".
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from hf_tangent.analysis.diagnostics import diagnose
from hf_tangent.analysis.evaluation import perplexity
from hf_tangent.core.config import TangentConfig
from hf_tangent.core.patching import patch
from hf_tangent.experiments.common import versions
from hf_tangent.experiments.plots import _pyplot
from hf_tangent.experiments.report import Report, register_report
from hf_tangent.experiments.runs import RunFolder, claim_run_folder
from hf_tangent.ranges import ProgressBar, Range, at_least, check_values, plain, validated
from hf_tangent.training.data import documents_digest, load_documents, pack_windows
from hf_tangent.training.trainer import ObserveCallback, lm_dataset, loss_curve, train, training_arguments

from .verdicts import summarize, verdict, verdict_outcome

STUDIES = {
    "tangential": {
        "unpatched": None,
        "projected": dict(update="projected"),
        "soft beta=0.5": dict(update="soft", beta=0.5),
        "norm_preserving": dict(update="norm_preserving"),
    },
    "retraction": {
        "euclidean": None,
        **{f"retract p={name}": dict(update="retract", p=p) for name, p in
           (("1", 1.0), ("2", 2.0), ("4", 4.0), ("8", 8.0), ("inf", math.inf))},
    },
    "noise": {
        "none": None,
        **{f"tangent gamma={g:g}": dict(update="tangent_noise", gamma=g) for g in (1e-3, 3e-3, 1e-2, 3e-2)},
        "dropout (energy of gamma=1e-2)": dict(update="residual_dropout", gamma=1e-2),
        "gaussian (energy of gamma=1e-2)": dict(update="gaussian_noise", gamma=1e-2),
    },
}
SCALES = {
    "smoke": dict(n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8, max_steps=12, eval_every=6,
                  vocab_size=300, train_windows=96, val_windows=8, seeds=(0, 1), learning_rate=3e-3),
    "cpu": dict(n_layer=6, n_head=8, d_model=128, seq_len=128, batch_size=16, max_steps=300, eval_every=50,
                vocab_size=2048, train_windows=2400, val_windows=32, seeds=(0, 1, 2), learning_rate=1e-3),
    "paper": dict(n_layer=6, n_head=8, d_model=512, seq_len=256, batch_size=32, max_steps=5000, eval_every=250,
                  vocab_size=None, train_windows=160_000, val_windows=256, seeds=(0, 1, 2), learning_rate=6e-4,
                  dataset="wikitext-103"),
}
ARCHS = ("gpt2", "gpt_neox")
FP16_MAX = 65504.0


def check_request(study: str, scale: str, variants=None, arch: str = "gpt2") -> list[str]:
    for what, value, accepted in (("study", study, STUDIES), ("scale", scale, SCALES), ("architecture", arch, ARCHS)):
        if not isinstance(value, str) or value not in accepted:  # (a recipe's `study: [a]` is no name)
            raise ValueError(f"unknown {what} {value!r}; accepted: {', '.join(accepted)}.")
    names = list(STUDIES[study]) if not variants else list(variants)
    unknown = [v for v in names if v not in STUDIES[study]]
    if unknown:
        raise ValueError(f"unknown variants {unknown} for study {study!r}; accepted: {', '.join(STUDIES[study])}.")
    baseline = next(iter(STUDIES[study]))
    return [baseline, *[v for v in names if v != baseline]]


def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on the calibration documents (never on validation text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def model_config(arch: str, scale: dict, vocab_size: int):
    from transformers import GPT2Config, GPTNeoXConfig

    d, layers, heads = scale["d_model"], scale["n_layer"], scale["n_head"]
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=d, n_layer=layers, n_head=heads, n_positions=scale["seq_len"],
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPTNeoXConfig(vocab_size=vocab_size, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * d, max_position_embeddings=scale["seq_len"], use_parallel_residual=True)


def direction_statistics(states: torch.Tensor, clusters: int = 8, iterations: int = 10) -> dict:
    """Token directions (n, d): pairwise cosines, anti-polar fraction (cos < -0.9), spherical k-means
    clusters holding >= 5% of tokens, and the entropy of the cosine (Gram) spectrum."""
    u = torch.nn.functional.normalize(states.double(), dim=-1)
    cos = u @ u.T
    off = cos[~torch.eye(len(u), dtype=torch.bool)]
    eig = torch.linalg.eigvalsh(cos).clamp_min(0)
    prob = eig / eig.sum()
    entropy = -(prob[prob > 0] * prob[prob > 0].log()).sum().item()
    g = torch.Generator().manual_seed(0)
    centers = u[torch.randperm(len(u), generator=g)[:clusters]]
    for _ in range(iterations):
        assign = (u @ centers.T).argmax(-1)
        for k in range(len(centers)):
            members = u[assign == k]
            if len(members):
                centers[k] = torch.nn.functional.normalize(members.sum(0), dim=0)
    counts = torch.bincount((u @ centers.T).argmax(-1), minlength=len(centers))
    return {"cos_mean": off.mean().item(), "cos_std": off.std().item(), "antipolar_fraction": (off < -0.9).float().mean().item(),
            "kmeans_clusters": int((counts >= 0.05 * len(u)).sum()), "spectrum_entropy": entropy}


def _observe(model, val_windows, batch_size: int) -> dict:
    """Validation loss and the training diagnostics at one step (model left in its mode)."""
    was_training = model.training
    model.eval()
    loss = perplexity(model, val_windows, batch_size=batch_size)["nll"]
    sample = val_windows[: min(4, len(val_windows))]
    records = diagnose(model, sample, batch_size=batch_size)
    with torch.no_grad():
        hidden = model(sample.to(next(model.parameters()).device), output_hidden_states=True).hidden_states
    values = torch.cat([h.float().reshape(-1) for h in hidden[1:]])
    overflow = ((values.abs() > FP16_MAX) | ~torch.isfinite(values)).float().mean().item()
    model.train(was_training)
    out = {"val_loss": loss,
           "orthogonality_error": statistics.fmean(r["orthogonality_error"]["mean"] for r in records),
           "norm_growth": records[-1]["norm_out"]["mean"] / records[0]["norm_x"]["mean"],
           "diversity_after_ffn": records[-1]["diversity_after_ffn"]["mean"],
           "overflow_fraction": overflow}
    out |= direction_statistics(hidden[-1][0].float())
    return out


def run_variant(study: str, variant: str, seed: int, scale: dict, arch: str, tokenizer, train_windows, val_windows,
                output_dir: str, branches=("ffn",), device: str = "cpu") -> dict:
    """One seeded from-scratch run: the recipes' Trainer setup, with the validation loss and the
    diagnostics observed every `eval_every` steps (and at steps 0 and the last)."""
    from transformers import AutoModelForCausalLM

    settings = STUDIES[study][variant]
    torch.manual_seed(seed)  # the same initial weights for every variant of this seed
    model = AutoModelForCausalLM.from_config(model_config(arch, scale, len(tokenizer))).to(device)
    config = None
    if settings is not None:
        config = TangentConfig(**settings, eps_mode="relative", branches=tuple(branches))
        patch(model, config)
    args = training_arguments(os.path.join(output_dir, "runs", f"{variant.replace(' ', '_')}-seed{seed}"),
                              max_steps=scale["max_steps"], learning_rate=scale["learning_rate"],
                              batch_size=scale["batch_size"], seed=seed, device=device, lr_scheduler="cosine",
                              warmup_steps=max(1, scale["max_steps"] // 20), weight_decay=0.1)
    observer = ObserveCallback(lambda m: _observe(m, val_windows, 4), every=scale["eval_every"])
    trainer = train(model, lm_dataset(train_windows), args, callbacks=[observer])
    history = observer.history
    grad_norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    return {"variant": variant, "seed": seed, "final_val_loss": history[-1]["val_loss"], "history": history,
            "train_loss": loss_curve(trainer), "grad_norm_mean": statistics.fmean(grad_norms) if grad_norms else None,
            "grad_norm_variance": statistics.pvariance(grad_norms) if len(grad_norms) > 1 else None,
            "config": None if config is None else config.to_dict()}


# the budget overrides and their ranges (`python -m studies study --max-steps ...` and run_study(overrides=...))
BUDGET_RANGES = {"max_steps": at_least(1), "eval_every": at_least(1), "learning_rate": Range(0, open_low=True),
                 "batch_size": at_least(1), "seq_len": at_least(2), "train_windows": at_least(1),
                 "val_windows": at_least(1)}


def resolve_scale(scale_name: str, overrides: dict | None = None) -> dict:
    """The scale's settings with the user's budget overrides (only keys of BUDGET_RANGES, in their ranges)."""
    scale = dict(SCALES[scale_name])
    for key, value in (overrides or {}).items():
        if key not in BUDGET_RANGES:
            raise ValueError(f"unknown study setting {key!r}; accepted: {', '.join(BUDGET_RANGES)}.")
        if value is None:
            continue
        check_values(BUDGET_RANGES, **{key: value})  # a number of the key's type: never a list or a string
        scale[key] = plain(value, float)
    return scale


@validated()
def run_study(study: str, scale_name: str = "smoke", *, arch: str = "gpt2", variants: list[str] | None = None,
              seeds: list[int] | None = None, branches: list[str] = ("ffn",),
              output_dir: str | os.PathLike = "runs/study", device: str = "cpu", progress: ProgressBar | None = None,
              overrides: dict | None = None, train_docs: list[str] | None = None, val_docs: list[str] | None = None,
              data: str | None = None) -> Report:
    """Train every variant of `study` for every seed and compare them paired by seed (the `study` report).

    Args:
        study: tangential, retraction or noise; scale_name: smoke, cpu or paper (model size and budget).
        arch: gpt2 or gpt_neox; variants: a subset (the baseline always runs); seeds: default the scale's.
        branches: ("ffn",) or ("ffn", "attention"); overrides: budget keys of BUDGET_RANGES (each a number of
            its key's type and range, None: the scale's value).
        progress: a progress bar updated once per finished run (tqdm), or None.
        train_docs, val_docs: documents that replace the scale's text (both or neither); data: their name.
    The tokenizer is a byte-level BPE of the scale's vocabulary size trained on the training
    documents only, or GPT-2's where the scale has no vocabulary size (the `paper` scale)."""
    names = check_request(study, scale_name, variants, arch)
    claim_run_folder(output_dir, writer="studies.run_study(output_dir=)")
    scale = resolve_scale(scale_name, overrides)
    seeds = list(seeds or scale["seeds"])
    if (train_docs is None) != (val_docs is None):
        raise ValueError("pass both training and validation documents, or neither.")
    start = time.time()
    if train_docs is None and scale.get("dataset"):
        train_docs = load_documents(dataset=scale["dataset"], dataset_split="train")
        val_docs = load_documents(dataset=scale["dataset"], dataset_split="validation")
        data = data or f"{scale['dataset']} (train / validation)"
    elif train_docs is None:
        train_docs, val_docs = load_documents(split="calibration"), load_documents(split="evaluation")
        data = data or "Austen: calibration novels / held-out novels (Emma, Mansfield Park)"
    if scale.get("vocab_size"):
        tokenizer = train_tokenizer(train_docs, scale["vocab_size"])
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained("gpt2")
    train_windows = pack_windows(tokenizer, train_docs, scale["seq_len"], scale["train_windows"])
    val_windows = pack_windows(tokenizer, val_docs, scale["seq_len"], scale["val_windows"])
    runs = []
    with RunFolder(output_dir, writer="studies.run_study"):  # runs/<variant>-seed<k>: the Trainer's folders
        for seed in seeds:
            for variant in names:
                runs.append(run_variant(study, variant, seed, scale, arch, tokenizer, train_windows, val_windows,
                                        output_dir, branches, device))
                if progress is not None:
                    progress.update(1)
    summary = summarize(runs, names[0])
    return Report("study", {
        "study": study, "scale": scale_name, "arch": arch, "branches": list(branches), "settings": scale,
        "seeds": seeds, "variants": names, "runs": runs, "summary": summary, "verdict": verdict(study, summary, runs),
        "seconds": round(time.time() - start, 1), "threads": torch.get_num_threads(),
        "train_windows": len(train_windows), "val_windows": len(val_windows), "data": data or "user documents",
        "versions": versions(), "text_provenance": {"training": documents_digest({"train": list(train_docs)}),
                                                    "evaluation": documents_digest({"validation": list(val_docs)})}})


def merge_reports(reports: list[dict]) -> dict:
    """One report from several runs of the same study and settings with different seeds (more seeds
    added later); a (variant, seed) run twice is an error, not silently kept twice."""
    first = reports[0]
    same = ("study", "scale", "arch", "branches", "settings", "train_windows", "val_windows")
    for other in reports[1:]:
        differ = [k for k in same if json.dumps(other.get(k), default=str) != json.dumps(first.get(k), default=str)]
        if differ:
            raise ValueError(f"cannot merge study reports that differ in {differ}; merge only more seeds of one setting.")
    seen, runs = set(), []
    for report in reports:
        for run in report["runs"]:
            if (run["variant"], run["seed"]) in seen:
                raise ValueError(f"{run['variant']!r} seed {run['seed']} is in more than one report.")
            seen.add((run["variant"], run["seed"]))
            runs.append(run)
    order = list(STUDIES[first["study"]])
    variants = sorted({v for r in reports for v in r["variants"]}, key=order.index)
    runs.sort(key=lambda r: (r["seed"], variants.index(r["variant"])))
    summary = summarize(runs, variants[0])  # recomputed from all runs: never the first report's
    return first | {"runs": runs, "variants": variants, "seeds": sorted({r["seed"] for r in runs}),
                    "summary": summary, "verdict": verdict(first["study"], summary, runs),
                    "seconds": round(sum(r["seconds"] for r in reports), 1),
                    "merged_reports": sum(r.get("merged_reports", 1) for r in reports)}


def write_study_page(reports: list[tuple[str, dict]], page: Path) -> Path:
    """The results page from (path, report) pairs: reports of one study / arch / branches are merged
    by seed, and each merged report (JSON and plots) is kept in results/studies/<name>/ next to the
    page, so the page regenerates from there alone."""
    text = ["# From-scratch studies: results", "",
            "Generated by `python -m studies study-report` from the report.json files of `python -m studies study` runs;",
            "every number and plot comes from those files, kept next to this page in `results/studies/`. To regenerate:",
            f"`python -m studies study-report {(page.parent / 'results' / 'studies').as_posix()}/*/report.json --output {page}`.", "",
            "Overview. The hypothesis \"held\": the means point its way and every paired p <= 0.05; \"held in the",
            "mean only\": the means do and every seed agrees, too few seeds for p <= 0.05; \"inconclusive\": the means",
            "do but a seed disagrees; otherwise \"did not hold\" ([studies-guide.md](studies-guide.md)).", "",
            *OVERVIEW_HEADER]
    groups: dict[str, list] = {}
    for path, report in reports:
        for key in ("study", "scale", "arch", "branches", "runs", "summary", "settings"):
            if key not in report:
                raise ValueError(f"{path} is not a `python -m studies study` report (no {key!r}).")
        groups.setdefault(f"{report['study']}-{report['arch']}-{'+'.join(report['branches'])}", []).append((path, report))
    sections = []
    for name, members in groups.items():
        report = merge_reports([r for _, r in members])
        folder = page.parent / "results" / "studies" / name
        folder.mkdir(parents=True, exist_ok=True)
        report.pop("plots", None)
        (folder / "report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
        files = study_plots(report, str(folder))
        rel = folder.relative_to(page.parent).as_posix()
        text.append(overview_row(report))
        sections.append(study_markdown(report | {"plots": {title: f"{rel}/{file}" for title, file in files.items()}}))
    page.write_text("\n".join([*text, "", *sections]), encoding="utf-8")
    return page


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

DIAGNOSTIC_PANELS = {
    "orthogonality_error": "orthogonality error |cos(x, added update)|",
    "norm_growth": "residual norm drift (last out / first in)",
    "diversity_after_ffn": "angular diversity 1-|mean u|^2 (last block)",
    "overflow_fraction": "fp16 overflow / non-finite fraction",
    "antipolar_fraction": "anti-polar pairs (cos < -0.9)",
    "cos_mean": "pairwise cosine mean",
    "cos_std": "pairwise cosine sd",
    "kmeans_clusters": "spherical k-means clusters (>= 5%)",
    "spectrum_entropy": "cosine-spectrum entropy",
}


def study_plots(report: dict, folder: str) -> dict:
    """Validation loss and diagnostics over training (seed bands) as PNGs in folder; title -> file name."""
    os.makedirs(folder, exist_ok=True)
    label = f"{report['study']} ({report['scale']}, {report['arch']}, branches {'+'.join(report['branches'])})"
    files = {"validation loss": f"{report['study']}_val_loss.png", "diagnostics": f"{report['study']}_diagnostics.png"}
    # paired with the baseline of the same seed at the same step: the seed-to-seed spread cancels
    baseline = {(r["seed"], h["step"]): h["val_loss"] for r in report["runs"] if r["variant"] == report["variants"][0]
                for h in r["history"]}
    runs = [r | {"history": [h | {"delta": h["val_loss"] - baseline[(r["seed"], h["step"])]} for h in r["history"]
                             if (r["seed"], h["step"]) in baseline]} for r in report["runs"]]
    study_curves(runs, {"val_loss": "validation loss (nats/token)",
                              "delta": f"validation loss - {report['variants'][0]} (same seed)"},
                       os.path.join(folder, files["validation loss"]), f"{label}: seed mean, min..max band")
    study_curves(report["runs"], DIAGNOSTIC_PANELS, os.path.join(folder, files["diagnostics"]),
                       f"{label}: diagnostics over training", log_keys=("orthogonality_error",))
    return files


OVERVIEW_HEADER = ["| study | arch | branches | best variant (mean final val loss) | delta vs baseline | p | "
                   "hypothesis | wall time |", "|---|---|---|---|---:|---:|---|---:|"]


def overview_row(report: dict) -> str:
    """One line of the results page's overview table for one study report."""
    summary = summarize(report["runs"], report["variants"][0])
    best = min(summary, key=lambda r: r["final_val_loss_mean"])
    outcome, _ = verdict_outcome(report["study"], summary, report["runs"])
    p = "" if math.isnan(best["p_value"]) else f"{best['p_value']:.3f}"
    return (f"| {report['study']} | {report['arch']} | {'+'.join(report['branches'])} | {best['variant']} "
            f"({best['final_val_loss_mean']:.4f}) | {best['delta_mean']:+.4f} | {p} | {outcome} | "
            f"{report['seconds'] / 60:.1f} min |")


def study_markdown(report: dict) -> str:
    s = report["settings"]
    where = f" ({report['threads']} CPU threads, device {report.get('device', 'cpu')})" if "threads" in report else ""
    lines = [f"## Study `{report['study']}` ({report['scale']} scale, {report['arch']}, branches {report['branches']})", "",
             f"{s['n_layer']} layers, {s['n_head']} heads, d={s['d_model']}, {s['max_steps']} steps of "
             f"{s['batch_size']} x {s['seq_len']} tokens (AdamW, lr {s['learning_rate']:g}, cosine), seeds "
             f"{report['seeds']}; {report['train_windows']} training and {report['val_windows']} validation windows of "
             f"{report.get('data', 'Austen: calibration novels / held-out novels')}; wall time "
             f"{report['seconds']:.0f} s{where}" + (f", over {report['merged_reports']} runs of the command merged by seed"
                                                       if report.get("merged_reports", 1) > 1 else "") + ".", "",
             "| variant | final val loss (mean +- sd) | delta vs baseline | p (paired permutation) |",
             "|---|---:|---:|---:|"]
    summary = summarize(report["runs"], report["variants"][0])  # recomputed: the page follows the runs
    for r in summary:
        p = "" if math.isnan(r["p_value"]) else f"{r['p_value']:.3f}"
        lines.append(f"| {r['variant']} | {r['final_val_loss_mean']:.4f} +- {r['final_val_loss_sd']:.4f} | "
                     f"{r['delta_mean']:+.4f} | {p} |")
    last = {}
    for run in report["runs"]:
        last.setdefault(run["variant"], []).append(run["history"][-1])
    lines += ["", "Diagnostics at the last step (mean over seeds):", "",
              "| variant | orth. error | norm growth | diversity | fp16 overflow | anti-polar | k-means clusters | grad-norm var |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, hist in last.items():
        var = [r["grad_norm_variance"] for r in report["runs"] if r["variant"] == variant and r["grad_norm_variance"] is not None]
        def mean(key, hist=hist):
            return statistics.fmean(h[key] for h in hist)

        lines.append(f"| {variant} | {mean('orthogonality_error'):.2e} | {mean('norm_growth'):.3f} | "
                     f"{mean('diversity_after_ffn'):.3f} | {mean('overflow_fraction'):.2e} | {mean('antipolar_fraction'):.3f} | "
                     f"{mean('kmeans_clusters'):.1f} | {statistics.fmean(var) if var else float('nan'):.3g} |")
    plots = report.get("plots", {"validation loss": f"{report['study']}_val_loss.png"})
    lines += ["", f"**Verdict.** {verdict(report['study'], summary, report['runs'])}", ""]
    lines += [f"![{title}]({path})" for title, path in plots.items()]
    return "\n".join(lines) + "\n"


def study_curves(runs: list[dict], keys: dict[str, str], path: str, title: str, log_keys=()) -> str:
    """One panel per logged quantity over training steps: per variant the seed mean with a min..max
    band. runs: study runs (variant, history); keys: history key -> panel label."""
    plt = _pyplot()
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    width, height = (3.6, 2.9) if len(keys) > 2 else (5.5, 4.0)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    colors = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    for ax, (key, label) in zip(axes.flat, keys.items(), strict=False):
        floor = 1e-12 if key in log_keys else -math.inf  # log panels: exact zeros drawn at 1e-12
        for variant in variants:
            histories = [r["history"] for r in runs if r["variant"] == variant]
            steps = sorted({h["step"] for hist in histories for h in hist})
            values = [[max(h[key], floor) for hist in histories for h in hist if h["step"] == s and h.get(key) is not None]
                      for s in steps]
            kept = [(s, v) for s, v in zip(steps, values, strict=True) if v]
            if not kept:
                continue
            xs = [s for s, _ in kept]
            ax.plot(xs, [sum(v) / len(v) for _, v in kept], color=colors[variant], label=variant, lw=1.2)
            if len(histories) > 1:
                ax.fill_between(xs, [min(v) for _, v in kept], [max(v) for _, v in kept], color=colors[variant], alpha=0.15)
        if key in log_keys:
            ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(title, fontsize=10)
    legend_rows = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, min(0.3, 0.035 * legend_rows * 2.9 * 3 / (height * rows)), 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_study(data, folder):
    return [os.path.join(folder, name) for name in study_plots(data, folder).values()]


register_report('study', study_markdown, _plot_study)
