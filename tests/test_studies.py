"""Smoke runs of the three from-scratch studies (the checkout's studies/, `python -m studies`), determinism, bad
input, and the API's option checks."""

import glob
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # studies/: a tool of the checkout, not shipped
from hf_tangent.core.options import OptionTypeError, RangeError  # noqa: E402
from studies import commands, verdicts  # noqa: E402
from studies import study as study_module  # noqa: E402

RECIPES = ROOT / "studies" / "recipes"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = {}
    for study, extra in (("tangential", []), ("retraction", ["--branches", "ffn", "attention"]), ("noise", [])):
        folder = tmp_path_factory.mktemp(study)
        assert commands.main(["study", study, "--scale", "smoke", "--output-dir", str(folder), *extra]) == 0
        out[study] = (json.loads((folder / "report.json").read_text()), folder)
    return out


@pytest.mark.slow  # CI time: the three smoke studies (~60 s); test_study_recipe_budget_and_own_data trains one by default
def test_every_variant_trains(smoke):
    for study, (report, folder) in smoke.items():
        assert [s["variant"] for s in report["summary"]] == list(study_module.STUDIES[study])
        for run in report["runs"]:
            first, last = run["history"][0]["val_loss"], run["history"][-1]["val_loss"]
            assert last < first - 0.1, (study, run["variant"])
            assert run["train_loss"][-1][1] < run["train_loss"][0][1]
        assert (folder / f"{study}_val_loss.png").stat().st_size > 1000
        assert (folder / f"{study}_diagnostics.png").stat().st_size > 10_000
        assert report["verdict"] and "smallest reachable p" in report["verdict"] or study == "retraction"


@pytest.mark.slow  # CI time: the three smoke studies (~60 s); test_study_recipe_budget_and_own_data trains one by default
def test_the_patch_is_really_active(smoke):
    runs = {(r["variant"], r["seed"]): r for r in smoke["tangential"][0]["runs"]}
    for seed in (0, 1):
        assert runs[("projected", seed)]["history"][-1]["orthogonality_error"] < 1e-4
        assert runs[("norm_preserving", seed)]["history"][-1]["orthogonality_error"] < 1e-4
        assert runs[("unpatched", seed)]["history"][-1]["orthogonality_error"] > 1e-2
    for run in smoke["retraction"][0]["runs"]:  # retraction on both branches: the residual norm is constant
        growth = run["history"][-1]["norm_growth"]
        if run["variant"] == "euclidean":
            assert abs(growth - 1.0) > 1e-3
        else:
            assert growth == pytest.approx(1.0, abs=1e-4), run["variant"]


@pytest.mark.slow  # CI time: the three smoke studies (~60 s); test_study_recipe_budget_and_own_data trains one by default
def test_same_seed_same_numbers(smoke, tmp_path):
    report, _ = smoke["noise"]
    assert commands.main(["study", "noise", "--scale", "smoke", "--variants", "tangent gamma=0.03", "--seeds", "1",
                     "--output-dir", str(tmp_path)]) == 0
    again = {r["variant"]: r for r in json.loads((tmp_path / "report.json").read_text())["runs"]}
    first = {r["variant"]: r for r in report["runs"] if r["seed"] == 1}
    for variant in ("none", "tangent gamma=0.03"):
        assert again[variant]["final_val_loss"] == first[variant]["final_val_loss"]
        assert again[variant]["train_loss"] == first[variant]["train_loss"]


@pytest.mark.slow  # CI time: the three smoke studies (~60 s); test_study_recipe_budget_and_own_data trains one by default
def test_study_report_page(smoke, tmp_path):
    page = tmp_path / "studies.md"
    reports = [str(folder / "report.json") for _, folder in smoke.values()]
    assert commands.main(["study-report", *reports, "--output", str(page)]) == 0
    text = page.read_text()
    assert text.count("**Verdict.**") == 3 and "| retract p=inf |" in text
    for study in smoke:  # one overview row per report, its outcome one of the three words
        row = next(line for line in text.splitlines() if line.startswith(f"| {study} | gpt2 |"))
        assert any(f"| {word} |" in row for word in ("held", "held in the mean only", "did not hold"))
    kept = sorted((tmp_path / "results" / "studies").glob("*/report.json"))
    assert [p.parent.name for p in kept] == ["noise-gpt2-ffn", "retraction-gpt2-ffn+attention", "tangential-gpt2-ffn"]
    for link in ("results/studies/noise-gpt2-ffn/noise_diagnostics.png",
                 "results/studies/tangential-gpt2-ffn/tangential_val_loss.png"):
        assert f"]({link})" in text and (tmp_path / link).stat().st_size > 1000
    # the page regenerates from the copies kept next to it, to the same text
    again = tmp_path / "again.md"
    order = {json.loads(p.read_text())["study"]: p for p in kept}
    assert commands.main(["study-report", *(str(order[s]) for s in smoke), "--output", str(again)]) == 0
    assert again.read_text().split("\n", 6)[6] == text.split("\n", 6)[6]


def test_study_recipe_budget_and_own_data(tmp_path):
    """`study:` comes from the recipe, budget options override the scale, --text-files replace the text."""
    from hf_tangent.training.data import austen_files

    files = [str(f) for f in austen_files("evaluation")] + [str(f) for f in austen_files("calibration")][:1]
    assert commands.main(["study", "--recipe", str(RECIPES / "study_retraction.yaml"), "--scale", "smoke", "--variants", "retract p=2",
                     "--seeds", "3", "--max-steps", "4", "--eval-every", "2", "--seq-len", "16",
                     "--text-files", *files, "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["study"] == "retraction" and report["branches"] == ["ffn"] and report["seeds"] == [3]
    assert report["settings"]["max_steps"] == 4 and report["settings"]["seq_len"] == 16
    assert [h["step"] for h in report["runs"][0]["history"]] == [0, 2, 4]
    assert "(last 20% of documents)" in report["data"] and files[0] in report["data"]


@pytest.mark.parametrize("args, message", [
    (["study"], "name a study: one of tangential, retraction, noise"),
    (["study", "noise", "--model", "gpt2"], "unrecognized arguments: --model gpt2"),  # studies build their models
    (["study", "noise", "--seed", "1"], "unrecognized arguments: --seed 1"),  # not an abbreviation of --seeds
    (["study", "noise", "--eval-every", "0"], "--eval-every 0 is out of range; accepted: an integer >= 1"),
    (["study", "noise", "--calibration-files", "a.txt"], "--calibration-files needs --text-files"),
])
def test_bad_study_options(args, message, tmp_path, capsys):
    try:
        code = commands.main([*args, "--output-dir", str(tmp_path)])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().splitlines()[-1].startswith("python -m studies study: error: ")


@pytest.mark.parametrize("args, message", [
    (["study", "entropy"], "unknown study 'entropy'"),
    (["study", "noise", "--scale", "huge"], "unknown scale 'huge'"),
    (["study", "noise", "--variants", "tangent gamma=1"], "unknown variants ['tangent gamma=1']"),
    (["study", "noise", "--arch", "bert"], "unknown architecture 'bert'"),
])
def test_bad_study_requests(args, message, tmp_path, capsys):
    assert commands.main([*args, "--output-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_study_recipes_name_their_study_and_the_command_line_wins():
    from hf_tangent import cli

    for study in study_module.STUDIES:
        args = cli.parse_args(["study", "--recipe", str(RECIPES / f"study_{study}.yaml")], commands=commands.COMMANDS)
        assert (args.study, args.scale, args.output_dir) == (study, "cpu", f"runs/study-{study}")
    args = cli.parse_args(["study", "noise", "--recipe", str(RECIPES / "study_tangential.yaml"), "--branches", "ffn",
                           "attention"], commands=commands.COMMANDS)
    assert args.study == "noise" and args.branches == ["ffn", "attention"]


def _runs(losses: dict[str, list[float]]) -> list[dict]:
    return [{"variant": v, "seed": seed, "final_val_loss": loss} for v, ls in losses.items() for seed, loss in enumerate(ls)]


@pytest.mark.parametrize("seeds, best, flip, outcome", [
    (6, "retract p=4", False, "held"),                   # lowest on every seed: p = 2 / 2^6 against both contenders
    (3, "retract p=4", False, "held in the mean only"),  # every seed agrees, but 3 seeds cannot reach p <= 0.05
    (6, "retract p=4", True, "inconclusive"),            # lowest in the mean, but seed 0 disagrees
    (6, "retract p=inf", False, "did not hold"),
    (6, "euclidean", False, "did not hold"),
])
def test_retraction_verdict_follows_the_paired_statistics(seeds, best, flip, outcome):
    noise = [0.01 * ((7 * s) % 5) for s in range(seeds)]  # seed-to-seed spread shared by the variants
    losses = {v: [4.0 + 0.1 * i + n for n in noise] for i, v in enumerate(study_module.STUDIES["retraction"])}
    losses[best] = [value - 1.0 for value in losses[best]]  # p=4: 4.3 - 1 vs euclidean 4.0, p=inf 4.5
    if flip:
        losses[best][0] += 2.0
    runs = _runs(losses)
    summary = verdicts.summarize(runs, "euclidean")
    got, sentence = verdicts.verdict_outcome("retraction", summary, runs)
    assert got == outcome and f"Best mean final validation loss: {best}" in sentence
    if outcome == "held":
        assert f"p = {2 / 2**seeds:.3f}" in sentence and "vs euclidean -0.7000" in sentence and "vs retract p=inf -1.2000" in sentence


@pytest.mark.slow  # CI time: the three smoke studies (~60 s); test_study_recipe_budget_and_own_data trains one by default
def test_reports_with_more_seeds_merge_on_the_page(smoke, tmp_path, capsys):
    """Seeds run later (another `study` call) merge by seed; a (variant, seed) given twice is an error."""
    report, _ = smoke["noise"]
    parts = []
    for seed in (0, 1):  # the smoke report cut into one report per seed, as if run one seed at a time
        runs = [r for r in report["runs"] if r["seed"] == seed]
        summary = verdicts.summarize(runs, "none")  # each part's own summary: 1 seed
        part = dict(report, runs=runs, seeds=[seed], summary=summary, verdict=verdicts.verdict("noise", summary, runs))
        (tmp_path / f"seed{seed}.json").write_text(json.dumps(part))
        parts.append(str(tmp_path / f"seed{seed}.json"))
    assert commands.main(["study-report", *parts, "--output", str(tmp_path / "merged.md")]) == 0
    assert commands.main(["study-report", str(smoke["noise"][1] / "report.json"), "--output", str(tmp_path / "one.md")]) == 0
    merged, one = (tmp_path / "merged.md").read_text(), (tmp_path / "one.md").read_text()
    table = [line for line in merged.splitlines() if line.startswith("| none |") or line.startswith("| tangent")]
    assert table == [line for line in one.splitlines() if line.startswith("| none |") or line.startswith("| tangent")]
    assert "over 2 runs of the command merged by seed" in merged
    kept = json.loads((tmp_path / "results" / "studies" / "noise-gpt2-ffn" / "report.json").read_text())
    assert kept["seeds"] == [0, 1] and len(kept["runs"]) == len(report["runs"])
    # the merged summary and verdict come from all runs, not from the first report (a bug that was)
    assert all(row["seeds"] == 2 for row in kept["summary"])
    assert json.dumps(kept["summary"]) == json.dumps(verdicts.summarize(kept["runs"], "none"))  # (nan != nan)
    assert kept["verdict"] == verdicts.verdict("noise", kept["summary"], kept["runs"])
    capsys.readouterr()
    assert commands.main(["study-report", parts[0], parts[0], "--output", str(tmp_path / "x.md")]) == 2
    assert "'none' seed 0 is in more than one report" in capsys.readouterr().err
    other = dict(report, settings=dict(report["settings"], max_steps=99))
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"differ in \['settings'\]"):
        study_module.merge_reports([report, other])


def test_the_kept_studies_page_is_what_its_regenerate_command_writes(tmp_path, monkeypatch):
    """docs/studies.md's own "To regenerate" line, run as written (the shell's sorted glob) on the kept reports,
    writes the page exactly (pinned: the kept page had the studies in another order than the command gives)."""
    shutil.copytree(ROOT / "docs" / "results" / "studies", tmp_path / "docs" / "results" / "studies")
    monkeypatch.chdir(tmp_path)
    kept = (ROOT / "docs" / "studies.md").read_text(encoding="utf-8")
    line = next(s for s in kept.splitlines() if s.startswith("`python -m studies study-report "))
    argv = shlex.split(line.strip("`.").removeprefix("python -m studies "))
    argv = [a for pattern in argv for a in (sorted(glob.glob(pattern)) if "*" in pattern else [pattern])]
    assert commands.main(argv) == 0
    assert (tmp_path / "docs" / "studies.md").read_text(encoding="utf-8") == kept


def test_study_report_refuses_an_unreadable_report(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert commands.main(["study-report", str(tmp_path / "file"), "--output", str(tmp_path / "page.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m studies study-report: error: ") and "not a readable report.json" in err
    assert not (tmp_path / "page.md").exists()


# ----------------------------------------------------------------------------- run_study's own option checks
def test_run_study_progress_is_type_checked():
    with pytest.raises(OptionTypeError, match=r"progress=5 has the wrong type \(int\); accepted: a progress bar "
                                              r"\(an object with update\(n\), like tqdm\), or None\."):
        study_module.run_study("noise", progress=5)
    with pytest.raises(OptionTypeError, match=r"train_docs='abc' has the wrong type"):
        study_module.run_study("noise", train_docs="abc", val_docs=["x"])


@pytest.mark.parametrize("value, words", [([5], r"max_steps=\[5\] has the wrong type \(list\)"),
                                          ([], r"max_steps=\[\] has the wrong type \(list\)"),
                                          ("5", r"max_steps='5' has the wrong type \(str\)")])
def test_overrides_take_a_number_of_the_keys_type(value, words):
    with pytest.raises(OptionTypeError, match=words + r"; accepted: an integer >= 1\."):
        study_module.run_study("noise", overrides={"max_steps": value})


def test_an_empty_seed_list_is_refused_and_a_path_is_a_path(tmp_path):
    with pytest.raises(RangeError, match=r"seeds=\[\] is empty; .*, or None\."):
        study_module.run_study("noise", seeds=[])
    with pytest.raises(ValueError, match="unknown scale"):  # a Path object accepted: the call gets past the options
        study_module.run_study("noise", "no-such-scale", output_dir=tmp_path / "study")


def test_run_study_api(tmp_path):
    report = study_module.run_study("tangential", "smoke", variants=["projected"], seeds=[0], output_dir=str(tmp_path),
                             overrides={"max_steps": 2, "eval_every": 2})
    assert report.kind == "study" and [r["variant"] for r in report["runs"]] == ["unpatched", "projected"]
    assert "**Verdict.**" in report.to_markdown()


def test_a_study_has_no_model_options_and_smoke_caps_its_scale_and_seeds(monkeypatch):
    from hf_tangent import cli

    _, parsers = cli.build_parser(commands=commands.COMMANDS)
    assert {"model", "dtype", "seed"}.isdisjoint(a.dest for a in parsers["study"]._actions)
    monkeypatch.setenv("HF_TANGENT_SMOKE", "1")
    args = cli.parse_args(["study", "tangential", "--scale", "cpu", "--seeds", "3", "4", "5", "--seq_len", "16"],
                          commands=commands.COMMANDS)
    assert (args.scale, args.seeds, args.seq_len, args.max_steps) == ("smoke", [3], 16, None)  # None: the scale's


def test_a_recipe_by_name_and_hostile_recipes_and_pages_end_in_one_line(tmp_path, capsys):
    """Found by the reviews of the move: `--recipe study_noise` (a name, as before the move) was "not found"; a
    recipe's `study: [tangential]` crashed with a TypeError, a page --output at a folder, under a file or with a
    name too long with an OSError traceback, and a --recipe name too long for a path too (hf-tangent's as well)."""
    (tmp_path / "list.yaml").write_text("command: study\nstudy: [tangential]\n")
    (tmp_path / "afile").write_text("x")
    kept = str(ROOT / "docs" / "results" / "studies" / "noise-gpt2-ffn" / "report.json")
    for argv, words in [
        (["study", "--recipe", "study_noise", "--scale", "huge"], "unknown scale 'huge'"),  # the recipe was read
        (["study", "--recipe=study_noise", "--arch", "bert"], "unknown architecture 'bert'"),
        (["study", "--recipe", str(tmp_path / "list.yaml")], "unknown study ['tangential']; accepted: tangential,"),
        (["study-report", kept, "--output", str(tmp_path)], "is a folder or lies under a file; accepted:"),
        (["study-report", kept, "--output", str(tmp_path / "afile" / "x.md")], "is a folder or lies under a file"),
        (["study-report", kept, "--output", str(tmp_path / ("a" * 300 + ".md"))], "File name too long"),  # OSError
        (["study", "--recipe", "a" * 300], "not found: not a file, nor a shipped recipe"),  # (a traceback, both)
    ]:
        try:  # (a recipe's errors are the parser's: SystemExit)
            code = commands.main([*argv, "--output-dir", str(tmp_path / "out")] if argv[0] == "study" else argv)
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"python -m studies {argv[0]}: error: ") and words in last, (argv, last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "list.yaml"]  # nothing written


def test_smoke_size_runs_one_seed_of_the_scales(tmp_path, monkeypatch, capsys):
    """HF_TANGENT_SMOKE=1 promises one seed (docs/recipes.md), and stderr says what it capped; without --seeds a
    study ran its scale's two."""
    monkeypatch.setenv("HF_TANGENT_SMOKE", "1")
    assert commands.main(["study", "noise", "--variants", "none", "--max-steps", "2", "--eval-every", "2",
                          "--output-dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["seeds"] == [0]
    assert "HF_TANGENT_SMOKE=1: the smoke scale's seeds [0, 1] -> [0]" in capsys.readouterr().err


def test_a_kept_study_report_loads_once_studies_is_imported_and_says_so_before():
    import subprocess

    path = ROOT / "docs" / "results" / "studies" / "noise-gpt2-ffn" / "report.json"
    code = f"import hf_tangent as ht\ntry:\n    ht.Report.load({str(path)!r})\nexcept ValueError as e:\n    print(e)\n" \
           f"import studies\nprint(ht.Report.load({str(path)!r}).kind)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "a report of the checkout's from-scratch studies (`python -m studies`); `import studies`" in out
    assert out.strip().splitlines()[-1] == "study"


def test_hf_tangents_own_recipe_lookup_survives_a_name_too_long(capsys):
    from hf_tangent import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", "--recipe", "a" * 300])
    assert exit_.value.code == 2 and "not found: not a file, nor a shipped recipe" in capsys.readouterr().err
