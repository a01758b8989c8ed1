"""The shipped Austen tasks measure the model, not the text: no-model predictors (length rank,
position and punctuation rules, an n-gram model fitted on the calibration novels, a cross-validated
surface classifier; benchmarks/task_baselines.py) score the shipped next-sentence items at chance
+- 3 points, and the kept report that docs/lm-eval.md prints is what the script computes today."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import task_baselines  # noqa: E402

KEPT = ROOT / "docs" / "results" / "lm_eval" / "task_baselines.json"
MARGIN = 0.03  # about 2.4 standard errors of an accuracy at chance on the shipped 1192 items of 4 choices


@pytest.fixture(scope="module")
def shipped():
    from conftest import SHARED_AUSTEN

    if not SHARED_AUSTEN.is_dir():
        pytest.skip("the n-gram model is fitted on the whole calibration novels, in ../shared only")
    return task_baselines.baselines(None)


def test_every_no_model_predictor_is_at_chance_on_the_next_sentence_task(shipped):
    task = shipped["austen_nextsentence"]
    assert task["items"] >= 1000 and task["chance"] == 0.25
    assert len(task["predictors"]) >= 10
    off = {name: p["acc"] for name, p in task["predictors"].items() if abs(p["acc"] - task["chance"]) > MARGIN}
    assert not off, f"no-model predictors beyond chance +- {MARGIN}: {off}"


def test_the_kept_report_is_what_the_script_computes(shipped):
    kept = json.loads(KEPT.read_text(encoding="utf-8"))
    for task, values in shipped.items():
        assert kept["shipped"][task]["items"] == values["items"]
        for name, p in values["predictors"].items():
            assert kept["shipped"][task]["predictors"][name]["acc"] == pytest.approx(p["acc"], abs=1e-9), (task, name)
    # the previous version's surface cues, which the rebuild removed, are in the report as measured
    assert kept["previous"]["austen_nextsentence"]["predictors"]["no opening quote, median length"]["acc"] > 0.35


def test_the_predictors_see_a_planted_cue():
    """The baselines are not blind: on items whose true choice is always the longest, length rank and
    the classifier find it."""
    items = [{"novel": "x", "paragraph": k, "context": "She came in. He sat down. They spoke.",
              "choices": [c for c in ["Short one here now.", "Another short one here.", "Tiny bit of text now.",
                                      "This one is by far the longest of the four choices, and it goes on."]],
              "gold": 3} for k in range(100)]
    for k, item in enumerate(items):  # vary the order
        j = k % 4
        item["choices"][3], item["choices"][j] = item["choices"][j], item["choices"][3]
        item["gold"] = j
    assert task_baselines.classifier_accuracy(items) == 1.0
    scores = [[float(len(c)) for c in i["choices"]] for i in items]
    assert task_baselines.expected_accuracy(scores, [i["gold"] for i in items]) == 1.0
