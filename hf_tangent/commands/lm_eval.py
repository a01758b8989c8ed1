"""`hf-tangent lm-eval`: downstream accuracy with EleutherAI's LM Evaluation Harness, per variant."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..experiments.downstream import check_backend, lm_eval
from .arguments import Checked, ModelArguments, RunArguments, add_command, dataclasses_of, options_dataclass, preflight

LmEvalArguments = options_dataclass(lm_eval, __name__, names=("tasks", "variants", "model_folders", "include_path",
                                                             "num_fewshot", "limit", "bootstrap", "backend"))


@dataclass
class VllmArguments(Checked):
    """lm_eval's vllm_args (a dict) as the command line gives it: the string lm-eval's own model_args take."""

    vllm_args: str | None = field(default=None, metadata={
        "help": "with --backend vllm: vllm.LLM arguments as lm-eval writes model_args, "
                "e.g. enforce_eager=True,gpu_memory_utilization=0.3,max_model_len=512 (a CPU)"})


def vllm_arg_entries(text: str | None) -> dict | None:
    """"key=value,key=value" as {key: value text}: the form checked, and the keys known, without lm-eval."""
    if text is None:
        return None
    entries = [e.split("=", 1) for e in text.split(",") if e.strip()]
    if not entries or any(len(e) != 2 or not e[0].strip() for e in entries):
        raise ValueError(f"--vllm_args {text!r}: accepted: key=value pairs separated by commas, "
                         "e.g. enforce_eager=True,gpu_memory_utilization=0.3")
    return {key.strip(): value for key, value in entries}


def parse_vllm_args(text: str | None) -> dict | None:
    """The values as lm-eval parses its model_args (Python literals where they are), the keys stripped."""
    entries = vllm_arg_entries(text)
    if entries is None:
        return None
    from lm_eval.utils import handle_arg_string

    return {key: handle_arg_string(value) for key, value in entries.items()}


def lm_eval_command_parser(subparsers):
    return add_command(subparsers, "lm-eval", (ModelArguments, RunArguments, LmEvalArguments, VllmArguments),
                       "downstream accuracy (LM Evaluation Harness) of the unpatched model, update rules and saved "
                       "patched models, with paired differences", lm_eval_command, recipe_function=lm_eval)


def lm_eval_command(args) -> int:
    from ..integrations.harness.run import require_lm_eval

    model, run, options, vllm = dataclasses_of(args.parser, args)
    check_backend(options.backend, vllm_arg_entries(vllm.vllm_args))  # the arguments first, lm-eval installed or not
    require_lm_eval()  # before any model is loaded
    vllm_args = parse_vllm_args(vllm.vllm_args)
    preflight(run, output_dir=run.output_dir, device=run.device)
    report = lm_eval(model.model, **vars(options), batch_size=run.batch_size, dtype=model.dtype, device=run.device,
                     seed=run.seed, vllm_args=vllm_args)
    report.save(run.output_dir, echo=True)
    return 0
