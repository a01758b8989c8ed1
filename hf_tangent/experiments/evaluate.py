"""`evaluate_rules`: held-out perplexity of the unpatched model and of each update rule."""

from __future__ import annotations

import contextlib
import os

from ..analysis.evaluation import evaluate_variants, perplexity, update_variants
from ..artifacts.identity import scored_weights
from ..core.gather import peft_model_of
from ..core.patching import get_config, without_patch
from ..ranges import DType, validated
from ..training.data import TextSource
from . import plots
from .common import (
    Clock,
    Model,
    Text,
    Tokenizer,
    domain_slices,
    domain_windows,
    entry_point,
    environment,
    interval,
    paired_window_difference,
    progress_bar,
    resolve_model,
    stacked,
)
from .report import Report, register_report, variants_table


@validated(empty={"rules": "only the unpatched model (and a loaded patch, as it is)"})
@entry_point(patched_model="as is")
def evaluate_rules(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, rules: list[str] | None = None, seq_len: int = 512,
                   max_windows: int = 8, batch_size: int = 1, dtype: DType = "float32", device: str | None = None,
                   seed: int = 0, progress: bool = True) -> Report:
    """Held-out NLL and perplexity of the unpatched model and of every named update rule, each
    applied to every layer, untrained (the `eval` report).

    Args:
        model: a model name (offline name, folder, hub id) or a loaded model (then pass `tokenizer`).
            A patched model (or a saved patched folder) is also evaluated as it is, first.
        text: a `TextSource`, a list of documents, or None (the held-out Austen novels);
            `TextSource(corpus="mixed")`: every held-out domain of the mixed corpus, `max_windows` windows of
            each, with a table per domain beside the pooled one.
        rules: names from `evaluation.update_variants()` (default: all; []: only the unpatched model, and a
            loaded patch as it is).
        seq_len, max_windows, batch_size: windows of `seq_len` tokens, at most `max_windows`, per pass.
        dtype, device, seed: for a model loaded by name.
    """
    names = list(update_variants()) if rules is None else list(rules)
    text = TextSource.of(text)
    model, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype, device=device, seed=seed)
    documents = text.evaluation_domains()
    domains = domain_windows(model, tokenizer, documents, seq_len, max_windows)
    weights = scored_weights(model)  # as given, before any variant is patched in
    held_out = stacked(domains)
    loaded = get_config(model)
    clock = Clock()
    total = (len(set(names) | {"unpatched"}) + (loaded is not None)) * len(held_out)
    with progress_bar(progress, total, "hf-tangent eval") as bar:
        saved_row = None
        if loaded is not None:
            result = perplexity(model, held_out, batch_size=batch_size, progress=bar)
            saved_row = {"variant": "saved patch (as loaded)", "config": loaded.to_dict(), "nll": result["nll"],
                         "perplexity": result["perplexity"], "tokens": result["tokens"], "window_nll": result["window_nll"]}
        peft = peft_model_of(model)  # a patch repo with LoRA adapters: the comparison rows run on the base
        with without_patch(model), (peft.disable_adapter() if peft is not None else contextlib.nullcontext()):
            rows = evaluate_variants(model, held_out, names, batch_size=batch_size, progress=bar)
    # what the "unpatched" row is: the base itself, unless the weights given were trained (a complete folder
    # of a healed / fine-tuned model, or a model object with merged adapters): then those weights without the patch
    baseline = ("the model as given" if loaded is None else "the base model (the patch repo's adapters off)"
                if peft is not None else "the loaded weights with the patch off (a saved folder's weights may have "
                "been trained: compare with the base's own eval)")
    if saved_row is not None:
        saved_row["delta_nll"] = saved_row["nll"] - rows[0]["nll"]
        saved_row["delta_perplexity"] = saved_row["perplexity"] - rows[0]["perplexity"]
        rows.insert(1, saved_row)
    per_domain = domain_rows(rows, {n: len(w) for n, w in domains.items()}, seed) if len(domains) > 1 else None
    for row in rows:
        del row["window_nll"]
    device = next(model.parameters()).device
    return Report("eval", {
        "command": "eval", "model": name, "text": text.describe(), "seq_len": seq_len, "windows": len(held_out),
        "tokens_per_variant": rows[0]["tokens"], "seconds": clock.seconds,
        **environment(device, next(model.parameters()).dtype, seed, model=weights, text=text,
                      read={"evaluation": documents}), "rows": rows, "unpatched_is": baseline,
        **({"domains": per_domain} if per_domain else {}),
    })


def domain_rows(rows: list[dict], counts: dict[str, int], seed: int, bootstrap: int = 2000) -> dict:
    """Per held-out domain (its windows, in the order they were stacked): each variant's NLL and its
    difference from the first row (unpatched) over the same windows, 95 % paired bootstrap interval."""
    return {domain: {"windows": counts[domain], "rows": [
        {"variant": row["variant"], **paired_window_difference(row["window_nll"][window], rows[0]["window_nll"][window],
                                                               bootstrap, seed)} for row in rows]}
            for domain, window in domain_slices(counts).items()}


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

def eval_markdown(report: dict) -> str:
    return "\n".join([
        f"# hf-tangent eval: {report['model']}",
        "",
        f"Text: {report['text']}; {report['windows']} windows x {report['seq_len']} tokens "
        f"({report['tokens_per_variant']} predicted tokens per variant); dtype {report['dtype']}, "
        f"device {report['device']}, {report['seconds']} s. Every rule is applied to every layer, untrained."
        + (f" The unpatched row is {report['unpatched_is']}." if report.get("unpatched_is") else ""),
        "",
        variants_table(report["rows"]),
    ] + (["", "![delta NLL per update rule](rule_deltas.png)"] if plots.drawn_rules(report["rows"]) else [])
        + _domains_table(report)) + "\n"


def _domains_table(report: dict) -> list[str]:
    if not report.get("domains"):
        return []
    lines = ["", "Per held-out domain (the table above pools them): each variant's difference from the unpatched model "
             "over the domain's windows, 95% paired bootstrap interval (the windows resampled).", "",
             "| held-out domain | windows | variant | NLL | delta NLL [95% CI] |", "|---|---:|---|---:|---:|"]
    for domain, d in report["domains"].items():
        for r in d["rows"]:
            delta = "-" if r["variant"] == "unpatched" else interval(r)
            lines.append(f"| {domain} | {d['windows']} | {r['variant']} | {r['nll']:.4f} | {delta} |")
    return lines


def _plot_eval(data, folder):
    return [plots.rule_deltas(data["rows"], os.path.join(folder, "rule_deltas.png"),
                              title=f"Update rules, untrained, every layer: {data['model']}")] if plots.drawn_rules(
        data["rows"]) else []


register_report('eval', eval_markdown, _plot_eval)
