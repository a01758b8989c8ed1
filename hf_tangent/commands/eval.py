"""`hf-tangent eval`: held-out perplexity of the unpatched model and of each update rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..analysis.evaluation import update_variants
from .arguments import (
    Checked,
    EvalTextArguments,
    ModelArguments,
    RunArguments,
    add_command,
    dataclasses_of,
    preflight,
    text_source,
)


@dataclass
class EvalArguments(Checked):
    EMPTY: ClassVar[dict[str, str]] = {"updates": "only the unpatched model (and a loaded patch, as it is)"}

    updates: list[str] | None = field(default=None, metadata={
        "help": "update variants to evaluate (default all): " + "; ".join(update_variants()),
        "choices": list(update_variants()), "metavar": "NAME"})
    corpus: Literal["austen", "mixed"] | None = field(default=None, metadata={
        "help": "the offline text where none is given: austen (the held-out novels, the default) or mixed (every "
                "held-out domain of the mixed corpus, --max_windows windows of each, a table per domain)"})


def eval_command_parser(subparsers):
    return add_command(subparsers, "eval", (ModelArguments, EvalTextArguments, RunArguments, EvalArguments),
                       "perplexity of the unpatched model and of each update rule on held-out text", eval_command)


def eval_command(args) -> int:
    from ..experiments.evaluate import evaluate_rules

    model, text, run, options = dataclasses_of(args.parser, args)
    preflight(text, run, output_dir=run.output_dir, device=run.device)
    report = evaluate_rules(model.model, text=text_source(text, corpus=options.corpus), rules=options.updates, seq_len=text.seq_len,
                            max_windows=text.max_windows, batch_size=run.batch_size, dtype=model.dtype,
                            device=run.device, seed=run.seed)
    report.save(run.output_dir, echo=True)
    return 0
