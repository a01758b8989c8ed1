"""No-model baselines of the shipped Austen tasks: how much of each task a predictor that never runs a
language model solves, from the surface of the items alone (lengths, position and punctuation), an
n-gram model fitted on the calibration novels, and a cross-validated classifier on surface features.

    python benchmarks/task_baselines.py --previous 735387d --output docs/results/lm_eval/task_baselines.json

`--previous COMMIT` scores the task files of an earlier version too (read with `git show`), for the
model results measured on them. docs/lm-eval.md renders the kept JSON (docs/figures.py, region
lm-eval-baselines); tests/test_task_baselines.py recomputes it and holds every next-sentence
predictor to chance +- 3 points on the shipped file.

Accuracies are expected accuracies under random tie-breaking (a predictor that ties k choices,
the true one among them, scores 1/k on the item). Last word: a prediction is right when it equals
the target ignoring case (lm-eval's acc also needs the exact case, so these are upper bounds).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hf_tangent from this checkout

CHANCE = {"austen_nextsentence": 0.25}
FOLDS = 5
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?|[^\sa-z]")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


# ----------------------------------------------------------------------------- an n-gram model
class Trigram:
    """Interpolated absolute discounting (D = 0.75) down to an add-one unigram, on lower-cased words and
    punctuation marks; paragraphs are separated by <p>."""

    D = 0.75

    def __init__(self, paragraphs: list[str]):
        self.c1, self.c2, self.c3 = Counter(), Counter(), Counter()
        self.h1, self.h2 = Counter(), Counter()  # history counts
        self.f1, self.f2 = Counter(), Counter()  # distinct followers of a history
        stream = ["<p>"]
        for paragraph in paragraphs:
            stream += tokens(paragraph) + ["<p>"]
        self.c1.update(stream)
        for a, b in zip(stream, stream[1:], strict=False):
            self.c2[a, b] += 1
        for a, b, c in zip(stream, stream[1:], stream[2:], strict=False):
            self.c3[a, b, c] += 1
        for (a, _), n in self.c2.items():
            self.h1[a] += n
            self.f1[a] += 1
        for (a, b, _), n in self.c3.items():
            self.h2[a, b] += n
            self.f2[a, b] += 1
        self.total, self.vocab = sum(self.c1.values()), len(self.c1) + 1
        self.words = [w for w, _ in self.c1.most_common() if w.isalpha() and len(w) >= 3]

    def prob(self, a: str, b: str, w: str) -> float:
        p = (self.c1[w] + 1) / (self.total + self.vocab)
        if self.h1[b]:
            p = max(self.c2[b, w] - self.D, 0) / self.h1[b] + self.D * self.f1[b] / self.h1[b] * p
        if self.h2[a, b]:
            p = max(self.c3[a, b, w] - self.D, 0) / self.h2[a, b] + self.D * self.f2[a, b] / self.h2[a, b] * p
        return p

    def logprob(self, history: list[str], words: list[str]) -> float:
        seq = (["<p>", "<p>"] + history)[-2:] + words
        return sum(math.log(self.prob(seq[i - 2], seq[i - 1], seq[i])) for i in range(2, len(seq)))


# ----------------------------------------------------------------------------- scoring
def expected_accuracy(scores: list[list[float]], gold: list[int]) -> float:
    """Mean over items of 1/k when the true choice is among the k highest-scoring ones, else 0."""
    total = 0.0
    for row, g in zip(scores, gold, strict=True):
        best = max(row)
        ties = [i for i, s in enumerate(row) if s == best]
        total += (g in ties) / len(ties)
    return total / len(gold)


def _quote_open(text: str) -> bool:
    return text.count('"') % 2 == 1


def surface_features(context: str, choice: str) -> list[float]:
    """What a reader sees without reading: the choice's length, opening, closing and inner
    punctuation, quotation parity, and how they meet the context's (its open quotation, its last
    mark, its sentence lengths)."""
    words = choice.split()
    first, last = choice[0], choice[-1]
    core = choice.rstrip("\"'_)")
    mark = core[-1] if core else ""
    ctx_open, ctx_last = _quote_open(context), context[-1]
    ctx_words = len(context.split())
    opens_quote, closes_quote, odd = first in "\"'", last in "\"'", _quote_open(choice)
    own = [len(choice) / 100, len(words) / 20, math.log(len(words)), opens_quote, closes_quote, odd,
           choice.count('"') / 2, choice.count("'") / 2, mark == ".", mark == "?", mark == "!",
           mark not in ".?!", "--" in choice, choice.count(",") / 3, ";" in choice, ":" in choice, "_" in choice,
           first.islower(), choice.lstrip("\"'_")[:1].islower(), words[0].lstrip("\"'_") in ("I", "But", "And", "She", "He")]
    meet = [ctx_open * opens_quote, ctx_open * odd, ctx_open * closes_quote, (ctx_last in "\"'") * opens_quote,
            (ctx_last in "\"'") * odd, (ctx_last == "?") * opens_quote, len(words) / max(ctx_words, 1),
            (not ctx_open) * (not odd) * opens_quote]
    return [float(x) for x in own + meet]


def classifier_accuracy(items: list[dict], folds: int = FOLDS, seed: int = 0) -> float:
    """A conditional logistic regression (softmax over an item's choices) on `surface_features`,
    k-fold cross-validated by passage (folds of whole paragraphs of a novel: an item never shares a
    fold boundary with its passage); the accuracy of the held-out folds' argmax."""
    x = torch.tensor([[surface_features(i["context"], c) for c in i["choices"]] for i in items], dtype=torch.float64)
    y = torch.tensor([i["gold"] for i in items])
    passage = [(i["novel"], i.get("paragraph", k) // (50 if "paragraph" in i else 1)) for k, i in enumerate(items)]
    keys = sorted(set(passage))
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    fold_of_key = {keys[j]: n % folds for n, j in enumerate(order)}
    fold = torch.tensor([fold_of_key[p] for p in passage])
    x = (x - x.mean(dim=(0, 1))) / x.std(dim=(0, 1)).clamp_min(1e-9)
    scores = torch.zeros(y.shape[0], x.shape[1], dtype=torch.float64)
    for k in range(folds):
        train, test = fold != k, fold == k
        w = torch.zeros(x.shape[2], dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

        def closure(optimizer=optimizer, w=w, train=train):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(x[train] @ w, y[train]) + 1e-3 * w.square().sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        scores[test] = (x[test] @ w).detach()
    return expected_accuracy(scores.tolist(), y.tolist())


def _median_closest(lengths: list[int]) -> list[float]:
    middle = sorted(lengths)[len(lengths) // 2 - 1: len(lengths) // 2 + 1]
    median = sum(middle) / 2
    return [-abs(n - median) for n in lengths]


def nextsentence_baselines(items: list[dict], model: Trigram) -> dict:
    gold = [i["gold"] for i in items]
    lengths = [[len(c) for c in i["choices"]] for i in items]
    predictors = {
        "longest choice": ([[float(n) for n in row] for row in lengths], "length rank: the longest choice (characters)"),
        "shortest choice": ([[-float(n) for n in row] for row in lengths], "length rank: the shortest choice"),
        "median length": ([_median_closest(row) for row in lengths], "length rank: the choice closest to the median length of the four"),
        "no opening quote, median length": (
            [[(c[0] not in "\"'") * 1000 + s for c, s in zip(i["choices"], _median_closest(row), strict=True)]
             for i, row in zip(items, lengths, strict=True)],
            "drop the choices that open with a quote, then the median length"),
        "quotes balance": ([[float(not _quote_open(i["context"] + " " + c)) for c in i["choices"]] for i in items],
                           "position and punctuation: a choice after which the context's quotation marks balance"),
        "opening matches context": (
            [[float((c[0] in "\"'") == (i["context"][-1] in "\"'" and not _quote_open(i["context"]))) for c in i["choices"]]
             for i in items],
            "position and punctuation: a choice that opens with a quote exactly when the context ends a closed quotation"),
        "trigram, choice alone": ([[model.logprob([], tokens(c)) for c in i["choices"]] for i in items],
                                  "the n-gram model's log-probability of the choice on its own"),
        "trigram, choice alone per token": (
            [[model.logprob([], tokens(c)) / len(tokens(c)) for c in i["choices"]] for i in items],
            "the same per token (as acc_norm normalises)"),
        "trigram after the context": (
            [[model.logprob(tokens(i["context"]), tokens(c)) for c in i["choices"]] for i in items],
            "the n-gram model's log-probability of the choice after the context"),
        "trigram after the context per token": (
            [[model.logprob(tokens(i["context"]), tokens(c)) / len(tokens(c)) for c in i["choices"]] for i in items],
            "the same per token"),
    }
    out = {name: {"acc": expected_accuracy(scores, gold), "what": what} for name, (scores, what) in predictors.items()}
    out["surface classifier (5-fold CV)"] = {
        "acc": classifier_accuracy(items),
        "what": f"a logistic regression on {len(surface_features('a', 'b'))} surface features of the choice and of how "
                f"it meets the context, {FOLDS}-fold cross-validated by passage"}
    return out


def lastword_baselines(items: list[dict], model: Trigram, calibration_targets: Counter) -> dict:
    def hit(guess: str, target: str) -> float:
        return float(guess.lower() == target.lower())

    frequent = calibration_targets.most_common(1)[0][0]
    out = {"most frequent last word": {
        "acc": sum(hit(frequent, i["target"]) for i in items) / len(items),
        "what": f"always '{frequent}', the most frequent last word of the calibration novels' paragraphs"}}
    guesses, cached = [], []
    rank = {w: k for k, w in enumerate(model.words[:5000])}  # the candidates: the 5000 most frequent words
    followers2, followers3 = {}, {}
    for (x, w) in model.c2:
        followers2.setdefault(x, set()).add(w)
    for (x, y, w) in model.c3:
        followers3.setdefault((x, y), set()).add(w)
    for item in items:
        a, b = (["<p>", "<p>"] + tokens(item["context"]))[-2:]
        # a word never seen after (a, b) or b has the unigram's order: the most frequent of those is enough
        seen = (followers2.get(b, set()) | followers3.get((a, b), set())) & rank.keys()
        candidates = sorted(seen | set(model.words[:50]), key=rank.__getitem__)
        guesses.append(max(candidates, key=lambda w: model.prob(a, b, w)))
        own = {w for w in tokens(item["context"]) if w.isalpha() and len(w) >= 3}
        cached.append(max(sorted(own), key=lambda w: model.prob(a, b, w)) if own else frequent)
    out["trigram"] = {"acc": sum(hit(g, i["target"]) for g, i in zip(guesses, items, strict=True)) / len(items),
                      "what": "the n-gram model's most probable word (3+ letters) after the context's last two tokens"}
    out["trigram over the context's words"] = {
        "acc": sum(hit(g, i["target"]) for g, i in zip(cached, items, strict=True)) / len(items),
        "what": "the same, among the words of the context only"}
    return out


# ----------------------------------------------------------------------------- the report
def calibration_model():
    from benchmarks.lm_eval_tasks import _paragraphs, lastword_items
    from hf_tangent.training.data import AUSTEN_SPLITS, austen_dir

    folder = austen_dir()
    texts = {n: (folder / f"{n}.txt").read_text(encoding="utf-8") for n in AUSTEN_SPLITS["calibration"]}
    model = Trigram([p for text in texts.values() for p in _paragraphs(text)])
    targets = Counter(i["target"].lower() for i in lastword_items(texts, n=10**9))
    return model, targets, list(texts)


def read_items(task: str, commit: str | None = None) -> list[dict]:
    from hf_tangent.integrations.harness.tasks import data_file

    if commit is None:
        text = data_file(task).read_text(encoding="utf-8")
    else:
        # the data's folder at that commit (hf_tangent/harness/data before the layout of issue 33)
        for folder in ("hf_tangent/integrations/harness/data", "hf_tangent/harness/data"):
            shown = subprocess.run(["git", "show", f"{commit}:{folder}/{task}.jsonl"], cwd=ROOT, capture_output=True,
                                   text=True)
            if shown.returncode == 0:
                break
        else:
            raise FileNotFoundError(f"{task}.jsonl is not at commit {commit}: {shown.stderr.strip()}")
        text = shown.stdout
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def baselines(commit: str | None = None, fitted=None) -> dict:
    model, targets, _ = fitted or calibration_model()
    out = {}
    for task in ("austen_nextsentence", "austen_lastword"):
        items = read_items(task, commit)
        predictors = (nextsentence_baselines(items, model) if task == "austen_nextsentence"
                      else lastword_baselines(items, model, targets))
        out[task] = {"items": len(items), "chance": CHANCE.get(task), "predictors": predictors}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--previous", help="a commit whose task files to score too (the previous task version)")
    parser.add_argument("--output", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    started = time.time()
    fitted = calibration_model()
    report = {"command": "task-baselines", "calibration_novels": fitted[2], "folds": FOLDS,
              "shipped": baselines(None, fitted)}
    if args.previous:
        commit = subprocess.run(["git", "rev-parse", "--short", args.previous], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        report["previous"] = {"commit": commit, **baselines(commit, fitted)}
    report["seconds"] = round(time.time() - started, 1)
    args.output.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
