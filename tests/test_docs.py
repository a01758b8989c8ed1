"""Every figure in README.md and docs/ comes from a kept report (docs/figures.py): the rendered regions
equal their rendering from docs/results/*.json and benchmarks/results/*.json today, and no number
outside them is typed by hand unless it is a listed constant (a setting, a threshold, a paper value)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import figures  # noqa: E402


def test_the_docs_agree_with_the_kept_reports(capsys):
    assert figures.main(["--check"]) == 0, capsys.readouterr().out


def test_a_number_typed_into_a_region_or_beside_it_is_caught():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    region = figures.REGION.search(text)
    edited = text[:region.start("body")] + region.group("body").replace(".", ",", 1) + text[region.end("body"):]
    assert figures.render(edited) == text  # rendering puts the report's value back: --check sees the difference
    assert figures.stray_numbers("README.md", text + "\nA measured 0.4321 typed by hand.\n") == ["0.4321"]
    assert figures.stray_numbers("README.md", text) == []


def test_the_module_table_checks_the_layering_and_lists_every_module():
    text = (ROOT / "docs" / "core.md").read_text(encoding="utf-8")
    body = next(m for m in figures.REGION.finditer(text) if m.group("name") == "core-modules").group("body")
    assert figures.core_modules(body) == body
    # training/trainer.py imports analysis/diagnostics at module level: put below analysis, that breaks
    moved = body.replace("| training | `training/trainer.py` |", "| artifacts | `training/trainer.py` |")
    with pytest.raises(ValueError, match=r"training/trainer.py \(artifacts\) imports analysis/diagnostics \(analysis\) "
                       r"at module level"):
        figures.core_modules(moved)
    dropped = "\n".join(line for line in body.splitlines() if "`ranges.py`" not in line)
    with pytest.raises(ValueError, match=r"add rows for \['ranges.py'\]"):
        figures.core_modules(dropped)
