"""`lm_eval`: downstream accuracy with EleutherAI's LM Evaluation Harness, for several variants of one
base model in one run (unpatched, update rules, saved patched folders and patch repos), with paired
differences against the unpatched model from lm-eval's per-sample outputs."""

from __future__ import annotations

import gc
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Literal

import torch

from ..analysis.evaluation import UpdateName, update_variants
from ..analysis.stats import bootstrap_interval, strata_mean
from ..artifacts.identity import patch_differences, scored_weights
from ..artifacts.loading import from_pretrained
from ..artifacts.offline import hub_error, unreachable
from ..artifacts.patch_repo import is_patch_repo, read_record
from ..core.patching import get_config, patch, without_patch
from ..integrations.harness.run import (
    BACKENDS,
    PAIRED_METRICS,
    evaluate,
    model_context,
    require_lm_eval,
    require_vllm,
    rolling_tasks,
    task_manager,
    vllm_lm,
)
from ..integrations.harness.tasks import TASK_VERSION, TASKS, data_file
from ..ranges import DType, at_least, validated
from . import plots
from .common import Clock, Model, Tokenizer, entry_point, environment, resolve_model
from .report import Report, provenance_problems, register_report

LM_EVAL_RANGES = {"limit": at_least(1), "num_fewshot": at_least(0), "batch_size": at_least(1), "bootstrap": at_least(1)}


@validated(LM_EVAL_RANGES, empty={"model_folders": "none (as None)"})
@entry_point(patched_model="as is")
def lm_eval(model: Model, tokenizer: Tokenizer = None, *, tasks: list[str] = TASKS,
            variants: list[UpdateName] = ("unpatched", "projected"), model_folders: list[str] | None = None,
            include_path: str | os.PathLike | None = None, num_fewshot: int | None = None,
            limit: int | None = None, batch_size: int = 1, bootstrap: int = 2000, dtype: DType = "float32",
            device: str | None = None, seed: int = 0, backend: Literal[BACKENDS] = "hf",
            vllm_args: dict | None = None) -> Report:
    """Downstream accuracy of every variant on lm-eval tasks (the `lm-eval` report): the metrics
    exactly as lm-eval names them ("acc,none", "acc_stderr,none", ...) per variant and task (a group's
    subtasks included), and per variant the paired difference of each per-sample metric against
    "unpatched" with a paired bootstrap interval over the documents: acc and acc_norm, a rolling
    task's bits_per_byte and word_nll (`_paired`), per subtask and for a group; a requested task that
    has nothing to pair is listed under "unpaired" with the reason.

    Args:
        model, tokenizer: a model name (offline name, folder, hub id) or a loaded model with its tokenizer;
            a patched model is evaluated as it is too ("as given").
        tasks: lm-eval task names; offline: austen_lastword, austen_nextsentence, austen_perplexity (held-out
            Austen, in-domain for the calibration text; austen_perplexity: word_perplexity, bits_per_byte); with a
            network the Hub tasks too (hellaswag arc_easy lambada_openai mmlu ...; a group is paired per subtask
            and as a whole)
        variants: unpatched and update variants, each on every layer (saved folders: model_folders)
        model_folders: saved patched folders or patch repos (healed, converted) of the same base, evaluated as
            loaded (default: none)
        include_path: a folder of your own lm-eval task YAMLs
        num_fewshot: few-shot examples (lm-eval's default: the task's)
        limit: items per task (default: all)
        batch_size, dtype, device, seed: as lm-eval's, and for a model loaded by name.
        bootstrap: bootstrap resamples of the paired 95% intervals
        backend: hf: lm-eval's HFLM on the model in memory; vllm: lm-eval's VLLM, every variant written as a
            complete folder (in a temporary folder; a complete folder in model_folders as it is) and served by
            vLLM with hf_tangent's plugin (needs vLLM:
            https://github.com/hf-tangent/hf_tangent/blob/main/docs/serving.md)
        vllm_args: keyword arguments of vllm.LLM (on a CPU: enforce_eager, gpu_memory_utilization, max_model_len)
    """
    vllm_args = check_backend(backend, vllm_args)  # the arguments first: the same error with lm-eval missing or not
    require_lm_eval()
    if include_path is not None and not os.path.isdir(include_path):  # lm-eval itself skips a missing folder silently
        raise ValueError(f"hf_tangent.lm_eval: include_path={include_path!r} is not a folder; accepted: a folder of "
                         "lm-eval task YAMLs.")
    manager = task_manager(include_path, tasks)
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        raise ValueError(f"unknown lm-eval tasks {missing}; the offline ones: {', '.join(TASKS)} (or --include_path).")
    model, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype, device=device, seed=seed)
    model_folders = list(model_folders or ())
    _check_vocabularies(model, tokenizer, name, model_folders)  # every variant's, before any is scored
    _check_contexts(model, tokenizer, model_folders, rolling_tasks(manager, list(tasks)))
    weights, folder_weights = scored_weights(model), {}  # the base variants' weights; each folder's as loaded
    if backend == "vllm":
        _check_served(model)
        _check_vllm_context(model, tokenizer, manager, tasks, vllm_args)
    scratch = tempfile.TemporaryDirectory(prefix="hf_tangent_vllm_") if backend == "vllm" else None
    clock = Clock()
    runs, seconds = {}, {}

    def run(label, candidate, folder=None):
        started = Clock()
        options = dict(num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, seed=seed)
        if backend == "hf":
            runs[label] = evaluate(candidate, tokenizer, list(tasks), manager, **options)
        else:
            with tempfile.TemporaryDirectory(dir=scratch.name) as written:
                lm = vllm_lm(folder or _complete_folder(candidate, tokenizer, written), tokenizer=tokenizer_folder,
                             batch_size=batch_size, seed=seed, vllm_args=vllm_args,
                             dtype=str(next(candidate.parameters()).dtype).removeprefix("torch."))
                try:
                    runs[label] = evaluate(lm, tokenizer, list(tasks), manager, **options)
                finally:  # the engine's memory, before the next variant's
                    del lm
                    gc.collect()
        seconds[label] = started.seconds

    tokenizer_folder = None
    if scratch is not None:  # every variant is scored with this tokenizer, as with backend="hf"
        tokenizer_folder = os.path.join(scratch.name, "tokenizer")
        tokenizer.save_pretrained(tokenizer_folder)

    try:
        if get_config(model) is not None:
            run("as given", model)
        with without_patch(model):
            known = update_variants()
            for variant in ["unpatched", *[v for v in variants if v != "unpatched"]]:
                if known[variant] is not None:
                    patch(model, known[variant])
                run(variant, model.eval())
        for folder in model_folders:
            repo = is_patch_repo(folder)
            if backend == "vllm" and not repo:  # a complete folder: served as saved
                folder_weights[str(folder)] = _files_digest(folder)
                run(str(folder), model, folder=str(folder))
                continue
            merge = {"merge": True} if repo else {}  # LoRA of a patch repo merged; a full folder has none
            loaded = from_pretrained(folder, **merge, dtype=next(model.parameters()).dtype).to(next(model.parameters()).device)
            folder_weights[str(folder)] = scored_weights(loaded)
            run(str(folder), loaded.eval())
            del loaded
    finally:
        if scratch is not None:
            scratch.cleanup()
    paired = {label: _paired(runs[label], runs["unpatched"], bootstrap, seed) for label in runs if label != "unpatched"}
    return Report("lm-eval", {
        "command": "lm-eval", "model": name, "tasks": list(tasks), "variants": list(runs),
        "num_fewshot": num_fewshot, "limit": limit, "include_path": include_path, "bootstrap": bootstrap,
        "task_source": {t: "hf_tangent: held-out Austen novels (in-domain for the calibration / healing text), "
                           f"task files version {TASK_VERSION}" for t in tasks if t in TASKS},
        "rolling_window": {label: r["rolling_window"] for label, r in runs.items()},
        "results": {label: r["results"] for label, r in runs.items()},
        "n_samples": {label: r["n_samples"] for label, r in runs.items()},
        "paired": paired, "groups": runs["unpatched"]["groups"],
        "unpaired": _unpaired(paired, list(tasks)) if paired else {}, "variant_seconds": seconds, "seconds": clock.seconds,
        "backend": backend, "vllm_args": vllm_args, "variant_weights": folder_weights,
        "task_files": task_files(tasks, include_path),
        **environment(next(model.parameters()).device, next(model.parameters()).dtype, seed, model=weights)})


def _files_digest(folder) -> dict:
    """A complete folder that vLLM serves as saved: a digest of its weight files and config.json."""
    import hashlib

    digest = hashlib.blake2b(digest_size=32)
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and (path.suffix == ".safetensors" or path.name in ("config.json",
                                                                               "model.safetensors.index.json")):
            with open(path, "rb") as f:
                digest.update(path.name.encode() + b"\0")
                for block in iter(lambda f=f: f.read(1 << 22), b""):
                    digest.update(block)
    return {"method": "blake2b-256 over the folder's config.json and safetensors files", "digest": digest.hexdigest()}


def task_files(tasks, include_path) -> dict[str, str | None]:
    """Task -> sha256 of the files that define it: a shipped task's data file, or the YAML (and for a
    local data file, that file) of a task from `include_path`; None for lm-eval's own tasks (their
    version is lm-eval's, recorded under "versions")."""
    import hashlib

    out = {}
    for task in tasks:
        files = [data_file(task)] if task in TASKS else []
        if not files and include_path is not None:
            files = sorted(p for p in Path(include_path).rglob("*") if p.is_file())
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        out[task] = digest.hexdigest() if files else None
    return out


VLLM_ARGS_SET_HERE = ("model", "pretrained", "dtype", "seed", "batch_size", "tokenizer")


def check_backend(backend: str, vllm_args) -> dict | None:
    """The backend and vLLM's arguments, checked before any model is loaded."""
    if backend == "hf":
        if vllm_args is not None:
            raise ValueError("hf_tangent.lm_eval: vllm_args are for backend='vllm'; with backend='hf' pass none.")
        return None
    if vllm_args is not None and (not isinstance(vllm_args, dict) or not all(isinstance(k, str) for k in vllm_args)):
        raise ValueError(f"hf_tangent.lm_eval: vllm_args={vllm_args!r}; accepted: a dict of vllm.LLM keyword arguments.")
    fixed = sorted(set(vllm_args or {}) & set(VLLM_ARGS_SET_HERE))
    if fixed:
        raise ValueError(f"hf_tangent.lm_eval: vllm_args {fixed} are set by lm_eval itself (the variant's folder, dtype=, "
                         "seed=, batch_size=, the model's tokenizer); pass them as lm_eval's own arguments.")
    require_vllm()
    return dict(vllm_args or {})


def _check_served(model) -> None:
    """backend="vllm": the base family must be one the plugin serves, and a patched model passed in ("as given")
    one it serves patched: refused before any variant is scored."""
    from ..core.registry import base_model_type
    from ..integrations.vllm.plugin import SUPPORTED

    family = base_model_type(model.config)
    if family not in SUPPORTED:
        raise ValueError(f"hf_tangent.lm_eval: backend='vllm' serves patched folders of {', '.join(SUPPORTED)} "
                         f"(docs/serving.md); this model is {family!r}: use backend='hf'.")
    config = get_config(model)
    if config is not None and "attention" in config.branches and config.update != "add":
        raise ValueError("hf_tangent.lm_eval: backend='vllm' does not serve branches=('ffn', 'attention') (the model "
                         "passed in); use backend='hf'.")


def _check_vllm_context(model, tokenizer, manager, tasks, vllm_args: dict) -> None:
    """backend="vllm": a perplexity task (rolling windows) is scored in windows of the model's own context, as
    backend="hf" scores it; a max_model_len (or max_length) below it would score other windows, so other
    numbers under the same task name: refused before any variant is scored."""
    served = vllm_args.get("max_model_len", vllm_args.get("max_length"))
    if served is None:  # vLLM serves the folder's own context, which is the one HFLM reads
        return
    rolling = rolling_tasks(manager, list(tasks))
    own = model_context(model, tokenizer)
    if rolling and int(served) < own:
        raise ValueError(
            f"hf_tangent.lm_eval: backend='vllm' with max_model_len={served} would score {', '.join(rolling)} (lm-eval's "
            f"perplexity: rolling windows of the context) in windows of {int(served) - 2} tokens, where backend='hf' "
            f"scores windows of the model's context, {own} tokens: other requests, other numbers under the same name. "
            f"Leave max_model_len out of vllm_args (vLLM then serves the model's {own} tokens, in windows of {own - 2}: "
            f"lm-eval's VLLM keeps two tokens free), or score {', '.join(rolling)} with backend='hf'.")


def _check_contexts(model, tokenizer, model_folders, rolling: list[str]) -> None:
    """A perplexity task pairs documents scored in rolling windows of the context: a saved complete folder whose
    config gives another context than the model's would be compared on other windows; refused up front (a patch
    repo's base is the model's own, checked by its record)."""
    if not rolling:
        return
    own = model_context(model, tokenizer)
    for folder in model_folders:
        if is_patch_repo(folder):
            continue
        config = _config_json(folder) or {}
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        theirs = next((text[k] for k in ("n_positions", "max_position_embeddings", "n_ctx") if isinstance(text.get(k), int)),
                      None)
        if theirs is not None and theirs != own:
            raise ValueError(f"hf_tangent.lm_eval: model_folders entry {str(folder)!r} has a context of {theirs} tokens and "
                             f"the model {own}: {', '.join(rolling)} (rolling windows of the context) would pair other "
                             "windows; accepted: folders of the same base, or those tasks left out.")


def _complete_folder(model, tokenizer, folder: str) -> str:
    """`model` as vLLM serves it: a complete folder (patched: hf_tangent's format, which the plugin serves
    patched or refuses; unpatched: transformers' own), with the tokenizer."""
    from ..artifacts.hub import save_hub_folder

    if get_config(model) is not None:
        save_hub_folder(model, folder, tokenizer=tokenizer)
    else:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def _vocab_size(config: dict) -> int | None:
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def _config_json(source: str) -> dict | None:
    """config.json of a folder or hub repo, or None when it has none."""
    import json

    from transformers.utils import cached_file

    path = cached_file(str(source), "config.json", _raise_exceptions_for_missing_entries=False)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _check_vocabularies(model, tokenizer, name: str, model_folders) -> None:
    """Every variant is scored with `tokenizer`: the model and every folder in `model_folders` (a patch
    repo, checked through its record, or a saved model folder) must exist and hold every token id of
    the tokenizer, and a folder that ships a tokenizer must ship the same one. Checked before any
    variant is scored, so that a wrong folder never ends a run after the others have run."""
    from transformers import AutoTokenizer

    needed = len(tokenizer)
    own = model.get_input_embeddings().num_embeddings
    accepted = "accepted: the tokenizer of the model and of every folder must be the same, and every token id in the vocabulary"
    if own < needed:
        raise ValueError(f"hf_tangent.lm_eval: the model's vocabulary has {own} tokens and the tokenizer {needed}; {accepted}.")
    for folder in model_folders:
        where = f"hf_tangent.lm_eval: model_folders entry {str(folder)!r}"
        try:
            if is_patch_repo(folder):
                base = read_record(folder)["base"]["name_or_path"]
                config = None if base == name else _config_json(base)
                vocab = own if base == name else _vocab_size(config) if config else None
            else:
                config = _config_json(folder)
                if config is None:
                    raise ValueError("it has no config.json")
                vocab = _vocab_size(config)
        except (OSError, ValueError) as err:
            reason = unreachable(err)
            if reason is not None:  # a hub id where the Hub is not reached: say that, not "not a folder"
                raise hub_error(f"the model_folders entry {str(folder)!r}", "load", reason) from err
            raise ValueError(f"{where} is neither a patch repo nor a saved model folder ({err}); accepted: folders "
                             "written by hf_tangent.save_patch or save_pretrained, or their hub ids.") from None
        if vocab is not None and vocab < needed:
            raise ValueError(f"{where} has a vocabulary of {vocab} tokens and the tokenizer {needed}; {accepted}.")
        if os.path.isfile(os.path.join(str(folder), "tokenizer_config.json")):
            try:
                same = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False).get_vocab() == tokenizer.get_vocab()
            except (OSError, ValueError) as err:
                raise ValueError(f"{where}: its tokenizer could not be read ({err}).") from None
            if not same:
                raise ValueError(f"{where} ships a tokenizer other than the model's; {accepted}.")


ROLLING_PAIRED = {  # a rolling task's paired differences: ratios of sums over the documents
    "bits_per_byte": ("bytes", 1 / math.log(2)),  # bits per byte: -sum(ll) / sum(bytes) / ln 2
    "word_nll": ("words", 1.0),  # nats per word: log(word_perplexity)
}


def _ratio(scale):
    def statistic(strata, dim=0):  # columns: (baseline ll - variant ll, count)
        return scale * sum(s.select(-1, 0).sum(dim) for s in strata) / sum(s.select(-1, 1).sum(dim) for s in strata)
    return statistic


def _paired(variant: dict, baseline: dict, bootstrap: int, seed: int) -> dict:
    """Per task and paired metric: the difference variant - baseline over the documents both have, with
    a paired percentile bootstrap interval (95 %, resampling documents). acc and acc_norm: the mean of
    the per-document differences; a rolling (perplexity) task: bits_per_byte and word_nll (nats per
    word, the log of word_perplexity), ratios of sums. A group (MMLU-style) gets every subtask's
    entry and its own: the mean over all its subtasks' documents (size-weighted), the bootstrap
    resampling within each subtask."""
    out = {}
    per_leaf: dict[str, dict[str, torch.Tensor]] = {}
    for task, docs in variant["samples"].items():
        base = baseline["samples"].get(task, {})
        common = sorted(set(docs) & set(base))
        out[task], per_leaf[task] = {}, {}
        if not common:
            continue
        for metric in PAIRED_METRICS:
            if metric in docs[common[0]]:
                per_leaf[task][metric] = torch.tensor([docs[d][metric] - base[d][metric] for d in common],
                                                      dtype=torch.float64)
        for metric, (count, _) in ROLLING_PAIRED.items():
            if count in docs[common[0]]:
                per_leaf[task][metric] = torch.tensor([[base[d]["loglikelihood"] - docs[d]["loglikelihood"], docs[d][count]]
                                                       for d in common], dtype=torch.float64)
        for metric, values in per_leaf[task].items():
            out[task][metric] = _summary([values], metric, bootstrap, seed)
    for group, leaves in variant.get("groups", {}).items():
        out[group] = {}
        for metric in {m for leaf in leaves for m in per_leaf.get(leaf, {})}:
            strata = [per_leaf[leaf][metric] for leaf in leaves if metric in per_leaf.get(leaf, {})]
            out[group][metric] = {**_summary(strata, metric, bootstrap, seed), "subtasks": len(strata),
                                  "aggregation": "size-weighted over the subtasks' documents"}
    return out


def _summary(strata: list[torch.Tensor], metric: str, bootstrap: int, seed: int) -> dict:
    statistic = _ratio(ROLLING_PAIRED[metric][1]) if metric in ROLLING_PAIRED else strata_mean
    low, high = bootstrap_interval(strata, statistic, bootstrap, seed)
    return {"diff": float(statistic(strata)), "low": low, "high": high, "n": sum(len(s) for s in strata)}


def _unpaired(paired: dict, tasks: list[str]) -> dict[str, str]:
    """The requested tasks that got no paired difference, and why (said in the report, never silently)."""
    notes = {}
    for task in tasks:
        if not any(p.get(task) for p in paired.values()):
            notes[task] = ("no per-sample metric to pair (acc, acc_norm, or a rolling task's log-likelihood) in "
                           "lm-eval's outputs for it or its subtasks; only lm-eval's own stderr")
    return notes


# What must agree for reports to be parts of one measurement (the items they score and how).
MERGE_SAME = ("model", "num_fewshot", "bootstrap", "seed", "dtype", "hf_tangent_version", "backend", "vllm_args")
MERGE_DEFAULTS = {"backend": "hf", "vllm_args": None}  # reports written before the vLLM backend


def task_limit(report: dict, task: str) -> int | None:
    """The items per task a report was run with: its "limit", or a merged report's per-task entry."""
    return report["limit"].get(task) if isinstance(report["limit"], dict) else report["limit"]


def limit_text(report: dict) -> str:
    limit = report["limit"]
    if isinstance(limit, dict):
        return "items per task: " + ", ".join(f"{t} {n or 'all'}" for t, n in limit.items())
    return f"{limit or 'all'} items per task"


def _same(a, b) -> bool:
    """Equal as report.json writes them (NaN equals NaN, as a saved report reads back)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _part_entries(report: dict, name: str) -> list[dict]:
    return report.get("parts") or [{
        "report": name, "tasks": report["tasks"], "variants": report["variants"], "limit": report["limit"],
        "seconds": report["seconds"], "threads": report.get("threads"), "device": report.get("device"),
        "torch": report.get("torch"), "peak_rss_gb": report.get("peak_rss_gb")}]


def _read_part(item, k: int) -> tuple[dict, str]:
    """A part's data and its name in errors: a Report object's, or a report.json (or its folder) as read."""
    if isinstance(item, Report):
        data, name, kind = item.data, f"part {k} (a Report object)", item.kind
    elif isinstance(item, (str, os.PathLike)):
        name = os.path.join(item, "report.json") if os.path.isdir(item) else os.fspath(item)
        try:
            data = json.loads(Path(name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"merge_lm_eval: {name}: not a readable report.json ({err}).") from None
        kind = data.get("command") if isinstance(data, dict) else None
    else:
        raise TypeError(f"merge_lm_eval: {item!r} is neither a Report nor the path of a report.json.")
    if not isinstance(data, dict):
        raise ValueError(f"merge_lm_eval: {name} holds a JSON {type(data).__name__}; accepted: a JSON object, the "
                         "report.json of `hf-tangent lm-eval`.")
    if kind != "lm-eval":
        raise ValueError(f"merge_lm_eval: {name} is a {kind!r} report; accepted: lm-eval reports only.")
    return data, name


# What merge_lm_eval reads from a part, and what each field may hold: every part is checked whole against it
# before anything is read (a string where a list is would be merged letter by letter). A check returns None,
# or (field, value, accepted) for the first thing malformed. Provenance: _check_provenance.
def _leaf(test, accepted: str):
    return lambda value, at: None if test(value) else (at, value, accepted)


def _at(at: str, key) -> str:
    return f"{at}[{key!r}]" if at else key


def _each(item, accepted: str, keyed: bool = False, nonempty: bool = False):
    """A JSON list (keyed: an object keyed by names) whose every item passes `item`."""
    def check(value, at):
        if not (isinstance(value, dict) and all(isinstance(k, str) for k in value) if keyed else
                isinstance(value, list)) or (nonempty and not value):
            return at, value, accepted
        pairs = value.items() if keyed else enumerate(value)
        return next(filter(None, (item(v, _at(at, k)) for k, v in pairs)), None)
    return check


def _record(fields: dict, accepted: str, optional: tuple = ()):
    """A JSON object with these fields (others ignored), each passing its check; `optional` ones may be absent."""
    def check(value, at):
        if not isinstance(value, dict):
            return at, value, accepted
        return next(filter(None, (field(value.get(key, _MISSING), _at(at, key)) for key, field in fields.items()
                                  if key in value or key not in optional)), None)  # _MISSING fails every check
    return check


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _metrics(value, at):
    """lm-eval's metrics of one task: a stderr may be NaN (lm-eval's, of too few items), a metric is finite."""
    if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        return at, value, "an object of metric -> number"
    for key, number in value.items():
        stderr = "_stderr," in key
        if not (_finite(number) or stderr and isinstance(number, float)):
            return _at(at, key), number, "a number" if stderr else "a finite number"
    return None


_MISSING = object()
_TEXT = _leaf(lambda v: isinstance(v, str), "a string")
_NAMES = _each(_TEXT, "a non-empty list of names (strings)", nonempty=True)
_SECONDS = _leaf(lambda v: _finite(v) and v >= 0, "a finite number >= 0")
_ITEMS = _leaf(lambda v: v is None or _int(v) and v >= 1, "an integer >= 1, or null (all items)")
_LIMIT = _leaf(lambda v: _ITEMS(v, "") is None or isinstance(v, dict) and all(
    isinstance(k, str) and _ITEMS(n, "") is None for k, n in v.items()),
    "an integer >= 1, null (all items), or an object of task -> one of those")
_INTERVAL = _record({"diff": _leaf(_finite, "a finite number"), "low": _leaf(_finite, "a finite number"),
                     "high": _leaf(_finite, "a finite number"), "n": _leaf(lambda v: _int(v) and v >= 1, "an integer >= 1")},
                    "an object of diff, low, high and n")
LM_EVAL_PART = _record({
    "model": _TEXT, "tasks": _NAMES, "variants": _NAMES, "limit": _LIMIT,
    "num_fewshot": _leaf(lambda v: v is None or _int(v) and v >= 0, "an integer >= 0, or null"),
    "bootstrap": _leaf(lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "seed": _leaf(_int, "an integer"), "dtype": _TEXT, "hf_tangent_version": _TEXT,
    "backend": _leaf(lambda v: v in BACKENDS, " or ".join(map(repr, BACKENDS))),
    "vllm_args": _leaf(lambda v: v is None or isinstance(v, dict), "an object, or null"),
    "include_path": _leaf(lambda v: v is None or _TEXT(v, "") is None or _NAMES(v, "") is None,
                          "a path, a list of paths, or null"),
    "task_source": _each(_TEXT, "an object of task -> string", keyed=True),
    "groups": _each(_each(_TEXT, "a list of task names"), "an object of group -> list of task names", keyed=True),
    "results": _each(_each(_metrics, "an object of task -> metrics", keyed=True),
                     "an object of variant -> task -> metrics", keyed=True),
    "n_samples": _each(_each(_leaf(lambda v: isinstance(v, dict), "an object"), "an object of task -> counts",
                             keyed=True), "an object of variant -> task -> counts", keyed=True),
    "paired": _each(_each(_each(_INTERVAL, "an object of metric -> interval", keyed=True),
                          "an object of task -> metric -> interval", keyed=True),
                    "an object of variant -> task -> metric -> interval", keyed=True),
    "variant_seconds": _each(_SECONDS, "an object of variant -> seconds", keyed=True),
    "seconds": _SECONDS,
    "parts": _each(_record({"report": _TEXT, "tasks": _NAMES, "variants": _NAMES, "limit": _LIMIT,
                            "seconds": _SECONDS}, "an object of report, tasks, variants, limit and seconds"),
                   "a list of parts (objects)"),
    "peak_rss_gb": _leaf(lambda v: v is None or _finite(v), "a finite number, or null"),
}, "an lm-eval report", optional=("backend", "vllm_args", "include_path", "task_source", "groups", "parts",
                                  "peak_rss_gb"))


def _check_part(data: dict, name: str) -> None:
    """Refused, naming the field, what it holds and what is accepted, unless `data` is an lm-eval report."""
    problem = LM_EVAL_PART(data, "") or _disagreement(data)
    if problem:
        field, value, accepted = problem
        held = "is missing" if value is _MISSING else f"holds {_shown(value)} ({type(value).__name__})"
        raise ValueError(f"merge_lm_eval: {name} is malformed: field {field} {held}; accepted: {accepted}.")


def _disagreement(data: dict):
    """The fields that must agree with each other (the shapes are checked): (field, value, accepted) or None."""
    tasks, variants, results = data["tasks"], data["variants"], data["results"]
    for field in ("tasks", "variants"):
        if len(set(data[field])) != len(data[field]):
            return field, data[field], "names without repeats"
    if "unpatched" not in variants or set(results) != set(variants):
        return "results", sorted(results), f"one entry per variant, 'unpatched' among them ({sorted(variants)})"
    if set(results["unpatched"]) != set(tasks):
        return "results['unpatched']", sorted(results["unpatched"]), f"every task ({sorted(tasks)})"
    for variant, scored in results.items():
        if not set(scored) <= set(tasks):
            return f"results[{variant!r}]", sorted(scored), f"tasks of the report ({sorted(tasks)})"
        if set(data["n_samples"].get(variant, {})) != set(scored):
            return f"n_samples[{variant!r}]", sorted(data["n_samples"].get(variant, {})), f"the tasks of results[{variant!r}]"
        if variant != "unpatched" and set(data["paired"].get(variant, {})) != set(scored):
            return f"paired[{variant!r}]", sorted(data["paired"].get(variant, {})), f"the tasks of results[{variant!r}]"
    if set(data["paired"]) - set(variants) or set(data["variant_seconds"]) != set(variants):
        return "variant_seconds", sorted(data["variant_seconds"]), f"one entry per variant ({sorted(variants)})"
    if isinstance(data["limit"], dict) and set(data["limit"]) != set(tasks):
        return "limit", data["limit"], f"a number, null, or one per task ({sorted(tasks)})"
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _listed(paths) -> list[str]:
    """include_path: one path (a part) or a list of them (a merged report)."""
    return [paths] if isinstance(paths, str) else list(paths or [])


def merge_lm_eval(reports: list[Report | str | os.PathLike]) -> Report:
    """One `lm-eval` report from parts of one measurement run separately (parallel processes, or
    machines of one kind): parts may split the tasks, the variants, or both. Refused, with the
    reason, unless the parts agree on the model, few-shot, bootstrap, seed, dtype and hf_tangent
    version and, per task, on the limit and the task files; a (variant, task) scored in several
    parts (every part scores `unpatched`) must have the same lm-eval results and paired difference
    to the last digit in each, so parts of other models, items, software or hardware are caught
    there; a part given twice, and "as given" (a model object, which no label identifies) in more
    than one part, are refused. The parts must also record the same provenance (`_check_provenance`):
    a digest of the weights scored (and of each saved folder scored in more than one part), the
    library versions and the task files' digests; a part without them is refused.
    The merged report keeps each part's tasks, variants, limit, time and environment under "parts";
    "seconds" is the sum of the parts' processes (each also scored `unpatched`), "limit" one number
    or a task -> limit map.

    Args:
        reports: two or more `lm-eval` reports (Report objects or paths of report.json / their folders).
    """
    if isinstance(reports, (str, os.PathLike, Report)) or not isinstance(reports, (list, tuple)):
        raise TypeError(f"merge_lm_eval expects a list of lm-eval reports (Report objects or report.json paths), got "
                        f"{type(reports).__name__}.")
    if len(reports) < 2:
        raise ValueError(f"merge_lm_eval: {len(reports)} report(s) given; accepted: two or more parts of one measurement.")
    parts, names = [], []
    for item in reports:
        data, name = _read_part(item, len(parts) + 1)
        _check_part(data, name)
        parts.append(data)
        names.append(name)
    seen: dict[str, str] = {}
    for part, name in zip(parts, names, strict=True):
        for entry in _part_entries(part, name):
            key = json.dumps({**{k: v for k, v in entry.items() if k != "report"}, **{k: part.get(k, MERGE_DEFAULTS.get(k)) for k in MERGE_SAME}},
                             sort_keys=True, default=str)
            if key in seen:
                raise ValueError(f"merge_lm_eval: {name} repeats a part already given ({seen[key]}): each part once.")
            seen[key] = name
    given = [name for part, name in zip(parts, names, strict=True) if "as given" in part["variants"]]
    if len(given) > 1:
        raise ValueError(f"merge_lm_eval: 'as given' (a model object passed in) is in {', '.join(given)}: nothing says "
                         "they are one model; accepted: 'as given' in one part only (or save the model and pass its folder).")
    first = parts[0]
    for key in MERGE_SAME:
        values = {json.dumps(p.get(key, MERGE_DEFAULTS.get(key))) for p in parts}
        if len(values) > 1:
            raise ValueError(f"merge_lm_eval: the parts differ in {key!r} ({', '.join(sorted(values))}); accepted: "
                             "parts of one measurement (same model, few-shot, bootstrap, seed, dtype, hf_tangent version, "
                             "backend and vLLM arguments).")
    _check_provenance(parts, names)
    limits: dict[str, int | None] = {}
    sources: dict[str, str | None] = {}
    variants: list[str] = []
    results: dict[str, dict] = {}
    n_samples: dict[str, dict] = {}
    paired: dict[str, dict] = {}
    variant_seconds: dict[str, float] = {}
    for part, name in zip(parts, names, strict=True):
        for task in part["tasks"]:
            limit, source = task_limit(part, task), part.get("task_source", {}).get(task)
            if task in limits and limits[task] != limit:
                raise ValueError(f"merge_lm_eval: task {task!r} was scored with limit {limits[task]} in one part and "
                                 f"{limit} in {name}: different items, not parts of one measurement.")
            if task in sources and sources[task] != source:
                raise ValueError(f"merge_lm_eval: task {task!r} comes from other task files in {name} ({source!r} "
                                 f"against {sources[task]!r}).")
            limits[task], sources[task] = limit, source
        for variant in part["variants"]:
            if variant not in variants:
                variants.append(variant)
            variant_seconds[variant] = variant_seconds.get(variant, 0.0) + part["variant_seconds"].get(variant, 0.0)
            for field, merged in (("results", results), ("n_samples", n_samples), ("paired", paired)):
                for task, value in part[field].get(variant, {}).items():
                    held = merged.setdefault(variant, {})
                    if task in held and not _same(held[task], value):
                        raise ValueError(f"merge_lm_eval: {variant!r} on {task!r} differs between the parts ({field}: "
                                         f"{held[task]} against {value} in {name}); the same variant on the same items "
                                         "must give the same numbers: the parts are not of one model, task files, "
                                         "software and kind of hardware.")
                    held[task] = value
    tasks = list(limits)
    one_limit = len(set(limits.values())) == 1
    paired = {v: p for v, p in paired.items() if v != "unpatched"}
    unpaired = _unpaired(paired, [t for t in tasks if any(t in results.get(v, {}) for v in paired)]) if paired else {}
    unpaired |= {t: "only the unpatched model was scored on it in these parts" for t in tasks
                 if not any(t in results.get(v, {}) for v in paired)}
    return Report("lm-eval", {
        **{key: first.get(key, MERGE_DEFAULTS.get(key)) for key in MERGE_SAME}, "command": "lm-eval", "tasks": tasks, "variants": variants,
        "limit": next(iter(limits.values())) if one_limit else limits,
        "include_path": sorted({f for p in parts for f in _listed(p.get("include_path"))}) or None,
        "task_source": {t: s for t, s in sources.items() if s is not None},
        "results": results, "n_samples": n_samples, "paired": paired,
        "groups": {g: s for p in parts for g, s in p.get("groups", {}).items()}, "unpaired": unpaired,
        "variant_seconds": variant_seconds, "seconds": round(sum(p["seconds"] for p in parts), 1),
        "parts": [entry for p, name in zip(parts, names, strict=True) for entry in _part_entries(p, name)],
        **{key: first.get(key) for key in ("torch", "python", "device", "threads", "weights", "versions")},
        "variant_weights": {k: v for p in parts for k, v in p["variant_weights"].items()},
        "task_files": {k: v for p in parts for k, v in p["task_files"].items()},
        "peak_rss_gb": max((p.get("peak_rss_gb") or 0.0) for p in parts)})


PROVENANCE = ("weights", "versions", "variant_weights", "task_files")  # what every part records (since 0.4)


def _check_provenance(parts: list[dict], names: list[str]) -> None:
    """The parts scored the same weights (the base, and each saved folder scored in several parts) with
    the same libraries and task files: refused otherwise, naming both parts and both values."""
    for part, name in zip(parts, names, strict=True):
        missing = [key for key in PROVENANCE if part.get(key) is None]
        if missing or (isinstance(part["weights"], dict) and part["weights"].get("digest") is None):
            raise ValueError(f"merge_lm_eval: {name} records no {', '.join(missing) or 'weights digest'} (a report "
                             "written before hf_tangent 0.4, or of offloaded weights), so nothing shows that its "
                             "numbers come from the same weights and software as the others; rerun that part.")
        problems = provenance_problems(part)
        if problems:
            raise ValueError(f"merge_lm_eval: {name} has malformed provenance ({'; '.join(problems)}); accepted: a "
                             "report as hf-tangent lm-eval wrote it.")
    first, first_name = parts[0], names[0]
    for part, name in zip(parts[1:], names[1:], strict=True):
        if part["weights"]["digest"] != first["weights"]["digest"]:
            raise ValueError(f"merge_lm_eval: the parts scored different weights: {first_name} "
                             f"{first['weights']['digest'][:16]}... ({first['weights'].get('dtypes')}) and {name} "
                             f"{part['weights']['digest'][:16]}... ({part['weights'].get('dtypes')})"
                             f"{_patch_differences(first['weights'], part['weights'], first_name, name)}; accepted: "
                             "parts of one measurement, on the same weights.")
        differ = sorted(k for k in set(first["versions"]) | set(part["versions"])
                        if first["versions"].get(k) != part["versions"].get(k))
        if differ:
            raise ValueError("merge_lm_eval: the parts ran other software: " + "; ".join(
                f"{k} {first['versions'].get(k)} in {first_name} and {part['versions'].get(k)} in {name}"
                for k in differ) + "; accepted: parts run with the same versions.")
    for key, what in (("variant_weights", "saved folder"), ("task_files", "task")):
        seen: dict[str, tuple] = {}
        for part, name in zip(parts, names, strict=True):
            for label, value in part[key].items():
                value = value.get("digest") if isinstance(value, dict) else value
                if label in seen and seen[label][0] != value:
                    patch = _patch_differences(seen[label][2], part[key][label], seen[label][1], name)
                    raise ValueError(f"merge_lm_eval: the {what} {label!r} differs between {seen[label][1]} "
                                     f"({str(seen[label][0])[:16]}...) and {name} ({str(value)[:16]}...){patch}: other "
                                     "weights or task files under the same name; accepted: parts of one measurement.")
                seen.setdefault(label, (value, name, part[key][label]))


def _patch_differences(one, other, one_name: str, other_name: str) -> str:
    """"; the patch differs: ..." between two recorded weights whose patch records differ, else ""."""
    if not all(isinstance(w, dict) and "patch" in w for w in (one, other)):
        return ""  # a saved folder's files digest: its config.json, patch record included, is in the digest
    differ = patch_differences(one["patch"], other["patch"])
    return "; the patch differs: " + "; ".join(f"{k} {a!r} in {one_name} and {b!r} in {other_name}"
                                               for k, a, b in differ[:4]) + (" ..." if len(differ) > 4 else "") \
        if differ else ""


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

PAIRED_SHOWN = (*PAIRED_METRICS, *ROLLING_PAIRED)  # every metric _paired pairs, in the table's order


def report_tasks(report: dict) -> list[str]:
    """The requested tasks in order, a group followed by its subtasks (each paired on its own)."""
    out = []
    for task in report["tasks"]:
        out += [task] + [sub for sub in report.get("groups", {}).get(task, []) if sub != task]
    return out


def lm_eval_markdown(report: dict) -> str:
    where = ("on the model in memory" if report.get("backend", "hf") == "hf" else
             f"through vLLM (lm-eval's VLLM model; every variant written as a complete folder and served by vLLM with "
             f"hf_tangent's plugin; vllm_args {report.get('vllm_args') or {}})")
    windows = sorted({c for c in (report.get("rolling_window") or {}).values() if c is not None})
    context = (f"; a perplexity task in rolling windows of {windows[0]} tokens" if len(windows) == 1 else
               "; a perplexity task's rolling windows per variant: "
               + ", ".join(f"{v} {c} tokens" for v, c in report["rolling_window"].items()) if windows else "")
    lines = [f"# hf-tangent lm-eval: {report['model']}", "",
             f"EleutherAI's LM Evaluation Harness {where}{context}; {limit_text(report)}, "
             f"{report['num_fewshot'] or 0}-shot; paired differences against `unpatched` over the same documents, 95% "
             f"paired bootstrap interval ({report['bootstrap']} resamples; bits_per_byte and word_nll, nats per word, "
             f"as ratios of sums over the documents); {report['seconds']} s"
             + (f" in all, in {len(report['parts'])} parts merged by `hf-tangent lm-eval-merge`" if report.get("parts")
                else "") + "."]
    for task in report_tasks(report):
        source = report.get("task_source", {}).get(task)
        group = report.get("groups", {}).get(task)
        lines += ["", f"## {task}" + (f" ({source})" if source else "")
                  + (f" — a group of {len(group)} subtasks, paired over all their documents" if group else ""), ""]
        metrics = sorted({k for r in report["results"].values() for k in r.get(task, {}) if "stderr" not in k
                          and k != "sample_len"})
        if windows and any(m.startswith(("bits_per_byte", "word_perplexity")) for m in metrics):
            lines += [f"Rolling windows of {', '.join(map(str, windows))} tokens ({_backend_windows(report)}); paired "
                      "only within this report (`lm-eval-merge` refuses parts of another backend).", ""]
        paired = [m for m in PAIRED_SHOWN if any(m in p.get(task, {}) for p in report["paired"].values())]
        header = ["variant", *metrics, *[f"delta {m} vs unpatched [95% CI]" for m in paired]]
        lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for variant in report["variants"]:
            if task not in report["results"][variant]:  # a merged report: a part that did not score this variant on it
                continue
            values = report["results"][variant][task]
            cells = []
            for m in metrics:
                stderr = values.get(m.replace(",", "_stderr,", 1))
                cells.append("-" if m not in values else f"{values[m]:.4f}" + (
                    f" +- {stderr:.4f}" if isinstance(stderr, float) else ""))
            for m in paired:
                p = report["paired"].get(variant, {}).get(task, {}).get(m)
                cells.append("-" if p is None else f"{p['diff']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]")
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    for task, why in report.get("unpaired", {}).items():
        lines += ["", f"No paired differences for `{task}`: {why}."]
    lines += ["", "![paired differences](lm_eval_differences.png)"]
    return "\n".join(lines) + "\n"


def _backend_windows(report: dict) -> str:
    if report.get("backend", "hf") == "vllm":
        return "lm-eval's VLLM: the served max_model_len less two tokens"
    return "lm-eval's HFLM: the model's context"


def _plot_lm_eval(data, folder):
    return [plots.paired_differences(data["paired"], report_tasks(data), os.path.join(folder, "lm_eval_differences.png"),
                                     f"{data['model']}: against the unpatched model")]


register_report('lm-eval', lm_eval_markdown, _plot_lm_eval)
