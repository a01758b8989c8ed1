"""The hostile-input sweep (tests/sweeps/hostile_inputs.py) as part of the suite: every case must end
'ok' (a valid input, the right result) or 'clear' (refused, the error names what is wrong and what
is accepted, the model unchanged). The groups in DEFAULT run by default; the rest, and the check of
the kept report (docs/results/hostile_sweep.json, whose case count README quotes), under -m sweep."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sweeps"))
import hostile_inputs as sweep  # noqa: E402

KEPT = Path(__file__).resolve().parents[1] / "docs" / "results" / "hostile_sweep.json"
DEFAULT = ("config", "numbers", "patch", "behaviour", "reload", "homotopy", "disabled", "update_config", "register", "describe",
           "analysis", "heal", "adapters", "artifacts", "lm_eval", "entries", "batch", "remote_code")
# ("options": test_option_walk.py)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    return tmp, sweep.tiny_model_folder(tmp)


@pytest.mark.parametrize("group", [g if g in DEFAULT else pytest.param(g, marks=pytest.mark.sweep) for g in sweep.GROUPS])
def test_every_case_is_ok_or_a_clear_error(group, folders):
    rows = sweep.run_group(group, *folders)
    failing = [f"{case}: {outcome} ({detail})" for _, case, outcome, detail in rows if outcome not in sweep.PASSING]
    assert rows, f"group {group} ran no case"
    assert not failing, "\n".join(failing)


@pytest.mark.sweep
def test_the_kept_report_is_what_the_sweep_gives_now():
    """Regenerate with: python tests/sweeps/hostile_inputs.py --output docs/results/hostile_sweep"""
    assert sweep.summary(sweep.run_all()) == json.loads(KEPT.read_text(encoding="utf-8"))
