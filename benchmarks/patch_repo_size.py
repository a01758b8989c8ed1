"""Patch repo vs complete folder on SmolLM2-135M: bytes written and reload time, for a calibrate run
(gates) and a heal run (LoRA r=8 adapters), measured in one run.

    python benchmarks/patch_repo_size.py --output benchmarks/results/patch_repo_cpu.json   # ~5 min, 2 cores

The runs are short (their weights do not change the sizes); reload: `ht.from_pretrained` of each
artifact, 3 interleaved repeats, median (the patch repo's base comes from the offline cache); the
logits of the two reloads on one Austen window are compared (identical for gates; for LoRA the
complete folder holds merged weights, so rounding differs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import hf_tangent as ht
from hf_tangent.experiments.heal import HealTrainingArguments


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def reload_seconds(folders: dict[str, Path], repeats: int) -> dict[str, float]:
    times = {name: [] for name in folders}
    for i in range(repeats):
        for name in (list(folders) if i % 2 == 0 else list(reversed(folders))):
            start = time.perf_counter()
            model = ht.from_pretrained(folders[name])
            times[name].append(time.perf_counter() - start)
            del model
    return {name: statistics.median(values) for name, values in times.items()}


def logits_gap(folders: dict[str, Path]) -> float:
    """Largest |logit| difference between the reloaded patch repo and the complete folder on 64 Austen tokens."""
    from hf_tangent.artifacts.models import load_tokenizer
    from hf_tangent.training.data import load_documents, pack_windows

    ids = pack_windows(load_tokenizer("smollm2-135m"), load_documents(), seq_len=64, max_windows=1)[:1]
    out = []
    for folder in folders.values():
        with torch.no_grad():
            out.append(ht.from_pretrained(folder).eval()(ids).logits)
    return (out[0] - out[1]).abs().max().item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    text = dict(seq_len=64, max_windows=1, train_windows=6)  # at least one per domain of the mixed corpus
    result = {"benchmark": "patch_repo_size", "model": "smollm2-135m", "threads": torch.get_num_threads(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ht.calibrate_gates("smollm2-135m", **text, training_args=ht.TangentTrainingArguments(
            output_dir=str(tmp / "calibrate"), max_steps=1, per_device_train_batch_size=1, use_cpu=True),
            save_patch=tmp / "calibrate" / "patch", save_model=tmp / "calibrate" / "model", progress=False)
        ht.heal("smollm2-135m", ht.TangentConfig(update="projected"), **text, save_models=True, save_full_models=True,
                training_args=HealTrainingArguments(output_dir=str(tmp / "heal"), max_steps=1,
                                                    per_device_train_batch_size=1, use_cpu=True), max_new_tokens=1)
        artifacts = {"calibrate": (tmp / "calibrate" / "patch", tmp / "calibrate" / "model"),
                     "heal": (tmp / "heal" / "runs" / "seed0" / "patch", tmp / "heal" / "runs" / "seed0" / "model")}
        for run, (patch, full) in artifacts.items():
            seconds = reload_seconds({"patch": patch, "full": full}, args.repeats)
            result["runs"][run] = {"patch_bytes": size(patch), "full_bytes": size(full),
                                   "patch_files": sorted(str(p.relative_to(patch)) for p in patch.rglob("*") if p.is_file()),
                                   "reload_patch_s": seconds["patch"], "reload_full_s": seconds["full"],
                                   "logits_max_abs_diff": logits_gap({"patch": patch, "full": full})}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return result


if __name__ == "__main__":
    main()
