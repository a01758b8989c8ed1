"""`evaluate_rules`: held-out perplexity of the unpatched model and of each update rule."""

from __future__ import annotations

from ..analysis.evaluation import evaluate_variants, perplexity, update_variants
from ..core.patching import get_config, without_patch
from ..ranges import DType, validated
from ..training.data import TextSource
from .common import Clock, Model, Text, Tokenizer, entry_point, environment, progress_bar, resolve_model, windows
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
        text: a `TextSource`, a list of documents, or None (the held-out Austen novels).
        rules: names from `evaluation.update_variants()` (default: all; []: only the unpatched model, and a
            loaded patch as it is).
        seq_len, max_windows, batch_size: windows of `seq_len` tokens, at most `max_windows`, per pass.
        dtype, device, seed: for a model loaded by name.
    """
    names = list(update_variants()) if rules is None else list(rules)
    text = TextSource.of(text)
    model, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype, device=device, seed=seed)
    held_out = windows(model, tokenizer, text.evaluation_documents(), seq_len, max_windows)
    loaded = get_config(model)
    clock = Clock()
    total = (len(set(names) | {"unpatched"}) + (loaded is not None)) * len(held_out)
    with progress_bar(progress, total, "hf-tangent eval") as bar:
        saved_row = None
        if loaded is not None:
            result = perplexity(model, held_out, batch_size=batch_size, progress=bar)
            saved_row = {"variant": "saved patch (as loaded)", "config": loaded.to_dict(), "nll": result["nll"],
                         "perplexity": result["perplexity"], "tokens": result["tokens"]}
        with without_patch(model):
            rows = evaluate_variants(model, held_out, names, batch_size=batch_size, progress=bar)
    if saved_row is not None:
        saved_row["delta_nll"] = saved_row["nll"] - rows[0]["nll"]
        saved_row["delta_perplexity"] = saved_row["perplexity"] - rows[0]["perplexity"]
        rows.insert(1, saved_row)
    device = next(model.parameters()).device
    return Report("eval", {
        "command": "eval", "model": name, "text": text.describe(), "seq_len": seq_len, "windows": len(held_out),
        "tokens_per_variant": rows[0]["tokens"], "seconds": clock.seconds,
        **environment(device, next(model.parameters()).dtype, seed), "rows": rows,
    })


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

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


register_report('eval', eval_markdown)
