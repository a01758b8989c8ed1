"""Offline lm-eval tasks built from the held-out Austen novels (Emma, Mansfield Park), shipped as data
inside the package, and the task folder that `TaskManager(include_path=...)` reads.

    austen_lastword       LAMBADA-style: a paragraph without its last word; the target is that word
                          (output_type loglikelihood; acc = greedy match of the target tokens, perplexity)
    austen_nextsentence   three consecutive sentences; choose the true next sentence among four (the
                          other three: sentences of the same novel, of similar length, far from the
                          context) (multiple_choice; acc, acc_norm)

Built by `python -m hf_tangent.harness.tasks --build FOLDER_WITH_THE_NOVELS` (deterministic: seeded);
the items are in-domain for this project's calibration and healing text (other Austen novels), which
every result next to them says. The novels are public domain.
"""

from __future__ import annotations

import json
import random
import re
import sys
from importlib import resources
from pathlib import Path

TASKS = ("austen_lastword", "austen_nextsentence")
NOVELS = ("emma", "mansfieldpark")  # the held-out split (data.AUSTEN_SPLITS["evaluation"])
ITEMS = 2000  # per task
SEED = 0
_SENTENCE = re.compile(r"(?<=[.!?])[\"']?\s+(?=[\"']?[A-Z])")

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
  version: 1.0
  source: "hf_tangent: the held-out Austen novels (Emma, Mansfield Park); distractors: same novel, similar length"
""",
}


_ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.", "Messrs.")


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph: split after . ! ? (and a closing quote) before a capital, except
    after a title (Mr., Mrs., ...), which the name follows."""
    out: list[str] = []
    for piece in _SENTENCE.split(paragraph):
        if out and out[-1].endswith(_ABBREVIATIONS):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def lastword_items(texts: dict[str, str], n: int = ITEMS, seed: int = SEED) -> list[dict]:
    """Paragraphs of 40-200 words whose last word is alphabetic (3+ letters): context = the paragraph
    up to that word, target = the word (its closing punctuation dropped)."""
    items = []
    for novel, text in texts.items():
        for paragraph in _paragraphs(text):
            words = paragraph.split(" ")
            if not 40 <= len(words) <= 200:
                continue
            last = words[-1].strip(".,;:!?\"'_()-")
            if len(last) >= 3 and last.isalpha():
                items.append({"novel": novel, "context": " ".join(words[:-1]), "target": last})
    random.Random(seed).shuffle(items)
    return items[:n]


def nextsentence_items(texts: dict[str, str], n: int = ITEMS, seed: int = SEED) -> list[dict]:
    """Three consecutive sentences of a paragraph and four candidate continuations: the true next
    sentence and three sentences of the same novel of similar length (0.67-1.5x), at least 50
    sentences away; the order of the choices is shuffled (seeded)."""
    rng = random.Random(seed)
    items = []
    for novel, text in texts.items():
        sentences = [s for p in _paragraphs(text) for s in [*_sentences(p), "\u2029"]]  # \u2029: paragraph end
        for i in range(len(sentences) - 3):
            window = sentences[i:i + 4]
            if "\u2029" in window or not all(5 <= len(s.split()) <= 40 for s in window):
                continue
            gold = window[3]
            pool = [j for j, s in enumerate(sentences) if abs(j - i) > 50 and s != "\u2029"
                    and 0.67 <= len(s.split()) / len(gold.split()) <= 1.5]
            if len(pool) < 3:
                continue
            choices = [gold] + [sentences[j] for j in rng.sample(pool, 3)]
            order = list(range(4))
            rng.shuffle(order)
            items.append({"novel": novel, "context": " ".join(window[:3]), "choices": [choices[k] for k in order],
                          "gold": order.index(0)})
    rng.shuffle(items)
    return items[:n]


def build(source: Path, target: Path) -> dict[str, int]:
    """Write <task>.jsonl into `target` from the novels in `source` (<name>.txt); returns the counts."""
    texts = {name: (source / f"{name}.txt").read_text(encoding="utf-8") for name in NOVELS}
    target.mkdir(parents=True, exist_ok=True)
    counts = {}
    for task, items in (("austen_lastword", lastword_items(texts)), ("austen_nextsentence", nextsentence_items(texts))):
        (target / f"{task}.jsonl").write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items),
                                              encoding="utf-8")
        counts[task] = len(items)
    return counts


def data_file(task: str) -> Path:
    """The shipped JSONL of a task (package data)."""
    return Path(str(resources.files("hf_tangent.harness") / "data" / f"{task}.jsonl"))


def task_folder(folder: str | Path | None = None) -> Path:
    """A folder with the YAML of every shipped task (absolute paths to the shipped data), for
    `TaskManager(include_path=...)` and `lm_eval --include_path`; written under the hf_tangent cache
    unless `folder` is given."""
    if folder is None:
        from ..models import cache_dir

        folder = cache_dir() / "lm_eval_tasks"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for task in TASKS:
        text = _YAML[task].format(data=json.dumps(str(data_file(task))))
        path = folder / f"{task}.yaml"
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    return folder


if __name__ == "__main__":  # python -m hf_tangent.harness.tasks [--build NOVELS_FOLDER]: prints the task folder
    if len(sys.argv) == 3 and sys.argv[1] == "--build":
        print(build(Path(sys.argv[2]), Path(__file__).resolve().parent / "data"))
    else:
        print(task_folder())
