"""The package's layout contracts (issue 33): import-linter's contracts in .importlinter hold (the core
imports nothing else of hf_tangent, the layers point one way, no cycle, function-level imports
included); no module loads one of the package's own modules through importlib; the core listed for
import-linter is the remote code every patched folder ships."""

import ast
import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports is not installed (pip install -e '.[test]' brings import-linter)")
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "0 broken" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


def test_no_importlib_load_of_the_package_itself():
    found = []
    for path in sorted((ROOT / "hf_tangent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
                arg = node.args[0]
                text = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
                if not isinstance(arg, ast.Constant) or text.startswith(".") or text.startswith("hf_tangent"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "importlib loads a module of the package (import it by name instead):\n" + "\n".join(found)


def test_the_core_of_the_contracts_is_the_remote_code():
    """The contract's core is the folder hf_tangent/core, and what a patched folder ships as remote code is
    that folder's modules (listed, so a module added there ships) plus the two generated files."""
    from hf_tangent.artifacts import hub
    from hf_tangent.core.destinations import REMOTE_CODE_MODULES

    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    assert config["importlinter:contract:core-stands-alone"]["source_modules"].split() == ["hf_tangent.core"]
    on_disk = sorted(p.name for p in (ROOT / "hf_tangent" / "core").glob("*.py") if p.name != "__init__.py")
    assert list(hub.REMOTE_CODE_MODULES) == on_disk
    assert set(REMOTE_CODE_MODULES) == {*on_disk, "configuration_hf_tangent.py", "modeling_hf_tangent.py"}


def test_a_module_added_to_the_core_ships_as_remote_code(tmp_path):
    copy = tmp_path / "hf_tangent"
    shutil.copytree(ROOT / "hf_tangent", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "core" / "extra_rule.py").write_text("X = 1\n", encoding="utf-8")
    code = "from hf_tangent.artifacts import hub; print(' '.join(hub.REMOTE_CODE_MODULES))"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "extra_rule.py" in result.stdout.split() and "patching.py" in result.stdout.split()


def test_the_contracts_can_fail(tmp_path):
    """A copy of the package with one upward import (the core importing the CLI) breaks a contract."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    copy = tmp_path / "hf_tangent"
    shutil.copytree(ROOT / "hf_tangent", copy, ignore=shutil.ignore_patterns("__pycache__"))
    rules = copy / "core" / "rules.py"
    rules.write_text(rules.read_text(encoding="utf-8") + "\nfrom .. import cli  # noqa\n", encoding="utf-8")
    result = subprocess.run([lint, "--no-cache", str(ROOT / ".importlinter")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": str(Path(lint).parent)})
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
