"""From-scratch studies: small GPT-2 / GPT-NeoX models trained with the update rules.

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

import torch

from .config import TangentConfig
from .diagnostics import diagnose
from .evaluation import perplexity
from .training import lm_dataset, paired_permutation_test, training_arguments

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
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}; accepted: {', '.join(STUDIES)}.")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; accepted: {', '.join(SCALES)}.")
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; accepted: {', '.join(ARCHS)}.")
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
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, default_data_collator

    from .patching import patch

    settings = STUDIES[study][variant]
    torch.manual_seed(seed)  # the same initial weights for every variant of this seed
    model = AutoModelForCausalLM.from_config(model_config(arch, scale, len(tokenizer))).to(device)
    config = None
    if settings is not None:
        config = TangentConfig(**settings, eps_mode="relative", branches=tuple(branches))
        patch(model, config)
    history = []
    every = scale["eval_every"]

    class Observe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0 or state.global_step == scale["max_steps"]:
                history.append({"step": state.global_step, **_observe(model, val_windows, 4)})

    args = training_arguments(os.path.join(output_dir, "runs", f"{variant.replace(' ', '_')}-seed{seed}"),
                              max_steps=scale["max_steps"], learning_rate=scale["learning_rate"],
                              batch_size=scale["batch_size"], seed=seed, device=device, lr_scheduler="cosine",
                              warmup_steps=max(1, scale["max_steps"] // 20), weight_decay=0.1)
    history.append({"step": 0, **_observe(model, val_windows, 4)})
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(train_windows), data_collator=default_data_collator,
                      callbacks=[Observe()])
    trainer.train()
    grad_norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    train_losses = [(row["step"], row["loss"]) for row in trainer.state.log_history if "loss" in row]
    return {"variant": variant, "seed": seed, "final_val_loss": history[-1]["val_loss"], "history": history,
            "train_loss": train_losses, "grad_norm_mean": statistics.fmean(grad_norms) if grad_norms else None,
            "grad_norm_variance": statistics.pvariance(grad_norms) if len(grad_norms) > 1 else None,
            "config": None if config is None else config.to_dict()}


def summarize(runs: list[dict], baseline: str) -> list[dict]:
    by = {(r["variant"], r["seed"]): r for r in runs}
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    rows = []
    for v in variants:
        seeds = sorted(s for (name, s) in by if name == v)
        losses = [by[(v, s)]["final_val_loss"] for s in seeds]
        deltas = paired_deltas(runs, v, baseline)
        rows.append({"variant": v, "seeds": len(seeds), "final_val_loss_mean": statistics.fmean(losses),
                     "final_val_loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                     "delta_mean": statistics.fmean(deltas) if deltas else float("nan"),
                     "p_value": paired_permutation_test(deltas) if v != baseline else float("nan")})
    return rows


def paired_deltas(runs: list[dict], a: str, b: str) -> list[float]:
    """Final loss(a) - final loss(b) per seed both were run with, in seed order."""
    by = {(r["variant"], r["seed"]): r["final_val_loss"] for r in runs}
    return [by[(a, s)] - by[(b, s)] for s in sorted(s for (v, s) in by if v == a) if (b, s) in by]


def paired(runs: list[dict], a: str, b: str) -> tuple[float, float]:
    """Mean over shared seeds of final loss(a) - final loss(b), and its paired permutation p-value."""
    deltas = paired_deltas(runs, a, b)
    return (statistics.fmean(deltas), paired_permutation_test(deltas)) if deltas else (float("nan"), float("nan"))


def _outcome(direction: bool, p_values: list[float], floor: float) -> str:
    """'held': the means point the hypothesis' way and every paired p <= 0.05; 'held in the mean only':
    the means do and every seed agrees (p at its floor 2/2^n), too few seeds for more; 'inconclusive':
    the means do but some seed disagrees; otherwise 'did not hold'."""
    if not direction:
        return "did not hold"
    if p_values and all(p <= 0.05 for p in p_values):
        return "held"
    if p_values and all(p <= floor * (1 + 1e-9) for p in p_values):
        return "held in the mean only"
    return "inconclusive"


def _said(outcome: str) -> str:
    return "was inconclusive" if outcome == "inconclusive" else outcome


def verdict_outcome(study: str, summary: list[dict], runs: list[dict] | None = None) -> tuple[str, str]:
    """(outcome, sentence) per study, from the numbers, with the confidence the seeds allow; with the
    runs, also the paired comparisons of the best variant against the other contenders."""
    base, others = summary[0], summary[1:]
    n = base["seeds"]
    floor = 2 / 2**n
    reach = f"with {n} seeds the smallest reachable p-value is {floor:.3f}"
    if study == "retraction":
        best = min(summary, key=lambda r: r["final_val_loss_mean"])
        finite = best["variant"] not in ("euclidean", "retract p=inf")
        against, p_values = "", []
        if best is not base:
            against = f" (vs euclidean {best['delta_mean']:+.4f}, p = {best['p_value']:.3f}"
            p_values.append(best["p_value"])
            if runs and finite and any(r["variant"] == "retract p=inf" for r in runs):
                delta, p = paired(runs, best["variant"], "retract p=inf")
                against += f"; vs retract p=inf {delta:+.4f}, p = {p:.3f}"
                p_values.append(p)
            against += ")"
        outcome = _outcome(finite, p_values, floor)
        family = [r for r in summary if r["variant"].startswith("retract")]
        within = ""
        if family:  # where the optimum over p sits among the retraction variants alone
            top = min(family, key=lambda r: r["final_val_loss_mean"])
            place = ("at the small-p end of the range tried" if top is family[0] else "at p = inf" if top is family[-1]
                     else "inside the range tried")
            within = (f" Among the retraction variants alone the best is {top['variant']} "
                      f"({top['final_val_loss_mean']:.4f}, {place}; " +
                      ", ".join(f"{r['variant'].split()[-1]}: {r['final_val_loss_mean']:.4f}" for r in family) + ").")
        return outcome, (f"Best mean final validation loss: {best['variant']} ({best['final_val_loss_mean']:.4f}){against}."
                         f"{within} The hypothesis (best at a finite p) {_said(outcome)} on this data at this scale; {reach}.")
    if study == "noise":
        tangent = [r for r in others if r["variant"].startswith("tangent")]
        matched = {r["variant"]: r for r in others if not r["variant"].startswith("tangent")}
        if not tangent:
            return "not tested", "No tangent-noise variant was run."
        best = min(tangent, key=lambda r: r["final_val_loss_mean"])
        pairs = {k: paired(runs, best["variant"], k) for k in matched} if runs else {}
        comparison = ", ".join(f"{k}: {v['final_val_loss_mean']:.4f}" + (
            " (paired delta {:+.4f}, p = {:.3f})".format(*pairs[k]) if k in pairs else "") for k, v in matched.items())
        beats = all(best["final_val_loss_mean"] < v["final_val_loss_mean"] for v in matched.values()) and \
            best["final_val_loss_mean"] < base["final_val_loss_mean"]
        outcome = _outcome(beats, [best["p_value"], *(p for _, p in pairs.values())] if len(pairs) == len(matched) else [],
                           floor)
        return outcome, (f"Best tangent noise: {best['variant']} ({best['final_val_loss_mean']:.4f}, delta vs no noise "
                         f"{best['delta_mean']:+.4f}, p = {best['p_value']:.3f}); matched comparators: "
                         f"{comparison or 'not run'}. The hypothesis (tangent noise beats no noise and the matched "
                         f"comparators) {_said(outcome)} on this data at this scale; {reach}.")
    better = [r for r in others if r["delta_mean"] < 0]
    significant = [r for r in better if r["p_value"] <= 0.05]
    outcome = max((_outcome(True, [r["p_value"]], floor) for r in better), default="did not hold",
                  key=["did not hold", "inconclusive", "held in the mean only", "held"].index)
    return outcome, (f"Variants below the unpatched final validation loss: {[r['variant'] for r in better] or 'none'}; "
                     f"significant at p <= 0.05: {[r['variant'] for r in significant] or 'none'}; {reach}. "
                     f"The hypothesis (tangential updates train better) {_said(outcome)} on this data at this scale.")


def verdict(study: str, summary: list[dict], runs: list[dict] | None = None) -> str:
    return verdict_outcome(study, summary, runs)[1]


BUDGET_KEYS = ("max_steps", "eval_every", "learning_rate", "batch_size", "seq_len", "train_windows", "val_windows")


def resolve_scale(scale_name: str, overrides: dict | None = None) -> dict:
    """The scale's settings with the user's budget overrides (only keys in BUDGET_KEYS, positive values)."""
    scale = dict(SCALES[scale_name])
    for key, value in (overrides or {}).items():
        if key not in BUDGET_KEYS:
            raise ValueError(f"unknown study setting {key!r}; accepted: {', '.join(BUDGET_KEYS)}.")
        if value is None:
            continue
        if not value > 0:
            raise ValueError(f"study setting {key}={value} must be positive.")
        scale[key] = value
    return scale


def run_study(study: str, scale_name: str = "smoke", *, arch: str = "gpt2", variants=None, seeds=None,
              branches=("ffn",), output_dir: str = "runs/study", device: str = "cpu", progress=None,
              overrides: dict | None = None, train_docs=None, val_docs=None, data: str | None = None) -> dict:
    """Train every variant of `study` for every seed; train_docs / val_docs replace the scale's text.

    The tokenizer is a byte-level BPE of the scale's vocabulary size trained on the training
    documents only, or GPT-2's where the scale has no vocabulary size (the `paper` scale)."""
    from .data import load_documents, pack_windows

    names = check_request(study, scale_name, variants, arch)
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
    for seed in seeds:
        for variant in names:
            runs.append(run_variant(study, variant, seed, scale, arch, tokenizer, train_windows, val_windows,
                                    output_dir, branches, device))
            if progress is not None:
                progress.update(1)
    summary = summarize(runs, names[0])
    return {"study": study, "scale": scale_name, "arch": arch, "branches": list(branches), "settings": scale,
            "seeds": seeds, "variants": names, "runs": runs, "summary": summary, "verdict": verdict(study, summary, runs),
            "seconds": round(time.time() - start, 1), "threads": torch.get_num_threads(), "train_windows": len(train_windows), "val_windows": len(val_windows),
            "data": data or "user documents"}


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
    return first | {"runs": runs, "variants": variants, "seeds": sorted({r["seed"] for r in runs}),
                    "seconds": round(sum(r["seconds"] for r in reports), 1),
                    "merged_reports": sum(r.get("merged_reports", 1) for r in reports)}


# Quantities logged over training (run["history"]) and plotted, one panel each.
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


def write_plots(report: dict, folder: str) -> dict:
    """Validation loss and diagnostics over training (seed bands) as PNGs in folder; title -> file name."""
    from . import plots

    os.makedirs(folder, exist_ok=True)
    label = f"{report['study']} ({report['scale']}, {report['arch']}, branches {'+'.join(report['branches'])})"
    files = {"validation loss": f"{report['study']}_val_loss.png", "diagnostics": f"{report['study']}_diagnostics.png"}
    # paired with the baseline of the same seed at the same step: the seed-to-seed spread cancels
    baseline = {(r["seed"], h["step"]): h["val_loss"] for r in report["runs"] if r["variant"] == report["variants"][0]
                for h in r["history"]}
    runs = [r | {"history": [h | {"delta": h["val_loss"] - baseline[(r["seed"], h["step"])]} for h in r["history"]
                             if (r["seed"], h["step"]) in baseline]} for r in report["runs"]]
    plots.study_curves(runs, {"val_loss": "validation loss (nats/token)",
                              "delta": f"validation loss - {report['variants'][0]} (same seed)"},
                       os.path.join(folder, files["validation loss"]), f"{label}: seed mean, min..max band")
    plots.study_curves(report["runs"], DIAGNOSTIC_PANELS, os.path.join(folder, files["diagnostics"]),
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
