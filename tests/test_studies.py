"""Smoke runs of the three from-scratch studies, determinism, and bad input."""

import json

import pytest

from hf_tangent import cli, studies


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = {}
    for study, extra in (("tangential", []), ("retraction", ["--branches", "ffn", "attention"]), ("noise", [])):
        folder = tmp_path_factory.mktemp(study)
        assert cli.main(["study", study, "--scale", "smoke", "--output-dir", str(folder), *extra]) == 0
        out[study] = (json.loads((folder / "report.json").read_text()), folder)
    return out


def test_every_variant_trains(smoke):
    for study, (report, folder) in smoke.items():
        assert [s["variant"] for s in report["summary"]] == list(studies.STUDIES[study])
        for run in report["runs"]:
            first, last = run["history"][0]["val_loss"], run["history"][-1]["val_loss"]
            assert last < first - 0.1, (study, run["variant"])
            assert run["train_loss"][-1][1] < run["train_loss"][0][1]
        assert (folder / f"{study}_val_loss.png").stat().st_size > 1000
        assert report["verdict"] and "smallest reachable p" in report["verdict"] or study == "retraction"


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


def test_same_seed_same_numbers(smoke, tmp_path):
    report, _ = smoke["noise"]
    assert cli.main(["study", "noise", "--scale", "smoke", "--variants", "tangent gamma=0.03", "--seeds", "1",
                     "--output-dir", str(tmp_path)]) == 0
    again = {r["variant"]: r for r in json.loads((tmp_path / "report.json").read_text())["runs"]}
    first = {r["variant"]: r for r in report["runs"] if r["seed"] == 1}
    for variant in ("none", "tangent gamma=0.03"):
        assert again[variant]["final_val_loss"] == first[variant]["final_val_loss"]
        assert again[variant]["train_loss"] == first[variant]["train_loss"]


def test_study_report_page(smoke, tmp_path):
    page = tmp_path / "studies.md"
    reports = [str(folder / "report.json") for _, folder in smoke.values()]
    assert cli.main(["study-report", *reports, "--output", str(page)]) == 0
    text = page.read_text()
    assert text.count("**Verdict.**") == 3 and "| retract p=inf |" in text


@pytest.mark.parametrize("args, message", [
    (["study", "entropy"], "unknown study 'entropy'"),
    (["study", "noise", "--scale", "huge"], "unknown scale 'huge'"),
    (["study", "noise", "--variants", "tangent gamma=1"], "unknown variants ['tangent gamma=1']"),
    (["study", "noise", "--arch", "bert"], "unknown architecture 'bert'"),
])
def test_bad_study_requests(args, message, tmp_path, capsys):
    assert cli.main([*args, "--output-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
