"""`hf-tangent lm-eval`: downstream accuracy with EleutherAI's LM Evaluation Harness, per variant."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..analysis.evaluation import update_variants
from ..integrations.harness.tasks import TASKS
from ..ranges import Range, at_least
from .arguments import Checked, ModelArguments, RunArguments, add_command, dataclasses_of, preflight


@dataclass
class LmEvalArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = {"limit": at_least(1), "num_fewshot": at_least(0), "bootstrap": at_least(1)}

    tasks: list[str] = field(default_factory=lambda: list(TASKS), metadata={
        "help": "lm-eval task names; offline: " + ", ".join(TASKS) + " (held-out Austen, in-domain; austen_perplexity: "
                "word_perplexity, bits_per_byte); with a network the Hub tasks too (hellaswag arc_easy lambada_openai "
                "mmlu ...; a group is paired per subtask and as a whole)"})
    variants: list[str] = field(default_factory=lambda: ["unpatched", "projected"], metadata={
        "help": "unpatched and update variants, each on every layer: " + "; ".join(update_variants()),
        "choices": list(update_variants()), "metavar": "NAME"})
    model_folders: list[str] | None = field(default=None, metadata={
        "help": "saved patched folders or patch repos (healed, converted) of the same base, evaluated as loaded"})
    include_path: str | None = field(default=None, metadata={"help": "a folder of your own lm-eval task YAMLs"})
    num_fewshot: int | None = field(default=None, metadata={"help": "few-shot examples (lm-eval's default: the task's)"})
    limit: int | None = field(default=None, metadata={"help": "items per task (default: all)"})
    bootstrap: int = field(default=2000, metadata={"help": "bootstrap resamples of the paired 95% intervals"})


def lm_eval_command_parser(subparsers):
    return add_command(subparsers, "lm-eval", (ModelArguments, RunArguments, LmEvalArguments),
                       "downstream accuracy (LM Evaluation Harness) of the unpatched model, update rules and saved "
                       "patched models, with paired differences", lm_eval_command)


def lm_eval_command(args) -> int:
    from ..integrations.harness.run import require_lm_eval

    model, run, options = dataclasses_of(args.parser, args)
    require_lm_eval()  # before any model is loaded
    preflight(run, output_dir=run.output_dir, device=run.device)
    from ..experiments.downstream import lm_eval

    report = lm_eval(model.model, tasks=options.tasks, variants=options.variants,
                     model_folders=options.model_folders or [], include_path=options.include_path,
                     num_fewshot=options.num_fewshot, limit=options.limit, batch_size=run.batch_size,
                     bootstrap=options.bootstrap, dtype=model.dtype, device=run.device, seed=run.seed)
    report.save(run.output_dir, echo=True)
    return 0
