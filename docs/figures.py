"""Every figure quoted in README.md and docs/ comes from a kept report, written there by this script.

    python docs/figures.py            # render every generated region in place
    python docs/figures.py --check    # exit 1 on a region that differs from its rendering, or a
                                      # number outside the regions that is not a listed constant

A generated region in a Markdown file:

    <!-- figures: NAME -->
    ...text rendered by REGIONS[NAME] from kept reports...
    <!-- /figures -->

Kept reports: docs/results/**/*.json (experiments) and benchmarks/results/*.json (benchmarks). A
number outside the regions (and outside code) must be a setting, threshold or paper value listed in
CONSTANTS for its file: the list is what a reviewer reads to see that nothing measured is typed by
hand. tests/test_docs.py runs --check. Report pages (docs/results/**/report.md and the like) are
rendered from their JSON by hf_tangent's own renderer and checked against it there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_tangent from this checkout

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
REGION = re.compile(r"(<!-- figures: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)
NUMBER = re.compile(r"(?<![\w.#/-])[-+]?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])|(?<![\w.#/-])\d+e[-+]?\d+(?![\w.])")
# the files whose numbers must all be rendered or listed (generated pages have their own checks)
CHECKED = ("README.md", "docs/results/README.md", "docs/recipes.md", "docs/geometry.md", "docs/core.md",
           "docs/parallel.md", "docs/diagnostics.md", "docs/studies-guide.md", "docs/performance.md", "docs/math.md",
           "docs/serving.md", "docs/lm-eval.md")


@cache
def report(path: str) -> dict:
    """A kept report: a path under docs/results/ (or benchmarks/results/ with that prefix)."""
    base = ROOT if path.startswith("benchmarks/") else RESULTS
    return json.loads((base / path).read_text(encoding="utf-8"))


def signed(value: float, digits: int) -> str:
    return f"{value:+.{digits}f}"


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60)} s"


# ----------------------------------------------------------------------------- regions
def main_job() -> str:
    r = report("offline_default_smollm2.json")
    g, h, t = r["gate_summary"], r["heldout"], r["training"]
    rules = len(r["update_variants"]) - 1  # beside the unpatched row
    return wrap(f"Measured on this machine (a 2-core CPU, {r['threads']} torch threads, otherwise idle): "
                f"{minutes(r['seconds'])} wall and {r['peak_rss_gb']:.1f} GB peak RSS for {rules} rules x "
                f"{r['eval_windows']} held-out windows of {r['seq_len']} tokens and {t['max_steps']} steps of "
                f"{t['batch_size']} x {r['seq_len']} tokens. The time grows with rules x windows (step 1) and with "
                f"steps x batch x tokens (step 2); on a machine whose cores are busy it takes several times longer. "
                f"Result: mean gate {g['mean']:.3f}, range {g['min']:.3f} (layer {g['argmin']}) .. {g['max']:.3f} "
                f"(layer {g['argmax']}); Delta L = {h['delta_nll']:.4f} nats (perplexity "
                f"{h['natural_perplexity']:.2f} -> {h['gated_perplexity']:.2f}).")


def wrap(text: str, width: int = 110, indent: str = "") -> str:
    """A paragraph (or list item: `indent` on the lines after the first) at the pages' line length."""
    import textwrap

    return textwrap.fill(text, width, subsequent_indent=indent, break_on_hyphens=False) + "\n"


def main_job_table() -> str:
    from hf_tangent.experiments.report import variants_table

    return variants_table(report("offline_default_smollm2.json")["update_variants"]) + "\n"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def main_job_files() -> str:
    """What the main job writes (a measured run's folder, benchmarks/main_job_files.py), by file."""
    r = report("offline_default_files.json")
    groups: dict[str, list[tuple[str, int]]] = {}
    for path, size in r["files"].items():
        top = path.split("/", 1)[0]
        groups.setdefault(top if "/" in path else "", []).append((path, size))
    lines = [f"`runs/offline_default/` after the run ({_size(r['total_bytes'])} in all):"]
    for top, entries in sorted(groups.items(), key=lambda kv: (kv[0] != "", kv[0])):
        if not top:
            lines += [f"- `{path}` {_size(size)}" for path, size in entries]
        else:
            inside = ", ".join(f"`{path.split('/', 1)[1]}` {_size(size)}" for path, size in entries)
            lines.append(wrap(f"- `{top}/` {_size(sum(size for _, size in entries))}: {inside}", indent="  ").rstrip())
    return "\n".join(lines) + "\n"


def sweep_count() -> str:
    r = report("hostile_sweep.json")
    o = r["outcomes"]
    return wrap(f"`python tests/sweeps/hostile_inputs.py` runs the {r['cases']}-case hostile-input sweep ({o['ok']} "
                f"ok, {o['clear']} clear errors, {r['cases'] - o['ok'] - o['clear']} other; "
                "[docs/results/hostile_sweep.md](docs/results/hostile_sweep.md)); pytest runs its groups too.")


def table(header: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or "|".join(["---"] + ["---:"] * (len(header) - 1))
    lines = ["| " + " | ".join(header) + " |", f"|{align}|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def by(rows: list[dict], *keys) -> dict:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows}


# ----------------------------------------------------------------------------- docs/results/README.md
def results_main_job() -> str:
    from hf_tangent.experiments.report import PAPER_MEAN_GATES

    r = report("offline_default_smollm2.json")
    g, h, c, t = r["gate_summary"], r["heldout"], r["calibration"], r["training"]
    return (f"{t['max_steps']} steps of {t['batch_size']} x {r['seq_len']} tokens, all weights frozen, seed {r['seed']}, "
            f"{minutes(r['seconds'])} wall, {r['peak_rss_gb']:.1f} GB peak RSS. [report](offline_default_smollm2.md)\n\n"
            f"- mean gate **{g['mean']:.3f}**, min {g['min']:.3f} (layer {g['argmin']}) .. max {g['max']:.3f} "
            f"(layer {g['argmax']}) ([profile](gate_profile.png));\n  paper: {PAPER_MEAN_GATES};\n"
            f"- held-out ({r['eval_windows']} x {r['seq_len']} tokens): Delta L = **{h['delta_nll']:.4f}** nats/token "
            f"(perplexity {h['natural_perplexity']:.2f} -> {h['gated_perplexity']:.2f});\n"
            f"  calibration NLL {c['natural_nll']:.4f} -> {c['gated_nll']:.4f}.\n")


def results_finetune() -> str:
    r, untrained = report("finetune_lora_smollm2.json"), by(report("offline_default_smollm2.json")["update_variants"], "variant")
    t, lora = r["training"], r["training"]["lora"]
    rows = [[s["variant"], f"{s['nll_mean']:.4f} +- {s['nll_std']:.4f}", f"{s['perplexity_mean']:.2f}",
             signed(s["delta_nll_mean"], 4), "" if s["variant"] == "unpatched" else f"{s['p_value']:g}"] for s in r["summary"]]
    summary = by(r["summary"], "variant")
    cayley = "retract p=2 (cayley)"
    return (f"LoRA r={lora['r']} ({', '.join(x.split('_')[0] for x in lora['targets'])}), {t['max_steps']} steps of "
            f"{t['batch_size']} x {r['seq_len']} tokens, AdamW lr {t['learning_rate']:g} {t['lr_scheduler']}, seeds "
            f"{' and '.join(map(str, r['seeds']))}, same data\norder for every variant; held-out {r['eval_windows']} x "
            f"{r['seq_len']} tokens. {r['seconds'] / 60:.1f} min. [report](finetune_lora_smollm2.md)\n\n"
            + table(["variant", "held-out NLL (mean +- sd)", "perplexity", "delta NLL vs unpatched", "p"], rows)
            + f"\nWith {len(r['seeds'])} seeds the exact permutation p cannot go below "
            f"{min(s['p_value'] for s in r['summary'] if s['variant'] != 'unpatched'):g}. Applied to every layer of a "
            "checkpoint pretrained with the plain add, every rule starts far above the unpatched loss (untrained, on "
            f"the main job's {report('offline_default_smollm2.json')['eval_windows']} held-out windows: projected "
            f"{signed(untrained['projected']['delta_nll'], 2)}, retract p=2 {signed(untrained[cayley]['delta_nll'], 2)}); "
            f"{t['max_steps']} LoRA steps recover much of it (projected {signed(summary['projected']['delta_nll_mean'], 2)}, "
            f"retract p=2 {signed(summary[cayley]['delta_nll_mean'], 2)}) but none reaches the unpatched model.\n")


def _ablation_all(path: str) -> dict:
    return {r["variant"]: r for r in report(path)["rows"] if r["layer"] == "all"}


def results_ablation() -> str:
    r, rows = report("ablation_smollm2.json"), _ablation_all("ablation_smollm2.json")
    layer = {(x["variant"], x["layer"]): x["increase"] for x in r["rows"] if x["layer"] != "all"}
    tangential = [layer[("tangential_only", i)] for i in range(r["num_layers"])]
    small = [i for i, v in enumerate(tangential) if v < 0.03]
    large = [i for i, v in enumerate(tangential) if v >= 0.03]
    body = table(["variant (all layers)", "loss increase", "95% CI"],
                 [[v, f"**{signed(x['increase'], 3)}**" if v == "tangential_only" else signed(x["increase"], 3),
                   f"[{signed(x['ci_low'], 3)}, {signed(x['ci_high'], 3)}]"] for v, x in rows.items()], "---|---:|---")
    return (f"Full model loss {r['full_loss']:.4f} nats/token; increase with 95% paired bootstrap interval over "
            f"{r['windows']} windows.\n[report](ablation_smollm2.md), [bars](ablation_bars.png), [layerwise heatmap]"
            f"(ablation_heatmap.png)\n\n{body}\nAs the paper reports, tangential-only is by far the closest to full, "
            "and radial-only is about as bad\nas removing the FFN. One layer at a time, removing the radial part costs "
            f"< 0.03 nats in {len(small)} of {r['num_layers']}\nlayers; it matters in layers "
            + ", ".join(f"{i} ({signed(tangential[i], 2)})" for i in large) + ".\n")


def results_gemma3() -> str:
    smol, gemma = by(report("eval_smollm2_8x256.json")["rows"], "variant"), by(report("gemma3/eval.json")["rows"], "variant")
    g = report("gemma3/ablation.json")
    names = ["projected", "soft beta=0.5", "norm_preserving", "retract p=2 (cayley)", "retract p=inf (exp)",
             "radial (ablation)", "zero (ablation)"]
    evals = table(["variant", "SmolLM2-135M", "Gemma-3-270M"],
                  [["unpatched NLL", f"{smol['unpatched']['nll']:.4f}", f"{gemma['unpatched']['nll']:.4f}"]]
                  + [[n, signed(smol[n]["delta_nll"], 3), signed(gemma[n]["delta_nll"], 3)] for n in names])
    sa, ga = _ablation_all("ablation_smollm2.json"), _ablation_all("gemma3/ablation.json")

    def cell(x, bold):
        text = signed(x["increase"], 2)
        return f"{'**' + text + '**' if bold else text} [{signed(x['ci_low'], 2)}, {signed(x['ci_high'], 2)}]"

    ablations = table(["variant (all layers)", "SmolLM2-135M", "Gemma-3-270M"],
                      [[v, cell(sa[v], v == "tangential_only"), cell(ga[v], v == "tangential_only")] for v in sa])
    layer = {(x["variant"], x["layer"]): x["increase"] for x in g["rows"] if x["layer"] != "all"}
    tangential = [layer[("tangential_only", i)] for i in range(g["num_layers"])]
    quiet = [i for i, v in enumerate(tangential) if v < 0.05]
    first = [i for i in range(g["num_layers"]) if i not in quiet]
    return (f"Untrained rules on every layer (`hf-tangent eval --max-windows {report('gemma3/eval.json')['windows']} "
            f"--seq-len {report('gemma3/eval.json')['seq_len']}`; [SmolLM2](eval_smollm2_8x256.md), "
            f"[Gemma-3](gemma3/eval.md)), delta NLL:\n\n{evals}\nAblations on all layers (`hf-tangent ablate "
            f"--layerwise --max-windows {g['windows']} --seq-len {g['seq_len']}`), loss increase\nwith 95% paired "
            f"bootstrap interval:\n\n{ablations}\n**Gemma-3 does not follow the paper's pattern on all layers at once**:"
            f" keeping only the tangential\npart of every layer's FFN update ({signed(ga['tangential_only']['increase'], 2)})"
            f" costs *more* than removing the FFN entirely\n({signed(ga['zero_ffn']['increase'], 2)}), while in "
            "SmolLM2 it is by far the closest to the full model. One layer at a time the pattern is there:\nremoving "
            f"the radial part costs < 0.05 nats in the {len(quiet)} layers {quiet[0]}-{quiet[-1]}, but it is essential in "
            f"layer 0\n({signed(tangential[0], 2)}, far more than zeroing that FFN, {signed(layer[('zero_ffn', 0)], 2)}) "
            f"and matters in layers {first[1]}-{first[-1]} ("
            + ", ".join(signed(tangential[i], 2) for i in first[1:]) + "). Radial-only is the worst variant in both "
            "models.\n")


HEAL_ROWS = [  # (label, report folders in seed order)
    ("projected (default)", ["projected", "projected_seeds12"]),
    ("norm_preserving", ["norm_preserving", "norm_preserving_seeds12"]),
    ("retract p=2 (cayley)", ["retract_p2", "retract_p2_seeds12"]),
    ("parallel conversion, 8 layers [6-9, 20-23]", ["parallel8"]),
    ("parallel conversion, 10 layers (greedy order, first 10)", ["parallel10"]),
    ("parallel conversion, 12 layers (greedy set)", ["parallel12"]),
    ("projected, direct (target from step 0)", ["projected_direct", "projected_direct_seeds12"]),
    ("projected, LM loss instead of KL", ["projected_lm"]),
    ("projected, full fine-tuning (frozen teacher copy)", ["projected_full"]),
    ("projected, progressive (3 layer groups)", ["projected_progressive"]),
    ("norm_preserving, progressive (3 groups)", ["norm_preserving_progressive"]),
    ("retract p=2, progressive (3 groups)", ["retract_p2_progressive"]),
    ("parallel 12 layers, progressive (3 groups)", ["parallel12_progressive"]),
    ("projected, 120 steps over 240 windows", ["projected_120"]),
    ("norm_preserving, 120 steps over 240 windows", ["norm_preserving_120"]),
    ("retract p=2, 120 steps over 240 windows", ["retract_p2_120"]),
    ("parallel conversion, 12 layers, 100 steps over 240 windows", ["parallel12_100"]),
]


def heal_runs(folders: list[str]) -> tuple[dict, list[dict]]:
    reports = [report(f"heal/{f}/report.json") for f in folders]
    return reports[0], [run for r in reports for run in r["runs"]]


def healed_delta(folders) -> float:
    first, runs = heal_runs(folders)
    return sum(r["healed"]["nll"] for r in runs) / len(runs) - first["unpatched_nll"]


def results_heal() -> str:
    first, _ = heal_runs(["projected"])
    t = first["training"]
    rows = []
    for label, folders in HEAL_ROWS:
        head, runs = heal_runs(folders)
        deltas = [r["healed"]["nll"] - head["unpatched_nll"] for r in runs]
        mean = sum(deltas) / len(deltas)
        rows.append([label, ", ".join(str(r["seed"]) for r in runs), signed(runs[0]["untrained"]["nll"] -
                     head["unpatched_nll"], 3), ", ".join(signed(d, 3) for d in deltas), f"**{signed(mean, 3)}**",
                     f"{sum(r['healed']['kl'] for r in runs) / len(runs):.3f}"])
    seconds = [report(f"heal/{f}/report.json")["seconds"] for _, fs in HEAL_ROWS for f in fs]
    return (f"Distillation from the unpatched model (teacher: the same model with patch and LoRA off), LoRA r="
            f"{t['lora']['r']}\n({', '.join(x.split('_')[0] for x in t['lora']['targets'])}), {t['max_steps']} steps of "
            f"{t['batch_size']} x {first['seq_len']} tokens from {first['train_windows']} training windows, lr "
            f"{t['learning_rate']:g} {t['lr_scheduler']}, KL at T={first['settings']['temperature']:g},\nlinear homotopy "
            f"over the first {round(first['settings']['homotopy_fraction'] * t['max_steps'])} steps, all layers at once — "
            "the default; each other row changes one factor (its report says which settings).\nHeld-out Emma "
            f"{first['eval_windows']} x {first['seq_len']}; unpatched NLL {first['unpatched_nll']:.4f}. Reports: "
            f"[heal/](heal/). Wall time per report: {min(seconds) / 60:.0f}-{max(seconds) / 60:.0f} min (1 or 2 threads,"
            " some runs sharing the machine).\n\n"
            + table(["rule / variant (all 30 layers unless noted)", "seeds", "untrained delta NLL", "healed delta NLL",
                     "mean", "KL after (mean)"], rows, "---|---|---:|---:|---:|---:"))


def results_heal_findings() -> str:
    def seeds(folders):
        head, runs = heal_runs(folders)
        return {r["seed"]: r["healed"]["nll"] - head["unpatched_nll"] for r in runs}

    homotopy, direct = seeds(["projected", "projected_seeds12"]), seeds(["projected_direct", "projected_direct_seeds12"])
    gains = [direct[s] - homotopy[s] for s in sorted(homotopy)]
    from hf_tangent.analysis.stats import paired_permutation_test

    lm, kl = report("heal/projected_lm/report.json"), report("heal/projected/report.json")
    d = {name: healed_delta([name]) for name in ("projected", "norm_preserving", "retract_p2", "parallel12",
                                                   "projected_progressive", "norm_preserving_progressive",
                                                   "retract_p2_progressive", "parallel12_progressive", "projected_full",
                                                   "parallel8", "parallel10", "parallel12_100", "projected_120",
                                                   "norm_preserving_120", "retract_p2_120")}
    mean = {name: healed_delta(fs) for name, fs in (("projected", ["projected", "projected_seeds12"]),
                                                  ("norm_preserving", ["norm_preserving", "norm_preserving_seeds12"]),
                                                  ("retract_p2", ["retract_p2", "retract_p2_seeds12"]))}
    sweep = report("parallel_sweep_smollm2.json")["sweep"]
    greedy_2 = sweep["curves"]["greedy"]["2"]
    return (f"- **Homotopy vs direct** (projected, {len(gains)} paired seeds): the homotopy is better on every seed, by\n  "
            + ", ".join(signed(g, 3) for g in gains) + f" nats (mean {signed(sum(gains) / len(gains), 3)}; exact sign-flip"
            f" p = {paired_permutation_test(gains):g}, the smallest p {len(gains)} seeds can\n  give).\n"
            f"- **KL vs LM loss** (seed 0): the LM loss ends at a lower NLL ({signed(lm['summary']['healed_delta_nll'], 3)}"
            f" vs {signed(kl['summary']['healed_delta_nll'], 3)}) but further from the\n  teacher (KL "
            f"{lm['summary']['healed_kl']:.2f} vs {kl['summary']['healed_kl']:.2f}) — it fits the text, not the unpatched "
            "model.\n"
            f"- **LoRA vs full fine-tuning** (seed 0, same {kl['training']['max_steps']} steps): LoRA "
            f"{signed(d['projected'], 3)}, full {signed(d['projected_full'], 3)}; the full run at\n  lr "
            f"{report('heal/projected_full/report.json')['training']['learning_rate']:g} moves slower, not tuned further.\n"
            f"- **All at once vs progressive** (seed 0 each): all at once is better for projected ({signed(d['projected'], 3)}"
            f" vs\n  {signed(d['projected_progressive'], 3)}), norm_preserving ({signed(d['norm_preserving'], 3)} vs "
            f"{signed(d['norm_preserving_progressive'], 3)}) and the 12-layer parallel conversion ("
            f"{signed(d['parallel12'], 3)} vs\n  {signed(d['parallel12_progressive'], 3)}); progressive is better for "
            f"retract p=2 ({signed(d['retract_p2_progressive'], 3)} vs {signed(d['retract_p2'], 3)}), the rule with the "
            "largest\n  untrained damage. Single seeds.\n"
            f"- **Parallel conversion, largest k within +0.02 nats held-out**: before healing 2 (greedy order,\n  "
            f"[parallel-sweep](parallel_sweep_smollm2.md), {signed(greedy_2, 3)}); after "
            f"{kl['training']['max_steps']} healing steps **8** ({signed(d['parallel8'], 4)}); 10 and 12\n  layers end at "
            f"{signed(d['parallel10'], 3)} and {signed(d['parallel12'], 3)}; after 100 steps over 240 windows the 12-layer "
            f"greedy set is\n  within budget (**{signed(d['parallel12_100'], 4)}**), so the largest k within +0.02 is at "
            "least 12 (more layers not tried).\n"
            f"- **Targets**: at the default length projected and norm_preserving reach\n  "
            f"{signed(mean['projected'], 3)} and {signed(mean['norm_preserving'], 3)} (target <= +0.10); with 120 steps "
            f"over 240 windows (recipe `heal_long`, the\n  homotopy over 60 steps) they reach **{signed(d['projected_120'], 3)}"
            f"** and **{signed(d['norm_preserving_120'], 3)}** — met, single seed, the longer\n  homotopy, the extra steps "
            f"and the extra data changed together. retract p=2 misses its target\n  (<= +0.20) by far: "
            f"{signed(mean['retract_p2'], 2)} at 40 steps, {signed(d['retract_p2_120'], 2)} at 120. Parallel conversion: "
            "at least 8 layers within\n  +0.02 is met (8 at 40 steps, 12 at 100).\n")


def results_diagnostics() -> str:
    r, overhead = report("diagnostics_smollm2.json"), report("benchmarks/results/diagnostics_overhead_cpu.json")
    layers = r["layers"]
    mean = lambda key: sum(x[key]["mean"] for x in layers) / len(layers)  # noqa: E731
    rho = [x["rho"]["mean"] for x in layers]
    deficit = [x["deficit"]["mean"] for x in layers]
    low_deficit = sorted(range(len(layers)), key=lambda i: deficit[i])[:2]
    div = {k: [x[f"diversity_{k}"]["mean"] for x in layers] for k in ("before_attention", "after_attention", "after_ffn")}
    norms = [x["norm_x"]["q50"] for x in layers]
    errors = [x["orthogonality_error"] for x in report("diagnostics_smollm2_projected.json")["layers"]]
    return (f"[report](diagnostics_smollm2.md), [per-layer plot](diagnostics_layers.png). Means over layers: radial\n"
            f"fraction rho {mean('rho'):.3f} ({rho[0]:.2f} at layer 0, {rho[1]:.2f} at layer 1, {min(rho[2:]):.2f}-"
            f"{max(rho[2:]):.2f} elsewhere); attention-only angular\ndeficit {mean('deficit'):.3f} (lowest at layers "
            f"{low_deficit[0]} and {low_deficit[1]}: {deficit[low_deficit[0]]:.2f}, {deficit[low_deficit[1]]:.2f}); FFN "
            f"share of the realized tangent update\n{mean('ffn_share'):.3f}; FFN step angle {mean('ffn_angle'):.2f} rad. "
            f"Spherical diversity of a sequence goes from {div['before_attention'][0]:.2f} at the input to\n"
            f"{div['after_attention'][0]:.2f} after layer 0's attention and {div['after_ffn'][-1]:.2f} at the output; the"
            f" FFN raises it in layer 0 ({div['after_attention'][0]:.2f} -> {div['after_ffn'][0]:.2f}) and in the last "
            f"layer ({div['after_attention'][-1]:.2f} -> {div['after_ffn'][-1]:.2f}). The median residual norm grows from "
            f"{norms[0]:.1f} (layer 0) to {norms[-1]:.0f} (layer {len(layers) - 1}).\n"
            f"With `--update projected` the orthogonality error reads {sum(e['mean'] for e in errors) / len(errors):.1e} "
            f"on average, {max(e['max'] for e in errors):.1e} at most\n([report](diagnostics_smollm2_projected.md)). "
            f"Diagnostics overhead on a {overhead['tokens'] // 512} x 512-token forward:\n**{overhead['ratio_median']:.3f}x**"
            f" (q25..q75 {overhead['ratio_q25']:.3f}..{overhead['ratio_q75']:.3f}, {overhead['repeats']} interleaved "
            "repeats; `benchmarks/diagnostics_overhead.py`).\n")


def results_parallel() -> str:
    s, sweep, speed = report("sensitivity_smollm2.json"), report("parallel_sweep_smollm2.json"), \
        report("benchmarks/results/parallel_speed_cpu.json")
    scores = s["scores"]
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    curves = sweep["sweep"]["curves"]
    shown = [k for k in (2, 4, 8, 12, 16, 24, 30) if k in sweep["sweep"]["ks"]]

    def at(curve, k):
        value = curves[curve].get(str(k))
        return "-" if value is None else signed(value, 3)

    rows = [[k, at("low_c", k), at("high_c", k), at("random", k), at("greedy", k)] for k in shown]
    greedy = sweep["recommendations"]["greedy"]
    return (f"C_l on {s['windows']} x {s['seq_len']} calibration tokens ([report](sensitivity_smollm2.md), [plot]"
            f"(sensitivity.png)): {scores[order[0]]:.2f} (layer {order[0]})\nto {scores[order[-1]]:.2f} (layer "
            f"{order[-1]}); low to high: {', '.join(map(str, order[:12]))}, ...; high: {', '.join(map(str, order[:-5:-1]))}.\n"
            f"Sweep on {sweep['heldout_windows']} x {sweep['seq_len']} held-out tokens, base loss "
            f"{sweep['sweep']['base_loss']:.4f} ([report](parallel_sweep_smollm2.md),\n[plot](parallel_sweep.png)); "
            f"loss increase:\n\n" + table(["k", "low-C_l", "high-C_l", "random (mean over seeds)", "greedy (loss-aware)"],
                                           rows)
            + "\nLow-C_l-first beats random and high-C_l-first at every k, as in the paper, but SmolLM2 is far more\n"
            f"sensitive than the paper's GPT-2-large: no low-C_l set fits +0.02 (the first 2 layers cost {at('low_c', 2)}"
            f" already).\nChoosing k on calibration text over-fits: the budget rule picked {greedy['k']} greedy layers that "
            f"cost {signed(greedy['heldout_increase'], 3)} on held-out text.\n\n"
            f"Speed (`benchmarks/parallel_speed.py --k {len(speed['layers'])}`, 1 x {speed['tokens']} tokens, "
            f"{speed['measured_hooks']['repeats']} interleaved repeats): converting the\n{len(speed['layers'])} lowest-C_l "
            f"layers was *estimated* at **{speed['estimated_speedup']:.3f}x** from the measured T_A "
            f"({speed['t_attention_total_s']:.2f} s in all layers) and\nT_Phi ({speed['t_ffn_total_s']:.2f} s) assuming "
            f"concurrency (the estimate of that run; issue 58 replaced it by a model of what fused execution saves); "
            f"*measured* end to end: **{speed['measured_speedup_hooks']:.2f}x** with the hook conversion "
            f"and\n**{speed['measured_speedup_fused']:.2f}x** with the fused execution path (q25..q75 of the time ratio "
            f"{speed['measured_hooks']['ratio_q25']:.2f}..{speed['measured_hooks']['ratio_q75']:.2f} and "
            f"{speed['measured_fused']['ratio_q25']:.2f}..{speed['measured_fused']['ratio_q75']:.2f}).\n")


def eval_table(path: str) -> str:
    r = report(path)
    main = report("offline_default_smollm2.json")
    head = wrap(f"`hf-tangent eval` at its defaults (this 2-core CPU, {r['dtype']}, Emma, {r['windows']} windows x "
                f"{r['seq_len']} tokens, {round(r['seconds'])} s; [report](results/{path.replace('.json', '.md')})). "
                f"The main job (`hf-tangent calibrate --recipe offline_default`) prints the same table on "
                f"{main['eval_windows']} windows of {main['seq_len']} tokens from the start of Emma "
                "([its report](results/offline_default_smollm2.md)): other windows, so other numbers:")
    from hf_tangent.experiments.report import variants_table

    return head + "\n" + variants_table(r["rows"]) + "\n"


# ----------------------------------------------------------------------------- residual geometry
PAPER_TABLE_2 = {  # the paper's Table 2 (arXiv 2608.02071), Pythia-1.4B saddle share, and all models' saddles / total
    "attention": ("55.6%", None), "ffn": ("91.3%", "118/140"), "full": ("93.6%", "116/140")}


def _critical_row(t: dict, refined: bool) -> list:
    n = t["roots"] if "roots" in t else t.get("candidates", 0)
    pct = lambda k: f"{t['counts'].get(k, 0)} ({100 * t['counts'].get(k, 0) / n:.1f}%)" if n else "0"  # noqa: E731
    return [n, pct("attractor"), pct("saddle"), pct("repeller"), "-" if t.get("mean_unstable_share") is None
            else f"{t['mean_unstable_share']:.2f}"]


def _closest_unfinished(report: dict, field: str) -> float:
    return min(s for r in report["layers"] for s in r["fields"][field].get("unfinished_scores", []))


def results_critical() -> str:
    names = {"attention": "OV-only `P_u F_A`", "ffn": "FFN-only `P_u Phi(N_2(u))`", "full": "full (additive)"}
    out = []
    for model, folder in (("SmolLM2-135M", "geometry/critical"), ("Gemma-3-270M", "geometry/gemma3_critical")):
        if not (RESULTS / folder / "report.json").is_file():
            continue
        refined = report(f"{folder}/report.json")
        paper = report(f"{folder}_paper/report.json") if (RESULTS / f"{folder}_paper" / "report.json").is_file() else None
        rows = []
        for f in refined["fields"]:
            t = refined["totals"][f]
            path = "exact (M)" if all(r["fields"][f]["path"].startswith("exact") for r in refined["layers"]) else \
                f"search: {t['converged']} of {t['refined']} refined converged" + (
                    f" ({t['stalled']} stalled, {t['unfinished']} unfinished, the closest at "
                    f"{_closest_unfinished(refined, f):.1e})" if t.get("unfinished") else "")
            row = [names[f], path, *_critical_row(t, True)]
            if paper:
                p = paper["totals"][f]
                row.append(f"{_critical_row(p, False)[0]}: {_critical_row(p, False)[2]}")
            rows.append(row + [PAPER_TABLE_2[f][0]])
        timing = (f"{minutes(refined['seconds'])} refined" + (f" / {minutes(paper['seconds'])} paper protocol" if paper else "")
                  + f"; [refined]({folder}/report.md)" + (f", [paper protocol]({folder}_paper/report.md)" if paper else ""))
        out.append(f"**{model}** ({len(refined['layers'])} layers, {refined['random_starts']} random + "
                   f"{refined['token_starts']} token starts per layer and field, {timing}):\n\n"
                   + table(["field", "roots found by", "roots", "attractor", "saddle", "repeller", "mean unstable share",
                            *(["paper protocol: near-invariant candidates: saddles"] if paper else []),
                            "paper, Pythia-1.4B saddles"], rows,
                           "---|---|---:|---:|---:|---:|---:|" + ("---|" if paper else "") + "---:"))
    return "\n".join(out)


def results_critical_structure() -> str:
    out = []
    for model, folder in (("SmolLM2-135M", "geometry/critical"), ("Gemma-3-270M", "geometry/gemma3_critical")):
        if not (RESULTS / folder / "report.json").is_file():
            continue
        r = report(f"{folder}/report.json")
        common = [x["common"] for x in r["layers"] if x.get("common")]
        n_common = sum(c["common"] for c in common)
        ov_scores = [c["best_ffn_score_at_ov_roots"] for c in common if c.get("best_ffn_score_at_ov_roots") is not None]
        ffn_ov = [c["smallest_ov_response_at_ffn_roots"] for c in common if c.get("smallest_ov_response_at_ffn_roots")
                  is not None]
        s = [x["ov_structure"] for x in r["layers"] if x.get("ov_structure")]
        if s:
            kernel, rank = {x["kernel_dimension"] for x in s}, {x["rank"] for x in s}
            share = sorted(x["kernel_dimension"] / (x["dimension"] - 1) for x in s)
            text = (f"The OV map of every {model} layer has rank {'/'.join(map(str, sorted(rank)))} of {s[0]['dimension']} "
                    f"(GQA: the value projection is {min(rank)} wide), so its kernel (dimension "
                    f"{'/'.join(map(str, sorted(kernel)))}) is a degenerate set where F_A = 0, and at every isolated OV "
                    f"root {share[0]:.2f} of the tangent eigenvalues equal -rho exactly: the unstable share is forced below "
                    f"{1 - share[0]:.2f} for rho > 0 and above {share[0]:.2f} for rho < 0, and the saddle majority is what a "
                    f"linear field with {min(x['real_eigenvalues'] for x in s)}+ real eigenvalues must have (at most one "
                    "attractor and one repeller line).")
        else:
            residual = [x["ov_linear_residual"] for x in r["layers"]]
            text = (f"{model}'s OV field is not linear on the sphere (the linear map through F_A(e_i) misses F_A(u) at random "
                    f"u by a relative {min(residual):.1e} to {max(residual):.1e} across layers; a linear field would give "
                    "rounding), so its roots come from the search, like the FFN's.")
        text += (f" Common critical directions of F_A and F_Phi, where the paper's law lambda = lambda_A + lambda_Phi "
                 f"could be tested: {n_common}")
        if ov_scores:
            text += f"; the FFN's smallest zero score at an OV root is {min(ov_scores):.3f} (a common direction would have 0)"
        if ffn_ov:
            text += f"; the smallest OV response at an FFN root is {min(ffn_ov):.3f} of the OV map's norm"
        out.append(text + (", so the law is not testable here." if not n_common else "."))
    return "\n\n".join(out) + "\n"


def results_pressure() -> str:
    r = report("geometry/pressure/report.json")
    summary = {(x["factor"], x["variant"]): x for x in r["summary"]}
    variants = r["variants"]
    d_table = table(["factor", *variants], [[f"{f:g}", *(f"{summary[f, v]['after_attention']:.3f} / "
                                                        f"{summary[f, v]['output']:.3f}" for v in variants)]
                                           for f in r["factors"]], "---:" + "|---" * len(variants))

    def lifts(f, v):
        rows = [x for x in r["rows"] if x["factor"] == f and x["variant"] == v]
        values = [x["after_ffn"] - x["after_attention"] for x in rows]
        return f"{sum(v > 0 for v in values)}/{len(values)}, {signed(sum(values) / len(values), 3)}"

    lift_table = table(["factor", *[v for v in variants if v != "zero_ffn"]],
                       [[f"{f:g}", *(lifts(f, v) for v in variants if v != "zero_ffn")] for f in r["factors"]],
                       "---:" + "|---" * (len(variants) - 1))
    return (f"`hf-tangent pressure --seq_len {r['seq_len']} --max_windows {r['windows']}` (attention logit scale x factor,"
            f" 0 = uniform causal averaging; {round(r['seconds'])} s). [report](geometry/pressure/report.md), [curves]"
            "(geometry/pressure/pressure_curves.png). Mean over layers of D after attention / D at the output:\n\n"
            + d_table + "\nPer block — the evidence for the paper's claim (iii) that the FFN restores diversity —: layers "
            "whose FFN raises D (D after the FFN minus D after attention > 0), and the mean lift, per factor:\n\n"
            + lift_table)


def results_ffn_jacobian() -> str:
    r = report("geometry/ffn_jacobian/report.json")
    rows, rho = r["layers"], r["spearman"]
    norms = [x["spectral_norm"] for x in rows]
    ratio = [x["spectral_norm"] / x["output_norm"] for x in rows]
    ranks = [x["effective_rank"] for x in rows]
    radial = [x["radial_fraction"] for x in rows]
    transition = [x["gain"]["transition"] for x in rows]
    off, linear = [x["gain"]["off"] for x in rows], [x["gain"]["linear"] for x in rows]
    shares = [x["top_share"] for x in rows]
    top = sorted(rows, key=lambda x: -x["top_share"])[:3]
    return (f"`hf-tangent ffn-jacobian --tokens {r['tokens']} --seq_len {r['seq_len']} --max_windows {r['windows']} "
            f"--ablation_report ablation_smollm2.json` ({round(r['seconds'])} s). [report](geometry/ffn_jacobian/report.md), "
            "[gain histograms](geometry/ffn_jacobian/gain_histograms.png)\n\n"
            f"- `J = r P_u DPhi P_u` (response per radian of rotation): spectral norm {min(norms):.0f} to {max(norms):.3g} "
            f"across layers, {min(ratio):.1f}-{max(ratio):.1f} times the FFN output norm; effective rank "
            f"{min(ranks[:-1]):.0f}-{max(ranks[:-1]):.0f} of {r.get('dimension', 575)} except the last layer "
            f"({ranks[-1]:.0f}); radial fraction of the response {min(radial):.3f}-{max(radial):.3f} — the FFN's response "
            "to a rotation is almost entirely tangential.\n"
            f"- SiLU gain at the gate pre-activations: the transition regime dominates ({100 * min(transition):.0f}-"
            f"{100 * max(transition):.0f}% of units, mean {100 * sum(transition) / len(transition):.0f}%); off "
            f"{100 * min(off):.1f}-{100 * max(off):.1f}%, linear {100 * min(linear):.1f}-{100 * max(linear):.1f}%.\n"
            f"- Keys/values: the top-{r['top_k']} hidden units carry {100 * min(shares):.0f}-{100 * max(shares):.0f}% of a "
            f"token's tangential update (most concentrated in layers {', '.join(str(x['layer']) for x in top)}).\n"
            f"- Spearman across {len(rows)} layers against C_l: spectral norm {signed(rho['spectral_norm']['c_l'], 2)}, "
            f"gain off {signed(rho['gain_off']['c_l'], 2)}, gain linear {signed(rho['gain_linear']['c_l'], 2)}, top-"
            f"{r['top_k']} share {signed(rho['top_share']['c_l'], 2)}; the cost of removing the radial part "
            f"(`tangential_only` ablation) against the radial fraction {signed(rho['radial_fraction']['ablation_tangential_only'], 2)}"
            f" and the linear-gain share {signed(rho['gain_linear']['ablation_tangential_only'], 2)}; the cost of removing"
            f" the tangential part against the top-{r['top_k']} share {signed(rho['top_share']['ablation_radial_only'], 2)}"
            ". With n = 30, |rho| > 0.36 is p < 0.05 (two-sided).\n")


# ----------------------------------------------------------------------------- docs/performance.md
CPU_RUNS = ["cpu.json", "cpu_memory.json", "cpu_compile.json", "cpu_generate_rerun.json"]  # later files win


def _performance():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import make_performance_md

    runs = [report(f"benchmarks/results/{name}") for name in CPU_RUNS]
    return make_performance_md, runs, make_performance_md.merge(runs, CPU_RUNS)


def performance_tables() -> str:
    module, _, merged = _performance()
    return module.render([merged], header=False)


def performance_notes() -> str:
    _, runs, merged = _performance()
    first = {(r["shape"], r["rule"]): r for r in runs[0]["rows"] if r["suite"] == "generate"}
    rerun = {(r["shape"], r["rule"]): r for r in runs[3]["rows"]}
    memory = {r["shape"]: r for r in merged["rows"] if r["suite"] == "memory" and r["rule"] == "projected"}
    quiet = [first[k]["tokens_per_s_ratio"] for k in first if k[0] == "llama-smollm2"]
    forward = [r["ratio_median"] for r in merged["rows"] if r["suite"] in ("forward", "train")]
    return ("Measurement notes: 2 CPU cores; the spread (q25..q75 in the JSON) is several percent, so single cells "
            "within a few percent\nof a target are not distinguishable from it. The forward and memory columns come "
            "from a quiet run. The generate\ncolumn was re-measured after the no-grad fast path (`fused_residual_delta` "
            "skips autograd when no\ngradient is needed) while other jobs shared the CPU, and is the noisiest column: "
            f"the quiet first pass (before the\nfast path) read {min(quiet):.2f}-{max(quiet):.2f} on llama-smollm2; "
            "the re-measured projected and retract rows read "
            f"{rerun['llama-smollm2', 'projected']['tokens_per_s_ratio']:.2f} / "
            f"{rerun['llama-smollm2', 'retract_cayley']['tokens_per_s_ratio']:.2f} (llama) and "
            f"{rerun['gpt2-small', 'projected']['tokens_per_s_ratio']:.2f} / "
            f"{rerun['gpt2-small', 'retract_cayley']['tokens_per_s_ratio']:.2f} (gpt2). Generation decodes one token "
            "per step,\nso the patch's fixed per-layer cost (three hook calls and ~10 small kernels) is a visible share "
            "of a\n1-token step on a CPU; forward and training steps over 512 tokens stay within "
            f"{min(forward):.3f}..{max(forward):.3f}. The\nsaved-for-backward column counts distinct storages: the fused "
            "rule adds the FFN output y (in the\nmodel's dtype), "
            f"{100 * (memory['gpt2-small']['saved_bytes_ratio'] - 1):+.1f}% (gpt2) / "
            f"{100 * (memory['llama-smollm2']['saved_bytes_ratio'] - 1):+.1f}% (llama); the peak RSS of a training step "
            f"moves by {min(r['peak_ratio'] for r in memory.values()):.3f}..{max(r['peak_ratio'] for r in memory.values()):.3f}"
            ".\n")


def patch_repo_sizes() -> str:
    r = report("benchmarks/results/patch_repo_cpu.json")

    def mb(n):
        return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"

    rows = [[run, mb(x["patch_bytes"]), mb(x["full_bytes"]), f"{x['full_bytes'] / x['patch_bytes']:.0f}x",
             f"{x['reload_patch_s']:.1f} s", f"{x['reload_full_s']:.1f} s",
             "identical" if x["logits_max_abs_diff"] == 0 else f"{x['logits_max_abs_diff']:.1e}",
             ", ".join(f"`{f}`" for f in x["patch_files"])]
            for run, x in r["runs"].items()]
    return table(["run", "patch repo", "complete folder", "smaller by", "reload (patch repo)", "reload (folder)",
                  "logits, patch repo vs folder", "patch repo files"], rows, "---|---:|---:|---:|---:|---:|---:|---")


def vllm_speed() -> str:
    r = report("benchmarks/results/vllm_cpu.json")
    keys = [("prefill_tokens_per_s", "prefill"), ("decode_batch1_tokens_per_s", "decode, batch 1"),
            ("decode_batch32_tokens_per_s", "decode, 32 concurrent")]
    agree = r["agreement"]
    rows = [[name, *(f"{r['vllm_rates'][name][k]:.0f} tok/s ({r['ratios'][name][k]:.2f}x)" for k, _ in keys),
             "equal" if agree[name]["tokens_equal"] else "differ",
             "-" if agree[name]["max_logprob_gap"] is None else f"{agree[name]['max_logprob_gap']:.1e}"]
            for name in r["vllm_rates"]]
    hf = r["transformers_rates_projected"]
    return (f"vLLM {r['vllm']} on this CPU ({r['threads']} threads, {r['dtype']}, eager), SmolLM2-135M; throughput and "
            f"ratio to the unpatched folder served the same way, median of {r['vllm_rates']['unpatched']['repeats']} "
            "repeats (`benchmarks/vllm_speed.py`, [benchmarks/results/vllm_cpu.json](../benchmarks/results/vllm_cpu.json))"
            f"; the last two columns compare vLLM's greedy output with transformers' on the same folder "
            f"({r['agreement_prompts']} prompts x {r['agreement_tokens']} tokens, tests/vllm_worker.py's):"
            "\n\n" + table(["variant", *(label for _, label in keys), "greedy tokens", "largest logprob gap"], rows)
            + f"\ntransformers `generate` on the `projected` folder: {hf['decode_batch1_tokens_per_s']:.0f} tok/s at batch 1, "
            f"{hf['decode_batch32_tokens_per_s']:.0f} tok/s at batch 32; vLLM serves it "
            f"{r['vllm_over_transformers_projected']['decode_batch1_tokens_per_s']:.2f}x and "
            f"{r['vllm_over_transformers_projected']['decode_batch32_tokens_per_s']:.2f}x as fast.\n")


def gpu_check() -> str:
    """benchmarks/gpu_check.py's own rendering of its kept report, its heading one level down."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check as module

    return "#" + module.render(report("benchmarks/results/gpu.json")).strip() + "\n"


def rule_calls() -> str:
    r = report("benchmarks/results/rule_calls_cpu.json")
    calls = r["us_per_call"]
    rules = list(dict.fromkeys(k.split(", ")[0] for k in calls))
    counts = list(dict.fromkeys(k.split(", ")[1] for k in calls))
    rows = [[f"`{rule}`", *(f"{calls[f'{rule}, {n}']:.0f} us" for n in counts)] for rule in rules]
    clock = "CPU time of the process" if r.get("clock") == "cpu" else "wall clock"
    return (f"One call of the rule alone (tensor ops, no gradient, float32, rows of {r['width']}, {r['threads']} "
            f"thread{'s' * (r['threads'] != 1)}, {clock}): microseconds per call, median of {r['repeats']} interleaved "
            "rounds of 2000 calls "
            "(`benchmarks/decode_speed.py --calls`, [benchmarks/results/rule_calls_cpu.json]"
            "(../benchmarks/results/rule_calls_cpu.json)):\n\n" + table(["rule", *counts], rows))


DECODE_RUNS = ("benchmarks/results/decode_cpu.json", "benchmarks/results/decode_cpu_process_time_before.json",
               "benchmarks/results/decode_cpu_process_time.json",
               "benchmarks/results/decode_cpu_process_time_rerun_415ba94.json",
               "benchmarks/results/decode_cpu_process_time_rerun.json")


def decode_speed() -> str:
    return "\n".join(_decode_run(path) for path in DECODE_RUNS)


def _decode_run(path: str) -> str:
    r = report(path)
    batches = list(r["rows"])
    variants = list(r["rows"][batches[0]])
    cpu = r.get("clock", "wall") == "cpu"

    def cell(batch, name):
        x = r["rows"][batch][name]
        return f"{x['tokens_per_s_ratio']:.3f} [{x['q25']:.3f}, {x['q75']:.3f}]"

    base = {b: next(iter(r["rows"][b].values()))["unpatched_tokens_per_s"] for b in batches}
    code = f"At commit {r['commit']} ({r['note']}): " if "commit" in r else ""
    return (code + f"transformers `generate`, SmolLM2-135M ({r['dtype']}, {r['threads']} thread{'s' * (r['threads'] != 1)}, "
            f"{r['prompt_tokens']}-token prompts, {r['new_tokens']} new tokens, greedy), timed by "
            + ("the process's CPU time" if cpu else "the wall clock")
            + ": tokens/s of the patched model over the unpatched one, both measured in one run, median of "
            f"{r['repeats']} interleaved rounds [quartiles] (`benchmarks/decode_speed.py`, [{path}](../{path}); "
            f"{r['timed_s'] // 60} min {r['timed_s'] % 60} s of timed rounds); the unpatched model ran at "
            + ", ".join(f"{base[b]:.0f} tok/s ({b})" for b in batches) + (" of CPU time" if cpu else "") + ":\n\n"
            + table(["variant", *batches], [[v, *(cell(b, v) for b in batches)] for v in variants]))


# ----------------------------------------------------------------------------- the module table of docs/core.md
LAYERS = ("core", "options", "artifacts", "analysis", "training", "integrations", "experiments", "commands")
COMMAND_MODULES = "commands/<name>.py"


def _hf_tangent_imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level, call-time) imports of hf_tangent modules by one file, as paths relative to hf_tangent."""
    import ast

    package = list(path.relative_to(ROOT / "hf_tangent").parent.parts)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    at_call_time = {id(n) for stmt in tree.body if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    for n in ast.walk(stmt)}
    top, inner = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module.split(".") if node.module else []
        if node.level:
            base = package[:len(package) - node.level + 1] + module
        elif module[:1] == ["hf_tangent"]:
            base = module[1:]
        else:
            continue
        # `from X import Y` names module X, or module X.Y where Y is a module (a file or a package)
        names = [base + [alias.name] if (ROOT / "hf_tangent" / Path(*base, alias.name + ".py")).exists()
                 or (ROOT / "hf_tangent" / Path(*base, alias.name)).is_dir() else base for alias in node.names]
        (inner if id(node) in at_call_time else top).update("/".join(n) for n in names)
    return top, inner - top


def _module_of(name: str, rows: dict) -> str | None:
    """The table row a dotted import path belongs to (a module, or a package listed by its files)."""
    for candidate in (name + ".py", name + "/__init__.py"):
        if candidate in rows:
            return candidate
        if candidate.startswith("commands/") and candidate != "commands/arguments.py":
            return COMMAND_MODULES
    if (ROOT / "hf_tangent" / name).is_dir():
        return name + "/"
    return None


def _short(name: str, importer: str) -> str:
    here = importer.rsplit("/", 1)[0] + "/" if "/" in importer else ""
    return name.removeprefix(here).replace("/", ".") if here and name.startswith(here) else name.replace("/", ".")


def core_modules(body: str) -> str:
    """The module table: layer and description kept from the page; lines and imports read from the source; the
    layering (each module imports at module level only modules of its own or an earlier layer) checked."""
    rows = {}
    for line in body.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        module = cells[1].strip("`").split("` (")[0].strip("`")
        rows[module] = (cells[0], cells[3])
    files = sorted(p.relative_to(ROOT / "hf_tangent").as_posix() for p in (ROOT / "hf_tangent").rglob("*.py")
                   if p.name != "__init__.py")
    commands = [f for f in files if f.startswith("commands/") and f != "commands/arguments.py"]
    listed = {f for f in files if f not in commands} | {COMMAND_MODULES}
    missing, unknown = sorted(listed - set(rows)), sorted(set(rows) - listed)
    if missing or unknown:
        raise ValueError(f"docs/core.md module table: add rows for {missing}, remove rows for {unknown}")
    problems, out = [], []
    for module, (layer, what) in rows.items():
        paths = commands if module == COMMAND_MODULES else [module]
        if layer not in LAYERS:
            raise ValueError(f"docs/core.md: layer {layer!r} of {module} is not one of {LAYERS}")
        top, inner = set(), set()
        for path in paths:
            t, i = _hf_tangent_imports(ROOT / "hf_tangent" / path)
            top |= t
            inner |= i
        for name in sorted(top):
            target = _module_of(name, rows)
            target_layer = rows[target][0] if target in rows else (
                max((rows[r][0] for r in rows if r.startswith(target or "-")), key=LAYERS.index, default=None))
            if target_layer is None:
                problems.append(f"{module} imports {name}, which is not in the table")
            elif LAYERS.index(target_layer) > LAYERS.index(layer):
                problems.append(f"{module} ({layer}) imports {name} ({target_layer}) at module level")
        own = module.rsplit("/", 1)[0] + "/" if "/" in module else None
        shown = sorted({_short(n, module) for n in top if not (own and module == COMMAND_MODULES and n == "commands")})
        later = sorted({_short(n, module) for n in inner} - set(shown))
        imports = ", ".join(f"`{n}`" for n in shown) or "–"
        if later:
            imports += " (at call time: " + ", ".join(f"`{n}`" for n in later) + ")"
        lengths = [len((ROOT / "hf_tangent" / p).read_text(encoding="utf-8").splitlines()) for p in paths]
        lines = f"{min(lengths)}–{max(lengths)}" if len(paths) > 1 else str(lengths[0])
        name = f"`{module}` ({len(paths)})" if module == COMMAND_MODULES else f"`{module}`"
        out.append([layer, name, lines, what, imports])
    if problems:
        raise ValueError("docs/core.md: the layering is broken: " + "; ".join(problems))
    out.sort(key=lambda row: LAYERS.index(row[0]))
    return table(["layer", "module", "lines", "what it holds", "imports (hf_tangent)"], out, "---|---|---:|---|---")


# ----------------------------------------------------------------------------- docs/lm-eval.md
LM_EVAL_MODELS = "lm_eval/models/report.json"  # the measured models (merged parts), and the rules' perplexity
LM_EVAL_RULES = "lm_eval/rules/report.json"  # the untrained rules on the multiple-choice tasks, fewer items
LM_EVAL_VERSION1 = "lm_eval/version1/report.json"  # the previous task version's run (a record)
LM_EVAL_FOLDERS = {  # the saved patches of the kept runs: what they hold, and the report of the run that made them
    "main_job/patch": ("calibrated gates (main job, patch repo)", "lm_eval/main_job.json",
                       lambda r: r["heldout"]["delta_nll"]),
    "heal_long/runs/seed0/patch": ("healed: heal_long, projected, 120 steps (patch repo)", "lm_eval/heal_long.json",
                                   lambda r: r["summary"]["healed_delta_nll"]),
    "heal_parallel/runs/seed0/patch": ("healed: heal_parallel, 8 parallel layers, 60 steps (patch repo)",
                                       "lm_eval/heal_parallel.json", lambda r: r["summary"]["healed_delta_nll"]),
}
LM_EVAL_METRICS = ("acc", "acc_norm", "word_perplexity", "bits_per_byte")  # lm-eval's, as the table shows them
LM_EVAL_PAIRED = ("acc", "acc_norm", "bits_per_byte", "word_nll")


def _lm_eval_folder(label: str):
    return next((entry for tail, entry in LM_EVAL_FOLDERS.items() if label.endswith(tail)), None)


def _lm_eval_label(label: str) -> str:
    entry = _lm_eval_folder(label)
    return label if entry is None else entry[0]


def _lm_eval_held_out(label: str, rules: dict):
    """The variant's held-out Delta L: `hf-tangent eval` for the rules, the report of the run that saved a folder."""
    entry = _lm_eval_folder(label)
    return rules.get(label) if entry is None else entry[2](report(entry[1]))


def _lm_eval_parts(r: dict) -> str:
    if not r.get("parts"):
        return f"{minutes(r['seconds'])} on this CPU ({r['threads']} thread(s))"
    parts = r["parts"]
    threads = sorted({str(p.get("threads")) for p in parts})
    return (f"{minutes(r['seconds'])} of process time in all on this CPU ({len(parts)} part(s) of "
            f"{'/'.join(map(str, threads))} thread(s), two at a time, merged by `hf-tangent lm-eval-merge`; "
            + "; ".join(f"{', '.join(p['tasks'])} x {len(p['variants'])} variants: {minutes(p['seconds'])}" for p in parts)
            + ")")


def _lm_eval_tables(r: dict, held_out: dict) -> list[str]:
    out = []
    for task in r["tasks"]:
        variants = [v for v in r["variants"] if task in r["results"][v]]
        metrics = [m for m in LM_EVAL_METRICS if any(f"{m},none" in r["results"][v][task] for v in variants)]
        paired = [m for m in LM_EVAL_PAIRED if any(m in p.get(task, {}) for p in r["paired"].values())]
        rows = []
        for variant in variants:
            values, p = r["results"][variant][task], r["paired"].get(variant, {}).get(task, {})
            cells = [f"{values[f'{m},none']:.4g}" + (f" ± {values[f'{m}_stderr,none']:.2g}"
                                                     if isinstance(values.get(f"{m}_stderr,none"), float) else "")
                     for m in metrics]
            cells += ["-" if m not in p else f"{signed(p[m]['diff'], 4)} [{signed(p[m]['low'], 4)}, {signed(p[m]['high'], 4)}]"
                      for m in paired]
            delta = _lm_eval_held_out(variant, held_out)
            rows.append([_lm_eval_label(variant), *cells, "-" if delta is None else signed(delta, 4)])
        n = r["n_samples"]["unpatched"][task]
        unit = "chapters" if "bits_per_byte" in metrics else "items"
        out.append(f"**{task}** ({n['effective']} of {n['original']} {unit})\n\n" + table(
            ["variant", *metrics, *[f"delta {m} [95% CI]" for m in paired], "held-out Delta L"], rows,
            "---" + "|---:" * (len(metrics) + len(paired) + 1)))
    return out


def lm_eval_results() -> str:
    """The measured tables: the trained models on every task (merged parts) and the untrained rules."""
    models, rules = report(LM_EVAL_MODELS), report(LM_EVAL_RULES)
    held_out = {row["variant"]: row["delta_nll"] for row in report("eval_smollm2.json")["rows"]}
    windows = "; ".join(sorted({f"{_lm_eval_label(v)}: {w['eval_windows']} x {w['seq_len']} tokens"
                                for v in models["variants"] if _lm_eval_folder(v) for w in [report(_lm_eval_folder(v)[1])]}))
    out = [f"`hf-tangent lm-eval` on {models['model']}, {models['num_fewshot'] or 0}-shot, task version "
           f"{next(iter(models['task_source'].values())).rsplit(' ', 1)[-1]}, {_lm_eval_parts(models)} "
           "([report](results/lm_eval/models/report.md)). Differences against the unpatched model over the same items, "
           f"95% paired bootstrap interval ({models['bootstrap']} resamples of the items; of the chapters for "
           "austen_perplexity, whose bits_per_byte and word_nll, nats per word, are ratios of sums). The last column is "
           "the variant's held-out Delta L in nats per token: from `hf-tangent eval` (README, 16 x 256 tokens of Emma) "
           f"for the update rules, from the report of the run that saved it for a patch ({windows}).\n"]
    out += _lm_eval_tables(models, held_out)
    out.append(f"\n**The untrained rules on the multiple-choice tasks** ({rules['limit']} items per task, "
               f"{_lm_eval_parts(rules)}; [report](results/lm_eval/rules/report.md)):\n")
    out += _lm_eval_tables(rules, held_out)
    return "\n".join(out)


def lm_eval_findings() -> str:
    """Per variant (both kept runs together): which paired differences the measurement resolves (95%
    interval excluding zero), and the widest interval of the trained models' accuracy differences
    against the +-3-point target."""
    models, rules = report(LM_EVAL_MODELS), report(LM_EVAL_RULES)
    held_out = {row["variant"]: row["delta_nll"] for row in report("eval_smollm2.json")["rows"]}
    found: dict[str, tuple[list, list]] = {}
    widest = (0.0, "", "")
    for r in (models, rules):
        for variant, tasks in r["paired"].items():
            resolved, unresolved = found.setdefault(variant, ([], []))
            for task, metrics in tasks.items():
                for metric, d in metrics.items():
                    scale, digits, unit = (100, 1, " points") if metric in ("acc", "acc_norm") else (1, 4, "")
                    text = (f"{task} {metric} {signed(d['diff'] * scale, digits)}{unit} "
                            f"[{signed(d['low'] * scale, digits)}, {signed(d['high'] * scale, digits)}]")
                    (resolved if d["low"] > 0 or d["high"] < 0 else unresolved).append(text)
                    if r is models and scale == 100 and (d["high"] - d["low"]) / 2 > widest[0]:
                        widest = ((d["high"] - d["low"]) / 2, _lm_eval_label(variant), f"{task} {metric}")
    lines = []
    for variant, (resolved, unresolved) in found.items():
        delta = _lm_eval_held_out(variant, held_out)
        lines.append(f"- **{_lm_eval_label(variant)}** (held-out Delta L {'-' if delta is None else signed(delta, 4)}): "
                     f"resolved: {'; '.join(resolved) or 'none'}; within noise: {'; '.join(unresolved) or 'none'}.")
    return (f"The widest 95% interval of a trained model's accuracy difference: +-{widest[0] * 100:.1f} points "
            f"({widest[1]}, {widest[2]}); the measurement asked for at most +-3.\n\n" + "\n".join(lines) + "\n")


LM_EVAL_BASELINES = "lm_eval/task_baselines.json"


def lm_eval_baselines() -> str:
    """No-model baselines of the shipped tasks and of the previous task version (benchmarks/task_baselines.py),
    next to the models' accuracy on each version (the kept lm-eval runs)."""
    b, now_run, before_run = report(LM_EVAL_BASELINES), report(LM_EVAL_MODELS), report(LM_EVAL_VERSION1)
    shipped, previous = b["shipped"], b["previous"]
    out = [f"`benchmarks/task_baselines.py` on the shipped task files and on the previous version (commit "
           f"`{previous['commit']}`); n-gram model fitted on the calibration novels ({', '.join(b['calibration_novels'])}); "
           "expected accuracy under random tie-breaking (last word: a case-insensitive match, an upper bound of lm-eval's "
           "acc). The model rows (bold): the kept lm-eval runs (items scored: in each task's heading).\n"]
    for task in ("austen_nextsentence", "austen_lastword"):
        now, before = shipped[task], previous[task]
        chance = "" if now["chance"] is None else f", chance {now['chance']:.2f}"
        rows = [[name, p["what"], f"{p['acc']:.4f}", f"{before['predictors'][name]['acc']:.4f}"]
                for name, p in now["predictors"].items()]
        for variant in now_run["variants"]:
            for metric in ("acc", "acc_norm"):
                value = now_run["results"][variant].get(task, {}).get(f"{metric},none")
                if value is None:
                    continue
                old = before_run["results"].get(variant, {}).get(task, {}).get(f"{metric},none")
                rows.append([f"**{_lm_eval_label(variant)}, {metric}**", "the model",
                             f"{value:.4f}", "-" if old is None else f"{old:.4f}"])
        scored = (f"; models on the first {now_run['n_samples']['unpatched'][task]['effective']} items now, "
                  f"{before_run['n_samples']['unpatched'][task]['effective']} before")
        out.append(f"**{task}** ({now['items']} items now, {before['items']} before{chance}{scored})\n\n" + table(
            ["predictor", "what it reads", "shipped version", "previous version"], rows, "---|---|---:|---:"))
    return "\n".join(out)


def lm_eval_data_size() -> str:
    files = sorted((ROOT / "hf_tangent" / "integrations" / "harness" / "data").glob("*.jsonl"))
    return f"{sum(f.stat().st_size for f in files) / 1e6:.1f} MB"


# ----------------------------------------------------------------------------- docs/recipes.md (the mixed corpus)
CORPUS_SOURCES = "corpus/sources.json"  # SOURCES of the extracted corpus (hf_tangent.training.corpora), kept


def corpus_sources() -> str:
    r = report(CORPUS_SOURCES)
    rows = [["austen", "r-cran-janeaustenr", "public domain", "three novels (calibration)", "two novels (Emma, Mansfield Park)",
             "early 19th-century fiction"]]
    for name, d in r["domains"].items():
        rows.append([name, f"{d['package']} {d['version'].split()[-1]}", d["licence"],
                     f"{d['train']['documents']} docs, {d['train']['words']:,} words",
                     f"{d['heldout']['documents']} docs, {d['heldout']['words']:,} words", d["description"]])
    sizes = r["sizes"]
    return (f"Extracted here from Debian bookworm (kept: `docs/results/corpus/sources.json`); training text capped at "
            f"{sizes['train_max_words']:,} words and held-out text at {sizes['heldout_max_words']:,} words per domain "
            f"(at least {sizes['heldout_min_words']:,}).\n\n"
            + table(["domain", "package", "licence", "train", "held out", "what"], rows, "---|---|---|---:|---:|---"))


# ----------------------------------------------------------------------------- docs/recipes.md (healing per domain)
HEAL_DOMAINS = "heal/domains"  # issue 37: the heals trained on Austen only and on the mixed corpus, every held-out domain
HEAL_DOMAIN_RUNS = {  # patch: (label, Austen-only heal report, its per-domain eval, mixed-corpus heal report (if run),
    # the untrained patch's per-domain eval and its row there)
    "projected": ("projected, 120 steps (heal_long)", "heal_long_austen/report.json", "heal_long_austen/eval.json",
                  "heal_long_mixed/report.json", "untrained_eval.json", "projected"),
    "parallel": ("8 parallel layers, 60 steps (heal_parallel)", "heal_parallel_austen/report.json",
                 "heal_parallel_austen/eval.json", "heal_parallel_mixed/report.json", "parallel_untrained_eval.json",
                 "saved patch (as loaded)"),
}


def _ci(d: dict) -> str:
    return signed(d["delta_nll"], 4) + ("" if d.get("low") is None else f" [{signed(d['low'], 4)}, {signed(d['high'], 4)}]")


def _domain_rows(evaluation: dict, domain: str, unpatched: float, windows: int) -> dict:
    rows = {r["variant"]: r for r in evaluation["domains"][domain]["rows"]}
    if abs(rows["unpatched"]["nll"] - unpatched) > 1e-4 or evaluation["domains"][domain]["windows"] != windows:
        raise ValueError(f"heal-domains, {domain}: the per-domain reports scored other windows")
    return rows


def _heal_domain_runs():
    """Per heal of HEAL_DOMAIN_RUNS: its label, the line on how it was trained, and per held-out domain the
    window count, the unpatched NLL and the differences (dicts with delta_nll, low, high) of the untrained
    patch, the Austen-only heal and the mixed-corpus heal (None where not measured)."""
    for label, austen_report, austen_eval, mixed_report, untrained_eval, untrained_row in HEAL_DOMAIN_RUNS.values():
        austen, evaluation = report(f"{HEAL_DOMAINS}/{austen_report}"), report(f"{HEAL_DOMAINS}/{austen_eval}")
        untrained = report(f"{HEAL_DOMAINS}/{untrained_eval}")
        mixed = report(f"{HEAL_DOMAINS}/{mixed_report}") if (RESULTS / HEAL_DOMAINS / mixed_report).is_file() else None
        rows = []
        for domain, d in evaluation["domains"].items():
            base = _domain_rows(evaluation, domain, evaluation["domains"][domain]["rows"][0]["nll"], d["windows"])
            first = _domain_rows(untrained, domain, base["unpatched"]["nll"], d["windows"])
            m = mixed["domains"][domain] if mixed else None
            if m and (abs(m["unpatched_nll"] - base["unpatched"]["nll"]) > 1e-4 or m["windows"] != d["windows"]):
                raise ValueError(f"heal-domains, {domain}: the mixed heal scored other windows")
            rows.append({"domain": domain, "windows": d["windows"], "unpatched": base["unpatched"]["nll"],
                         "untrained": m["runs"][0]["untrained"] if m else first.get(untrained_row),
                         "austen": base["saved patch (as loaded)"], "mixed": m["runs"][0]["healed"] if m else None})
        trained = (f"mixed: {', '.join(f'{n} {k}' for n, k in mixed['train_domains'].items())} training windows, "
                   f"{minutes(mixed['seconds'])}; " if mixed else "")
        yield label, (f"(seed {austen['seeds'][0]}, {austen['training']['max_steps']} steps; {trained}Austen only: "
                      f"{austen['train_windows']} windows of the calibration novels, {minutes(austen['seconds'])})"), rows


def heal_domains() -> str:
    """Per held-out domain: the unpatched NLL, the untrained patch, and the patch healed on Austen only
    and (where measured) on the mixed corpus: differences from the unpatched model over the same windows."""
    out = []
    for label, trained, rows in _heal_domain_runs():
        out.append(f"**{label}** {trained}\n\n" + table(
            ["held-out domain", "windows", "unpatched NLL", "untrained patch", "healed on Austen only",
             "healed on the mixed corpus"],
            [[r["domain"], str(r["windows"]), f"{r['unpatched']:.4f}", _ci(r["untrained"]) if r["untrained"] else "-",
              _ci(r["austen"]), _ci(r["mixed"]) if r["mixed"] else "not measured"] for r in rows],
            "---|---:|---:|---:|---:|---:"))
    return ("Delta NLL against the unpatched model (nats per token) over each domain's first held-out windows of 256 "
            "tokens, 95% paired bootstrap interval over the windows; kept under `docs/results/heal/domains/` (the heal "
            "reports, `hf-tangent eval --corpus mixed` of each patch, the patch repos; the same as intervals: "
            "`heal/domains/intervals.png`).\n\n" + "\n\n".join(out))


def heal_domain_intervals(path: Path) -> None:
    """The heal-domains tables as interval plots: one panel per heal, per domain the untrained patch and
    the two heals, point and 95% interval, on a log axis (the untrained projected patch is 100x the rest)."""
    from hf_tangent.experiments.plots import _pyplot, _save

    plt = _pyplot()
    runs = list(_heal_domain_runs())
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.8), squeeze=False)
    for ax, (label, _, rows) in zip(axes[0], runs, strict=True):
        for k, (key, name, color) in enumerate((("untrained", "untrained patch", "tab:red"),
                                                ("austen", "healed on Austen only", "tab:blue"),
                                                ("mixed", "healed on the mixed corpus", "tab:green"))):
            points = [(i + (k - 1) * 0.22, r[key]) for i, r in enumerate(rows) if r[key]]
            ax.errorbar([x for x, _ in points], [d["delta_nll"] for _, d in points], fmt="o", color=color, capsize=3,
                        label=name, yerr=[[d["delta_nll"] - d["low"] for _, d in points],
                                          [d["high"] - d["delta_nll"] for _, d in points]])
        ax.axhline(HEAL_DOMAIN_TARGET, color="grey", ls="--", lw=0.8, label=f"target +{HEAL_DOMAIN_TARGET}")
        ax.set_yscale("symlog", linthresh=0.01)  # some intervals reach below zero
        ax.set_xticks(range(len(rows)), [r["domain"] for r in rows])
        ax.set_ylabel("delta NLL vs unpatched (nats, symlog)")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=7)
    _save(fig, str(path))


def heal_domains_findings() -> str:
    """What the per-domain table says, from the same reports."""
    lines = []
    for label, _, austen_eval, mixed_report, untrained_eval, untrained_row in HEAL_DOMAIN_RUNS.values():
        evaluation, untrained = report(f"{HEAL_DOMAINS}/{austen_eval}"), report(f"{HEAL_DOMAINS}/{untrained_eval}")
        healed = {d: {r["variant"]: r for r in v["rows"]}["saved patch (as loaded)"] for d, v in evaluation["domains"].items()}
        before = {d: {r["variant"]: r for r in v["rows"]}[untrained_row] for d, v in untrained["domains"].items()}
        others = [d for d in healed if d != "austen"]
        low = min(healed[d]["delta_nll"] for d in others)
        high = max(healed[d]["delta_nll"] for d in others)
        above = sum(healed[d]["low"] > 0 for d in others)
        kept = [1 - healed[d]["delta_nll"] / before[d]["delta_nll"] for d in others]
        lines.append(
            f"- **{label}**, trained on the novels only: {signed(healed['austen']['delta_nll'], 4)} nats on held-out "
            f"Austen, {signed(low, 3)} to {signed(high, 3)} on the other {len(others)} domains ({above} of them with "
            f"the whole interval above zero); of the untrained damage there "
            f"({signed(min(before[d]['delta_nll'] for d in others), 3)} to "
            f"{signed(max(before[d]['delta_nll'] for d in others), 3)}) the heal removed "
            f"{min(kept):.0%} to {max(kept):.0%}, against {1 - healed['austen']['delta_nll'] / before['austen']['delta_nll']:.0%} "
            "on Austen." + (_mixed_finding(report(f"{HEAL_DOMAINS}/{mixed_report}"), healed)
                            if (RESULTS / HEAL_DOMAINS / mixed_report).is_file() else
                            " The same heal on the mixed corpus: not measured yet."))
    return "\n".join(lines)


HEAL_DOMAIN_TARGET = 0.05  # issue 37: the mixed-corpus heal within +0.05 nats of the unpatched model on every domain
HEAL_AUSTEN_MARGIN = 0.01  # ... and no worse than the Austen-only heal on held-out Austen by more than 0.01


def _mixed_finding(mixed: dict, austen_only: dict) -> str:
    """The same heal trained on the mixed corpus, against the target and the Austen-only heal."""
    healed = {d: v["runs"][0]["healed"] for d, v in mixed["domains"].items()}
    others = [d for d in healed if d != "austen"]
    missed = [f"{d} {signed(healed[d]['delta_nll'], 3)}" for d in healed if healed[d]["delta_nll"] > HEAL_DOMAIN_TARGET]
    change = healed["austen"]["delta_nll"] - austen_only["austen"]["delta_nll"]
    return (f" Trained on the mixed corpus instead: {signed(healed['austen']['delta_nll'], 4)} on held-out Austen "
            f"({signed(change, 4)} against the Austen-only heal), "
            f"{signed(min(healed[d]['delta_nll'] for d in others), 3)} to "
            f"{signed(max(healed[d]['delta_nll'] for d in others), 3)} on the other domains. Target (within "
            f"+{HEAL_DOMAIN_TARGET} of the unpatched model on every domain, Austen no worse by more than "
            f"{HEAL_AUSTEN_MARGIN}): " + ("met." if not missed and change <= HEAL_AUSTEN_MARGIN else "missed (" + "; ".join(
                missed + ([f"Austen {signed(change, 4)} against the Austen-only heal"] if change > HEAL_AUSTEN_MARGIN
                          else [])) + ")."))


REGIONS = {
    "heal-domains": heal_domains,
    "heal-domains-findings": heal_domains_findings,
    "corpus-sources": corpus_sources,
    "lm-eval-results": lm_eval_results,
    "lm-eval-findings": lm_eval_findings,
    "lm-eval-data-size": lm_eval_data_size,
    "lm-eval-baselines": lm_eval_baselines,
    "core-modules": core_modules,
    "vllm-speed": vllm_speed,
    "decode-speed": decode_speed,
    "gpu-check": gpu_check,
    "rule-calls": rule_calls,
    "patch-repo-sizes": patch_repo_sizes,
    "performance-tables": performance_tables,
    "performance-notes": performance_notes,
    "main-job": main_job,
    "main-job-table": main_job_table,
    "main-job-files": main_job_files,
    "sweep-count": sweep_count,
    "eval-table": lambda: eval_table("eval_smollm2.json"),
    "results-main-job": results_main_job,
    "results-finetune": results_finetune,
    "results-ablation": results_ablation,
    "results-gemma3": results_gemma3,
    "results-heal": results_heal,
    "results-heal-findings": results_heal_findings,
    "results-diagnostics": results_diagnostics,
    "results-parallel": results_parallel,
    "results-critical": results_critical,
    "results-critical-structure": results_critical_structure,
    "results-pressure": results_pressure,
    "results-ffn-jacobian": results_ffn_jacobian,
}

# Numbers outside the regions that are not measurements: settings, thresholds, formulas, paper values.
CONSTANTS: dict[str, set[str]] = {
    # versions (hf_tangent 0.3, transformers 5.24), eps 1e-6, gate init 1.0
    "README.md": {"0.3", "5.24", "1e-6", "1.0"},
    # the geometry section is rendered (results-critical ...) except the paper's published values
    "docs/results/README.md": set(),
    # Trainer settings and a tolerance of the tests (lr 1e-2 / 5e-5, lambda 0.5, losses within 5e-7)
    "docs/recipes.md": {"0.0", "0.5", "1.0", "1e-2", "5e-5", "5e-7"},
    # the critical-direction search's settings and the arXiv id of the paper
    "docs/geometry.md": {"0.01", "0.05", "0.999", "0.33", "0.67", "1e-2", "1e-4", "1e-6", "1e-7", "1e-8", "1e-9", "2608.02071",
                         "5e-2"},
    # versions, the coverage builder's ranges and tolerances, eps orders of magnitude
    "docs/core.md": {"0.1", "0.2", "0.3", "0.5", "1.5", "1e-4", "1e-5", "5.24"},
    "docs/parallel.md": {"1e-6"},  # a tolerance of the tests
    "docs/diagnostics.md": {"1e-7"},  # a tolerance of the tests
    # the studies' variant settings (gamma, beta, thresholds)
    "docs/studies-guide.md": {"0.9", "0.031", "0.03125", "0.05", "0.0625", "0.1", "0.25", "0.5", "0.6", "1e-2", "1e-3",
                              "3e-2", "3e-3"},
    # the targets (forward <= 1.02, training <= 1.03, generation >= 0.98, vLLM decode >= 0.95) and test tolerances
    "docs/performance.md": {"0.95", "0.97", "0.98", "0.99", "1.02", "1.03", "1e-5", "1e-6", "1e-7"},  # targets, tolerances
    "docs/serving.md": {"1e-4", "0.32"},  # the test's logprob tolerance, the vllm-cpu version
    "docs/lm-eval.md": {"0.4", "0.67", "1.5", "1e-4", "0.3"},  # lm-eval's version line, the builder's length ratio bounds, the vLLM test's tolerance and CPU memory fraction
    # the formulas' constants, the paper's published gate means and budgets, the arXiv ids
    "docs/math.md": {"0.02", "0.29", "0.9", "0.25", "0.5", "0.852", "0.917", "1.0", "1.009", "1.048", "1.063", "1e-2",
                     "1e-3", "1e-6", "2601.22095", "2608.02071", "2608.02668", "3e-2", "3e-3"},
}


# ----------------------------------------------------------------------------- rendering and checks
def render(text: str) -> str:
    def fill(match):
        name = match.group("name")
        if name not in REGIONS:
            raise KeyError(f"unknown figures region {name!r}; known: {', '.join(REGIONS)}")
        renderer = REGIONS[name]
        # a renderer with a parameter keeps what the page itself holds (descriptions) and renders the rest
        body = renderer(match.group("body")) if renderer.__code__.co_argcount else renderer()
        return match.group(1) + body + match.group(4)

    return REGION.sub(fill, text)


def stray_numbers(path: str, text: str) -> list[str]:
    """Numbers outside generated regions, code and links that CONSTANTS does not list for `path`."""
    text = REGION.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    return sorted({n for n in NUMBER.findall(text) if n.lstrip("+-") not in CONSTANTS.get(path, set())})


def main_job_plots(folder: Path) -> None:
    """The main job's plots (gate profile, loss curve, delta NLL per rule) from its kept report."""
    from hf_tangent.experiments.report import Report

    Report.load(RESULTS / "offline_default_smollm2.json").plot(folder)


# Images the pages show, drawn from kept reports (not compared by --check: PNG bytes vary with matplotlib)
IMAGES = {RESULTS / "heal" / "domains" / "intervals.png": heal_domain_intervals, RESULTS: main_job_plots}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on any difference")
    args = parser.parse_args(argv)
    problems = []
    for path in CHECKED:
        file = ROOT / path
        text = file.read_text(encoding="utf-8")
        rendered = render(text)
        if rendered != text:
            if args.check:
                problems.append(f"{path}: a generated region differs from its rendering (run python docs/figures.py)")
            else:
                file.write_text(rendered, encoding="utf-8")
        stray = stray_numbers(path, rendered)
        if stray:
            problems.append(f"{path}: numbers neither rendered from a report nor listed in CONSTANTS: {', '.join(stray)}")
    if not args.check:
        for path, draw in IMAGES.items():
            draw(path)
    print("\n".join(problems) or "figures: every region matches its reports; no stray numbers")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
