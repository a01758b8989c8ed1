"""Reports: what every experiment returns, and the one module that renders them.

A `Report` is JSON-able data plus its kind (the command that made it); `to_markdown()` and
`plot(folder)` render it, `save(folder)` writes report.json, report.md and the plots, and
`Report.load(path)` reads a saved one back, so a page regenerates from the kept JSON alone.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from . import plots
from .destinations import claim_run_folder
from .verdicts import summarize, verdict, verdict_outcome

# Published values the pages quote beside ours (not measured here)
PAPER_MEAN_GATES = "GPT-2 0.852, GPT-2-large 0.917, Pythia 1.063 / 1.048, Mistral 1.009"


@dataclass
class Report:
    """The result of one experiment (`kind`: eval, calibrate, finetune, diagnose, ablate,
    sensitivity, parallel-sweep, study, heal, critical, pressure,
    ffn-jacobian); `data` is what report.json holds."""

    kind: str
    data: dict
    tensors: dict | None = None  # named tensors saved beside report.json as data["directions_file"] (safetensors)

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in MARKDOWN:
            raise ValueError(f"unknown report kind {self.kind!r}; accepted: {', '.join(MARKDOWN)}.")
        if not isinstance(self.data, dict):
            raise TypeError(f"Report data must be a dict (what report.json holds), got {type(self.data).__name__}.")

    def __getitem__(self, key: str):
        return self.data[key]

    def to_dict(self) -> dict:
        return self.data

    def to_markdown(self) -> str:
        return MARKDOWN[self.kind](self.data)

    def plot(self, folder: str | os.PathLike) -> list[str]:
        """Write this report's plots (PNG) into `folder`; returns their paths."""
        os.makedirs(folder, exist_ok=True)
        return PLOTS.get(self.kind, lambda data, folder: [])(self.data, str(folder))

    def save(self, folder: str | os.PathLike, *, echo: bool = False) -> Path:
        """report.json, report.md and the plots in `folder` (a new or empty folder, or one holding
        only what hf_tangent runs write: destinations.claim_run_folder; files of the same names are
        replaced); `echo` also prints the Markdown."""
        claim_run_folder(folder, writer="Report.save")
        folder = Path(folder)
        self.plot(folder)
        (folder / "report.json").write_text(json.dumps(self.data, indent=2, default=str), encoding="utf-8")
        if self.tensors is not None:
            from safetensors.torch import save_file

            save_file(self.tensors, str(folder / self.data["directions_file"]), metadata={"report": self.kind})
        markdown = self.to_markdown()
        (folder / "report.md").write_text(markdown, encoding="utf-8")
        if echo:
            print(markdown)
            print(f"wrote {folder / 'report.json'} and report.md")
        return folder

    @classmethod
    def load(cls, path: str | os.PathLike) -> Report:
        """A saved report.json (its "command" or "study" field says which kind), checked whole: a
        report that could not be rendered (a JSON list, a field missing) is refused here, not later."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"Report.load expects the path of a report.json, got {type(path).__name__}.")
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable report.json ({err}).") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not an hf-tangent report: a JSON {type(data).__name__}, accepted: a JSON object "
                             "with a 'command' field.")
        kind = data.get("command") or ("study" if "study" in data else None)
        if not isinstance(kind, str) or kind not in MARKDOWN:
            raise ValueError(f"{path}: not an hf-tangent report (command={data.get('command')!r}; accepted: "
                             f"{', '.join(MARKDOWN)}).")
        try:
            MARKDOWN[kind](data)
        except KeyError as err:
            raise ValueError(f"{path}: an incomplete {kind!r} report: field {err.args[0]!r} is missing.") from None
        except (TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as err:
            raise ValueError(f"{path}: a damaged {kind!r} report ({type(err).__name__}: {err}).") from None
        return cls(kind, data)


def variants_table(rows: list[dict]) -> str:
    lines = ["| variant | NLL | perplexity | delta NLL | delta perplexity |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['nll']:.4f} | {r['perplexity']:.3f} | {r['delta_nll']:+.4f} | "
                     f"{r['delta_perplexity']:+.3f} |")
    return "\n".join(lines)


def eval_markdown(report: dict) -> str:
    return "\n".join([
        f"# hf-tangent eval: {report['model']}",
        "",
        f"Text: {report['text']}; {report['windows']} windows x {report['seq_len']} tokens "
        f"({report['tokens_per_variant']} predicted tokens per variant); dtype {report['dtype']}, "
        f"device {report['device']}, {report['seconds']} s. Every rule is applied to every layer, untrained.",
        "",
        variants_table(report["rows"]),
    ]) + "\n"


def training_card(report: dict) -> str:
    """The model card's training paragraph of a calibrate (or heal) report."""
    t = report["training"]
    return (f"Text: {json.dumps(report['text'])}. {report['train_windows']} training windows of {report['seq_len']} "
            f"tokens; {t['max_steps']} optimizer steps, learning rate {t['learning_rate']}, batch "
            f"{t['batch_size']} x {t['grad_accum']} accumulation x {t['world_size']} processes; bf16 {t['bf16']}; "
            f"seed {report['seed']}; hf_tangent {report['hf_tangent_version']}, torch {report['torch']}.")


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
    return "\n".join(lines)


def calibrate_results_markdown(report: dict) -> str:
    """The held-out results of a calibrate report (its report.md section and the model card's)."""
    h, c = report["heldout"], report["calibration"]
    lines = [
        "",
        "| | NLL | perplexity |",
        "|---|---:|---:|",
        f"| natural (gates = 1) | {h['natural_nll']:.4f} | {h['natural_perplexity']:.3f} |",
        f"| calibrated gates | {h['gated_nll']:.4f} | {h['gated_perplexity']:.3f} |",
        f"| **Delta L** | **{h['delta_nll']:+.4f}** | |",
        "",
        f"Calibration windows ({c['windows']}): NLL {c['natural_nll']:.4f} natural -> {c['gated_nll']:.4f} gated.",
    ]
    if len(report["update_variants"]) > 1:
        lines += ["", "## Update rules, untrained, every layer", "", variants_table(report["update_variants"])]
    return "\n".join(lines) + "\n"


def finetune_markdown(report: dict) -> str:
    t = report["training"]
    lines = [
        f"# hf-tangent finetune: {report['model']} ({report['method']})",
        "",
        f"Same data order, steps ({t['max_steps']}), optimizer (AdamW, lr {t['learning_rate']}, {t['lr_scheduler']}) "
        f"for every variant; seeds {report['seeds']}; {report['train_windows']} training and "
        f"{report['eval_windows']} held-out windows of {report['seq_len']} tokens; {report['seconds']} s.",
        "",
        "| variant | seeds | held-out NLL (mean +- sd) | perplexity | delta NLL vs unpatched | delta perplexity | p (paired permutation) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["summary"]:
        p = "" if s["variant"] == "unpatched" else f"{s['p_value']:.3f}"
        lines.append(f"| {s['variant']} | {s['seeds']} | {s['nll_mean']:.4f} +- {s['nll_std']:.4f} | "
                     f"{s['perplexity_mean']:.3f} | {s['delta_nll_mean']:+.4f} | {s['delta_perplexity_mean']:+.3f} | {p} |")
    lines += ["", "With n seeds the exact sign-flip test cannot go below p = 2 / 2^n.", "",
              "![training loss](loss_curves.png)"]
    return "\n".join(lines) + "\n"


def diagnose_markdown(report: dict) -> str:
    cols = ["rho", "orthogonality_error", "norm_x", "ffn_angle", "diversity_before_attention",
            "diversity_after_attention", "diversity_after_ffn", "deficit", "ffn_share"]
    lines = [f"# hf-tangent diagnose: {report['model']} ({report['update']})", "",
             f"{report['windows']} windows x {report['seq_len']} tokens of {report['text']}; per-layer means over "
             "tokens (diversity: mean over sequences). Definitions: docs/diagnostics.md.", "",
             "| layer | " + " | ".join(cols) + " | norm drift |", "|---" * (len(cols) + 2) + "|"]
    for r in report["layers"]:
        lines.append(f"| {r['layer']} | " + " | ".join(f"{r[c]['mean']:.4g}" for c in cols) + f" | {r['norm_drift']:.4g} |")
    lines += ["", "![per-layer diagnostics](diagnostics_layers.png)"]
    return "\n".join(lines) + "\n"


def ablate_markdown(report: dict) -> str:
    lines = [f"# hf-tangent ablate: {report['model']}", "",
             f"Full model loss {report['full_loss']:.4f} nats/token on {report['windows']} windows x "
             f"{report['seq_len']} tokens of {report['text']}; increase over full with a 95% paired bootstrap "
             "interval over windows.", "",
             "| variant | layers | loss | increase | 95% CI |", "|---|---|---:|---:|---|"]
    for r in report["rows"]:
        if r["layer"] == "all":
            lines.append(f"| {r['variant']} | all | {r['loss']:.4f} | {r['increase']:+.4f} | "
                         f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] |")
    layerwise = [r for r in report["rows"] if r["layer"] != "all"]
    if layerwise:
        variants = list(dict.fromkeys(r["variant"] for r in layerwise))
        lines += ["", "One layer at a time (loss increase):", "", "| layer | " + " | ".join(variants) + " |",
                  "|---" * (len(variants) + 1) + "|"]
        for layer in sorted({r["layer"] for r in layerwise}):
            cells = [next(r for r in layerwise if r["layer"] == layer and r["variant"] == v) for v in variants]
            lines.append(f"| {layer} | " + " | ".join(f"{c['increase']:+.4f}" for c in cells) + " |")
        lines += ["", "![layerwise](ablation_heatmap.png)"]
    lines += ["", "![ablations](ablation_bars.png)"]
    return "\n".join(lines) + "\n"


def sensitivity_markdown(report: dict) -> str:
    lines = [f"# hf-tangent sensitivity: {report['model']}", "",
             f"C_l on {report['windows']} calibration windows x {report['seq_len']} tokens of {report['text']}.", ""]
    if report["already_parallel"]:
        lines += [f"Layers {report['already_parallel']} are already parallel-residual blocks: nothing to convert there.", ""]
    lines += ["| layer | C_l (token mean) | window mean +- sd | q05 .. q95 |", "|---:|---:|---:|---|"]
    for r in report["layers"]:
        if not r["already_parallel"]:
            t = r["token_stats"]
            lines.append(f"| {r['layer']} | {r['c']:.4f} | {r['window_mean']:.4f} +- {r['window_std']:.4f} | "
                         f"{t['q05']:.3f} .. {t['q95']:.3f} |")
    return "\n".join(lines + ["", "![C_l](sensitivity.png)"]) + "\n"


def sweep_markdown(report: dict) -> str:
    sweep = report["sweep"]
    curves = _int_keys(sweep["curves"])
    schedules = list(curves)
    lines = [f"# hf-tangent parallel-sweep: {report['model']}", "",
             f"Held-out loss {sweep['base_loss']:.4f} nats/token unconverted ({report['heldout_windows']} windows x "
             f"{report['seq_len']} tokens); C_l and greedy on {report['calibration_windows']} calibration windows. "
             "Loss increase by number of converted layers (random: mean over seeds):", "",
             "| k | " + " | ".join(schedules) + " |", "|---:" * (len(schedules) + 1) + "|"]
    for k in sweep["ks"]:
        lines.append(f"| {k} | " + " | ".join(f"{curves[s][k]:+.4f}" if k in curves[s] else "-" for s in schedules) + " |")
    lines += ["", "![sweep](parallel_sweep.png)", "", f"## Largest set within +{next(iter(report['recommendations'].values()))['budget']} nats (chosen on calibration text)", "",
              "| order | k | layers | held-out increase | within budget on held-out |", "|---|---:|---|---:|---|"]
    for name, r in report["recommendations"].items():
        lines.append(f"| {name} | {r['k']} | {r['layers']} | {r['heldout_increase']:+.4f} | {r['within_budget_heldout']} |")
    if report["speed"]:
        sp = report["speed"]
        lines += ["", "## Speed", "", f"Converted layers {sp['layers']}: estimated speedup (A and FFN concurrent, "
                  f"from measured T_A, T_Phi) **{sp['estimated_speedup']:.3f}x**; measured end-to-end (1 x "
                  f"{sp['tokens']} tokens, same run): " + ", ".join(f"{k} {v:.3f}x" for k, v in sp["measured_speedup"].items()) + "."]
    return "\n".join(lines) + "\n"


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



def _int_keys(curves: dict) -> dict:
    """Sweep curves by schedule and k, with int k (a report read back from JSON has string keys)."""
    return {schedule: {int(k): v for k, v in curve.items()} for schedule, curve in curves.items()}


def _plot_calibrate(data, folder):
    curve = [tuple(point) for point in data["loss_curve"]]
    return [plots.gate_profile({int(k): v for k, v in data["gates"].items()}, os.path.join(folder, "gate_profile.png"),
                               title=f"Calibrated FFN gates: {data['model']}"),
            plots.loss_curves({"gates": [curve]}, os.path.join(folder, "loss_curve.png"), title="Calibration loss")]


def _plot_finetune(data, folder):
    curves = {}
    for run in data["runs"]:
        curves.setdefault(run["variant"], []).append([tuple(p) for p in run["loss_curve"]])
    return [plots.loss_curves(curves, os.path.join(folder, "loss_curves.png"),
                              title=f"{data['method']} fine-tuning, {data['model']}")]


def _plot_ablate(data, folder):
    out = [plots.ablation_bars(data["rows"], os.path.join(folder, "ablation_bars.png"), title=f"{data['model']}: ablations")]
    if any(r["layer"] != "all" for r in data["rows"]):
        out.append(plots.ablation_heatmap(data["rows"], os.path.join(folder, "ablation_heatmap.png"),
                                          title=f"{data['model']}: one layer at a time"))
    return out


def _plot_sensitivity(data, folder):
    layers = data["layers"] if "layers" in data else data["sensitivity"]["layers"]
    if all(r["already_parallel"] for r in layers):
        return []
    return [plots.sensitivity_profile(layers, os.path.join(folder, "sensitivity.png"), title=f"C_l: {data['model']}")]


def _plot_sweep(data, folder):
    sweep = data["sweep"]
    curves, spread = _int_keys(sweep["curves"]), {int(k): v for k, v in sweep["random_std"].items()}
    return _plot_sensitivity(data, folder) + [plots.parallel_sweep(
        curves, spread, os.path.join(folder, "parallel_sweep.png"), title=f"{data['model']}: parallel-residual conversion")]


def _plot_study(data, folder):
    return [os.path.join(folder, name) for name in study_plots(data, folder).values()]


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
              f"- healed: \"{report['runs'][0]['healed']['sample']}\"", "", "![heal loss](loss_curves.png)"]
    return "\n".join(lines) + "\n"


def _plot_heal(data, folder):
    curves = {"KL (heal)": [[tuple(p) for p in run["loss_curve"]] for run in data["runs"]]}
    return [plots.loss_curves(curves, os.path.join(folder, "loss_curves.png"),
                              title=f"heal {data['patch']['update']}, {data['model']}")]


def critical_markdown(report: dict) -> str:
    fields, refined = report["fields"], report.get("protocol", "paper") == "refined"
    if refined:
        what = (f"critical directions = roots of g = P_u F refined in float64 to a zero score < {report['tol']:g} "
                f"(at most {report['max_iter']} Newton steps, up to 4x that for a row already below 1e-4; 'stalled': the "
                "damped step no longer lowers the residual, 'unfinished': the step cap reached) from every start whose search (Adam, {report['steps']} steps) "
                f"ended below {report['threshold']:g}; distinct by angle (u and -u one line for an odd field); typed by "
                "the signs of the tangent spectrum (flagged where the smallest |Re lambda| is at rounding level)")
    else:
        what = (f"the paper's protocol: candidates = zero score ||P_u F|| / ||F|| < {report['threshold']} after "
                f"{report['steps']} Adam steps (near-invariant directions, not roots); a real part counts as zero below "
                f"{report['rel_tol']} x the spectral radius")
    lines = [f"# hf-tangent critical: {report['model']} ({report.get('protocol', 'paper')} protocol)", "",
             f"Reduced fields per layer ({report['composition']}); {what}; from {report['random_starts']} random and "
             f"{report['token_starts']} token starts per layer ({report['windows']} windows x {report['seq_len']} tokens "
             f"of {report['text']}); {report['seconds']} s. Directions: `{report.get('directions_file', '-')}`.", ""]
    header = ["field", "path", "starts", "below threshold", "refined", "converged", "stalled", "unfinished", "roots",
              "attractor",
              "saddle", "repeller", "neutral", "flagged", "mean unstable share"] if refined else [
              "field", "starts", "converged", "distinct candidates", "attractor", "saddle", "repeller", "neutral",
              "mean unstable share"]
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for f in fields:
        t = report["totals"][f]
        n = t.get("roots", t.get("candidates", 0))
        pct = lambda k, t=t, n=n: f"{t['counts'].get(k, 0)} ({100 * t['counts'].get(k, 0) / n:.1f}%)" if n else "0"  # noqa: E731
        share = "-" if t.get("mean_unstable_share") is None else f"{t['mean_unstable_share']:.3f}"
        paths = sorted({r["fields"][f]["path"].split(" (")[0] for r in report["layers"]})
        cells = ([f, "/".join(paths), t["starts"], t["below_threshold"], t["refined"], t["converged"], t["stalled"],
                  t.get("unfinished", "-"), n]
                 if refined else [f, t["starts"], t["converged"], n])
        cells += [pct("attractor"), pct("saddle"), pct("repeller"), pct("neutral")]
        cells += [t["flagged"], share] if refined else [share]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Per layer (roots: attractor / saddle / repeller / neutral; then the search's converged / refined):"
              if refined else "Per layer (candidates: attractor / saddle / repeller / neutral):", "",
              "| layer | " + " | ".join(fields) + " | s |", "|---:" + "|---" * len(fields) + "|---:|"]
    for r in report["layers"]:
        cells = []
        for f in fields:
            x, c = r["fields"][f], r["fields"][f]["counts"]
            cell = f"{c['attractor']}/{c['saddle']}/{c['repeller']}/{c['neutral']}"
            if refined:
                cell += f" ({x.get('converged', '-')}/{x.get('refined', '-')})" if x["path"] == "search" else " (exact)"
            cells.append(cell)
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + f" | {r['seconds']} |")
    if refined:
        lines += _critical_structure(report)
    lines += ["", "![eigenvalues](critical_eigenvalues.png)", "", "![labels](critical_labels.png)"]
    return "\n".join(lines) + "\n"


def _critical_structure(report: dict) -> list[str]:
    """The OV map's rank and kernel (what forces the OV spectra), the search's check against the exact
    OV roots, and the common directions of F_A and F_Phi with the eigenvalue law."""
    lines = []
    structures = [(r["layer"], r["ov_structure"]) for r in report["layers"] if r.get("ov_structure")]
    if structures:
        lines += ["", "OV map per layer (where the OV field is linear on the sphere, F_A(u) = M u): rank, kernel "
                  "dimension (F_A = 0 there: a degenerate set, not points), real eigenvalues, isolated roots; at an OV "
                  "root the kernel makes that many tangent eigenvalues equal to -rho exactly, so its type is forced by "
                  "the sign of rho unless the other eigenvalues decide it.", "",
                  "| layer | rank | kernel | real eigenvalues | isolated roots | other degenerate sets | search roots "
                  "matched / exact found |", "|---:|---:|---:|---:|---:|---:|---|"]
        for layer, s in structures:
            check = next(r["fields"]["attention"].get("check") for r in report["layers"] if r["layer"] == layer) \
                if "attention" in report["fields"] else None
            matched = "-" if not check else f"{check['matched']} of {check['search_roots']} / {check['exact_found']} of " \
                f"{check['exact']}"
            others = [f"{d['dimension']}-dim (eigenvalue {d['eigenvalue']:.3g})" for d in s["degenerate"] if not d["kernel"]]
            lines.append(f"| {layer} | {s['rank']} | {s['kernel_dimension']} | {s['real_eigenvalues']} | "
                         f"{s['isolated_roots']} | {', '.join(others) or '-'} | {matched} |")
    commons = [(r["layer"], r["common"]) for r in report["layers"] if r.get("common")]
    if commons:
        total = sum(c["common"] for _, c in commons)
        best = [c.get("best_ffn_score_at_ov_roots") for _, c in commons if c.get("best_ffn_score_at_ov_roots") is not None]
        lines += ["", f"Common critical directions of F_A and F_Phi (where the eigenvalue law lambda = lambda_A + "
                  f"lambda_Phi can be tested): {total} in {len(commons)} layers" + (
                      f"; the FFN's smallest zero score at an OV root is {min(best):.3g}" if best else "") + "."]
        laws = [law for _, c in commons for law in c["law"]]
        if laws:
            lines.append(f"At them, J_A's eigenvectors leave a relative off-diagonal part of up to "
                         f"{max(x['offdiagonal'] for x in laws):.3g} in J_Phi, and the largest gap between J's eigenvalues "
                         f"and lambda_A + lambda_Phi is {max(x['largest_gap'] for x in laws):.3g}.")
    return lines


def lm_eval_markdown(report: dict) -> str:
    lines = [f"# hf-tangent lm-eval: {report['model']}", "",
             f"EleutherAI's LM Evaluation Harness on the model in memory; {report['limit'] or 'all'} items per task, "
             f"{report['num_fewshot'] or 0}-shot; paired differences against `unpatched` over the same documents, 95% "
             f"paired bootstrap interval ({report['bootstrap']} resamples); {report['seconds']} s."]
    for task in report["tasks"]:
        source = report.get("task_source", {}).get(task)
        lines += ["", f"## {task}" + (f" ({source})" if source else ""), ""]
        metrics = sorted({k for r in report["results"].values() for k in r.get(task, {}) if "stderr" not in k
                          and k != "sample_len"})
        header = ["variant", *metrics, *[f"delta {m} vs unpatched [95% CI]" for m in ("acc", "acc_norm")
                                         if any(m in p.get(task, {}) for p in report["paired"].values())]]
        lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for variant in report["variants"]:
            values = report["results"][variant].get(task, {})
            cells = []
            for m in metrics:
                stderr = values.get(m.replace(",", "_stderr,", 1))
                cells.append("-" if m not in values else f"{values[m]:.4f}" + (
                    f" +- {stderr:.4f}" if isinstance(stderr, float) else ""))
            for m in header[1 + len(metrics):]:
                key = m.split(" ")[1]
                p = report["paired"].get(variant, {}).get(task, {}).get(key)
                cells.append("-" if p is None else f"{p['diff']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]")
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += ["", "![paired differences](lm_eval_differences.png)"]
    return "\n".join(lines) + "\n"


def _plot_lm_eval(data, folder):
    return [plots.paired_differences(data["paired"], data["tasks"], os.path.join(folder, "lm_eval_differences.png"),
                                     f"{data['model']}: accuracy against the unpatched model")]


def _plot_critical(data, folder):
    best = {}
    for f in data["fields"]:
        best[f] = [min(r["fields"][f]["roots"], key=lambda x: x["score"])["eigenvalues"]
                   for r in data["layers"] if r["fields"][f]["roots"]]
    counts = {f: {r["layer"]: r["fields"][f]["counts"] for r in data["layers"]} for f in data["fields"]}
    title = "roots" if data.get("protocol") == "refined" else "candidates"
    return [plots.critical_eigenvalues(best, os.path.join(folder, "critical_eigenvalues.png"),
                                       f"{data['model']}: tangent-Jacobian spectra, best {title[:-1]} per layer"),
            plots.label_bars(counts, os.path.join(folder, "critical_labels.png"), f"{data['model']}: {title} by type")]


def pressure_markdown(report: dict) -> str:
    lines = [f"# hf-tangent pressure: {report['model']}", "",
             f"Spherical diversity D = 1 - ||mean u||^2 over each sequence, with every attention's logit scale "
             f"multiplied by the factor (1: the model; 0: a uniform average over the visible tokens), per FFN variant "
             f"in all layers; {report['windows']} windows x {report['seq_len']} tokens of {report['text']}; means over "
             f"layers {report['layers'][0]}..{report['layers'][-1]}; {report['seconds']} s.", "",
             "| factor | variant | D after attention | D after FFN | FFN lift | D at the output |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in report["summary"]:
        lines.append(f"| {r['factor']:g} | {r['variant']} | {r['after_attention']:.4f} | {r['after_ffn']:.4f} | "
                     f"{r['ffn_lift']:+.4f} | {r['output']:.4f} |")
    return "\n".join(lines + ["", "![pressure](pressure_curves.png)"]) + "\n"


def ffn_jacobian_markdown(report: dict) -> str:
    ablations = sorted({k.removeprefix("ablation_") for r in report["layers"] for k in r if k.startswith("ablation_")})
    lines = [f"# hf-tangent ffn-jacobian: {report['model']}", "",
             f"{report['tokens']} sampled tokens per layer from {report['windows']} windows x {report['seq_len']} tokens "
             f"of {report['text']}. J = r P_u DPhi(x) P_u (the FFN's response per radian of rotation of its input); "
             "radial fraction ||u u^T DPhi P_u||_F^2 / ||DPhi P_u||_F^2; activation gain sigma'(z): off "
             f"{report['regimes']['off']}, linear {report['regimes']['linear']}; top-{report['top_k']} share: the "
             f"top-{report['top_k']} hidden units' share of P_u y; {report['seconds']} s.", "",
             "| layer | spectral norm of J | norm of Phi(x) | eff. rank | radial frac. | gain off | gain linear | gain transition | top share | "
             "top units (count) | C_l |" + "".join(f" {a} |" for a in ablations),
             "|---:" * (11 + len(ablations)) + "|"]
    for r in report["layers"]:
        units = ", ".join(f"{u} ({n})" for u, n in r["top_units"][:3])
        lines.append(f"| {r['layer']} | {r['spectral_norm']:.3g} | {r['output_norm']:.3g} | {r['effective_rank']:.1f} | {r['radial_fraction']:.3f} | "
                     f"{r['gain']['off']:.3f} | {r['gain']['linear']:.3f} | {r['gain']['transition']:.3f} | "
                     f"{r['top_share']:.3f} | {units} | " + (f"{r['c_l']:.3f}" if r["c_l"] is not None else "-") + " |"
                     + "".join(f" {r['ablation_' + a]:+.4f} |" if r.get("ablation_" + a) is not None else " - |"
                               for a in ablations))
    lines += ["", "Spearman rank correlation across layers:", "", "| figure | " + " | ".join(
        next(iter(report["spearman"].values())).keys()) + " |", "|---" * (1 + len(next(iter(report["spearman"].values())))) + "|"]
    for figure, row in report["spearman"].items():
        lines.append(f"| {figure} | " + " | ".join("-" if v is None else f"{v:+.2f}" for v in row.values()) + " |")
    return "\n".join(lines + ["", "![gain](gain_histograms.png)"]) + "\n"


MARKDOWN = {"eval": eval_markdown, "calibrate": calibrate_markdown, "finetune": finetune_markdown,
            "diagnose": diagnose_markdown, "ablate": ablate_markdown, "sensitivity": sensitivity_markdown,
            "parallel-sweep": sweep_markdown, "study": study_markdown, "heal": heal_markdown,
            "critical": critical_markdown, "pressure": pressure_markdown, "ffn-jacobian": ffn_jacobian_markdown,
            "lm-eval": lm_eval_markdown}
PLOTS = {"calibrate": _plot_calibrate, "finetune": _plot_finetune, "ablate": _plot_ablate,
         "diagnose": lambda data, folder: [plots.diagnostics_layers(
             data["layers"], os.path.join(folder, "diagnostics_layers.png"), title=f"{data['model']} ({data['update']})")],
         "sensitivity": _plot_sensitivity, "parallel-sweep": _plot_sweep, "study": _plot_study, "heal": _plot_heal,
         "critical": _plot_critical, "lm-eval": _plot_lm_eval,
         "pressure": lambda data, folder: [plots.pressure_curves(
             data["summary"], os.path.join(folder, "pressure_curves.png"), f"{data['model']}: diversity under pressure")],
         "ffn-jacobian": lambda data, folder: [plots.gain_histograms(
             data["layers"], os.path.join(folder, "gain_histograms.png"), f"{data['model']}: activation gain")]}
