"""Builds the shipped lm-eval task data (hf_tangent/integrations/harness/data/<task>.jsonl) from the held-out
Austen novels: `python benchmarks/lm_eval_tasks.py FOLDER_WITH_THE_NOVELS` (deterministic: seeded). What each task
is: hf_tangent/integrations/harness/tasks.py. A tool of the checkout, not shipped: the package reads only the data."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_tangent from this checkout
from hf_tangent.integrations.harness.tasks import NOVELS  # noqa: E402

ITEMS = 2000  # per task, at most
SEED = 0
_SENTENCE = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'_]))\s+(?=[\"'_]?[A-Z])")  # a closing quote stays before the split

_ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.", "Messrs.")
_HEADING = re.compile(r"^(?:CHAPTER|VOLUME)\b|^[A-Z][A-Z .,()0-9]*$")  # chapter / volume headings, title lines
CANDIDATE_WORDS = (5, 40)  # words of a candidate sentence (the true next sentence and the distractors)
CONTEXT_WORDS = 100  # at most, per context sentence
MIN_DISTANCE = 50  # sentences between the members of one item (the true window and each distractor)


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph: split after . ! ? (and the closing quote that follows it, which stays
    with its sentence) before a capital or an opening quote, except after a title (Mr., Mrs., ...),
    which the name follows."""
    out: list[str] = []
    for piece in _SENTENCE.split(paragraph):
        if out and out[-1].endswith(_ABBREVIATIONS):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def _chapters(text: str) -> list[list[str]]:
    """The paragraphs of a novel by chapter (headings, the title page and anything before the first
    chapter dropped)."""
    chapters: list[list[str]] = []
    for paragraph in _paragraphs(text):
        if paragraph.startswith("CHAPTER"):
            chapters.append([])
        elif chapters and not _HEADING.match(paragraph):
            chapters[-1].append(paragraph)
    return [c for c in chapters if c]


def sentence_table(text: str) -> list[dict]:
    """Every sentence of a novel in order, with where it stands: chapter, paragraph (running index),
    position in its paragraph, whether it ends the paragraph, and whether it starts / ends inside a
    quotation (the parity of the double quotes before it in its paragraph)."""
    rows = []
    paragraph_index = 0
    for chapter, paragraphs in enumerate(_chapters(text)):
        for paragraph in paragraphs:
            sentences = _sentences(paragraph)
            quotes = 0
            for position, sentence in enumerate(sentences):
                inside = quotes % 2 == 1
                quotes += sentence.count('"')
                rows.append({"text": sentence, "chapter": chapter, "paragraph": paragraph_index, "position": position,
                             "last": position == len(sentences) - 1, "inside_start": inside,
                             "inside_end": quotes % 2 == 1})
            paragraph_index += 1
    return rows


def _length_bin(words: int) -> int:
    return 0 if words <= 9 else 1 if words <= 17 else 2


def _end_mark(sentence: str) -> str:
    core = sentence.rstrip("\"'_)")
    return core[-1] if core and core[-1] in ".?!" else "other"


def surface_cell(row: dict) -> tuple:
    """What a distractor shares with the true next sentence: where it stands in its paragraph (first,
    last), how it opens (a quote or not) and closes (its end mark, a closing quote), whether it starts
    and ends inside a quotation, and its length (three bins). The true sentence is drawn at random
    from four sentences of one cell, so nothing of these tells it from the others."""
    text = row["text"]
    return (row["position"] == 0, row["last"], text[0] in "\"'", text[-1] in "\"'", _end_mark(text),
            row["inside_start"], row["inside_end"], _length_bin(len(text.split())))


def lastword_items(texts: dict[str, str], n: int = ITEMS, seed: int = SEED) -> list[dict]:
    """Paragraphs of 40-200 words whose last word is alphabetic (3+ letters): context = the paragraph
    up to that word, target = the word (its closing punctuation dropped). Every item is its own
    paragraph."""
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
    """Three consecutive sentences of a chapter (paragraph breaks included) and four candidate
    continuations, built so that only the text's sense tells the true one:

    - candidates are sentences of 5-40 words that follow three sentences of their own chapter, each of
      at most 100 words, and occur once in the novels (not even inside another sentence);
    - the four candidates of an item come from one novel and one `surface_cell` (position in the
      paragraph, opening and closing punctuation, quotation state, length bin), at least 50 sentences
      apart; which of the four is the true continuation (its three preceding sentences becoming the
      context) is drawn uniformly at random, so any predictor that reads only the candidates scores
      chance in expectation;
    - items are independent: every sentence is used by at most one item (as context, answer or
      distractor), so no item's answer or distractor appears in another item's context.

    The order of the choices is shuffled (seeded); at most `n` items, in random order."""
    rng = random.Random(seed)
    everything = [row["text"] for text in texts.values() for row in sentence_table(text)]
    by_trigram: dict[tuple, set[int]] = {}  # the sentences that hold a run of three words
    for k, sentence in enumerate(everything):
        words = sentence.split(" ")
        for j in range(len(words) - 2):
            by_trigram.setdefault(tuple(words[j:j + 3]), set()).add(k)

    def once(sentence: str) -> bool:
        """Nowhere else in the novels, alone or inside a longer sentence (its 2nd-4th words are whole
        words wherever it occurs)."""
        holders = by_trigram.get(tuple(sentence.split(" ")[1:4]), set())
        return sum(sentence in everything[k] for k in holders) == 1

    items = []
    for novel, text in texts.items():
        rows = sentence_table(text)
        eligible = [i for i in range(3, len(rows))
                    if CANDIDATE_WORDS[0] <= len(rows[i]["text"].split()) <= CANDIDATE_WORDS[1]
                    and once(rows[i]["text"]) and len({rows[j]["chapter"] for j in range(i - 3, i + 1)}) == 1
                    and all(len(rows[j]["text"].split()) <= CONTEXT_WORDS for j in range(i - 3, i))]
        eligible_set = set(eligible)
        cells: dict[tuple, list[int]] = {}
        for i in eligible:
            cells.setdefault(surface_cell(rows[i]), []).append(i)
        for members in cells.values():
            rng.shuffle(members)
        order = eligible[:]
        rng.shuffle(order)
        used: set[int] = set()

        def free(i: int, used: set[int] = used) -> bool:
            return not used.intersection(range(i - 3, i + 1))

        for seed_index in order:
            if not free(seed_index):
                continue
            group = [seed_index]
            # the distractors: free members of the cell, those that break the fewest other candidates'
            # windows first (a distractor at j breaks the windows of j+1..j+3); the choice of the four
            # never depends on which becomes the true one, drawn after
            options = [j for j in cells[surface_cell(rows[seed_index])] if j != seed_index and free(j)]
            options.sort(key=lambda j: sum(m in eligible_set and free(m) for m in range(j + 1, j + 4)))
            for j in options:
                if all(abs(j - k) > MIN_DISTANCE for k in group):
                    group.append(j)
                    if len(group) == 4:
                        break
            if len(group) < 4:
                continue
            gold = rng.randrange(4)
            used.update(range(group[gold] - 3, group[gold] + 1))
            used.update(group)
            choices = [rows[j]["text"] for j in group]
            shuffled = list(range(4))
            rng.shuffle(shuffled)
            items.append({"novel": novel, "paragraph": rows[group[gold]]["paragraph"],
                          "context": " ".join(rows[j]["text"] for j in range(group[gold] - 3, group[gold])),
                          "choices": [choices[k] for k in shuffled], "gold": shuffled.index(gold)})
    rng.shuffle(items)
    return items[:n]


def heldout_documents(texts: dict[str, str]) -> list[dict]:
    """The held-out novels by chapter, for lm-eval's perplexity metrics (loglikelihood_rolling): each
    chapter's paragraphs (lines unwrapped) joined by blank lines, in reading order."""
    return [{"novel": novel, "chapter": k + 1, "text": "\n\n".join(paragraphs)}
            for novel, text in texts.items() for k, paragraphs in enumerate(_chapters(text))]


def build(source: Path, target: Path) -> dict[str, int]:
    """Write <task>.jsonl into `target` from the novels in `source` (<name>.txt); returns the counts."""
    texts = {name: (source / f"{name}.txt").read_text(encoding="utf-8") for name in NOVELS}
    target.mkdir(parents=True, exist_ok=True)
    counts = {}
    for task, items in (("austen_lastword", lastword_items(texts)), ("austen_nextsentence", nextsentence_items(texts)),
                        ("austen_perplexity", heldout_documents(texts))):
        (target / f"{task}.jsonl").write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items),
                                              encoding="utf-8")
        counts[task] = len(items)
    return counts


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python benchmarks/lm_eval_tasks.py FOLDER (a folder holding "
                 + ", ".join(f"{n}.txt" for n in NOVELS) + ")")
    print(build(Path(sys.argv[1]), Path(__file__).resolve().parents[1] / "hf_tangent" / "integrations" / "harness" / "data"))
