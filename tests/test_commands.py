"""The command layer: each command owns its options, recipes are checked key by key, and every
user error ends in one `hf-tangent <command>: error: ...` line with exit code 2, before any
expensive work. Reports regenerate from their kept JSON."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from hf_tangent import cli
from hf_tangent.experiments.report import Report

DOCS = Path(__file__).resolve().parents[1] / "docs"


def run(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def assert_user_error(code, err, command, message):
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hf-tangent {command}: error: ") and message in last, err


@pytest.fixture
def common(tiny_lm_folder, austen_dir, tmp_path):
    return ["--model", str(tiny_lm_folder), "--text-files", str(austen_dir / "emma.txt"), "--seq-len", "32",
            "--max-windows", "1", "--output-dir", str(tmp_path / "out")]


def test_each_command_owns_exactly_its_options():
    _, parsers = cli.build_parser()
    options = {name: {a.dest for a in p._actions} for name, p in parsers.items()}
    assert "text_files" not in options["sensitivity"] and "dataset" not in options["sensitivity"]
    assert "calibration_files" in options["sensitivity"]
    assert "deepspeed" in options["calibrate"] and "fsdp" in options["finetune"]  # TrainingArguments pass through
    assert "deepspeed" not in options["eval"] and "updates" not in options["ablate"]


def _recipe_functions():  # each command and the function it runs, named here independently of the commands
    import importlib

    named = {"eval": "evaluate.evaluate_rules", "calibrate": "calibrate.calibrate_gates", "finetune": "finetune.finetune",
             "heal": "heal.heal", "diagnose": "analysis.diagnose_layers", "ablate": "analysis.ablate",
             "sensitivity": "analysis.layer_sensitivity", "parallel-sweep": "analysis.parallel_sweep",
             "critical": "geometry.critical", "pressure": "geometry.pressure", "ffn-jacobian": "geometry.ffn_jacobian",
             "lm-eval": "downstream.lm_eval"}
    return {command: getattr(importlib.import_module(f"hf_tangent.experiments.{path.split('.')[0]}"), path.split(".")[1])
            for command, path in named.items()}


@pytest.mark.parametrize("command", list(_recipe_functions()))
def test_a_command_without_options_runs_its_function_at_the_function_defaults(command):
    """One declaration of a default: `hf-tangent COMMAND` with no option runs what the Python function does called
    with no argument (critical, pressure and ffn-jacobian read 8 windows of 512 tokens from the command line and 2 or
    4 of 256 from Python, heal 512-token windows against 256). None or () is the option's own (the device: None)."""
    import inspect

    _, parsers = cli.build_parser()
    parsed = vars(parsers[command].parse_args([]))
    compared = []
    option = {"rules": "updates"}  # a parameter the command names otherwise (eval, finetune: --updates)
    for name, parameter in inspect.signature(_recipe_functions()[command]).parameters.items():
        if option.get(name, name) in parsed and parameter.default not in (None, (), inspect.Parameter.empty):
            default = list(parameter.default) if isinstance(parameter.default, tuple) else parameter.default
            assert parsed[option.get(name, name)] == default, (command, name, parsed[option.get(name, name)], default)
            compared.append(name)
    assert "dtype" in compared and ("seq_len" in compared or command == "lm-eval"), compared


def test_the_settings_a_command_builds_have_their_own_defaults():
    """The options a command turns into a settings object (heal's loss and homotopy, LoRA's rank, alpha and targets)
    default to that object's own defaults: what `hf-tangent heal` builds without options equals HealSettings() and
    LoraSettings()."""
    import dataclasses

    from hf_tangent.experiments.finetune import LoraSettings
    from hf_tangent.experiments.heal import HealSettings

    _, parsers = cli.build_parser()
    lora = {"lora_r": LoraSettings().r, "lora_alpha": LoraSettings().alpha, "lora_targets": list(LoraSettings().targets)}
    for command in ("heal", "finetune"):
        parsed = vars(parsers[command].parse_args([]))
        assert {k: parsed[k] for k in lora} == lora, command
    parsed = vars(parsers["heal"].parse_args([]))
    settings = dataclasses.asdict(HealSettings())
    assert {k: parsed[k] for k in settings} == settings


def test_heal_and_finetune_pass_the_settings_objects_their_options_declare(tmp_path):
    """heal's loss and homotopy options are HealSettings' fields and the LoRA options LoraSettings' (with `lora_`):
    declared once, in those dataclasses (help included); the command passes the very objects a Python caller would
    build from the same values (a list of targets kept as the tuple LoraSettings holds)."""
    from hf_tangent.commands.arguments import dataclasses_of
    from hf_tangent.experiments.finetune import LoraSettings
    from hf_tangent.experiments.heal import HealSettings

    _, parsers = cli.build_parser()
    passed = {}
    for argv in (["heal", "--temperature", "2", "--stages", "2", "--lora-r", "4", "--lora-targets", "q_proj",
                  "--seeds", "3"], ["finetune", "--lora-alpha", "8", "--method", "full", "--updates", "projected"]):
        parser = parsers[argv[0]]
        args = parser.parse_args([*argv[1:], "--output_dir", str(tmp_path / "out")])
        made = dataclasses_of(parser, args)  # model, text, calibration text, *own, training
        own, training = made[3:-1], made[-1]
        options = parser.get_default("func").__wrapped__.keywords["options"]  # what run_training calls
        passed[argv[0]] = options(*own, training)
    assert passed["heal"]["settings"] == HealSettings(temperature=2.0, stages=2)
    assert passed["heal"]["lora"] == LoraSettings(r=4, targets=("q_proj",)) and passed["heal"]["seeds"] == [3]
    assert passed["finetune"]["lora"] == LoraSettings(alpha=8) and passed["finetune"]["method"] == "full"
    assert passed["finetune"]["rules"] == ["projected"]
    assert LoraSettings(targets=["q_proj"]).targets == ("q_proj",)
    helps = {a.dest: a.help for a in parsers["heal"]._actions}
    for cls, prefix in ((HealSettings, ""), (LoraSettings, "lora_")):
        for f in dataclasses.fields(cls):
            assert helps[prefix + f.name] == f.metadata["help"].replace("%", "%%"), f.name


@pytest.mark.parametrize("argv, command, message", [
    (["eval", "--device", "cuda"], "eval", "CUDA is not available here"),
    (["eval", "--device", "gpu0"], "eval", "is not a device"),
    (["ablate", "--bootstrap", "0"], "ablate", "--bootstrap 0 is out of range; accepted: an integer >= 1"),
    (["eval", "--seq-len", "1"], "eval", "--seq-len 1 is out of range; accepted: an integer >= 2"),
    (["eval", "--updates", "projectd"], "eval", "invalid choice: 'projectd'"),
    (["eval", "--max-window", "2"], "eval", "unrecognized arguments: --max-window 2"),  # no abbreviations
])
def test_bad_options_are_one_line_errors(common, capsys, argv, command, message):
    if argv[0] == "eval" and torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("this machine has CUDA")
    code, err = run([argv[0], *common, *argv[1:]], capsys)
    assert_user_error(code, err, command, message)


def test_output_dir_that_is_a_file_fails_before_the_run(common, tmp_path, capsys, monkeypatch):
    import hf_tangent.experiments.evaluate as evaluate

    monkeypatch.setattr(evaluate, "evaluate_rules", lambda *a, **k: pytest.fail("ran before checking the output dir"))
    (tmp_path / "taken").write_text("a file")
    code, err = run(["eval", *common, "--output-dir", str(tmp_path / "taken")], capsys)
    assert_user_error(code, err, "eval", "is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "a file"


def test_non_utf8_text_is_named(common, tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    code, err = run(["eval", *common, "--text-files", str(bad)], capsys)
    assert_user_error(code, err, "eval", f"text file {bad} is not UTF-8 text (byte 3")


@pytest.mark.parametrize("recipe, message", [
    ("max_steps: [3\n", "is not valid YAML"),
    ("- just\n- a list\n", "must be a YAML mapping"),
    # a value of the wrong type: the words of every door (core/options.py), after the file's name
    ("save_patch: \"false\"\n", "save_patch='false' has the wrong type (str); accepted: true or false."),
    ("max_steps: three\n", "max_steps='three' has the wrong type (str); accepted: an integer >= 1."),
    ("seq_len: 3.5\n", "seq_len=3.5 has the wrong type (float); accepted: an integer >= 2."),
    ("compare_updates: projected\n", "compare_updates='projected' has the wrong type (str); accepted: a list."),
    ("compare_updates: [projectd]\n", "compare_updates='projectd' is not one of the choices; accepted: one of 'unpatched', 'add',"),
    ("command: eval\n", "is for `eval`, not `calibrate`"),
    ("max_step: 3\n", "key 'max_step' is not an option of `calibrate`"),
])
def test_recipe_errors_name_the_file_and_key(common, tmp_path, capsys, recipe, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    code, err = run(["calibrate", *common, "--recipe", str(path)], capsys)
    assert_user_error(code, err, "calibrate", message)
    if "accepted" in message:
        assert f"recipe {path}: {message}" in err


def test_recipe_booleans_and_the_command_line_wins(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("command: calibrate\nsave_patch: false\nmax_steps: 7\nseq_len: 64\ncompare_updates: [projected]\n")
    args = cli.parse_args(["calibrate", "--recipe", str(path), "--seq-len", "32"])
    assert args.save_patch is False and args.max_steps == 7 and args.seq_len == 32
    assert args.compare_updates == ["projected"]
    assert cli.parse_args(["calibrate", "--recipe", str(path), "--save-patch"]).save_patch is True
    with pytest.raises(SystemExit):
        cli.parse_args(["calibrate", "--recipe", str(tmp_path / "missing.yaml")])


KEPT_REPORTS = sorted(str(p.relative_to(DOCS / "results")) for p in (DOCS / "results").rglob("*.json")
                      if "command" in json.loads(p.read_text()) and p.with_suffix(".md").is_file())
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?:e[-+]?\d+)?")


def _values(data) -> list[float]:
    if isinstance(data, dict):
        return [v for item in data.values() for v in _values(item)]
    if isinstance(data, list):
        return [v for item in data for v in _values(item)]
    return [float(data)] if isinstance(data, (int, float)) and not isinstance(data, bool) else []


@pytest.mark.parametrize("name", KEPT_REPORTS)
def test_kept_report_pages_are_in_sync_with_their_json(name):
    """docs/results/**.md are what the renderer makes of the JSON kept beside them today (a page
    edited by hand, or a renderer changed without regenerating the pages, fails here)."""
    def text(markdown):  # the kept pages link renamed plot files: compare everything but image links
        return [line for line in markdown.splitlines() if not line.startswith("![")]

    report = Report.load(DOCS / "results" / name)
    kept = (DOCS / "results" / name).with_suffix(".md").read_text(encoding="utf-8")
    assert text(report.to_markdown()) == text(kept)


@pytest.mark.parametrize("name", KEPT_REPORTS)
def test_every_number_on_a_kept_report_page_is_in_its_json(name):
    """Independent of the renderer: each decimal number on the page is a value of the JSON (to the
    digits printed), a difference from the report's reference value (heal: the unpatched NLL), or a
    published value the page quotes (experiments.report.PAPER_MEAN_GATES)."""
    from hf_tangent.experiments.report import PAPER_MEAN_GATES

    data = json.loads((DOCS / "results" / name).read_text())
    values = _values(data)
    values += [v - data["unpatched_nll"] for v in values] if "unpatched_nll" in data else []
    quoted = set(NUMBER.findall(PAPER_MEAN_GATES))
    page = (DOCS / "results" / name).with_suffix(".md").read_text(encoding="utf-8")
    unknown = []
    # "k (p%)" cells: p must be 100 k / n for a count n of the JSON (a share of the row's total)
    counts = {int(v) for v in values if float(v).is_integer() and v > 0}
    for k, p in re.findall(r"(\d+) \((\d+\.\d)%\)", page):
        if not any(abs(100 * int(k) / n - float(p)) <= 0.05 for n in counts):
            unknown.append(f"{k} ({p}%)")
    page = re.sub(r"(\d+) \((\d+\.\d)%\)", r"\1", page)
    for number in NUMBER.findall(page):
        mantissa = number.split("e")[0]
        digits = len(mantissa.split(".")[1])
        x = float(number)
        tolerance = 0.5 * 10 ** -digits * (abs(x) / float(mantissa) if "e" in number and float(mantissa) else 1) + 1e-12
        if number not in quoted and not any(abs(v - x) <= tolerance or abs(-v - x) <= tolerance for v in values):
            unknown.append(number)
    assert not unknown, f"{name}: numbers on the page that are not in its JSON: {unknown}"


def test_report_load_refuses_what_is_not_a_report(tmp_path):
    (tmp_path / "x.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not an hf-tangent report"):
        Report.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(ValueError, match="not a readable report.json"):
        Report.load(tmp_path / "y.json")


def test_eval_command_writes_its_files(common, tmp_path, capsys):
    code, _ = run(["eval", *common, "--updates", "projected"], capsys)
    assert code == 0
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert report["command"] == "eval" and [r["variant"] for r in report["rows"]] == ["unpatched", "projected"]
    assert (out / "report.md").read_text() == Report.load(out / "report.json").to_markdown()


def test_a_refused_run_creates_no_output_folder(common, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    code, err = run(["calibrate", *common, "--output-dir", str(out), "--layers", "9"], capsys)
    assert_user_error(code, err, "calibrate", "out of range")
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    code, err = run(["eval", *common, "--output-dir", str(tmp_path / "file" / "sub")], capsys)
    assert_user_error(code, err, "eval", "is a file, not a folder")


# ----------------------------------------------------------------------------- HF_TANGENT_SMOKE
def test_smoke_caps_the_command_line_and_leaves_smaller_values(monkeypatch, capsys):
    """The documented commands run in CI at a smoke size: HF_TANGENT_SMOKE=1 caps each size option the command has
    (arguments.SMOKE), keeps a value already below its cap, and says so on stderr."""
    monkeypatch.setenv("HF_TANGENT_SMOKE", "1")
    args = cli.parse_args(["calibrate", "--max_steps", "60", "--seq_len", "256", "--max_windows", "1",
                           "--learning_rate", "0.5", "--compare_updates", "projected", "add"])
    assert (args.max_steps, args.seq_len, args.max_windows, args.train_windows) == (2, 64, 1, 6)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 1)
    assert args.learning_rate == 0.5 and args.compare_updates == ["projected", "add"]  # not sizes
    assert capsys.readouterr().err == (
        "HF_TANGENT_SMOKE=1: sizes capped (max_steps 60 -> 2, seq_len 256 -> 64, train_windows 64 -> 6, "
        "per_device_train_batch_size 8 -> 2, per_device_eval_batch_size 8 -> 2)\n")
    assert cli.parse_args(["lm-eval"]).limit == 2  # None: every item
    assert cli.parse_args(["lm-eval", "--limit", "1"]).limit == 1


def test_smoke_caps_a_recipe_and_says_so_where_nothing_is_capped(monkeypatch, capsys):
    monkeypatch.setenv("HF_TANGENT_SMOKE", "1")
    args = cli.parse_args(["calibrate", "--recipe", "offline_default"])
    assert (args.max_steps, args.seq_len, args.max_windows, args.train_windows) == (2, 64, 2, 6)
    assert len(args.compare_updates) == 9 and args.save_steps == 20
    assert capsys.readouterr().err.startswith("HF_TANGENT_SMOKE=1: sizes capped (max_steps 60 -> 2, max_windows 16 -> 2")
    cli.parse_args(["export", "--patch", "p", "--output", "o"])
    assert capsys.readouterr().err == "HF_TANGENT_SMOKE=1: sizes capped (none above the smoke size)\n"
    monkeypatch.setenv("HF_TANGENT_SMOKE", "0")
    assert cli.parse_args(["calibrate", "--recipe", "offline_default"]).max_steps == 60
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1"])
def test_smoke_refuses_another_value(monkeypatch, capsys, value):
    monkeypatch.setenv("HF_TANGENT_SMOKE", value)
    code, err = run(["eval"], capsys)
    assert_user_error(code, err, "eval", f"HF_TANGENT_SMOKE={value!r} is not accepted; accepted: unset, '', 0 (full "
                                         "size) or 1 (every size capped to a smoke run).")


def test_smoke_table_names_options_and_reaches_the_run(common, tmp_path, capsys, monkeypatch):
    """Every entry of SMOKE is an option of some command (a renamed option would silently stop being capped), and
    the capped value is what runs: eval's 8 windows become 2 (report: 2 windows of 31 predicted tokens)."""
    from hf_tangent.commands.arguments import SMOKE

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from studies import commands  # the checkout's `python -m studies`: hf-tangent's command line, smoke sizes included

    parsers = {**cli.build_parser()[1], **cli.build_parser(commands=commands.COMMANDS)[1]}
    options = {a.dest for p in parsers.values() for a in p._actions}
    assert set(SMOKE) <= options, sorted(set(SMOKE) - options)
    monkeypatch.setenv("HF_TANGENT_SMOKE", "1")
    argv = ["eval", *common, "--updates", "projected"]
    argv[argv.index("--max-windows") + 1] = "8"
    code, err = run(argv, capsys)
    assert code == 0 and "HF_TANGENT_SMOKE=1: sizes capped (max_windows 8 -> 2)" in err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["tokens_per_variant"] == 2 * 31


def test_rule_tables_and_plots_take_any_row(tmp_path):
    """The fresh-eyes review of issue 60: a NaN or huge delta NLL (an fp16 overflow) made the plot, drawn before
    the report files, fail the whole save; a report of the unpatched model alone linked a plot never drawn; a
    perplexity that rounds to 1e4 was printed as 10000.00."""
    from hf_tangent.experiments.report import perplexity_text

    assert [perplexity_text(p) for p in (35.174, 9999.994, 9999.996, 2926224549.558, float("nan"))] == [
        "35.17", "9999.99", "1.00e+04", "2.93e+09", "nan"]
    data = json.loads((DOCS / "results" / "eval_smollm2.json").read_text())
    data["rows"][1].update(delta_nll=float("nan"), nll=float("nan"), perplexity=float("nan"))
    data["rows"][2].update(delta_nll=1e300)
    Report("eval", data).save(tmp_path / "odd")
    assert (tmp_path / "odd" / "rule_deltas.png").is_file() and "| nan | nan |" in (tmp_path / "odd" / "report.md").read_text()
    Report("eval", {**data, "rows": data["rows"][:1]}).save(tmp_path / "alone")
    assert not (tmp_path / "alone" / "rule_deltas.png").exists()
    assert "rule_deltas.png" not in (tmp_path / "alone" / "report.md").read_text()


ANALYSES = {"ablate": "ablate", "diagnose": "diagnose_layers", "parallel-sweep": "parallel_sweep",
            "critical": "critical", "pressure": "pressure", "ffn-jacobian": "ffn_jacobian"}


@pytest.mark.parametrize("command", list(ANALYSES))
def test_an_analysis_commands_own_options_are_its_functions_parameters(command, capsys, monkeypatch):
    """One declaration per option (issue 59, item 4): the analysis commands' own options are made from the keyword
    parameters of the function they run: the same names, defaults, ranges' words and the docstring's help."""
    import inspect

    import hf_tangent as ht
    from hf_tangent.commands.arguments import SHARED_PARAMETERS
    from hf_tangent.ranges import options_of

    function = getattr(ht, ANALYSES[command])
    parser = cli.build_parser()[1][command]
    own = parser.dataclass_types[-1]
    parameters = {name: p.default for name, p in inspect.signature(function).parameters.items()
                  if p.kind is p.KEYWORD_ONLY and name not in SHARED_PARAMETERS}
    actions = {a.dest: a for a in parser._actions}
    assert [f.name for f in dataclasses.fields(own)] == list(parameters)
    for name, default in parameters.items():
        assert actions[name].default == (list(default) if isinstance(default, tuple) else default), name
        api, cli_option = options_of(function)[name], options_of(own)[name]
        if api.range is not None:
            assert cli_option.accepted == api.accepted, name
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: the help as the docstring says it
    out = " ".join(_help_text(command, capsys).split())
    doc = " ".join((inspect.getdoc(function) or "").split())
    for field in dataclasses.fields(own):
        text = field.metadata["help"]
        assert text in out and text.split(": ")[0] in doc, (field.name, text)


def _help_text(command, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return capsys.readouterr().out


def test_an_undocumented_parameter_cannot_become_an_option():
    from hf_tangent.commands.arguments import options_dataclass
    from hf_tangent.ranges import validated

    @validated()
    def probe(model, *, text=None, steps: int = 3, depth: int = 2):
        """A probe.

        Args:
            steps: how many
                steps, in all
        """

    with pytest.raises(TypeError, match="probe: parameter 'depth' is not in its docstring's Args"):
        options_dataclass(probe, __name__)

    @validated()
    def documented(model, *, text=None, steps: int = 3, depth: int = 2, width: int = 1, height: int = 4):
        """A probe.

        Args: as the other analyses, and

            model, text: the shared ones
            steps (int): how many
                steps, in all

            depth:
                how deep
            width: how wide, counted
            the way the paper counts
            height: how high
        """

    fields = {f.name: f.metadata["help"] for f in dataclasses.fields(options_dataclass(documented, __name__))}
    assert fields == {"steps": "how many steps, in all", "depth": "how deep",
                      "width": "how wide, counted the way the paper counts", "height": "how high"}

    @validated()
    def misread(model, *, steps: int = 3):
        """A probe whose continuation line looks like an entry.

        Args:
            steps: how many; refined
            values: are read as a parameter
        """

    with pytest.raises(TypeError, match=r"misread: its docstring's Args name \['values'\], which are not its"):
        options_dataclass(misread, __name__)

    with pytest.raises(TypeError, match=r"documented: \['heigth'\] are not keyword parameters with a default"):
        options_dataclass(documented, __name__, names=("steps", "heigth"))

    @validated()
    def required(model, *, steps: int):
        """A probe.

        Args:
            steps: how many
        """

    with pytest.raises(TypeError, match="required: parameter 'steps' has no default, which an option needs"):
        options_dataclass(required, __name__)


def test_the_generated_options_classes_pickle_and_refuse_what_their_function_refuses():
    """A command's options made from its function are module-level classes (they pickle, as the hand-written ones
    did) and check their values with the function's options: a typo in a choice is refused by the class too."""
    import pickle

    from hf_tangent.commands.analyses import AblateArguments
    from hf_tangent.ranges import ChoiceError

    for parser in cli.build_parser()[1].values():
        for cls in parser.dataclass_types:
            if cls.__module__.startswith("hf_tangent.commands") and cls.__name__ != "ExportArguments":
                assert pickle.loads(pickle.dumps(cls())) == cls(), cls
    with pytest.raises(ChoiceError, match=r"variants=\['typo'\] has 'typo', not one of the choices"):
        AblateArguments(variants=["typo"])


@pytest.mark.parametrize("function, option, value", [
    ("ablate", "variants", ["full", "no_such_ablation"]), ("diagnose_layers", "update", "no such rule"),
    ("critical", "protocol", "papers")])
def test_a_choice_the_command_line_refuses_the_python_call_refuses_before_loading_a_model(function, option, value):
    """The choices are the function's annotation (a Literal), so ht.ablate(variants=[...]) refuses an unknown name
    in the command line's words, before the model name is looked up (it used to load first, and fail later)."""
    import hf_tangent as ht
    from hf_tangent.ranges import ChoiceError

    with pytest.raises(ChoiceError, match=f"{option}=.* (is not one|has 'no_such_ablation', not one) of the choices; "
                                          "accepted: .*(one of|values among) '"):
        getattr(ht, function)("/nonexistent/hf_tangent_choice_probe", **{option: value})


@pytest.mark.parametrize("command, key, value, words", [
    ("ablate", "variants", ["full", "typo", "x"], "has 'typo', 'x', none of the choices; accepted: a non-empty list of "
     "values among"),
    ("ablate", "variants", ["full", 5], "has the wrong type"),
    ("diagnose", "update", 5, "has the wrong type (int); accepted: one of 'unpatched'"),
    ("diagnose", "update", True, "has the wrong type (bool); accepted: one of 'unpatched'"),
    ("diagnose", "update", "typo", "is not one of the choices; accepted: one of 'unpatched'"),
    ("critical", "protocol", 3, "has the wrong type (int); accepted: one of 'refined', 'paper'."),
    ("critical", "protocol", None, "has the wrong type (NoneType); accepted: one of 'refined', 'paper'."),
    ("lm-eval", "backend", None, "has the wrong type (NoneType); accepted: one of 'hf', 'vllm'.")])
def test_a_recipe_and_the_api_refuse_a_choice_in_the_same_words(command, key, value, words, tmp_path, capsys):
    import yaml

    import hf_tangent as ht
    from hf_tangent.ranges import RangeError

    function = {"ablate": ht.ablate, "diagnose": ht.diagnose_layers, "critical": ht.critical, "lm-eval": ht.lm_eval}[command]
    with pytest.raises(RangeError) as api:
        function("/nonexistent/hf_tangent_choice_probe", **{key: value})
    assert words in str(api.value)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"command": command, key: value}))
    code, err = run([command, "--recipe", str(recipe), "--output-dir", str(tmp_path / "out")], capsys)
    assert_user_error(code, err, command, words)
    assert str(api.value).split("; accepted: ")[1] in err and not (tmp_path / "out").exists()
    if "none of the choices" in words or value is None:  # the very same sentence through both doors
        assert err.strip().endswith(f"recipe {recipe}: {api.value}")


def test_lm_eval_model_folders_take_none_and_an_empty_list_as_no_folders(tmp_path):
    """--model_folders was `list | None` on the command line and a list in the API: one declaration takes both."""
    import yaml

    import hf_tangent as ht
    from hf_tangent.ranges import options_of

    for value in (None, [], ["a/folder"]):
        options_of(ht.lm_eval)["model_folders"].check(value)
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({"command": "lm-eval", "model_folders": value}))
        assert cli.parse_args(["lm-eval", "--recipe", str(recipe)]).model_folders == value


@pytest.mark.parametrize("text, hint", [("save_strategy: no", "write 'no' in quotes"),
                                        ("save_strategy: off", "write 'no' in quotes"),
                                        ("logging_strategy: yes", None)])
def test_a_yaml_boolean_for_a_choice_says_to_quote_it(text, hint, tmp_path, capsys):
    """YAML 1.1 reads `save_strategy: no` (the Trainer's own value) as false: refused as a bool, as before, and the
    error says why and what to write, where a choice is the word YAML turned into a boolean."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"command: calibrate\n{text}\n")
    code, err = run(["calibrate", "--recipe", str(recipe), "--output-dir", str(tmp_path / "out")], capsys)
    assert_user_error(code, err, "calibrate", "has the wrong type (bool); accepted: one of 'no', 'steps'")
    assert (hint in err) if hint else "in quotes" not in err
    recipe.write_text(f"command: calibrate\n{text.split(':')[0]}: 'no'\n")
    assert cli.parse_args(["calibrate", "--recipe", str(recipe)]).__dict__[text.split(":")[0]] == "no"
