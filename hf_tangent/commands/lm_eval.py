"""`hf-tangent lm-eval`: downstream accuracy with EleutherAI's LM Evaluation Harness, per variant."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..analysis.evaluation import update_variants
from ..experiments.downstream import lm_eval
from ..integrations.harness.tasks import TASKS
from ..ranges import Range, at_least
from .arguments import DOCS, Checked, ModelArguments, RunArguments, add_command, dataclasses_of, preflight


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
    backend: str = field(default="hf", metadata={
        "help": "hf: lm-eval's HFLM on the model in memory; vllm: lm-eval's VLLM, every variant written as a complete "
                f"folder and served by vLLM with hf_tangent's plugin (needs vLLM: {DOCS}serving.md)",
        "choices": ["hf", "vllm"]})
    vllm_args: str | None = field(default=None, metadata={
        "help": "with --backend vllm: vllm.LLM arguments as lm-eval writes model_args, "
                "e.g. enforce_eager=True,gpu_memory_utilization=0.3,max_model_len=512 (a CPU)"})


def parse_vllm_args(text: str | None) -> dict | None:
    """"key=value,key=value" as lm-eval parses its model_args (values as Python literals where they are)."""
    if text is None:
        return None
    entries = [e for e in text.split(",") if e.strip()]
    bad = [e for e in entries if "=" not in e or not e.split("=", 1)[0].strip()]
    if bad or not entries:
        raise ValueError(f"--vllm_args {text!r}: accepted: key=value pairs separated by commas, "
                         "e.g. enforce_eager=True,gpu_memory_utilization=0.3")
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(text)


def lm_eval_command_parser(subparsers):
    return add_command(subparsers, "lm-eval", (ModelArguments, RunArguments, LmEvalArguments),
                       "downstream accuracy (LM Evaluation Harness) of the unpatched model, update rules and saved "
                       "patched models, with paired differences", lm_eval_command, recipe_function=lm_eval)


def lm_eval_command(args) -> int:
    from ..integrations.harness.run import require_lm_eval

    model, run, options = dataclasses_of(args.parser, args)
    require_lm_eval()  # before any model is loaded
    vllm_args = parse_vllm_args(options.vllm_args)
    preflight(run, output_dir=run.output_dir, device=run.device)
    report = lm_eval(model.model, tasks=options.tasks, variants=options.variants,
                     model_folders=options.model_folders or [], include_path=options.include_path,
                     num_fewshot=options.num_fewshot, limit=options.limit, batch_size=run.batch_size,
                     bootstrap=options.bootstrap, dtype=model.dtype, device=run.device, seed=run.seed,
                     backend=options.backend, vllm_args=vllm_args)
    report.save(run.output_dir, echo=True)
    return 0
