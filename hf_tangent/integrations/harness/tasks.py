"""Offline lm-eval tasks built from the held-out Austen novels (Emma, Mansfield Park), shipped as data
inside the package, and the task folder that `TaskManager(include_path=...)` reads.

    austen_lastword       LAMBADA-style: a paragraph without its last word; the target is that word
                          (output_type loglikelihood; acc = greedy match of the target tokens, perplexity)
    austen_nextsentence   three consecutive sentences; choose the true next sentence among four: four
                          sentences of one novel that look alike on the surface (position in the
                          paragraph, opening and closing punctuation, quotation state, length), one of
                          them drawn at random to be the true one, its three preceding sentences the
                          context; no sentence is in two items (multiple_choice; acc, acc_norm)
    austen_perplexity     the held-out novels, one document per chapter (loglikelihood_rolling;
                          word_perplexity, byte_perplexity, bits_per_byte)

Built by `python benchmarks/lm_eval_tasks.py FOLDER_WITH_THE_NOVELS` (deterministic: seeded; not shipped);
the items are in-domain for this project's calibration and healing text (other Austen novels), which
every result next to them says. The novels are public domain.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from importlib import resources
from pathlib import Path

from ...artifacts.checkpoints import cache_dir

TASKS = ("austen_lastword", "austen_nextsentence", "austen_perplexity")
NOVELS = ("emma", "mansfieldpark")  # the held-out split (data.AUSTEN_SPLITS["evaluation"])
TASK_VERSION = 2  # 2: next-sentence distractors from the true sentence's surface cell, independent items, austen_perplexity

_YAML = {
    "austen_lastword": """task: austen_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  source: "hf_tangent: the held-out Austen novels (Emma, Mansfield Park); LAMBADA-style, not filtered for context dependence"
""",
    "austen_nextsentence": """task: austen_nextsentence
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2.0
  source: "hf_tangent: the held-out Austen novels (Emma, Mansfield Park); distractors: sentences of the same novel and surface cell (position, punctuation, quotation, length), the true one drawn at random among the four; independent items"
""",
    "austen_perplexity": """task: austen_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
  source: "hf_tangent: the held-out Austen novels (Emma, Mansfield Park), one document per chapter"
""",
}


def data_file(task: str) -> Path:
    """The shipped JSONL of a task (package data)."""
    return Path(str(resources.files("hf_tangent.integrations.harness") / "data" / f"{task}.jsonl"))


def task_folder(folder: str | Path | None = None) -> Path:
    """A folder with the YAML of every shipped task (absolute paths to the shipped data), for
    `TaskManager(include_path=...)` and `lm_eval --include_path`; written under the hf_tangent cache
    unless `folder` is given."""
    if folder is None:
        folder = cache_dir() / "lm_eval_tasks"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for task in TASKS:
        text = _YAML[task].format(data=json.dumps(str(data_file(task))))
        path = folder / f"{task}.yaml"
        if not path.is_file() or path.read_text(encoding="utf-8") != text:  # in one rename: another process
            scratch = folder / f".{task}.yaml.{os.getpid()}-{uuid.uuid4().hex[:8]}"  # reading it never sees half
            try:
                scratch.write_text(text, encoding="utf-8")
                os.replace(scratch, path)
            finally:
                scratch.unlink(missing_ok=True)
    return folder


if __name__ == "__main__":  # python -m hf_tangent.integrations.harness.tasks: prints the task folder
    if len(sys.argv) > 1:
        sys.exit("usage: python -m hf_tangent.integrations.harness.tasks (no arguments: prints the task folder); the "
                 "task data is built by benchmarks/lm_eval_tasks.py in a checkout")
    print(task_folder())
