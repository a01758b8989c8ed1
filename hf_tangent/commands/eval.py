"""`hf-tangent eval`: held-out perplexity of the unpatched model and of each update rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..analysis.evaluation import update_variants
from ..experiments.evaluate import evaluate_rules
from .arguments import Checked, experiment_command, text_source


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
    return experiment_command(subparsers, "eval", "perplexity of the unpatched model and of each update rule on "
                              "held-out text", evaluate_rules, EvalArguments,
                              options=lambda own: {"rules": own.updates},
                              text=lambda text, own: text_source(text, corpus=own.corpus))
