"""Every code block of README.md and docs/*.md runs as written (python) or parses (the hf-tangent
command lines of bash blocks), offline and fast:

- `smollm2-135m` is a tiny random Llama (12 layers) with the real SmolLM2 tokenizer, and runs are
  scaled down (SCALE: at most 2 optimizer steps, 1 window of at most 16 tokens, 4 lm-eval items per
  task); the calls are the blocks' own, with their own arguments;
- a line that needs the Hub says what to run offline with a trailing `# offline: CODE` comment (or
  `# what it does; offline: CODE`): the Quick start's `from_pretrained("EleutherAI/pythia-160m")`,
  `push_patch`, `from_pretrained("user/...")`. The test runs CODE, with no Hub of any kind (the suite
  is offline: a line that reaches for the Hub fails); test_the_hub_lines_as_written_end_in_the_hub_error
  runs each hf_tangent line as written and gets hf_tangent's error naming the Hub and what to do offline;
- blocks that are fragments find the names they use ready: `model`, `tokenizer` (the tiny model,
  unpatched), `windows`, `calibration_windows`, `eval_windows`, `input_ids`, `trainer`, the numbers
  of `window_nll_sums` / `window_token_counts`, `ht`, `hf_tangent`, `torch`, `AutoModelForCausalLM`,
  and the files a reader would have: `emma.txt`, `prideprejudice.txt`, a patch repo `healed-patch`,
  a complete folder `my-folder`, a local copy of the base at `/mirror/SmolLM2-135M` (STANDS_FOR);
- a block that is not meant to run starts with `# not run: REASON` (python) and says why.

Command lines (`hf-tangent ...`, `... -m hf_tangent.cli ...`) go through the command's own parser
with any --recipe applied, and their option dataclasses are built (ranges checked)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.S | re.M)
OFFLINE = re.compile(r"^(?P<indent>\s*)(?P<code>.*?)\s+#(?:[^#\n]*;)?\s*offline:\s*(?P<instead>.+)$")
NOT_RUN = re.compile(r"^\s*#\s*not run:\s*\S")
MIRROR = "/mirror/SmolLM2-135M"


def blocks(lang: str) -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group("lang") == lang:
                found.append((page, text[:m.start()].count("\n") + 1, m.group("body")))
    return found


def offline(code: str) -> str:
    """The block with every `... # offline: CODE` line replaced by CODE (same indentation)."""
    lines = []
    for line in code.splitlines():
        m = OFFLINE.match(line)
        lines.append(m.group("indent") + m.group("instead").strip() if m else line)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- python blocks
@pytest.fixture(scope="module")
def docs_world(tmp_path_factory):
    """The tiny offline model, the reader's files; yields a function that builds a fresh namespace of
    the names fragments use."""
    from conftest import tiny_smollm2_llama

    import hf_tangent as ht
    import hf_tangent.experiments as experiments
    from hf_tangent.artifacts import checkpoints, models
    from hf_tangent.experiments import common
    from hf_tangent.training import trainer as training

    austen = ROOT / "tests" / "data" / "austen"  # the novels' openings: tokenized in milliseconds
    root = tmp_path_factory.mktemp("docs_world")
    base = root / "smollm2-tiny"
    tiny_smollm2_llama(base, layers=12)  # parallel.md converts 12
    work = root / "work"
    work.mkdir()
    for name in ("emma.txt", "prideprejudice.txt"):
        shutil.copy(austen / name, work / name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "offline_folder", lambda name: base)
        mp.setattr(checkpoints, "offline_folder", lambda name: base)  # what load_offline reads
        mp.setenv("HF_TANGENT_AUSTEN_DIR", str(austen))
        scale_down(mp, experiments, common, training)

        model, tokenizer = ht.load_model("smollm2-135m")
        ht.save_patch(ht.patch(model, ht.TangentConfig(update="projected", gates=True)), work / "healed-patch")
        ht.save_hub_folder(model, work / "my-folder", tokenizer=tokenizer)
        stands_for = {MIRROR: str(base)}

        def namespace() -> dict:
            from transformers import AutoModelForCausalLM, Trainer, default_data_collator

            from hf_tangent.training.trainer import TangentTrainingArguments, lm_dataset

            model, tokenizer = ht.load_model("smollm2-135m")
            windows = torch.randint(0, len(tokenizer), (4, 16), generator=torch.Generator().manual_seed(0))
            trainer = Trainer(model=model, train_dataset=lm_dataset(windows), data_collator=default_data_collator,
                              args=TangentTrainingArguments(output_dir=str(root / "trainer"), max_steps=1, use_cpu=True))
            return {"__name__": "__doc_block__", "ht": ht, "hf_tangent": ht, "torch": torch,
                    "AutoModelForCausalLM": AutoModelForCausalLM, "model": model, "tokenizer": tokenizer,
                    "windows": windows, "calibration_windows": windows, "eval_windows": windows,
                    "input_ids": windows[:1], "trainer": trainer,
                    "window_nll_sums": [40.0, 38.5], "window_token_counts": [15, 15]}

        cwd = os.getcwd()
        os.chdir(work)
        try:
            yield namespace, stands_for
        finally:
            os.chdir(cwd)


SCALE = {"max_steps": 2, "seq_len": 16, "max_windows": 1, "lm_eval_limit": 4}


def scale_down(mp, experiments, common, training):
    """Every run of the blocks at SCALE: the same functions and arguments, fewer steps and tokens."""
    import importlib

    windows = common.windows

    def small_windows(model, tokenizer, documents, seq_len, max_windows):
        return windows(model, tokenizer, documents, min(seq_len, SCALE["seq_len"]),
                       min(max_windows or SCALE["max_windows"], SCALE["max_windows"]))

    mp.setattr(common, "windows", small_windows)  # domain_windows / text_windows (calibrate, eval, finetune, heal)
    for name in ("analysis", "calibrate", "evaluate", "finetune", "heal"):  # the recipes that window a text themselves
        module = importlib.import_module(f"{experiments.__name__}.{name}")
        if hasattr(module, "windows"):
            mp.setattr(module, "windows", small_windows)
    post_init = training.TangentTrainingArguments.__post_init__

    def few_steps(self):
        self.max_steps = min(self.max_steps, SCALE["max_steps"])
        post_init(self)

    mp.setattr(training.TangentTrainingArguments, "__post_init__", few_steps)
    try:
        import lm_eval
    except ImportError:
        return
    simple_evaluate = lm_eval.simple_evaluate
    mp.setattr(lm_eval, "simple_evaluate",
               lambda *a, limit=None, **k: simple_evaluate(*a, limit=min(limit or SCALE["lm_eval_limit"],
                                                                         SCALE["lm_eval_limit"]), **k))


PYTHON = blocks("python")


@pytest.mark.parametrize("page,line,code", PYTHON, ids=[f"{p}:{n}" for p, n, _ in PYTHON])
def test_python_block_runs(docs_world, page, line, code):
    if NOT_RUN.match(code):
        pytest.skip(code.splitlines()[0].strip())
    namespace, stands_for = docs_world
    code = offline(code)
    for text, instead in stands_for.items():
        code = code.replace(text, instead)
    exec(compile(code, f"{page}:{line}", "exec"), namespace())  # noqa: S102


HUB_CALL = re.compile(r"\b(ht|hf_tangent)\.(push_patch|push_to_hub|from_pretrained|load_model)\(")


def hub_lines() -> list[tuple[str, int, str, int]]:
    """(page, block line, block, index of the line) for every `# offline:` line that calls hf_tangent's Hub API."""
    found = []
    for page, line, code in PYTHON:
        for i, text in enumerate(code.splitlines()):
            m = OFFLINE.match(text)
            if m and HUB_CALL.search(m.group("code")):
                found.append((page, line, code, i))
    return found


HUB_LINES = hub_lines()


@pytest.mark.parametrize("page,line,code,index", HUB_LINES, ids=[f"{p}:{n + i + 1}" for p, n, _, i in HUB_LINES])
def test_the_hub_lines_as_written_end_in_the_hub_error(docs_world, page, line, code, index):
    """Offline, the line as written (after the block's lines before it, with their offline code) ends in
    hf_tangent's error that names the Hub and says what to do offline, not in huggingface_hub's or
    httpx's own error (before: httpx.ConnectError from push_patch)."""
    from hf_tangent.artifacts.offline import HubUnavailableError

    namespace, stands_for = docs_world
    lines = code.splitlines()
    before = offline("\n".join(lines[:index])) if index else ""
    as_written = OFFLINE.match(lines[index]).group("code").strip()
    for text, instead in stands_for.items():
        before, as_written = before.replace(text, instead), as_written.replace(text, instead)
    names = namespace()
    exec(compile(before, f"{page}:{line}", "exec"), names)  # noqa: S102
    with pytest.raises(HubUnavailableError, match=r"needs the Hugging Face Hub \(https://huggingface.co\), which cannot "
                       r"be reached from here \(HF_HUB_OFFLINE is set\)\. Offline: "):
        exec(compile(as_written, f"{page}:{line + index + 1}", "exec"), names)  # noqa: S102


def test_blocks_are_found_and_markers_are_well_formed():
    assert len(PYTHON) >= 10 and any(p == "README.md" for p, _, _ in PYTHON)
    assert {p for p, _, _, _ in HUB_LINES} == {"README.md", "docs/recipes.md"} and len(HUB_LINES) >= 5
    for page, line, code in PYTHON:  # every hf_tangent Hub call of a block says what to do offline
        for i, text in enumerate(code.splitlines()):
            if HUB_CALL.search(text) and re.search(r"\(\s*[\"'][\w.-]+/[\w.-]+[\"']", text.split("#")[0]):
                assert OFFLINE.match(text), f"{page}:{line + i + 1}: a Hub id without an `# offline:` alternative: {text}"
    for page, line, code in PYTHON:
        for text in code.splitlines():
            if "offline:" in text:
                assert OFFLINE.match(text), f"{page}:{line}: an `# offline:` marker must end a line of code: {text}"
        if "not run" in code:
            assert NOT_RUN.match(code), f"{page}:{line}: `# not run: REASON` must open the block"


# ----------------------------------------------------------------------------- command lines
def command_lines() -> list[tuple[str, int, list[str]]]:
    """Every hf-tangent command line of a bash block: (page, line, argv after the program; `python -m studies ...`,
    the checkout's studies/, as ["studies", argv after it])."""
    found = []
    for page, line, body in blocks("bash"):
        for i, text in enumerate(body.replace("\\\n", " ").splitlines()):
            for part in re.split(r"&&|;|\||(?<![<>&])&(?![&>])", text):  # a list, a pipe, a background job (not 2>&1)
                try:
                    tokens = shlex.split(part, comments=True)
                except ValueError:
                    continue
                if ">" in tokens:  # a redirection of the shell's, not an argument (`> runs/x/log`)
                    tokens = tokens[:tokens.index(">")]
                if tokens[:1] == ["hf-tangent"]:
                    found.append((page, line + 1 + i, tokens[1:]))
                elif tokens[:3] == ["python", "-m", "studies"]:
                    found.append((page, line + 1 + i, ["studies", *tokens[3:]]))
                elif "hf_tangent.cli" in tokens:
                    found.append((page, line + 1 + i, tokens[tokens.index("hf_tangent.cli") + 1:]))
    return found


COMMANDS = command_lines()


@pytest.mark.parametrize("page,line,argv", COMMANDS, ids=[f"{p}:{n}" for p, n, _ in COMMANDS])
def test_command_line_parses(page, line, argv, monkeypatch):
    from hf_tangent import cli
    from hf_tangent.commands.arguments import dataclasses_of

    monkeypatch.chdir(ROOT)  # recipes/*.yaml paths are relative to the checkout, as in the docs
    monkeypatch.setenv("WORLD_SIZE", "1")
    try:
        if argv[0] == "studies":
            sys.path.insert(0, str(ROOT))
            from studies import commands

            args = cli.parse_args(argv[1:], commands=commands.COMMANDS)
        else:
            args = cli.parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"{page}:{line}: `hf-tangent {' '.join(argv)}` does not parse (exit {err.code})")
    dataclasses_of(args.parser, args)  # the options' ranges, as the command checks them first


def test_every_command_line_is_found():
    assert len(COMMANDS) >= 20
    assert {"calibrate", "finetune", "heal", "studies", "lm-eval", "diagnose"} <= {argv[0] for _, _, argv in COMMANDS}


@pytest.mark.slow
@pytest.mark.real
def test_the_readmes_quick_start_runs_as_written_on_the_real_weights(tmp_path):
    """The README's first python block (the offline Quick start), verbatim, in a fresh process and an empty
    folder, on the real SmolLM2-135M weights: its own asserts (disabled is the base bit for bit, the saved
    patch reloads to the same logits) hold there, not only on the tiny stand-in above."""
    import subprocess
    import sys

    page, _, code = next(block for block in PYTHON if block[0] == "README.md")
    assert "ht.load_model(\"smollm2-135m\")" in code and "# offline:" not in code  # runs offline as written
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "smollm2-cayley-patch" / "adapter_config.json").is_file()
