"""The hostile review of issue 32's validation, one test per defect (each failed before its fix): the
refusals come before any work (the model unpatched, the folders unchanged), in one message that names
the option, the value and what is accepted. The generic side is in tests/sweeps/option_walk.py."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "sweeps"))
import option_walk as walk  # noqa: E402
from conftest import AUSTEN, tiny_smollm2_llama  # noqa: E402

import hf_tangent as ht  # noqa: E402
from hf_tangent import cli  # noqa: E402
from hf_tangent.commands.arguments import dataclasses_of  # noqa: E402
from hf_tangent.ranges import ChoiceError, DType, OptionTypeError, RangeError, numeric, options_of  # noqa: E402

MISSING = walk.MISSING_MODEL


def _text():
    return ht.TextSource(text_files=(str(AUSTEN / "emma.txt"),), calibration_files=(str(AUSTEN / "prideprejudice.txt"),))


def _one_step(tmp_path, **fields):
    return ht.TangentTrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, use_cpu=True,
                                       per_device_train_batch_size=1, per_device_eval_batch_size=1, **fields)


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- 1, 2: calibrate_gates
def test_calibrate_a_nameless_model_without_a_patch_repo(tmp_path):
    model, tokenizer = tiny_smollm2_llama()
    assert not model.config._name_or_path
    report = ht.calibrate_gates(model, tokenizer, text=_text(), seq_len=16, max_windows=1, train_windows=1,
                                training_args=_one_step(tmp_path), progress=False)
    assert "patch_folder" not in report.data and set(report["gates"]) == {"0", "1"}


def test_calibrate_a_nameless_model_with_a_patch_repo_is_refused_before_patching(tmp_path):
    model, tokenizer = tiny_smollm2_llama()
    with pytest.raises(ValueError, match=r"config\._name_or_path is empty"):
        ht.calibrate_gates(model, tokenizer, text=_text(), seq_len=16, max_windows=1, train_windows=1,
                           training_args=_one_step(tmp_path), save_patch=tmp_path / "patch", progress=False)
    assert ht.get_config(model) is None and not (tmp_path / "patch").exists()


@pytest.mark.parametrize("option", ["save_patch", "save_model"])
def test_calibrate_checks_its_folders_before_any_work(tmp_path, option):
    model, tokenizer = tiny_smollm2_llama()
    model.config._name_or_path = "tiny"
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("my notes", encoding="utf-8")
    before = _tree(user)
    with pytest.raises(ValueError, match=rf"hf_tangent\.calibrate_gates\({option}=\).*notes\.txt"):
        ht.calibrate_gates(model, tokenizer, text=_text(), seq_len=16, max_windows=1, train_windows=1,
                           training_args=_one_step(tmp_path), progress=False, **{option: user})
    assert ht.get_config(model) is None and _tree(user) == before and not (tmp_path / "run").exists()


def test_calibrate_checks_the_repo_id_before_any_work(tmp_path):
    model, tokenizer = tiny_smollm2_llama()
    model.config._name_or_path = "tiny"
    with pytest.raises(ValueError, match=r"push_to_hub='bad//id!!' is not a hub repo id .*accepted: 'name' or "
                                         r"'namespace/name'"):
        ht.calibrate_gates(model, tokenizer, text=_text(), seq_len=16, max_windows=1, train_windows=1,
                           training_args=_one_step(tmp_path), push_to_hub="bad//id!!", progress=False)
    assert ht.get_config(model) is None and not (tmp_path / "run").exists()


def test_heal_and_finetune_check_their_run_folders_before_any_work(tmp_path):
    from hf_tangent.experiments.runs import RunFolder

    args = _one_step(tmp_path)
    with RunFolder(args.output_dir):  # an earlier run's folder, with a file of the user's in a patch folder
        patch_dir = Path(args.output_dir) / "runs" / "seed0" / "patch"
        patch_dir.mkdir(parents=True)
        (patch_dir / "mine.txt").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"hf_tangent\.heal.*mine\.txt"):
        ht.heal(MISSING, ht.TangentConfig(update="projected"), seeds=[0], save_models=True, training_args=args)
    folder = Path(args.output_dir) / "runs" / "projected-seed0" / "patch"
    folder.mkdir(parents=True)
    (folder / "mine.txt").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"hf_tangent\.finetune.*mine\.txt"):
        ht.finetune(MISSING, rules=["projected"], seeds=[0], save_models=True, training_args=args)


# ----------------------------------------------------------------------------- 3: no unannotated option
def test_an_annotation_that_does_not_resolve_fails_loudly():
    from hf_tangent.ranges import validated

    @validated()
    def broken(x: NoSuchType = 1):  # noqa: F821
        return x

    with pytest.raises(TypeError, match="do not resolve"):
        broken(x=2)


# ----------------------------------------------------------------------------- 4: overrides
# ----------------------------------------------------------------------------- 5, 6: the command line and recipes
def _parse(argv):
    """(dataclasses, None) or (None, the error line) for a command line, without running the command."""
    err = io.StringIO()
    try:
        studies = argv[0] in walk.STUDY_COMMANDS  # the checkout's `python -m studies`
        with contextlib.nullcontext() if studies else walk._one_parser(), contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            args = cli.parse_args(argv, commands=walk.study_commands.COMMANDS) if studies else cli.parse_args(argv)
            return dataclasses_of(args.parser, args), None
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1]
    except ValueError as exc:  # CommandError from dataclasses_of
        return None, str(exc)


def test_save_total_limit_none_is_reachable(tmp_path):
    out = str(tmp_path / "out")
    for argv in (["calibrate", f"--output_dir={out}", "--save_total_limit", "None"],
                 ["calibrate", f"--output_dir={out}", "--recipe", str(_recipe(tmp_path, "save_total_limit: null"))]):
        made, error = _parse(argv)
        assert error is None, error
        assert next(d for d in made if hasattr(d, "save_total_limit")).save_total_limit is None
    made, error = _parse(["calibrate", f"--output_dir={out}", "--save_total_limit", "0"])
    assert "--save-total-limit 0 is out of range; accepted: an integer >= 1, or None." in error
    with pytest.raises(RangeError, match=r"save_total_limit=0 is out of range"):
        ht.TangentTrainingArguments(save_total_limit=0)


def _recipe(tmp_path, text):
    path = tmp_path / f"recipe{len(list(tmp_path.glob('recipe*')))}.yaml"
    path.write_text(text + "\n", encoding="utf-8")
    return path


TEXTS = ("1e-3", "5", "0", "-1", "1.5", "nan", "inf", "abc", "None")


def test_the_command_line_and_a_recipe_give_the_same_answer_for_the_same_text(tmp_path):
    """Every numeric option of every command: `--name TEXT` and `name: TEXT` in a recipe are both accepted
    (with the same value) or both refused (saying the same accepted values, or the very same words where
    the Trainer's own cross-field check refuses)."""
    out = str(tmp_path / "out")
    compared = 0
    problems = []
    for command, parser in walk.command_parsers().items():
        seen = set()
        for cls in parser.dataclass_types:
            for option in options_of(cls).values():
                if not numeric(option.hint) or option.name in seen or option.range is None:
                    continue
                seen.add(option.name)
                as_list = not walk.matches(0, option.hint)
                base = [command, *walk.COMMAND_POSITIONALS.get(command, []), f"--output_dir={out}"]
                for text in TEXTS:
                    on_line, line_error = _parse([*base, f"--{option.name}={text}"])
                    yaml_text = f"[{text}]" if as_list else text
                    recipe = _recipe(tmp_path, f"{option.name}: {yaml_text}")
                    in_recipe, recipe_error = _parse([*base, "--recipe", str(recipe)])
                    compared += 1
                    if (line_error is None) != (recipe_error is None):
                        problems.append(f"{command} {option.name}={text}: line {line_error}, recipe {recipe_error}")
                    elif line_error is None:
                        a = [getattr(d, option.name) for d in on_line if hasattr(d, option.name)]
                        b = [getattr(d, option.name) for d in in_recipe if hasattr(d, option.name)]
                        if a != b:
                            problems.append(f"{command} {option.name}={text}: {a} vs {b}")
                    elif line_error != recipe_error and not (option.accepted in line_error and
                                                             option.accepted in recipe_error):
                        problems.append(f"{command} {option.name}={text}: {line_error} / {recipe_error}")
    assert compared > 1000 and not problems, "\n".join(problems[:30])


def test_learning_rate_1e_3_in_a_recipe(tmp_path):
    made, error = _parse(["calibrate", f"--output_dir={tmp_path / 'out'}", "--recipe",
                          str(_recipe(tmp_path, "learning_rate: 1e-3"))])
    assert error is None and next(d for d in made if hasattr(d, "learning_rate")).learning_rate == 1e-3


# ----------------------------------------------------------------------------- 7: empty lists
@pytest.mark.parametrize("call, words", [
    (lambda: ht.heal(MISSING, ht.TangentConfig(update="projected"), seeds=[]), r"seeds=\[\] is empty; accepted: a "
     r"non-empty list of integers >= 0 and <= 4294967295\."),
    (lambda: ht.finetune(MISSING, seeds=[]), r"seeds=\[\] is empty"),
    (lambda: ht.ablate(MISSING, variants=[]), r"variants=\[\] is empty; accepted: a non-empty list of values among 'full', "
     r"'zero_ffn', 'radial_only', 'tangential_only', 'attention_zero'\."),
    (lambda: ht.diagnose_layers(MISSING, layers=[]), r"layers=\[\] is empty"),
    (lambda: ht.parallel_sweep(MISSING, random_seeds=[]), r"random_seeds=\[\] is empty"),
])
def test_an_empty_list_that_means_nothing_is_refused(call, words):
    with pytest.raises(RangeError, match=words):
        call()


def test_an_empty_rules_list_is_documented():
    option = options_of(ht.evaluate_rules)["rules"]
    assert option.empty.startswith("only the unpatched model") and not option.nonempty


# ----------------------------------------------------------------------------- 8: dtype
@pytest.mark.parametrize("dtype", ["banana", "float64", "torch.float32"])
def test_dtype_is_one_of_the_command_lines_choices(dtype):
    """A string that is no choice is refused as such (a ValueError); a torch.dtype, which the docs never
    pass, as the wrong type (a TypeError); by name and with a model object alike."""
    import torch

    value = torch.float32 if dtype == "torch.float32" else dtype
    error, problem = (OptionTypeError, r"has the wrong type \(dtype\)") if dtype == "torch.float32" else \
        (ChoiceError, r"is not one of the choices")
    words = rf"dtype={value!r} {problem}; accepted: one of 'float32', 'bfloat16', 'float16'\."
    with pytest.raises(error, match=words.replace("torch.float32", r"torch\.float32")):
        ht.evaluate_rules(MISSING, dtype=value)
    model, tokenizer = tiny_smollm2_llama()
    with pytest.raises(error, match=r"accepted: one of 'float32', 'bfloat16', 'float16'\."):
        ht.evaluate_rules(model, tokenizer, dtype=value)


# ----------------------------------------------------------------------------- 9: ints beyond float range
def test_huge_ints_are_out_of_range():
    with pytest.raises(RangeError, match=r"budget=100000000000\.\.\.\(401 digits\) is out of range; accepted: a "
                                         r"finite number >= 0\."):
        ht.parallel_sweep(MISSING, budget=10**400)
    with pytest.raises(RangeError, match=r"threshold=100000000000\.\.\.\(401 digits\) is out of range"):
        ht.critical(MISSING, threshold=10**400)


# ----------------------------------------------------------------------------- 10: changed options objects
def test_an_options_object_is_checked_again_when_received(tmp_path):
    args = _one_step(tmp_path)
    args.learning_rate = math.nan
    with pytest.raises(RangeError, match=r"training_args\.learning_rate=nan is out of range; accepted: a finite number >= 0\."):
        ht.calibrate_gates(MISSING, training_args=args)
    settings = ht.HealSettings()
    settings.temperature = math.nan
    with pytest.raises(RangeError, match=r"settings\.temperature=nan is out of range"):
        ht.heal(MISSING, ht.TangentConfig(update="projected"), settings=settings)
    lora = ht.LoraSettings()
    lora.r = -3
    with pytest.raises(RangeError, match=r"lora\.r=-3 is out of range; accepted: an integer >= 1\."):
        ht.heal(MISSING, ht.TangentConfig(update="projected"), lora=lora)
    settings = ht.HealSettings()
    settings.method = "banana"
    with pytest.raises(ChoiceError, match=r"settings\.method='banana' is not one of the choices; accepted: one of "
                                          r"'lora', 'full'\."):
        ht.heal(MISSING, ht.TangentConfig(update="projected"), settings=settings)


# ----------------------------------------------------------------------------- the weaker ones
def test_path_objects_are_accepted_where_a_path_is_meant(tmp_path):
    with pytest.raises(Exception) as info:  # accepted: ends at loading the missing model
        ht.ffn_jacobian(MISSING, ablation_report=tmp_path / "report.json")
    assert not isinstance(info.value, RangeError)


def test_numpy_scalars_reach_the_function_as_plain_numbers():
    import numpy as np

    from hf_tangent.ranges import validated

    @validated()
    def seen(seq_len: int = 2, budget: float = 0.0, seeds: list[int] = (0,)):
        return seq_len, budget, seeds

    out = seen(seq_len=np.int64(4), budget=np.float32(0.5), seeds=[np.int32(1)])
    assert out == (4, 0.5, [1]) and [type(v) for v in (out[0], out[1], out[2][0])] == [int, float, int]


def test_numpy_scalars_in_the_options_dataclasses_are_kept_as_plain_numbers(tmp_path):
    """Issue 47: LoraSettings, HealSettings and TangentTrainingArguments kept numpy scalars as given (PEFT's
    save of LoRA r=np.int64(2) failed: 'Object of type int64 is not JSON serializable'; HealSettings(stages=
    np.int64(1)) was refused later by the homotopy). Made, or changed and then passed, each keeps a Python
    number, as the command line's dataclasses and TangentConfig do."""
    import numpy as np

    from hf_tangent.ranges import check_ranges

    lora = ht.LoraSettings(r=np.int64(2), alpha=np.int32(4))
    settings = ht.HealSettings(temperature=np.float32(2.0), lm_weight=np.float64(0.5), stages=np.int64(2))
    args = _one_step(tmp_path, learning_rate=np.float32(0.5), weight_decay=np.float64(0.25), seed=np.int64(3))
    kept = [lora.r, lora.alpha, settings.temperature, settings.lm_weight, settings.stages, args.learning_rate,
            args.weight_decay, args.seed]
    assert kept == [2, 4, 2.0, 0.5, 2, 0.5, 0.25, 3]
    assert [type(v) for v in kept] == [int, int, float, float, int, float, float, int]
    settings.temperature = np.float32(0.5)  # changed after it was made: kept plain when a function checks it again
    check_ranges(settings, prefix="settings.")
    assert type(settings.temperature) is float and settings.temperature == 0.5


def test_tangent_layer_index_type_and_short_messages():
    from transformers import TrainingArguments

    from hf_tangent.core.layer import TangentLayer

    with pytest.raises(TypeError, match=r"index='0' has the wrong type \(str\)"):
        TangentLayer(ht.TangentConfig(update="projected"), "0", update=True, parallel=False)
    with pytest.raises(OptionTypeError) as info:
        ht.calibrate_gates(MISSING, training_args=TrainingArguments(output_dir=os.devnull + "-x", use_cpu=True))
    assert str(info.value) == ("training_args=<TrainingArguments object> has the wrong type (TrainingArguments); "
                               "accepted: a TangentTrainingArguments, or None.")
    assert "LoraSettings" in ht.__all__ and ht.LoraSettings().r == 8


def test_a_report_writes_numbers_of_any_kind_as_json_numbers(tmp_path):
    """A numpy scalar in a report's data was written to report.json as a string ('0.5'), silently: written as
    a number now (a path or a dtype still as its str)."""

    import numpy as np

    from hf_tangent.experiments.report import Report

    rows = [{"variant": "unpatched", "nll": np.float32(1.0), "perplexity": np.float64(2.718), "delta_nll": 0.0,
             "delta_perplexity": 0.0, "tokens": np.int64(10), "config": None}]
    Report("eval", {"command": "eval", "model": "m", "text": tmp_path / "t.txt", "seq_len": np.int64(8), "windows": 1,
                    "tokens_per_variant": 10, "seconds": 0.1, "rows": rows, "unpatched_is": "the model", "device": "cpu",
                    "dtype": "float32", "seed": 0, "threads": 1, "torch": "x", "hf_tangent_version": "x", "python": "x",
                    "peak_rss_gb": 0.1}).save(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (saved["seq_len"], saved["rows"][0]["nll"], saved["rows"][0]["tokens"]) == (8, 1.0, 10)
    assert [type(v) for v in (saved["seq_len"], saved["rows"][0]["nll"], saved["rows"][0]["tokens"])] == [int, float, int]
    assert saved["text"] == str(tmp_path / "t.txt")


# ----------------------------------------------------------------------------- issue 59: enum members
def test_an_enum_member_is_kept_as_its_value(tmp_path):
    """Issue 59's probe: a str enum member passed the check (U.P == 'projected') and was kept as str(U.P), 'U.P'
    (the recipe then refused its own 'U.P'); kept as its value now, through a recipe function (a list option
    too) and an options dataclass, and report.json stores that value."""
    import enum

    from hf_tangent.ranges import validated

    class U(str, enum.Enum):
        P = "projected"

    class Method(str, enum.Enum):
        FULL = "full"

    D = enum.Enum("D", {"BF16": "bfloat16"}, type=str)

    @validated()
    def seen(update: str = "add", variants: list[str] = ("add",), dtype: DType = "float32"):
        return update, variants, dtype

    out = seen(update=U.P, variants=[U.P, "add"], dtype=D.BF16)
    assert out == ("projected", ["projected", "add"], "bfloat16")
    assert [type(v) for v in (out[0], out[1][0], out[2])] == [str, str, str]
    settings = ht.HealSettings(method=Method.FULL)
    assert settings.method == "full" and type(settings.method) is str
    model, tokenizer = tiny_smollm2_llama()
    report = ht.diagnose_layers(model, tokenizer, text=_text(), update=U.P, seq_len=16, max_windows=1, progress=False)
    report.save(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "report.json").read_text())["update"] == "projected"
    assert ht.get_config(model) is None  # diagnose_layers undid its patch


def test_a_tangent_config_keeps_an_enum_member_as_its_value(tmp_path):
    """Issue 59's probe, in the core: ht.TangentConfig(update=U.P) stored str(U.P), 'U.P' (core/options.plain);
    its value now, in the config, its dict, a list field and a saved folder's record."""
    import enum

    class U(str, enum.Enum):
        P = "projected"

    class B(str, enum.Enum):
        FFN = "ffn"

    class Odd(str, enum.Enum):  # its text passes the check; its value is another thing (the review's case)
        P = 3

        def __new__(cls, value):
            member = str.__new__(cls, "projected")
            member._value_ = value
            return member

    assert ht.TangentConfig(update=Odd.P).update == "projected"  # what was checked is what is kept (was the int 3)
    config = ht.TangentConfig(update=U.P, branches=[B.FFN])
    assert config.update == "projected" and type(config.update) is str
    assert config.to_dict()["update"] == "projected" and list(config.to_dict()["branches"]) == ["ffn"]
    model, _ = tiny_smollm2_llama()
    ht.patch(model, config).save_pretrained(tmp_path / "folder")
    record = json.loads((tmp_path / "folder" / "config.json").read_text())["hf_tangent"]["config"]
    assert record["update"] == "projected" and record["branches"] == ["ffn"]


@pytest.mark.parametrize("patched", [False, True], ids=["plain folder", "patched folder"])
def test_a_truncated_weights_file_is_one_error_line_not_a_traceback(tmp_path, capsys, patched):
    """Issue 59's probe: a truncated model.safetensors raised safetensors' SafetensorError (not an OSError) through
    the command line as a traceback; now one `hf-tangent eval: error: ...` line naming the folder."""
    model, tokenizer = tiny_smollm2_llama()
    if patched:
        ht.patch(model, ht.TangentConfig(update="projected"))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (tmp_path / "t.txt").write_text((AUSTEN / "emma.txt").read_text(encoding="utf-8")[:4000], encoding="utf-8")
    code = cli.main(["eval", "--model", str(tmp_path / "m"), "--text_files", str(tmp_path / "t.txt"), "--updates",
                     "projected", "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    expected = (f"hf_tangent.from_pretrained: {weights}: not a readable safetensors file (" if patched else
                f"hf_tangent: could not load model '{tmp_path / 'm'}': a weights file is damaged (")
    assert err[-1].startswith("hf-tangent eval: error: " + expected), err[-1]


def _saved_patched_folder(folder: Path):
    """A tiny patched model saved with its tokenizer into `folder`: (folder, tokenizer)."""
    model, tokenizer = tiny_smollm2_llama()
    ht.patch(model, ht.TangentConfig(update="projected"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def _questions_on_stdin(monkeypatch, answer: str) -> list:
    """What is asked on stdin from here on (each question answered `answer`)."""
    import builtins

    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or answer)
    return asked


@pytest.mark.parametrize("config", ["not json", "a number", "a string record", "a null record"])
def test_a_damaged_config_json_is_one_error_line_and_a_damaged_record_is_not_loaded_plain(tmp_path, capsys, config):
    """load_model reads a local folder's config.json as the loader does (serialization.saved_record; holds_record
    went): a config.json that is not JSON or not an object is one `error:` line (a JSON number was a traceback), and
    a record that is not a mapping, or null, is the patched folder's loader's to refuse, never loaded as an unpatched
    model with its gates dropped (a review found 5c68edf loading the null one so)."""
    path = _saved_patched_folder(tmp_path / "m")[0] / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text({"not json": "{not json", "a number": "3",
                     "a string record": json.dumps({**data, "model_type": "llama", "hf_tangent": "projected"}),
                     "a null record": json.dumps({**data, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "hf_tangent": None})}[config], encoding="utf-8")
    (tmp_path / "t.txt").write_text((AUSTEN / "emma.txt").read_text(encoding="utf-8")[:4000], encoding="utf-8")
    code = cli.main(["eval", "--model", str(tmp_path / "m"), "--text_files", str(tmp_path / "t.txt"), "--updates",
                     "projected", "--output_dir", str(tmp_path / "out"), "--max_windows", "1", "--seq_len", "32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err) and not (tmp_path / "out").exists()
    expected = {"not json": "not a valid JSON file", "a number": "must be a JSON object (a model's config), got int",
                "a string record": "field 'hf_tangent' must be a mapping, got str",
                "a null record": "holds no hf_tangent patch (config.json has no 'hf_tangent' entry, only null)"}[config]
    assert err[-1].startswith("hf-tangent eval: error: ") and expected in err[-1], err[-1]


def test_loading_a_saved_patched_folder_asks_nothing_on_stdin(tmp_path, monkeypatch):
    """load_model (every command's --model) of a complete patched folder: transformers' AutoTokenizer read its
    config.json, which names the folder's remote code, and asked "Do you wish to run the custom code? [y/N]" on
    stdin (waiting 15 s on a terminal; reading a line of a pipe) although the tokenizer runs no code (older)."""
    folder, tokenizer = _saved_patched_folder(tmp_path / "m")
    asked = _questions_on_stdin(monkeypatch, "n")
    loaded, loaded_tokenizer = ht.load_model(str(folder))
    assert not asked and ht.get_config(loaded) is not None
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_lm_eval_reads_a_model_folders_tokenizer_asking_nothing_on_stdin(tmp_path, monkeypatch):
    """lm_eval's check that a --model_folders entry ships the same tokenizer asked the same question on stdin of a
    complete patched folder (older)."""
    from hf_tangent.experiments.downstream import _check_vocabularies

    model, tokenizer = tiny_smollm2_llama()
    folder, _ = _saved_patched_folder(tmp_path / "m")
    asked = _questions_on_stdin(monkeypatch, "n")
    _check_vocabularies(model, tokenizer, "base", [str(folder)])
    assert not asked


def test_a_peft_adapter_folder_without_config_json_still_loads_as_transformers_loads_it(tmp_path):
    """load_model of a local folder with no config.json (a plain PEFT LoRA adapter folder) goes to transformers, which
    loads the base and the adapter; a review found 5c68edf refusing it ("no config.json")."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base, tokenizer = tiny_smollm2_llama()
    base.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")  # the adapter records where its base is
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "lora")
    tokenizer.save_pretrained(tmp_path / "lora")
    x = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        expected = lora(x).logits
    model, _ = ht.load_model(str(tmp_path / "lora"))
    with torch.no_grad():
        assert torch.allclose(model(x).logits, expected, atol=1e-5)


def _custom_tokenizer_folder(path: Path) -> Path:
    """A plain model folder whose tokenizer is code of its own (tokenizer_config.json's auto_map)."""
    model, tokenizer = tiny_smollm2_llama()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "tokenization_custom.py").write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                                                 "class CustomTok(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "CustomTok", "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTok"]}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_tokenizer_with_code_of_its_own_loads_as_its_owner_allows(tmp_path, monkeypatch):
    """The review of c3b1507 (which read every tokenizer with trust_remote_code=False): a plain folder's tokenizer
    with code of its own is transformers' to ask about again (the user answers y), and a patch repo's base tokenizer
    runs its code when base_trust_remote_code=True says so, nothing asked (c3b1507 refused both, and for the patch
    repo no argument got past it)."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = _custom_tokenizer_folder(tmp_path / "custom")
    asked = _questions_on_stdin(monkeypatch, "y")
    _, tokenizer = ht.load_model(str(folder))
    assert type(tokenizer).__name__ == "CustomTok" and len(asked) == 1
    from transformers import AutoModelForCausalLM

    model = ht.patch(AutoModelForCausalLM.from_pretrained(folder), ht.TangentConfig(update="projected"))
    repo = ht.save_patch(model, tmp_path / "repo", base_model=str(folder))
    asked.clear()
    loaded, tokenizer = ht.load_model(str(repo), base_trust_remote_code=True)
    assert type(tokenizer).__name__ == "CustomTok" and not asked and ht.get_config(loaded) is not None
