"""Residual geometry of a frozen model (geometry.py): `critical` (critical directions of the reduced
fields and their tangent-Jacobian types, the paper's Table 2), `pressure` (spherical diversity under
growing attention aggregation, per FFN variant) and `ffn_jacobian` (per-token FFN Jacobian, gain and
keys/values view, next to C_l and the ablation costs)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Literal

import torch

from ..analysis.geometry import (
    FIELDS,
    GAIN_REGIMES,
    PROTOCOLS,
    FfnProbe,
    block_inputs,
    critical_directions,
    ffn_inputs,
    gain_regimes,
    label_counts,
    pressure_diversity,
)
from ..analysis.parallel import sensitivity
from ..analysis.stats import spearman
from ..core.discovery import decoder_layers
from ..ranges import LAYER_INDICES, DType, Range, at_least, validated
from . import plots
from .analysis import _setup
from .common import Clock, Model, Text, Tokenizer, entry_point, progress_bar
from .report import Report, register_report

PRESSURE_VARIANTS = ("full", "tangential_only", "radial_only", "zero_ffn")
CRITICAL_RANGES = {"random_starts": at_least(0), "token_starts": at_least(0), "steps": at_least(1),
                   "threshold": Range(0, 1, open_low=True), "rel_tol": Range(0, 1, open_high=True),
                   "tol": Range(0, 1, open_low=True, open_high=True), "max_iter": at_least(1),
                   "layers": LAYER_INDICES}
PRESSURE_RANGES = {"factors": Range(0), "layers": LAYER_INDICES}
FFN_JACOBIAN_RANGES = {"tokens": at_least(1), "top_k": at_least(1), "layers": LAYER_INDICES}


def _layers(model, layers):
    n = len(decoder_layers(model))
    chosen = list(range(n)) if layers is None else list(layers)
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {bad} out of range; accepted: 0..{n - 1}.")
    return chosen


@validated(CRITICAL_RANGES)
@entry_point(patched_model="refused")
def critical(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, layers: list[int] | None = None, fields: list[str] = FIELDS,
             protocol: Literal[PROTOCOLS] = "refined", random_starts: int = 32, token_starts: int = 32, steps: int = 300,
             threshold: float = 0.05, tol: float = 1e-8, max_iter: int = 20, rel_tol: float = 1e-2, seq_len: int = 256,
             max_windows: int = 2, dtype: DType = "float32", device: str | None = None, seed: int = 0,
             progress: bool = True) -> Report:
    """Critical directions of the OV-only, FFN-only and full reduced fields of every layer
    (docs/geometry.md), from `random_starts` Gaussian and `token_starts` real token directions (block
    inputs on `max_windows` windows of held-out text). protocol="refined": roots of P_u F refined to a
    zero score < `tol` in float64 (at most `max_iter` Newton steps), deduplicated, typed by the signs
    of their tangent spectra; the OV field solved exactly where it is linear on the sphere; common
    directions of F_A and F_Phi and the eigenvalue law there. protocol="paper": the paper's
    thresholded candidates (zero score < `threshold`, labels with `rel_tol`), which are not roots.
    The `critical` report; its `tensors` (critical_directions.safetensors) hold every reported
    direction, key `layer{L}.{field}`, rows in the report's order.

    Args:
        model, tokenizer, text, seq_len, max_windows, dtype, device, seed, progress: as every analysis (experiments/analysis.py).
        layers: layers to analyse (default all)
        fields: reduced fields: attention (OV-only), ffn (FFN-only), full (their sum)
        protocol: refined: roots of P_u F refined in float64 to a zero score < --tol (critical directions); paper:
            the paper's thresholded near-invariant directions (score < --threshold), for a like-for-like Table 2
        random_starts: random Gaussian starts per layer and field
        token_starts: real token directions (block inputs) as starts
        steps: Adam steps per start before the refinement
        threshold: search threshold: starts whose zero score ||P_u F|| / ||F|| ends below it are refined (refined)
            or counted as candidates (paper)
        tol: refined: a root's zero score must fall below this (float64)
        max_iter: refined: Newton / Levenberg-Marquardt steps per start
        rel_tol: paper: |Re lambda| below rel_tol x spectral radius counts as zero (refined types by sign)
    """
    bad = [f for f in fields if f not in FIELDS]
    if bad:
        raise ValueError(f"unknown fields {bad}; accepted: {', '.join(FIELDS)}.")
    if random_starts + token_starts == 0:
        raise ValueError("random_starts=0, token_starts=0: accepted: at least one start.")
    model, _, name, text, held_out, env = _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed)
    chosen = _layers(model, layers)
    clock = Clock()
    starts = block_inputs(model, held_out, chosen, token_starts, seed) if token_starts else {
        i: torch.zeros(0, model.get_input_embeddings().weight.shape[-1]) for i in chosen}
    rows, tensors = [], {}
    with progress_bar(progress, len(chosen), "hf-tangent critical", "layer") as bar:
        for i in chosen:
            layer_clock = Clock()
            result = critical_directions(model, i, starts[i], random_starts=random_starts, fields=fields, steps=steps,
                                         threshold=threshold, protocol=protocol, tol=tol, max_iter=max_iter,
                                         rel_tol=rel_tol, seed=seed)
            row = {k: v for k, v in result.items() if k != "fields"} | {"seconds": layer_clock.seconds, "fields": {}}
            for field, found in result["fields"].items():
                tensors[f"layer{i}.{field}"] = found["directions"].float().contiguous()
                row["fields"][field] = {k: v for k, v in found.items() if k != "directions"} | {
                    "counts": label_counts(found["roots"])}
            rows.append(row)
            bar.update(1)
    split_eigenvalues(rows, tensors)
    report = Report("critical", {
        "command": "critical", "protocol": protocol, "model": name, "text": text.describe(), "seq_len": seq_len,
        "windows": len(held_out), "fields": list(fields), "random_starts": random_starts, "token_starts": token_starts,
        "steps": steps, "threshold": threshold, "tol": tol, "max_iter": max_iter, "rel_tol": rel_tol,
        "composition": "additive: F = F_A + F_Phi (docs/geometry.md)", "layers": rows,
        "totals": _critical_totals(rows, fields), "directions_file": DIRECTIONS_FILE, "seconds": clock.seconds, **env})
    report.tensors = tensors
    return report


DIRECTIONS_FILE = "critical_directions.safetensors"


def split_eigenvalues(rows: list[dict], tensors: dict) -> None:
    """Move every root's eigenvalue sample ([re, im] pairs) into the directions file as
    `layer{i}.{field}.eigenvalues` ([roots, k, 2], in the order of the roots and of `layer{i}.{field}`);
    report.json keeps it only on each layer's best root (the lowest score, first on a tie: the one the
    plot shows), so the JSON stays readable (an exact OV path has hundreds of roots)."""
    for row in rows:
        for field, found in row["fields"].items():
            roots = found["roots"]
            if not roots or "eigenvalues" not in roots[0]:
                continue
            best = min(roots, key=lambda r: r["score"])
            tensors[f"layer{row['layer']}.{field}.eigenvalues"] = torch.tensor(
                [r["eigenvalues"] for r in roots], dtype=torch.float32)
            for root in roots:
                if root is not best:
                    del root["eigenvalues"]


def _critical_totals(rows: list[dict], fields) -> dict:
    totals = {}
    for f in fields:
        found = [r["fields"][f] for r in rows]
        roots = [root for x in found for root in x["roots"]]
        totals[f] = {key: sum(x.get(key, 0) for x in found) for key in (
            "starts", "below_threshold", "merged_before_refining", "refined", "converged", "stalled", "unfinished",
            "near_invariant")}
        totals[f] |= {"roots": len(roots), "counts": dict(sum((Counter(x["counts"]) for x in found), Counter())),
                      "flagged": sum(bool(root.get("flagged")) for root in roots),
                      "mean_unstable_share": sum(root["unstable_share"] for root in roots) / len(roots) if roots else None,
                      "degenerate": sum(len(x.get("degenerate", [])) for x in found)}
    return totals


@validated(PRESSURE_RANGES)
@entry_point(patched_model="refused")
def pressure(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, factors: list[float] = (1.0, 0.5, 0.25, 0.1, 0.0),
             variants: list[Literal[PRESSURE_VARIANTS]] = PRESSURE_VARIANTS, layers: list[int] | None = None, seq_len: int = 256,
             max_windows: int = 4, dtype: DType = "float32", device: str | None = None, seed: int = 0,
             progress: bool = True) -> Report:
    """Spherical diversity D before attention, after attention and after the FFN, per layer, as the
    attention logit scale is multiplied by each `factor` (1: the model; 0: uniform averaging, the
    most aggregation pressure), for every FFN variant (full, tangential-only, radial-only, zero).
    The `pressure` report.

    Args:
        model, tokenizer, text, seq_len, max_windows, dtype, device, seed, progress: as every analysis (experiments/analysis.py).
        factors: attention logit-scale factors (1: the model, 0: uniform averaging = most pressure)
        variants: FFN variants in all layers
        layers: layers whose diversity is recorded (default all)
    """
    if not factors:
        raise ValueError("pressure factors []; accepted: numbers >= 0 (1: the model's own scale).")
    model, _, name, text, held_out, env = _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed)
    chosen = _layers(model, layers)
    clock = Clock()
    with progress_bar(progress, len(factors), "hf-tangent pressure", "factor") as bar:
        rows = pressure_diversity(model, held_out, [float(f) for f in factors], list(variants), layers=chosen,
                                  progress=bar)
    return Report("pressure", {
        "command": "pressure", "model": name, "text": text.describe(), "seq_len": seq_len, "windows": len(held_out),
        "factors": [float(f) for f in factors], "variants": list(variants), "layers": chosen, "rows": rows,
        "summary": pressure_summary(rows), "seconds": clock.seconds, **env})


def pressure_summary(rows: list[dict]) -> list[dict]:
    """Per (factor, variant): D after attention and after the FFN averaged over layers, the FFN's lift
    (after FFN - after attention) averaged over layers, and D at the last layer's output."""
    out = []
    for key in dict.fromkeys((r["factor"], r["variant"]) for r in rows):
        sel = [r for r in rows if (r["factor"], r["variant"]) == key]
        last = max(sel, key=lambda r: r["layer"])
        mean = lambda k, sel=sel: sum(r[k] for r in sel) / len(sel)  # noqa: E731
        out.append({"factor": key[0], "variant": key[1], "after_attention": mean("after_attention"),
                    "after_ffn": mean("after_ffn"), "ffn_lift": mean("after_ffn") - mean("after_attention"),
                    "output": last["after_ffn"]})
    return out


@validated(FFN_JACOBIAN_RANGES)
@entry_point(patched_model="refused")
def ffn_jacobian(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, layers: list[int] | None = None, tokens: int = 16,
                 top_k: int = 8, ablation_report: str | os.PathLike | None = None, seq_len: int = 256, max_windows: int = 2,
                 dtype: DType = "float32", device: str | None = None, seed: int = 0, progress: bool = True) -> Report:
    """Per layer, over a seeded sample of `tokens` real FFN inputs: the spectral norm and effective rank
    of the FFN's Jacobian on the tangent space (per radian of rotation), its radial fraction, the
    activation's derivative at the pre-activations (off / linear / transition), the top-k hidden
    units' share of the tangential update (keys/values view); next to C_l on the same windows and,
    with `ablation_report` (an `ablate --layerwise` report.json), the per-layer ablation costs, with
    Spearman correlations. The `ffn-jacobian` report.

    Args:
        model, tokenizer, text, seq_len, max_windows, dtype, device, seed, progress: as every analysis (experiments/analysis.py).
        layers: layers to analyse (default all)
        tokens: sampled tokens per layer (one d x d Jacobian each)
        top_k: hidden units counted in the keys/values view
        ablation_report: report.json of `hf-tangent ablate --layerwise`, to set the per-layer ablation costs beside
    """
    costs = _ablation_costs(ablation_report) if ablation_report else {}
    model, _, name, text, held_out, env = _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed)
    chosen = _layers(model, layers)
    clock = Clock()
    sens = sensitivity(model, held_out)
    inputs = ffn_inputs(model, held_out, chosen, tokens, seed)
    rows = []
    with progress_bar(progress, len(chosen), "hf-tangent ffn-jacobian", "layer") as bar:
        for i in chosen:
            layer_clock = Clock()
            measured = FfnProbe(model, i).measure(inputs[i].to(next(model.parameters()).device), top_k)
            gain = measured["gain"].flatten().cpu()
            units = Counter(measured["top_units"].flatten().tolist()).most_common(5)
            rows.append({
                "layer": i, "tokens": len(inputs[i]), "seconds": layer_clock.seconds,
                **{k: measured[k].mean().item() for k in ("spectral_norm", "effective_rank", "radial_fraction", "output_norm")},
                "spectral_norm_q50": measured["spectral_norm"].median().item(),
                "gain": gain_regimes(gain), "gain_mean": gain.mean().item(),
                "gain_histogram": torch.histc(gain.clamp(-0.5, 1.5), bins=40, min=-0.5, max=1.5).tolist(),
                "top_share": measured["top_share"].mean().item(), "top_units": [[u, n] for u, n in units],
                "c_l": sens["scores"][i], **{f"ablation_{k}": v.get(i) for k, v in costs.items()}})
            bar.update(1)
    figures = {k: (lambda r, k=k: r[k]) for k in ("spectral_norm", "effective_rank", "radial_fraction", "top_share")}
    figures |= {f"gain_{g}": (lambda r, g=g: r["gain"][g]) for g in ("off", "linear")}
    against = ["c_l"] + [f"ablation_{k}" for k in costs]
    correlations = {f: {a: spearman([get(r) for r in rows if r[a] is not None], [r[a] for r in rows if r[a] is not None])
                        for a in against} for f, get in figures.items()}
    return Report("ffn-jacobian", {
        "command": "ffn-jacobian", "model": name, "text": text.describe(), "seq_len": seq_len, "windows": len(held_out),
        "tokens": tokens, "top_k": top_k, "regimes": GAIN_REGIMES, "ablation_report": ablation_report,
        "layers": rows, "spearman": correlations, "seconds": clock.seconds, **env})


def _ablation_costs(path: str) -> dict[str, dict[int, float]]:
    """{variant: {layer: loss increase}} from an `ablate --layerwise` report.json."""
    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--ablation-report {path}: not a readable report.json ({err}).") from err
    if data.get("command") != "ablate":
        raise ValueError(f"--ablation-report {path}: not an `ablate` report (command={data.get('command')!r}).")
    out: dict[str, dict[int, float]] = {}
    for r in data.get("rows", []):
        if r["layer"] != "all" and r["variant"] != "full":
            out.setdefault(r["variant"], {})[int(r["layer"])] = r["increase"]
    if not out:
        raise ValueError(f"--ablation-report {path}: no per-layer rows; run `hf-tangent ablate --layerwise`.")
    return out


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

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


def _plot_pressure(data, folder):
    return [plots.pressure_curves(data["summary"], os.path.join(folder, "pressure_curves.png"),
                                  f"{data['model']}: diversity under pressure")]


def _plot_ffn_jacobian(data, folder):
    return [plots.gain_histograms(data["layers"], os.path.join(folder, "gain_histograms.png"),
                                  f"{data['model']}: activation gain")]


register_report('critical', critical_markdown, _plot_critical)
register_report('pressure', pressure_markdown, _plot_pressure)
register_report('ffn-jacobian', ffn_jacobian_markdown, _plot_ffn_jacobian)
