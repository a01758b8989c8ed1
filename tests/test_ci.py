""".ci/run: it runs the README's test command verbatim, and it fails when any step of that command
fails. Checked with stand-in `python3` / `pip` programs on PATH: no real install, a second or two."""

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The bash blocks at the top of README.md: (run the main job, run the tests)."""
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)[:2]


def test_ci_runs_the_readme_test_command_verbatim_in_a_subshell():
    test_command = readme_commands()[1]
    assert test_command.endswith("python -m pytest") and "\n" not in test_command
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert f"({test_command})" in lines


# A stand-in python3: `-m venv DIR` makes DIR/bin/activate (which puts the stand-ins first on PATH);
# every call is logged; `-m pytest` exits with $PYTEST_EXIT. The stand-in pip exits with $PIP_EXIT.
_PYTHON = """#!/usr/bin/env bash
echo "python3 $*" >> "$CI_LOG"
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  printf 'export PATH="%s:$PATH"\\n' "$STUBS" > "$3/bin/activate"
  exit 0
fi
if [ "$1 $2" = "-m pytest" ]; then exit "${PYTEST_EXIT:-0}"; fi
exit 0
"""
_PIP = """#!/usr/bin/env bash
echo "pip $*" >> "$CI_LOG"
exit "${PIP_EXIT:-0}"
"""


def run_ci(tmp_path, **exits) -> tuple[int, list[str]]:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in (("python3", _PYTHON), ("python", _PYTHON), ("pip", _PIP)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    (checkout / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    log = tmp_path / "calls.log"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "CI_LOG": str(log), "STUBS": str(stubs), "HOME": str(tmp_path),
           **{k: str(v) for k, v in exits.items()}}
    result = subprocess.run(["bash", str(checkout / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return result.returncode, log.read_text().splitlines() if log.exists() else []


def test_ci_passes_when_every_step_passes(tmp_path):
    code, calls = run_ci(tmp_path)
    assert code == 0
    assert [c for c in calls if "pytest" in c] == ["python3 -m pytest", "python3 -m pytest -m core",
                                                   'python3 -m pytest -m vllm tests/test_vllm.py -k documented or '
                                                   'pre_03 or record_under or family_the_plugin or (every_served_family and '
                                                   '(llama or gemma3 or gpt2 or gpt_neox))']


@pytest.mark.parametrize("failing", ["PIP_EXIT", "PYTEST_EXIT"])
def test_ci_fails_when_any_step_of_the_test_command_fails(tmp_path, failing):
    code, calls = run_ci(tmp_path, **{failing: 1})
    assert code != 0
    # it stopped at the first failure: the oldest-transformers environment was never made
    assert not any(".venv-oldest" in c for c in calls)
    if failing == "PIP_EXIT":
        assert not any("pytest" in c for c in calls)


def test_the_old_and_list_form_would_have_passed_a_failing_install(tmp_path):
    """The defect this file pins: `a && b` as a bare line under `set -e` goes on after b fails."""
    script = tmp_path / "old.sh"
    script.write_text("set -euo pipefail\ntrue && false && true\necho next-line\n")
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 0 and result.stdout.strip() == "next-line"
