"""`hf-tangent eval`: report contents against an independent perplexity, and its errors."""

import dataclasses
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import nll_with_ffn_rule, projected
from transformers import LlamaForCausalLM

from hf_tangent import cli
from hf_tangent.artifacts.models import load_tokenizer
from hf_tangent.training.data import pack_windows


@pytest.fixture
def tiny_folder(tiny_lm_folder):
    return tiny_lm_folder


def test_eval_report_matches_an_independent_perplexity(tiny_folder, austen_dir, tmp_path):
    out = tmp_path / "run"
    text = str(austen_dir / "emma.txt")
    code = cli.main(["eval", "--model", str(tiny_folder), "--text-files", text, "--seq-len", "32",
                     "--max-windows", "3", "--output-dir", str(out), "--updates", "projected", "zero (ablation)"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == ["unpatched", "projected", "zero (ablation)"]
    # independent: the model's own loss on each window (equal lengths: token-weighted = plain mean), and
    # the rules written as plain torch hooks on the model's own layers
    model = LlamaForCausalLM.from_pretrained(tiny_folder).eval()
    windows = pack_windows(load_tokenizer(str(tiny_folder)), [open(text, encoding="utf-8").read()], 32, 3)
    expected = {"unpatched": nll_with_ffn_rule(model, windows), "projected": nll_with_ffn_rule(model, windows, projected),
                "zero (ablation)": nll_with_ffn_rule(model, windows, lambda x, y, i: torch.zeros_like(y))}
    for variant, nll in expected.items():
        assert rows[variant]["nll"] == pytest.approx(nll, rel=1e-5), variant
        assert rows[variant]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
        assert rows[variant]["delta_nll"] == pytest.approx(nll - expected["unpatched"], abs=1e-5)
    assert report["tokens_per_variant"] == 3 * 31
    markdown = (out / "report.md").read_text()
    assert "| projected |" in markdown and "| unpatched |" in markdown


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seq-len", "100"], "exceeds the model's context of 64 tokens"),
        (["--text-files", "/nonexistent.txt"], "text files not found"),
        (["--seq-len", "1"], "--seq-len 1 is out of range; accepted: an integer >= 2"),
    ],
)
def test_eval_errors_are_clear(tiny_folder, tmp_path, capsys, austen_dir, extra, message):
    args = ["eval", "--model", str(tiny_folder), "--output-dir", str(tmp_path), "--text-files",
            str(austen_dir / "emma.txt"), "--seq-len", "32", *extra]
    try:
        code = cli.main(args)
    except SystemExit as exit_:
        code, err = exit_.code, str(exit_)
    else:
        err = capsys.readouterr().err
    assert code not in (0, None)
    assert message in err


def test_eval_text_shorter_than_one_window(tiny_folder, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    code = cli.main(["eval", "--model", str(tiny_folder), "--text-files", str(short), "--seq-len", "64",
                     "--output-dir", str(tmp_path / "o")])
    assert code == 2 and "fewer than one window of seq_len=64" in capsys.readouterr().err


@pytest.mark.slow  # CI time (~25 s): test_wheel runs the main job's console script, test_kept_reports checks its rule table
def test_console_script_runs_the_offline_default(tmp_path):
    """The README's main command, at a tiny size: real SmolLM2 weights, held-out Austen text."""
    exe = [sys.executable, "-m", "hf_tangent.cli"]
    result = subprocess.run([*exe, "eval", "--max-windows", "1", "--seq-len", "64", "--updates", "projected",
                             "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["model"] == "smollm2-135m" and report["text"] == "austen:evaluation"
    rows = {r["variant"]: r for r in report["rows"]}
    # independent: the same window, the real weights, the projection as plain torch hooks
    from hf_tangent.artifacts.models import load_model
    from hf_tangent.training.data import load_documents

    model, tokenizer = load_model("smollm2-135m")
    windows = pack_windows(tokenizer, load_documents(split="evaluation"), 64, 1)
    unpatched = nll_with_ffn_rule(model, windows)
    assert rows["unpatched"]["nll"] == pytest.approx(unpatched, rel=1e-5)
    assert rows["projected"]["nll"] == pytest.approx(nll_with_ffn_rule(model, windows, projected), rel=1e-4)
    assert rows["unpatched"]["perplexity"] < 200.0  # a pretrained model (random weights: ~49152)


def test_eval_of_a_saved_patched_folder_reports_its_patch(tiny_folder, austen_dir, tmp_path):
    import hf_tangent as ht

    model = ht.patch(LlamaForCausalLM.from_pretrained(tiny_folder), ht.TangentConfig(update="zero", layers=[0]))
    model.save_pretrained(tmp_path / "patched")
    load_tokenizer(str(tiny_folder)).save_pretrained(tmp_path / "patched")
    assert cli.main(["eval", "--model", str(tmp_path / "patched"), "--text-files", str(austen_dir / "emma.txt"),
                     "--seq-len", "32", "--max-windows", "2", "--updates", "zero (ablation)",
                     "--output-dir", str(tmp_path / "out")]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["rows"]}
    assert rows["saved patch (as loaded)"]["config"]["layers"] == [0]
    unpatched = ht.unpatch(ht.from_pretrained(tmp_path / "patched"))
    windows = pack_windows(load_tokenizer(str(tiny_folder)), [open(austen_dir / "emma.txt").read()], 32, 2)
    from hf_tangent.analysis.evaluation import perplexity

    assert rows["unpatched"]["nll"] == pytest.approx(perplexity(unpatched, windows)["nll"], rel=1e-6)
    assert rows["saved patch (as loaded)"]["nll"] != rows["unpatched"]["nll"]


def _command_names():
    return [None, *cli.build_parser()[1]]  # None: `hf-tangent --help` itself


@pytest.mark.parametrize("command", _command_names())
def test_every_command_help_exits_0(command, capsys):
    """Walks the dispatcher's own command list, so a new command is covered without editing this test."""
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"usage: hf-tangent{'' if command is None else ' ' + command}")
    if command == "ablate":  # the help text that crashed argparse's %-formatting
        assert "for the 95% intervals" in " ".join(out.split())


@pytest.mark.parametrize("command", _command_names())
def test_help_is_for_users_and_prints_each_default_once(command, capsys):
    """`--help` speaks to users (no note about the source layout), and every option's default is
    printed once: no "(default: X)" appended to a help text that already says its default, and no
    "(default: None)"."""
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    out = capsys.readouterr().out
    assert "hf_tangent/commands" not in out and "this file" not in out
    options = re.split(r"\n  (?=-)", out.split("\noptions:\n", 1)[-1])  # one chunk per option
    for option in options:
        text = " ".join(option.split())
        appended = text.count("(default: ")
        assert appended <= 1 and "(default: None)" not in text, text
        if appended:
            assert len(re.findall(r"\bdefault", text, re.I)) == 1, f"default printed twice: {text}"


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _sections(out: str) -> list[tuple[str, list[str]]]:
    """(group title, its options' first flags) in the order the help prints them."""
    sections = []
    for chunk in re.split(r"\n\n(?=\S[^\n]*:\n)", out):
        title, _, body = chunk.partition(":\n")
        flags = re.findall(r"^  (--?[\w-]+)", body, re.M)
        if flags:
            sections.append((title.strip().splitlines()[-1], flags))
    return sections


@pytest.mark.parametrize("command", ["calibrate", "finetune", "heal", "eval", "lm-eval", "diagnose"])
def test_help_puts_the_recipe_model_and_output_first_and_the_trainer_last(command, capsys):
    """The options a user needs first come first (`calibrate --help` was 655 lines with --recipe last, after
    ~120 lines of usage and every TrainingArguments field): the usage line names only those three, the Trainer's
    options form the last group, the ones hf_tangent sets itself at its head."""
    out = _help([command], capsys)
    usage = out.split("\n\n", 1)[0]
    help_all = " | --help-all" if command in ("calibrate", "finetune", "heal") else ""
    assert usage == f"usage: hf-tangent {command} [-h{help_all}] [--recipe RECIPE] [--model MODEL] [--output_dir OUTPUT_DIR] " \
        "[options]" or usage.startswith(f"usage: hf-tangent {command} [-h{help_all}] [--recipe RECIPE] [--model MODEL]"), usage
    sections = _sections(out)
    titles = [title for title, _ in sections]
    assert titles[:3] == ["options", "the run", f"{command} options"], titles
    assert sections[1][1][:2] == ["--recipe", "--model"] and sections[1][1][2] in ("--output_dir", "--output-dir")
    if command in ("calibrate", "finetune", "heal"):
        assert titles[-1].startswith("Trainer options"), titles
        trainer = sections[-1][1]
        assert trainer[:3] == ["--max_steps", "--learning_rate", "--lr_scheduler_type"], trainer[:5]
        assert trainer.index("--resume_from_checkpoint") < trainer.index("--per_device_train_batch_size")


def test_a_no_option_says_what_it_turns_off_and_resume_names_last(capsys):
    """--no_save_patch had --save_patch's own help ("write the calibrated gates ...", default: False); the
    Trainer's --resume_from_checkpoint did not mention `last`, which hf_tangent accepts."""
    out = _help(["calibrate"], capsys)
    chunks = {chunk.split()[0].rstrip(","): " ".join(chunk.split()) for chunk in re.split(r"\n  (?=-)", out)[1:]}
    assert chunks["--no_save_patch"] == "--no_save_patch, --no-save-patch the opposite of --save_patch: turn it off"
    resume = chunks["--resume_from_checkpoint"]
    assert "`last` (the newest complete checkpoint in" in resume and "Not directly used by Trainer" not in resume


@pytest.mark.parametrize("command,recipe", [("calibrate", "offline_default"), ("calibrate", "calibrate"),
                                            ("heal", "heal_default"), ("finetune", "finetune_lora")])
def test_help_says_what_each_shipped_recipe_sets_and_shows_its_values(command, recipe, capsys):
    """The command's defaults are not the main job's (calibrate: seq_len 512 against the main job's 256, 50 steps
    against 60, ...) and the help did not say so. Now the plain help lists, for each shipped recipe, every value
    it sets that differs from the default shown (read here from the YAML itself), and `--recipe NAME --help`
    prints the recipe's values in place of the defaults, marked as the recipe's."""
    import yaml

    values = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.yaml").read_text())
    values.pop("command")
    plain = " ".join(_help([command], capsys).split())
    line = plain.split(f"--recipe {recipe}", 1)[1].split(" sets ", 1)[1].split(". ", 1)[0]
    parser = cli.build_parser()[1][command]
    defaults = {a.dest: a.default for a in parser._actions}
    for key, value in values.items():
        shown = " ".join(shlex.quote(str(v)) for v in value) if isinstance(value, list) else str(value)
        if key != "output_dir" and defaults[key] != value:
            assert f"--{key} {shown}" in line, (key, line)
        elif key != "output_dir":
            assert f"--{key} " not in line + " ", (key, line)
    with_recipe = _help([command, "--recipe", recipe], capsys)
    assert f"Defaults shown: recipe {recipe}'s values where it sets them" in " ".join(with_recipe.split())
    chunks = {chunk.split()[0].rstrip(","): " ".join(chunk.split()) for chunk in re.split(r"\n  (?=-)", with_recipe)[1:]}
    for key, value in values.items():
        option = chunks[next(a for a in parser._actions if a.dest == key).option_strings[0]]
        assert f"(recipe {recipe}: {value})" in option, (key, option)
        assert "(default:" not in option, option


HELP_LINES = {"calibrate": 128, "finetune": 120, "heal": 150}  # at 80 columns; the Trainer's ~120 others: --help-all


@pytest.mark.parametrize("command", list(cli.build_parser()[1]))
def test_help_shows_the_commands_own_options_and_points_to_the_trainers(command, capsys, monkeypatch):
    """`calibrate --help` was 527 lines, mostly TrainingArguments. Now --help shows every option of the command's
    own dataclasses and, of the Trainer's, those hf_tangent or a shipped recipe sets; --help-all all of them."""
    from transformers import TrainingArguments

    monkeypatch.setenv("COLUMNS", "80")
    out = _help([command], capsys)
    lines = out.count("\n")
    parser = cli.build_parser()[1][command]
    own = [f.name for kind in parser.dataclass_types if not issubclass(kind, TrainingArguments)
           for f in dataclasses.fields(kind)]
    flags = set(re.findall(r"^  (--?[\w-]+)", out, re.M))
    assert {f"--{name}" for name in own} <= flags, sorted({f"--{name}" for name in own} - flags)
    if command not in HELP_LINES:
        assert lines <= 80 and "--help-all" not in out, lines
        return
    assert lines == HELP_LINES[command], lines
    pointer = " ".join(out.split()).split("Trainer options (transformers.TrainingArguments", 1)[1]
    assert (f"All of them: `hf-tangent {command} --help-all`, or https://huggingface.co/docs/transformers/main_classes/"
            "trainer#transformers.TrainingArguments") in pointer
    assert {"--max_steps", "--learning_rate", "--per_device_train_batch_size"} <= flags  # hf_tangent's, a recipe's
    assert "--deepspeed" not in flags and "--weight_decay" not in flags
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help-all"])
    full = capsys.readouterr().out
    assert exit_.value.code == 0 and full.count("\n") > 400
    every = {action.option_strings[0] for action in parser._actions if action.option_strings}
    assert every <= set(re.findall(r"^  (--?[\w-]+)", full, re.M))  # --deepspeed, --weight_decay, ...: all
    assert "All of them:" not in full
    assert _help([command], capsys) == out  # the hidden options' help is back after each --help


def test_a_hidden_trainer_option_parses_from_the_command_line_and_a_recipe(tmp_path):
    """--help leaves the Trainer's options out; parsing takes every one of them as before."""
    args = cli.parse_args(["calibrate", "--weight_decay", "0.1", "--bf16", "--optim", "sgd", "--learning_rate", "0.5"])
    assert (args.weight_decay, args.bf16, args.optim, args.learning_rate) == (0.1, True, "sgd", 0.5)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("command: heal\nwarmup_steps: 3\nadam_beta2: 0.95\n")
    args = cli.parse_args(["heal", "--recipe", str(recipe)])
    assert (args.warmup_steps, args.adam_beta2) == (3, 0.95)


@pytest.mark.parametrize("command", _command_names())
def test_help_names_docs_by_url_not_by_a_file_an_installed_package_lacks(command, capsys):
    """The help cited "math.md section 5": a wheel has no docs/. Every *.md it names is a URL of the repository's
    docs, or the report it writes."""
    argv = [] if command is None else [command]
    out = _help(argv, capsys)
    for name in re.findall(r"\S*\.md\S*", out):
        assert name.startswith("https://github.com/hf-tangent/hf_tangent/blob/main/docs/") or \
            name.strip(",.;()") == "report.md", name
    assert "math.md section" not in out
