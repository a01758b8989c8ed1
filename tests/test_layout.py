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
    from hf_tangent.destinations import REMOTE_CODE_MODULES

    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    core = config["importlinter:contract:core-stands-alone"]["source_modules"].split()
    shipped = {name.removesuffix(".py") for name in REMOTE_CODE_MODULES} - {"configuration_hf_tangent",
                                                                            "modeling_hf_tangent"}
    assert {m.removeprefix("hf_tangent.") for m in core} == shipped


def test_the_contracts_can_fail(tmp_path):
    """A copy of the package with one upward import (the core importing the CLI) breaks a contract."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    copy = tmp_path / "hf_tangent"
    shutil.copytree(ROOT / "hf_tangent", copy, ignore=shutil.ignore_patterns("__pycache__"))
    rules = copy / "rules.py"
    rules.write_text(rules.read_text(encoding="utf-8") + "\nfrom . import cli  # noqa\n", encoding="utf-8")
    result = subprocess.run([lint, "--no-cache", str(ROOT / ".importlinter")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": str(Path(lint).parent)})
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
