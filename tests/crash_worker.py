"""Run by tests/test_crash_consistency.py: `python tests/crash_worker.py OUT.json SCENARIOS STEPS MODES`.

Every writer's kill walk, in one process started with OMP_NUM_THREADS=1 (no OpenMP thread pool,
so that it may fork). Per scenario it writes the old content, counts the steps of the writer
that replaces it (faults.Steps), then for each chosen step and mode:

- "before" / "after": forks a child that runs the writer and is killed (SIGKILL) before or after
  that step; "raise": runs the writer with an OSError injected at that step;
- checks what is left: the target is the old content or the new one, byte for byte (missing only
  where a kill came between renaming the old content aside and moving the new one in), and after
  the next loader (`ht.from_pretrained`, which finishes or rolls back, logged), it is the old or the
  new content, and loads with the logits of that model;
- runs the writer again (the next writer): it is not refused, leaves the new content and no
  leftover beside the target; then puts the old content back for the next step.

SCENARIOS: comma-separated names of SCENARIOS; STEPS: "all", "protocol" (every step outside the
stage being written, plus the first and last write inside it) or "renames" (every rename, and the
first step of each other kind); MODES: comma-separated. Writes
{scenario: {"steps": [...], "tested": {mode: [step numbers]}}} to OUT.json; a failed check exits 1
with the reason.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import tiny_smollm2_llama  # noqa: E402
from faults import Steps, count_steps, kill_at  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import hf_tangent as ht  # noqa: E402
from hf_tangent.core import destinations  # noqa: E402

IDS = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(0))


def snapshot(folder: Path):
    """Relative path -> bytes (folders -> None), None when `folder` does not exist."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def leftovers(target: Path) -> list[str]:
    """Hidden entries a writer of `target` may leave: beside it, and inside it."""
    beside = [p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]
    inside = [p.name for p in target.iterdir() if p.name.startswith(".")] if target.is_dir() else []
    return beside + inside


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


class Scenario:
    """target: where the writer writes; write(which) writes "old" or "new" content there; reset()
    puts the old content back; load(): the next reader, returns "old" or "new" by what it loaded."""

    def __init__(self, root: Path, name: str, base: Path):
        self.root, self.name, self.base = root / name, name, base
        self.root.mkdir()
        self.target = self.root / "target"
        self.models = {"old": self.gated(2.0), "new": self.gated(0.5)}
        self.expected = {which: logits(m) for which, m in self.models.items()}
        self.tokenizer = None

    def gated(self, value):
        model = ht.patch(LlamaForCausalLM.from_pretrained(self.base).eval(),
                         ht.TangentConfig(update="projected", gates=True))
        with torch.no_grad():
            for child in ht.tangent_layers(model):
                child.gate.fill_(value + 0.25 * child.index)
        return model

    # what the old content is: an artifact of the same kind (replaced), an empty folder, nothing
    old_kind = "artifact"
    writes_into = False  # an output_dir: written entry by entry

    def write(self, which: str) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        if self.old_kind == "artifact":
            self.write("old")
        else:
            shutil.rmtree(self.target, ignore_errors=True)
            if self.old_kind == "empty":
                self.target.mkdir()

    def load(self) -> str:
        loaded = logits(ht.from_pretrained(self.target).eval())
        return next(which for which, value in self.expected.items() if torch.equal(loaded, value))


class PatchRepo(Scenario):
    def write(self, which):
        ht.save_patch(self.models[which], self.target)


class PatchedFolder(Scenario):
    def write(self, which):
        self.models[which].save_pretrained(self.target)


class HubFolder(Scenario):
    def write(self, which):
        from transformers import AutoTokenizer

        self.tokenizer = self.tokenizer or AutoTokenizer.from_pretrained(self.base)
        ht.save_hub_folder(self.models[which], self.target, tokenizer=self.tokenizer)


class EmptyFolder(PatchRepo):
    old_kind = "empty"


class NewFolder(PatchedFolder):
    old_kind = "absent"


class OutputDir(HubFolder):
    """A Trainer output_dir (a checkpoint, logs, the Trainer's arguments) with an earlier save: written into. A kill
    may leave a folder without a record there, which the next reader finishes or rolls back. The save writes a
    card and a tokenizer over the earlier save's (moved aside first); the folder's name holds every stage word."""

    writes_into = True

    def __init__(self, *args):
        super().__init__(*args)
        self.target = self.root / "out-staging-ready-earlier-into-done-1"

    def reset(self):
        shutil.rmtree(self.target, ignore_errors=True)
        (self.target / "checkpoint-2").mkdir(parents=True)
        (self.target / "checkpoint-2" / "trainer_state.json").write_text("{}")
        (self.target / "runs").mkdir()
        (self.target / "runs" / "events.out.tfevents").write_text("log")
        (self.target / "training_args.bin").write_bytes(b"args")
        self.write("old")


class LoraRepo(Scenario):
    def __init__(self, *args):
        super().__init__(*args)
        from peft import LoraConfig, get_peft_model

        for which, seed in (("old", 1), ("new", 2)):
            torch.manual_seed(seed)
            self.models[which] = get_peft_model(ht.patch(LlamaForCausalLM.from_pretrained(self.base).eval(),
                                                         ht.TangentConfig(update="norm_preserving")),
                                                LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
            self.expected[which] = logits(self.models[which])

    def write(self, which):
        ht.save_patch(self.models[which], self.target)


SCENARIOS = {"patch_repo": PatchRepo, "patched_folder": PatchedFolder, "hub_folder": HubFolder,
             "empty_folder": EmptyFolder, "new_folder": NewFolder, "lora_repo": LoraRepo, "output_dir": OutputDir}


def protocol(steps: list[str], marker: str = ".hf_tangent-staging-") -> list[int]:
    """1-based steps outside the stage being written, plus the first and last write inside it (and of
    each run of removals inside one rmtree, the first and the last)."""
    def path(label):
        return label[label.index("(") + 1:-1]

    inner = [k for k, s in enumerate(steps, 1) if any(marker in part for part in path(s).split("/")[:-1])]
    removals, runs = [], []
    for k, s in enumerate(steps, 1):
        if k not in inner and "/" not in path(s) and s.startswith(("unlink(", "rmdir(")):
            runs.append(k)
        elif runs:
            removals.append(runs)
            runs = []
    if runs:
        removals.append(runs)
    skipped = set(inner[1:-1]) | {k for run in removals for k in run[1:-1]}
    return [k for k in range(1, len(steps) + 1) if k not in skipped]


def renames(steps: list[str]) -> list[int]:
    """1-based: every rename, and the first step of each other kind (mkdir, write, removal)."""
    first = {}
    for k, s in enumerate(steps, 1):
        first.setdefault(s.split("(")[0], k)
    return sorted({k for k, s in enumerate(steps, 1) if s.startswith(("replace(", "rename("))} | set(first.values()))


def fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(1)


def walk(scenario: Scenario, chosen: list[int], mode: str, steps: list[str], states: dict) -> None:
    target = scenario.target
    for n in chosen:
        where = f"{scenario.name}: {mode} step {n} ({steps[n - 1]})"
        raised = None
        if mode == "raise":
            try:
                with Steps(fail=n):
                    scenario.write("new")
            except OSError as err:
                raised = err
            if raised is not None:
                if snapshot(target) != states["old"]:
                    fail(f"{where}: the write failed and the target is not its old content")
                if leftovers(target):
                    fail(f"{where}: the write failed and left {leftovers(target)}")
        else:
            outcome = kill_at(functools.partial(scenario.write, "new"), n, mode)
            if outcome != "killed":
                fail(f"{where}: the writer finished instead of being killed")
            left = snapshot(target)
            if left not in (states["old"], states["new"]) and not ((left is None or scenario.writes_into) and any(
                    ".hf_tangent-" in name for name in leftovers(target))):
                fail(f"{where}: the kill left a target that is neither the old nor the new content: "
                     f"{sorted(left or {})}")
        # the next reader finishes or rolls back what was left, and sees the old or the new content
        if scenario.old_kind == "artifact":
            seen = scenario.load()
        else:
            destinations.recover(target)
            seen = "old" if snapshot(target) == states["old"] else "new"
            if seen == "new":
                seen = scenario.load()
        if snapshot(target) != states[seen]:
            fail(f"{where}: after the next reader the target is not the {seen} content: {sorted(snapshot(target) or {})}")
        if leftovers(target):
            fail(f"{where}: the next reader left {leftovers(target)}")
        if raised is not None and seen != "old":
            fail(f"{where}: the write raised ({raised}) but the new content is in place")
        # the next writer is not refused, and leaves the new content and nothing else
        scenario.write("new")
        if snapshot(target) != states["new"] or leftovers(target):
            fail(f"{where}: the next writer left {sorted(snapshot(target) or {})} and {leftovers(target)}")
        scenario.reset()
        if snapshot(target) != states["old"]:
            fail(f"{where}: the old content could not be put back")


def run(root: Path, names: list[str], which_steps: str, modes: list[str]) -> dict:
    """The walks of `names` (a failed check exits, in a worker, or raises SystemExit in a test)."""
    base = root / "base"
    if not base.exists():
        tiny_smollm2_llama(base)
    results = {}
    for name in names:
        scenario = SCENARIOS[name](root, name, base)
        scenario.reset()
        states = {"old": snapshot(scenario.target)}
        steps = count_steps(functools.partial(scenario.write, "new"))
        states["new"] = snapshot(scenario.target)
        scenario.reset()
        chosen = {"all": list(range(1, len(steps) + 1)), "protocol": protocol(steps),
                  "renames": renames(steps)}[which_steps]
        results[name] = {"steps": steps, "tested": {}}
        for mode in modes:
            walk(scenario, chosen, mode, steps, states)
            results[name]["tested"][mode] = chosen
    return results


def main() -> None:
    out, names, which_steps, modes = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4].split(",")
    logging.getLogger("hf_tangent").setLevel(logging.ERROR)  # the recoveries' log lines (test_crash_consistency checks them)
    root = Path(out).parent / "crash"
    root.mkdir()
    Path(out).write_text(json.dumps(run(root, names, which_steps, modes), indent=1))


if __name__ == "__main__":
    main()
