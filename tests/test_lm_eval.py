"""Downstream accuracy with lm-eval (hf-tangent lm-eval): the shipped Austen tasks, accuracy against an
independent greedy-match computation with plain transformers, variants against ht.disabled, the
paired interval against a hand-computed one, and plain `lm_eval` on a saved folder. Tiny models, a
few items; nothing is downloaded."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

import hf_tangent as ht  # noqa: E402
from hf_tangent.experiments.downstream import _paired  # noqa: E402
from hf_tangent.integrations.harness import run, tasks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import lm_eval_tasks  # noqa: E402  (the builder of the shipped task data: a tool of the checkout)

LIMIT = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with SmolLM2's tokenizer and a context long enough for the task items."""
    from conftest import tiny_smollm2_llama

    model, tokenizer = tiny_smollm2_llama(max_positions=1024)
    with torch.no_grad():  # a model with preferences: random small weights give near-uniform predictions
        model.lm_head.weight.mul_(20)
    folder = tmp_path_factory.mktemp("tiny_lm_eval")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer, folder


def _items(task, n=LIMIT):
    with open(tasks.data_file(task), encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_the_shipped_tasks_regenerate_from_the_novels(tmp_path):
    from conftest import SHARED_AUSTEN

    if not SHARED_AUSTEN.is_dir():
        pytest.skip("the whole novels are in ../shared only")
    assert lm_eval_tasks.build(SHARED_AUSTEN, tmp_path) == {"austen_lastword": 1960, "austen_nextsentence": 1192,
                                                    "austen_perplexity": 103}
    for task in tasks.TASKS:
        assert (tmp_path / f"{task}.jsonl").read_bytes() == tasks.data_file(task).read_bytes()
    item = _items("austen_nextsentence", 1)[0]
    assert len(item["choices"]) == 4 and 0 <= item["gold"] < 4 and item["novel"] in ("emma", "mansfieldpark")


def test_the_sentence_splitter_keeps_closing_quotes_with_their_sentence():
    paragraph = '"Six years hence! Dear Miss Woodhouse, he would be thirty!" said she. \'Tis so. Mr. Knightley came.'
    assert lm_eval_tasks._sentences(paragraph) == ['"Six years hence!', 'Dear Miss Woodhouse, he would be thirty!" said she.',
                                           "'Tis so.", "Mr. Knightley came."]
    assert lm_eval_tasks._sentences('He said, "No." She smiled.') == ['He said, "No."', "She smiled."]


def test_nextsentence_items_are_independent_and_their_choices_look_alike():
    """No item's answer or distractor is in another item's context (so the bootstrap's items are
    independent), the four choices of an item share their surface cell (position in the paragraph,
    punctuation, quotation state, length bin), and the true one is uniform over the four cells'
    members: its position among the choices and whether it was the drawn one are chance."""
    from collections import Counter

    from conftest import SHARED_AUSTEN

    items = [json.loads(line) for line in tasks.data_file("austen_nextsentence").read_text(encoding="utf-8").splitlines()]
    contexts = "\n".join(i["context"] for i in items)
    owner = [k for k, i in enumerate(items) for _ in range(len(i["context"]) + 1)]  # the item of each character
    for k, item in enumerate(items):
        for choice in item["choices"]:
            start = contexts.find(choice)
            assert start == -1, (k, owner[start], choice)  # not even in its own item's context
    assert len({c for i in items for c in i["choices"]}) == 4 * len(items)  # no sentence in two items
    golds = Counter(i["gold"] for i in items)
    assert all(abs(n - len(items) / 4) < 4 * (len(items) * 3 / 16) ** 0.5 for n in golds.values()), golds
    if not SHARED_AUSTEN.is_dir():
        pytest.skip("the cells are read from the whole novels in ../shared")
    rows = {r["text"]: r for n in lm_eval_tasks.NOVELS
            for r in lm_eval_tasks.sentence_table((SHARED_AUSTEN / f"{n}.txt").read_text(encoding="utf-8"))}
    for item in items:
        cells = {lm_eval_tasks.surface_cell(rows[c]) for c in item["choices"]}
        assert len(cells) == 1, item


def test_lastword_accuracy_against_greedy_match_with_plain_transformers():
    """On the real SmolLM2 weights (a random model never guesses a word): lm-eval's acc per item is the
    greedy match of the target's tokens, computed here with plain transformers."""
    from hf_tangent.artifacts.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    out = run.evaluate(model, tokenizer, ["austen_lastword"], run.task_manager(), limit=LIMIT)
    hits = []
    for doc_id, item in enumerate(_items("austen_lastword")):
        context = tokenizer(item["context"])["input_ids"]
        whole = tokenizer(item["context"] + " " + item["target"])["input_ids"]
        target = whole[len(context):]
        with torch.no_grad():
            logits = model(torch.tensor([whole[:-1]])).logits[0]
        greedy = logits[len(context) - 1:].argmax(-1).tolist()
        hits.append(float(greedy == target))
        assert out["samples"]["austen_lastword"][doc_id]["acc"] == hits[-1], doc_id
    assert out["results"]["austen_lastword"]["acc,none"] == pytest.approx(sum(hits) / len(hits))
    assert sum(hits) > 0  # the comparison is not all zeros


def test_variants_equal_the_model_under_disabled_and_the_patched_model(tiny):
    model, tokenizer, _ = tiny
    patched = ht.patch(__import__("copy").deepcopy(model), ht.TangentConfig(update="projected"))
    report = ht.lm_eval(patched, tokenizer, tasks=["austen_nextsentence"], variants=["unpatched", "projected"],
                        limit=LIMIT, bootstrap=200)
    with ht.disabled(patched):
        plain = run.evaluate(patched, tokenizer, ["austen_nextsentence"], run.task_manager(), limit=LIMIT)
    results = report["results"]
    assert results["unpatched"]["austen_nextsentence"] == plain["results"]["austen_nextsentence"]
    assert results["as given"] == results["projected"]  # the patched model as passed is the projected variant
    assert ht.get_config(patched).update == "projected"  # and it is left patched
    assert set(report["paired"]) == {"as given", "projected"}
    assert report["paired"]["projected"]["austen_nextsentence"]["acc"]["n"] == LIMIT


def test_the_paired_interval_against_a_hand_computed_one():
    """diffs (1, 1, 1, 0): the bootstrap mean takes 0, 1/4, ..., 1 with binomial(4, 3/4) weights; its
    2.5 % quantile is 1/4 (P(0) = 0.004 < 0.025 < P(<= 1/4) = 0.051) and its 97.5 % quantile is 1."""
    base = {"samples": {"t": {i: {"acc": 0.0} for i in range(4)}}}
    variant = {"samples": {"t": {0: {"acc": 1.0}, 1: {"acc": 1.0}, 2: {"acc": 1.0}, 3: {"acc": 0.0}}}}
    paired = _paired(variant, base, bootstrap=20000, seed=0)["t"]["acc"]
    assert (paired["diff"], paired["low"], paired["high"], paired["n"]) == (0.75, 0.25, 1.0, 4)


def test_plain_lm_eval_on_a_saved_folder_gives_the_same_accuracy(tiny, tmp_path):
    model, tokenizer, _ = tiny
    patched = ht.patch(__import__("copy").deepcopy(model), ht.TangentConfig(update="soft", beta=0.5))
    ht.save_hub_folder(patched, tmp_path / "folder", tokenizer=tokenizer)
    ours = ht.lm_eval(patched, tokenizer, tasks=["austen_lastword"], variants=["unpatched"],
                      limit=LIMIT, bootstrap=100)["results"]["as given"]["austen_lastword"]
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'folder'},trust_remote_code=True,dtype=float32", "--device", "cpu",
         "--include_path", str(tasks.task_folder()), "--tasks", "austen_lastword", "--limit", str(LIMIT),
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    written = next((tmp_path / "out").rglob("results_*.json"))
    theirs = json.loads(written.read_text())["results"]["austen_lastword"]
    assert theirs["acc,none"] == ours["acc,none"]
    assert theirs["perplexity,none"] == pytest.approx(ours["perplexity,none"], rel=1e-4)


def test_without_lm_eval_the_command_says_what_to_install_before_loading_a_model(monkeypatch, tmp_path, capsys):
    import importlib.util

    from hf_tangent import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    code = cli.main(["lm-eval", "--model", str(tmp_path / "no-such-model"), "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'hf_tangent[eval]'" in err[0]


def test_lm_eval_refusals(tiny):
    model, tokenizer, _ = tiny
    with pytest.raises(ValueError, match="variants=\\['nope'\\] has 'nope', not one of the choices; accepted: a non-empty list of "
                                         "values among 'unpatched', 'add', 'projected'"):
        ht.lm_eval(model, tokenizer, variants=["nope"])
    with pytest.raises(ValueError, match="unknown lm-eval tasks \\['no_such_task'\\]"):
        ht.lm_eval(model, tokenizer, tasks=["no_such_task"])
    with pytest.raises(ValueError, match="limit=0 is out of range"):
        ht.lm_eval(model, tokenizer, limit=0)


def test_model_folders_take_full_folders_and_patch_repos(tiny, tmp_path):
    """A complete patched folder (save_pretrained) and a patch repo (save_patch) of the same gated model
    score exactly what the model in memory scores (the full folder used to be refused: merge= was
    passed for every folder, and full folders take no merge)."""
    model, tokenizer, folder = tiny
    from transformers import LlamaForCausalLM

    patched = ht.patch(LlamaForCausalLM.from_pretrained(folder).eval(), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        ht.tangent_layers(patched)[1].gate.fill_(0.5)
    patched.save_pretrained(tmp_path / "full")
    ht.save_patch(patched, tmp_path / "patch", base_model=str(folder))
    report = ht.lm_eval(patched, tokenizer, tasks=["austen_lastword"], variants=["unpatched"], limit=LIMIT, bootstrap=50,
                        model_folders=[str(tmp_path / "full"), str(tmp_path / "patch")])
    results = report["results"]
    assert results[str(tmp_path / "full")] == results[str(tmp_path / "patch")] == results["as given"]


def _group_folder(folder, sizes=(6, 4)):
    """A small local group task (MMLU-style): two multiple-choice subtasks over the first shipped
    next-sentence items, and a group over them whose acc is size-weighted."""
    subtasks = []
    for k, n in enumerate(sizes):
        name = f"tiny_sub_{k}"
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(i) + "\n" for i in _items("austen_nextsentence", 12)[6 * k:6 * k + n]),
                        encoding="utf-8")
        text = tasks._YAML["austen_nextsentence"].format(data=json.dumps(str(data)))
        (folder / f"{name}.yaml").write_text(text.replace("task: austen_nextsentence", f"task: {name}"), encoding="utf-8")
        subtasks.append(name)
    (folder / "tiny_group.yaml").write_text(
        "group: tiny_group\ntask:\n" + "".join(f"  - {s}\n" for s in subtasks)
        + "aggregate_metric_list:\n  - metric: acc\n    aggregation: mean\n    weight_by_size: true\n"
        + "metadata:\n  version: 1.0\n", encoding="utf-8")
    return subtasks


def test_a_group_task_gets_paired_differences_per_subtask_and_for_the_group(tiny, tmp_path):
    """lm-eval keeps a group's per-sample outputs under its subtasks: the paired differences used to
    come back empty for the group. Now each subtask has its own and the group the size-weighted one,
    its bootstrap resampling within each subtask."""
    model, tokenizer, _ = tiny
    subtasks = _group_folder(tmp_path)
    report = ht.lm_eval(model, tokenizer, tasks=["tiny_group"], variants=["unpatched", "projected"],
                        include_path=str(tmp_path), bootstrap=300)
    assert report["groups"] == {"tiny_group": subtasks} and report["unpaired"] == {}
    paired = report["paired"]["projected"]
    results = report["results"]
    for name, n in zip(subtasks, (6, 4), strict=True):
        assert paired[name]["acc"]["n"] == n
        expected = results["projected"][name]["acc,none"] - results["unpatched"][name]["acc,none"]
        assert paired[name]["acc"]["diff"] == pytest.approx(expected)
    group = paired["tiny_group"]["acc"]
    assert group["n"] == 10 and group["subtasks"] == 2
    assert group["diff"] == pytest.approx((6 * paired[subtasks[0]]["acc"]["diff"] + 4 * paired[subtasks[1]]["acc"]["diff"]) / 10)
    assert group["diff"] == pytest.approx(results["projected"]["tiny_group"]["acc,none"]
                                          - results["unpatched"]["tiny_group"]["acc,none"])
    assert group["low"] <= group["diff"] <= group["high"]
    # the report shows the group and each subtask with its own paired row (it showed the group only)
    markdown = report.to_markdown()
    for name in ("tiny_group", *subtasks):
        row = next(line for line in markdown.split(f"## {name}", 1)[1].splitlines() if line.startswith("| projected |"))
        d = paired[name]["acc"]
        assert f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" in row
    assert "a group of 2 subtasks" in markdown


def test_the_report_says_which_task_had_nothing_to_pair_and_plots_perplexity_tasks(tmp_path):
    from hf_tangent.experiments import plots
    from hf_tangent.experiments.report import Report

    diff = {"diff": 0.01, "low": 0.0, "high": 0.02, "n": 3}
    data = {"command": "lm-eval", "model": "m", "limit": 3, "num_fewshot": 0, "bootstrap": 10, "seconds": 1.0,
            "tasks": ["mc", "ppl", "gen"], "variants": ["unpatched", "v"], "groups": {},
            "results": {"unpatched": {"mc": {"acc,none": 0.5}, "ppl": {"bits_per_byte,none": 1.0}, "gen": {}},
                        "v": {"mc": {"acc,none": 0.6}, "ppl": {"bits_per_byte,none": 1.1}, "gen": {}}},
            "paired": {"v": {"mc": {"acc": diff}, "ppl": {"bits_per_byte": diff, "word_nll": diff}, "gen": {}}},
            "unpaired": {"gen": "no per-sample metric to pair"}}
    markdown = Report("lm-eval", data).to_markdown()
    assert "No paired differences for `gen`: no per-sample metric to pair." in markdown
    ppl = markdown.split("## ppl", 1)[1].split("##", 1)[0]
    assert "delta bits_per_byte vs unpatched [95% CI]" in ppl and "delta word_nll vs unpatched [95% CI]" in ppl
    assert [plots.shown_difference(data["paired"], t) for t in data["tasks"]] == ["acc", "bits_per_byte", None]
    assert Report("lm-eval", data).plot(tmp_path) == [str(tmp_path / "lm_eval_differences.png")]


def test_a_task_with_nothing_to_pair_is_said_so():
    base = {"samples": {"gen": {0: {}, 1: {}}}}
    paired = {"v": _paired(base, base, bootstrap=10, seed=0)}
    assert paired["v"] == {"gen": {}}
    from hf_tangent.experiments.downstream import _unpaired

    assert "no per-sample metric to pair" in _unpaired(paired, ["gen"])["gen"]


def test_the_perplexity_task_gives_lm_eval_metrics_and_paired_bits_per_byte(tiny):
    """austen_perplexity (loglikelihood_rolling over the held-out chapters): lm-eval's word_perplexity,
    byte_perplexity and bits_per_byte, and the paired difference of bits_per_byte and of log
    word_perplexity (word_nll) equals the difference of lm-eval's own aggregates."""
    import math

    model, tokenizer, _ = tiny
    report = ht.lm_eval(model, tokenizer, tasks=["austen_perplexity"], variants=["unpatched", "projected"],
                        limit=2, bootstrap=100)
    unpatched, projected = (report["results"][v]["austen_perplexity"] for v in ("unpatched", "projected"))
    assert {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"} <= set(unpatched)
    paired = report["paired"]["projected"]["austen_perplexity"]
    assert paired["bits_per_byte"]["n"] == 2
    assert paired["bits_per_byte"]["diff"] == pytest.approx(projected["bits_per_byte,none"] - unpatched["bits_per_byte,none"])
    assert paired["word_nll"]["diff"] == pytest.approx(math.log(projected["word_perplexity,none"])
                                                       - math.log(unpatched["word_perplexity,none"]))
    assert paired["bits_per_byte"]["low"] <= paired["bits_per_byte"]["diff"] <= paired["bits_per_byte"]["high"]
    row = next(line for line in report.to_markdown().splitlines() if line.startswith("| projected |"))
    for metric in ("bits_per_byte", "word_nll"):  # the report's table showed acc and acc_norm only
        d = paired[metric]
        assert f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" in row


def test_smoke_every_shipped_task_end_to_end(tiny):
    model, tokenizer, _ = tiny
    report = ht.lm_eval(model, tokenizer, variants=["unpatched", "projected"], limit=3, bootstrap=50)
    assert report["tasks"] == list(tasks.TASKS) and report["unpaired"] == {}
    for task, metric in (("austen_lastword", "acc"), ("austen_nextsentence", "acc_norm"),
                         ("austen_perplexity", "bits_per_byte")):
        assert report["paired"]["projected"][task][metric]["n"] == 3


def test_reports_run_in_parts_merge_into_the_report_of_one_run(tiny, tmp_path):
    """Parts split by task and by variant (each scores unpatched) merge into what one run over
    everything gives for every (variant, task) the parts scored: lm-eval's results and the paired
    differences with their intervals; the CLI writes the same report, and a fresh process reads it."""
    model, tokenizer, _ = tiny
    small = {"limit": 4, "bootstrap": 200}
    whole = ht.lm_eval(model, tokenizer, tasks=["austen_lastword", "austen_nextsentence"],
                       variants=["unpatched", "projected", "norm_preserving"], **small)
    parts = [ht.lm_eval(model, tokenizer, tasks=["austen_lastword"], variants=["unpatched", "projected"], **small),
             ht.lm_eval(model, tokenizer, tasks=["austen_nextsentence"], variants=["unpatched", "projected"], **small),
             ht.lm_eval(model, tokenizer, tasks=["austen_lastword"], variants=["unpatched", "norm_preserving"], **small)]
    merged = ht.merge_lm_eval(parts)
    assert merged["variants"] == ["unpatched", "projected", "norm_preserving"] and merged["limit"] == 4
    assert merged["tasks"] == ["austen_lastword", "austen_nextsentence"]
    covered = {("unpatched", "austen_lastword"), ("unpatched", "austen_nextsentence"), ("projected", "austen_lastword"),
               ("projected", "austen_nextsentence"), ("norm_preserving", "austen_lastword")}
    for variant, task in covered:
        assert merged["results"][variant][task] == whole["results"][variant][task]
        if variant != "unpatched":
            assert merged["paired"][variant][task] == whole["paired"][variant][task]
    assert "austen_nextsentence" not in merged["results"]["norm_preserving"]
    assert merged["seconds"] == pytest.approx(sum(p["seconds"] for p in parts), abs=0.2)
    assert [p["tasks"] for p in merged["parts"]] == [["austen_lastword"], ["austen_nextsentence"], ["austen_lastword"]]
    section = merged.to_markdown().split("## austen_nextsentence", 1)[1]
    assert "| projected |" in section and "| norm_preserving |" not in section  # no row it did not score
    for k, part in enumerate(parts):
        part.save(tmp_path / f"part{k}")
    from hf_tangent import cli

    assert cli.main(["lm-eval-merge", *(str(tmp_path / f"part{k}") for k in range(3)),
                     "--output_dir", str(tmp_path / "merged")]) == 0
    script = ("import json, sys; from hf_tangent.experiments.report import Report; "
              "r = Report.load(sys.argv[1]); print(json.dumps([r['results'], r['paired'], r['limit']]))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "merged" / "report.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == json.loads(json.dumps([merged["results"], merged["paired"], merged["limit"]]))
    # a merged report merges again, with parts of other limits per task: the limit becomes per task
    other = ht.lm_eval(model, tokenizer, tasks=["austen_perplexity"], variants=["unpatched"], limit=2, bootstrap=200)
    again = ht.merge_lm_eval([str(tmp_path / "merged"), other])
    assert again["limit"] == {"austen_lastword": 4, "austen_nextsentence": 4, "austen_perplexity": 2}
    assert len(again["parts"]) == 4 and "items per task: austen_lastword 4" in again.to_markdown()


def test_merge_refuses_parts_of_different_measurements(tiny, tmp_path):
    """Parts that are not of one measurement are refused with the reason (never averaged): another
    limit for the same task, another model or seed, numbers that differ for the same variant on the
    same items, a report of another kind, fewer than two reports, not a list; the output folder
    rules of every report writer hold."""
    import copy

    from hf_tangent import cli
    from hf_tangent.experiments.report import Report

    model, tokenizer, _ = tiny
    a = ht.lm_eval(model, tokenizer, tasks=["austen_lastword"], variants=["unpatched"], limit=3, bootstrap=50)
    b = ht.lm_eval(model, tokenizer, tasks=["austen_lastword"], variants=["unpatched"], limit=4, bootstrap=50)
    with pytest.raises(ValueError, match="task 'austen_lastword' was scored with limit 3 in one part and 4"):
        ht.merge_lm_eval([a, b])
    for key, value in (("model", "another-model"), ("seed", 1), ("bootstrap", 51), ("num_fewshot", 2)):
        changed = Report("lm-eval", {**copy.deepcopy(a.data), key: value})
        with pytest.raises(ValueError, match=f"the parts differ in '{key}'"):
            ht.merge_lm_eval([a, changed])
    tampered = copy.deepcopy(a.data)
    tampered["results"]["unpatched"]["austen_lastword"]["acc,none"] += 0.25
    tampered["seconds"] += 1.0  # another process (the same timing would be a part given twice)
    with pytest.raises(ValueError, match="'unpatched' on 'austen_lastword' differs between the parts"):
        ht.merge_lm_eval([a, Report("lm-eval", tampered)])
    other_kind = tmp_path / "eval_report"
    other_kind.mkdir()
    (other_kind / "report.json").write_text(json.dumps({"command": "eval", "rows": []}), encoding="utf-8")
    with pytest.raises(ValueError, match="not an hf-tangent report|is a 'eval' report|incomplete 'eval' report"):
        ht.merge_lm_eval([a, str(other_kind)])
    with pytest.raises(ValueError, match="1 report\\(s\\) given; accepted: two or more"):
        ht.merge_lm_eval([a])
    with pytest.raises(TypeError, match="expects a list of lm-eval reports"):
        ht.merge_lm_eval(str(other_kind))
    with pytest.raises(TypeError, match="neither a Report nor the path"):
        ht.merge_lm_eval([a, 3])
    with pytest.raises(ValueError, match="not a readable report.json"):
        ht.merge_lm_eval([a, str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="repeats a part already given"):  # its seconds would count twice
        ht.merge_lm_eval([a, a])
    other_files = copy.deepcopy(a.data)
    other_files["task_source"]["austen_lastword"] = "hf_tangent: ... task files version 1"
    c = ht.lm_eval(model, tokenizer, tasks=["austen_nextsentence"], variants=["unpatched"], limit=3, bootstrap=50)
    with pytest.raises(ValueError, match="task 'austen_lastword' comes from other task files"):
        ht.merge_lm_eval([a, c, Report("lm-eval", {**other_files, "variants": ["unpatched"], "seconds": 2.0})])
    patched = ht.patch(copy.deepcopy(model), ht.TangentConfig(update="projected"))
    given = [ht.lm_eval(patched, tokenizer, tasks=[t], variants=["unpatched"], limit=3, bootstrap=50)
             for t in ("austen_lastword", "austen_nextsentence")]
    with pytest.raises(ValueError, match="'as given' \\(a model object passed in\\) is in part 1"):
        ht.merge_lm_eval(given)
    # NaN equals NaN, in memory as read back; only the unpatched model on a task: said so, not "nothing to pair"
    nan = copy.deepcopy(a.data)
    nan["results"]["unpatched"]["austen_lastword"]["acc_stderr,none"] = float("nan")
    nan_part = Report("lm-eval", nan)
    nan_part.save(tmp_path / "nan")
    merged = ht.merge_lm_eval([nan_part, c])
    assert merged["unpaired"] == {"austen_lastword": "only the unpatched model was scored on it in these parts",
                                  "austen_nextsentence": "only the unpatched model was scored on it in these parts"}
    loaded = json.loads((tmp_path / "nan" / "report.json").read_text())
    loaded["seconds"] += 1.0  # another process, the same numbers
    assert ht.merge_lm_eval([nan_part, Report("lm-eval", loaded)])["variants"] == ["unpatched"]
    # the command line: beside a user's files, which stay as they are (the Trainer's output_dir convention);
    # never over one of its own inputs
    a.save(tmp_path / "a")
    c.save(tmp_path / "c")
    user = tmp_path / "notes"
    user.mkdir()
    (user / "notes.txt").write_text("mine", encoding="utf-8")
    assert cli.main(["lm-eval-merge", str(tmp_path / "a"), str(tmp_path / "c"), "--output_dir", str(user)]) == 0
    assert (user / "notes.txt").read_text() == "mine" and (user / "report.json").is_file()
    before = (tmp_path / "a" / "report.json").read_bytes()
    assert cli.main(["lm-eval-merge", str(tmp_path / "a"), str(tmp_path / "c"), "--output_dir", str(tmp_path / "a")]) == 2
    assert (tmp_path / "a" / "report.json").read_bytes() == before
    assert cli.main(["lm-eval-merge", str(tmp_path / "a"), str(tmp_path / "c"), "--output_dir", str(tmp_path / "m")]) == 0



def test_merge_checks_every_part_against_one_schema_before_reading_it(tiny, tmp_path, capsys):
    """Issue 59's probe: a part with mistyped fields was merged as garbage (`tasks` a string, letter by letter)
    or crashed. Each malformed part is refused, naming the file, the field, what it holds and what is
    accepted, through the function and the command (which then writes nothing); well-formed parts read from
    their files merge as the Report objects do."""
    import copy
    import math

    from hf_tangent import cli

    model, tokenizer, _ = tiny
    a = ht.lm_eval(model, tokenizer, tasks=["austen_lastword"], variants=["unpatched"], limit=3, bootstrap=50)
    c = ht.lm_eval(model, tokenizer, tasks=["austen_nextsentence"], variants=["unpatched"], limit=3, bootstrap=50)
    a.save(tmp_path / "a")
    c.save(tmp_path / "c")
    from_files = ht.merge_lm_eval([str(tmp_path / "a"), str(tmp_path / "c" / "report.json")])
    from_objects = ht.merge_lm_eval([a, c])
    assert from_files.data == {**from_objects.data, "parts": from_files["parts"]}
    assert [p["report"] for p in from_files["parts"]] == [str(tmp_path / "a" / "report.json"),
                                                          str(tmp_path / "c" / "report.json")]
    assert from_files["tasks"] == ["austen_lastword", "austen_nextsentence"]
    assert from_files["results"]["unpatched"] == {**a["results"]["unpatched"], **c["results"]["unpatched"]}
    text = (tmp_path / "a" / "report.json").read_text(encoding="utf-8")

    def edited(change):
        data = copy.deepcopy(a.data)
        change(data)
        return json.dumps(data)

    acc = "results['unpatched']['austen_lastword']['acc,none']"
    capsys.readouterr()  # lm-eval's progress bars
    for name, written, message in [
            ("tasks_a_string", edited(lambda d: d.update(tasks="austen_lastword")),
             "field tasks holds 'austen_lastword' (str); accepted: a non-empty list of names (strings)"),
            ("variants_a_number", edited(lambda d: d.update(variants=3)),
             "field variants holds 3 (int); accepted: a non-empty list of names (strings)"),
            ("a_task_a_number", edited(lambda d: d.update(tasks=["austen_lastword", 7])),
             "field tasks[1] holds 7 (int); accepted: a string"),
            ("no_variant_seconds", edited(lambda d: d.pop("variant_seconds")),
             "field variant_seconds is missing; accepted: an object of variant -> seconds"),
            ("infinite_accuracy", edited(lambda d: d["results"]["unpatched"]["austen_lastword"].update(
                {"acc,none": math.inf})), f"field {acc} holds inf (float); accepted: a finite number"),
            ("nan_accuracy", edited(lambda d: d["results"]["unpatched"]["austen_lastword"].update(
                {"acc,none": math.nan})), f"field {acc} holds nan (float); accepted: a finite number"),
            ("a_list", "[1, 2]", "holds a JSON list; accepted: a JSON object, the report.json of `hf-tangent lm-eval`"),
            ("truncated", text[:len(text) // 2], "not a readable report.json"),
            # fields that disagree with each other (the fresh-eyes review: merged, then a KeyError or a wrong report)
            ("a_variant_without_results", edited(lambda d: d["variants"].append("retract")),
             "field results holds ['unpatched'] (list); accepted: one entry per variant"),
            ("a_limit_of_another_task", edited(lambda d: d.update(limit={"other": 3})),
             "field limit holds {'other': 3} (dict); accepted: a number, null, or one per task (['austen_lastword'])"),
            ("a_task_without_results", edited(lambda d: d["tasks"].append("ghost_task")),
             "field results['unpatched'] holds ['austen_lastword'] (list); accepted: every task"),
            ("a_repeated_task", edited(lambda d: d["tasks"].append("austen_lastword")),
             "field tasks holds ['austen_lastword', 'austen_lastword'] (list); accepted: names without repeats")]:
        bad = tmp_path / name
        bad.mkdir()
        (bad / "report.json").write_text(written, encoding="utf-8")
        where = str(bad / "report.json")
        with pytest.raises(ValueError, match=f"^merge_lm_eval: {re.escape(where)}:? .*{re.escape(message)}"):
            ht.merge_lm_eval([str(tmp_path / "a"), str(bad)])
        out = tmp_path / f"merged_{name}"
        assert cli.main(["lm-eval-merge", str(tmp_path / "c"), str(bad), "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and where in err[0] and message in err[0]
        assert not out.exists() or all(p.name.startswith(".") for p in out.iterdir())  # a run's lock file at most
    # a Report object: the same schema; lm-eval's NaN stderr (too few items) is a well-formed value
    with pytest.raises(ValueError, match=re.escape("part 2 (a Report object) is malformed: field tasks holds 'austen")):
        ht.merge_lm_eval([c, ht.Report("lm-eval", {**a.data, "tasks": "austen_lastword"})])
    nan_stderr = copy.deepcopy(a.data)
    nan_stderr["results"]["unpatched"]["austen_lastword"]["acc_stderr,none"] = math.nan
    assert ht.merge_lm_eval([c, ht.Report("lm-eval", nan_stderr)])["tasks"] == ["austen_nextsentence",
                                                                                "austen_lastword"]

@pytest.fixture
def fresh_task_index():
    """The cached task indexes emptied before and after the test, also when it fails: a fake TaskManager
    recorded by a test never reaches the next one."""
    from hf_tangent.integrations.harness import run

    run._task_manager.cache_clear()
    yield
    run._task_manager.cache_clear()


def test_the_task_index_is_built_once_per_contents_of_the_task_folders(tmp_path, monkeypatch, fresh_task_index):
    """task_manager: lm-eval's TaskManager (about 11 s to index lm-eval's own tasks) is reused while the task
    folders hold the same files, and built again when a task file is added or edited."""
    import lm_eval.tasks

    from hf_tangent.integrations.harness import run

    built = []

    class Recording:
        def __init__(self, include_path, include_defaults):
            assert include_defaults  # no shipped-only task list is given here
            built.append(list(include_path))

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recording)
    run._task_manager.cache_clear()
    (tmp_path / "a.yaml").write_text("task: a\n")
    first = run.task_manager(str(tmp_path))
    assert run.task_manager(str(tmp_path)) is first and len(built) == 1
    assert built[0] == [str(run.task_folder()), str(tmp_path)]
    (tmp_path / "b.yaml").write_text("task: b\n")  # a task added
    second = run.task_manager(str(tmp_path))
    assert second is not first and len(built) == 2
    (tmp_path / "b.yaml").write_text("task: b\nversion: 2\n")  # a task edited (another size)
    assert run.task_manager(str(tmp_path)) is not second and len(built) == 3
    assert run.task_manager() is not first and len(built) == 4  # the shipped tasks alone
    run._task_manager.cache_clear()


def test_lm_evals_own_tasks_are_indexed_unless_only_shipped_tasks_are_asked_for(tmp_path, monkeypatch,
                                                                                 fresh_task_index):
    """Shipped task names alone (and no folder of the user's): only the shipped folder is indexed; a name or
    pattern of anything else, or a user's folder (its YAMLs may name lm-eval's tasks), indexes lm-eval's too.
    That the two indexes score a shipped task alike: test_variants_equal_the_model_under_disabled_..."""
    import lm_eval.tasks

    from hf_tangent.integrations.harness import run, tasks

    built = []

    class Recording:
        def __init__(self, include_path, include_defaults):
            built.append((list(include_path), include_defaults))

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recording)
    run._task_manager.cache_clear()
    shipped = [str(run.task_folder())]
    for asked, defaults in ((list(tasks.TASKS), False), (["austen_lastword"], False), (["hellaswag"], True),
                            (["austen_lastword", "hellaswag"], True), (["austen_*"], True), (None, True)):
        built.clear()
        run._task_manager.cache_clear()
        run.task_manager(tasks=asked)
        assert built == [(shipped, defaults)], asked
    (tmp_path / "a.yaml").write_text("task: a\n")
    built.clear()
    run.task_manager(str(tmp_path), tasks=["austen_lastword"])
    assert built == [(shipped + [str(tmp_path)], True)]
    run._task_manager.cache_clear()


def test_vllm_args_from_the_command_line_are_read_as_lm_eval_reads_model_args_with_keys_stripped():
    """Values as lm-eval's handle_arg_string reads them; a key after ', ' is the key (lm-eval's own parser kept
    ' max_model_len', which vLLM refuses)."""
    from hf_tangent.commands.lm_eval import parse_vllm_args

    assert parse_vllm_args("enforce_eager=True, max_model_len=512,quantization='fp8',x=a=b") == {
        "enforce_eager": True, "max_model_len": 512, "quantization": "fp8", "x": "a=b"}
    assert parse_vllm_args(None) is None
    with pytest.raises(ValueError, match=r"--vllm_args 'a=1,=2': accepted: key=value pairs separated by commas"):
        parse_vllm_args("a=1,=2")
