"""The walk over every option of every door (issue 32): each public recipe function (`ht.*` returning a
Report) and each options dataclass (the public ones, every command's, and every dataclass a recipe
function takes), found by introspection, so that a new option is walked without editing this file.

Every numeric option (int, float, a list of them) is probed with 0, -1, NaN, +inf, -inf, 10**400
(beyond float range) and a string; every other typed option with a value of another type; every list
option with [] (refused unless its default is empty or the owner's `empty` / `EMPTY` says what it
means). An options object a recipe function takes (TangentTrainingArguments, HealSettings, ...) is
also made valid, then changed field by field to NaN / a wrong type, and passed: the function checks
it again. run_study(overrides=) is probed key by key like an option of the key's type. A probe is
  ok     accepted, and documented: its Range accepts it (the Range's words are what the error of a
         refused value says; TangentConfig's too, checked by the same core/options.py);
  clear  refused with one RangeError (OptionTypeError for a type) naming the option, the value and
         what is accepted, before any work: the API functions are called with a model name that does
         not exist, so a value checked late would end in a model-loading error instead.
The command line (and a recipe YAML file) is walked the same way for every numeric option of every
command, and must refuse with exit code 2 and the very words the API uses for what is accepted.

The checkout's studies/ (`python -m studies`, run_study) is walked with the package's doors.

Used by tests/test_option_walk.py and by the hostile sweep's `options` group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import math
import sys
import tempfile
import typing
from pathlib import Path

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.experiments.report import Report

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's studies/ (not shipped)
from hf_tangent.ranges import Option, RangeError, hints_of, listed, matches, numeric, options_of, shown  # noqa: E402
from studies import commands as study_commands  # noqa: E402
from studies import study  # noqa: E402

STUDY_COMMANDS = ("study", "study-report")  # their errors: `python -m studies <command>: error: ...`

MISSING_MODEL = "/nonexistent/hf_tangent_option_walk_model"
NUMBER_PROBES = (0, -1, math.nan, math.inf, -math.inf, 10**400, "1")
WRONG_TYPES = ("fast", 3, [1], {"x": 1}, 2.5)  # the first one the option's type refuses is its wrong-type probe
# Required parameters of the recipe functions, filled with a valid value.
REQUIRED = {"model": MISSING_MODEL, "tangent": ht.TangentConfig(update="projected"), "study": "noise"}
# Extra arguments that make an accepted value end at a cheap check after the options (not in a study or lm-eval's index)
FAIL_FAST = {"run_study": {"scale_name": "no-such-scale"}, "lm_eval": {"include_path": "/nonexistent/tasks"}}
# Options with no annotation (so no type check) fail the walk; these wait for their owner's file:
# lm_eval lives in hf_tangent/experiments/downstream.py (the lm-eval work), as does its `dtype: str`.
UNANNOTATED_PENDING: set[str] = set()
DTYPE_PENDING: set[str] = set()
# the recipe function each command calls (a CLI option with the same name must say what the API says)
COMMAND_FUNCTIONS = {"eval": "evaluate_rules", "calibrate": "calibrate_gates", "finetune": "finetune",
                     "diagnose": "diagnose_layers", "ablate": "ablate", "sensitivity": "layer_sensitivity",
                     "parallel-sweep": "parallel_sweep", "study": "run_study", "heal": "heal", "critical": "critical",
                     "pressure": "pressure", "ffn-jacobian": "ffn_jacobian", "lm-eval": "lm_eval",
                     "export": None, "study-report": None, "lm-eval-merge": None}
COMMAND_POSITIONALS = {"study": ["noise"]}
# Report-returning functions with no options to walk: merge_lm_eval takes only the reports to merge
# (its hostile cases: hostile_inputs.lm_eval_cases and tests/test_lm_eval.py).
NOT_RECIPES = {"merge_lm_eval"}


@dataclasses.dataclass
class Case:
    door: str  # api, dataclass, cli, recipe
    owner: str  # function / class / command name
    option: str
    value: typing.Any
    accepted: str  # what the option accepts
    refused: bool  # the value must be refused
    run: typing.Callable  # () -> (outcome, detail)

    @property
    def name(self) -> str:
        return f"{self.door} {self.owner}({self.option}={shown(self.value)})"


# ----------------------------------------------------------------------------- discovery
def api_functions() -> dict[str, typing.Callable]:
    """Every public `ht.*` function that returns a Report (the recipes)."""
    out = {}
    for name in ht.__all__:
        obj = getattr(ht, name)
        if inspect.isfunction(obj) and typing.get_type_hints(obj).get("return") is Report and name not in NOT_RECIPES:
            out[name] = obj
    return out | {"run_study": study.run_study}


def _dataclasses_in(hint) -> list[type]:
    found = [hint] if isinstance(hint, type) and dataclasses.is_dataclass(hint) else []
    return found + [d for arg in typing.get_args(hint) for d in _dataclasses_in(arg)]


def command_parsers() -> dict:
    return cli.build_parser()[1] | cli.build_parser(commands=study_commands.COMMANDS)[1]


def options_dataclasses() -> dict[str, type]:
    """The public options dataclasses, every command's, and every dataclass a recipe function takes."""
    found = [getattr(ht, n) for n in ht.__all__ if isinstance(getattr(ht, n), type)
             and dataclasses.is_dataclass(getattr(ht, n)) and any(numeric(o.hint) for o in _fields(getattr(ht, n)).values())]
    for parser in command_parsers().values():
        found += list(parser.dataclass_types)
    for function in api_functions().values():
        found += [d for name, hint in typing.get_type_hints(function).items() if name != "return"
                  for d in _dataclasses_in(hint)]
    return {cls.__name__: cls for cls in dict.fromkeys(found)}


def _fields(cls) -> dict:
    return options_of(cls)


def probes(option) -> list:
    """0, -1, NaN, +-inf and a string for a numeric option (in a list for a list option); a value of
    another type for any other typed option."""
    empty = [[]] if listed(option.hint) else []
    if numeric(option.hint):
        as_list = not matches(0, option.hint) and matches([0], option.hint)
        return [[v] if as_list and not isinstance(v, str) else v for v in NUMBER_PROBES] + empty
    if option.hint is typing.Any:
        return []
    return [next(v for v in WRONG_TYPES if not matches(v, option.hint))] + empty


def _refused(option, value) -> bool:
    if not matches(value, option.hint):
        return True
    if isinstance(value, (list, tuple)) and not value and listed(option.hint):
        return option.nonempty
    if option.range is None or value is None:
        return False
    return any(not option.range.accepts(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _type_checks_all(cls) -> bool:
    """Whether a dataclass checks the type of every field (TrainingArguments: only the numeric ones)."""
    return getattr(cls, "RANGES_ALL_TYPES", True)


# ----------------------------------------------------------------------------- one probe
def _clear(err: Exception, option: str, value, accepted: str, owner: str = "") -> tuple[str, str]:
    """One RangeError that names the option (an options class may name itself: `TangentConfig.beta`), the
    value and what the option accepts."""
    text = str(err)
    name = getattr(err, "name", None)
    good = isinstance(err, RangeError) and name in (option, f"{owner}.{option}") and err.accepted == accepted and \
        f"{name}={shown(value)}" in text
    return ("clear" if good else "unclear"), f"{type(err).__name__}: {text}"


def _api_case(fname, function, option, value) -> Case:
    required = {p.name: REQUIRED[p.name] for p in inspect.signature(function).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD and p.name != option.name}
    refused = _refused(option, value)

    def run():
        kwargs = {} if refused else FAIL_FAST.get(fname, {})
        try:
            function(**required, **kwargs, **{option.name: value})
        except RangeError as err:
            if not refused and err.name == option.name:
                return "silent wrong", f"an accepted value refused: {err}"
            if refused:
                return _clear(err, option.name, value, option.accepted)
            return "ok", f"accepted; then {type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001
            if refused:
                return "crash", f"not refused before the work: {type(err).__name__}: {err}"
            return "ok", f"accepted; then {type(err).__name__}: {str(err)[:80]}"
        return ("silent wrong", "accepted") if refused else ("ok", "accepted")

    return Case("api", fname, option.name, value, option.accepted, refused, run)


def _dataclass_case(cls, option, value, scratch: Path) -> Case:
    refused = _refused(option, value)
    base = {"output_dir": str(scratch / "out")} if "output_dir" in {f.name for f in dataclasses.fields(cls)} else {}

    def run():
        try:
            cls(**{**base, option.name: value})
        except (ValueError, TypeError) as err:
            if refused:
                return _clear(err, option.name, value, option.accepted, cls.__name__)
            if not isinstance(err, RangeError) and option.name in str(err):  # the class's own cross-field check
                return "ok", f"accepted by its range; then {type(err).__name__}: {err}"
            return "silent wrong", f"an accepted value refused: {type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001
            return "crash", f"{type(err).__name__}: {err}"
        return ("silent wrong", "accepted") if refused else ("ok", "accepted by its range")

    return Case("dataclass", cls.__name__, option.name, value, option.accepted, refused, run)


def _cli_case(command, option, value, scratch: Path, recipe: bool, dests) -> Case:
    """A refused value on the command line (`--name=value`; a word for the wrong type) or in a recipe;
    the other options point at a model and a scale that do not exist, so a value that is wrongly
    accepted ends at once instead of running the command."""
    if isinstance(value, str):
        value = "abc"  # "1" is a valid number on the command line: a word is the wrong type there
    if value == [] and not recipe:
        raise ValueError("an empty list is no command-line probe")
    words = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    argv = [command, *COMMAND_POSITIONALS.get(command, [])]
    argv += [f"--{dest}={safe}" for dest, safe in (("model", MISSING_MODEL), ("output_dir", str(scratch / "out")),
                                                     ("scale", "no-such-scale")) if dest in dests]
    if recipe:
        path = scratch / f"{command}-{option.name}-{len(list(scratch.iterdir()))}.yaml"
        path.write_text(f"{option.name}: {_yaml(value)}\n", encoding="utf-8")
        argv += ["--recipe", str(path)]
    else:
        argv += [f"--{option.name}={words[0]}", *words[1:]]

    def run():
        err, studies = io.StringIO(), command in STUDY_COMMANDS
        try:
            with contextlib.nullcontext() if studies else _one_parser(), contextlib.redirect_stderr(err), \
                    contextlib.redirect_stdout(io.StringIO()):
                code = study_commands.main(argv) if studies else cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except Exception as exc:  # noqa: BLE001
            return "crash", f"{type(exc).__name__}: {exc}"
        lines = err.getvalue().strip().splitlines()
        last = lines[-1] if lines else ""
        dashed = option.name.replace("_", "-")
        named = f"--{dashed}" in last or f"--{option.name}" in last or f": {option.name}=" in last
        if code != 2:
            return ("silent wrong" if code == 0 else "crash"), f"exit {code}: {last}"
        prog = "python -m studies" if studies else "hf-tangent"
        good = last.startswith(f"{prog} {command}: error: ") and named and f"{option.accepted}." in last
        return ("clear" if good else "unclear"), last

    return Case("recipe" if recipe else "cli", command, option.name, value, option.accepted, True, run)


_PARSER: list = []


@contextlib.contextmanager
def _one_parser():
    """cli.main with the parser built once (building all of them takes ~0.1 s a call): a recipe's
    defaults, set on a subcommand's parser, are put back afterwards."""
    if not _PARSER:
        _PARSER.append(cli.build_parser())
    parser, subparsers = _PARSER[0]
    saved = {name: (dict(sub._defaults), [(a, a.default) for a in sub._actions]) for name, sub in subparsers.items()}
    original, cli.build_parser = cli.build_parser, lambda: (parser, subparsers)
    try:
        yield
    finally:
        cli.build_parser = original
        for name, sub in subparsers.items():
            sub._defaults = saved[name][0]
            for action, default in saved[name][1]:
                action.default = default


def _yaml(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    return str(value)


def _ranged_classes(hint) -> list[type]:
    """The options classes (a RANGES table) an option of type `hint` takes."""
    return [d for d in _dataclasses_in(hint) if isinstance(getattr(d, "RANGES", None), dict)]


def _changed_object_cases() -> list[Case]:
    """An options object made valid, then one field changed (NaN for a number, a wrong type for
    another), passed to every recipe function that takes it: refused as `<option>.<field>=...`."""
    out = []
    for fname, function in api_functions().items():
        for option in options_of(function).values():
            for cls in _ranged_classes(option.hint):
                for field in options_of(cls).values():
                    if not (numeric(field.hint) or _type_checks_all(cls)) or listed(field.hint):
                        continue
                    value = math.nan if numeric(field.hint) else next(v for v in WRONG_TYPES if not matches(v, field.hint))
                    out.append(_changed_case(fname, function, option.name, cls, field, value))
    return out


def _changed_case(fname, function, name, cls, field, value) -> Case:
    required = {p.name: REQUIRED[p.name] for p in inspect.signature(function).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD and p.name != name}
    qualified = f"{name}.{field.name}"

    def run():
        with tempfile.TemporaryDirectory() as tmp:
            obj = cls(output_dir=str(Path(tmp) / "out")) if "output_dir" in {f.name for f in dataclasses.fields(cls)} \
                else cls()
            object.__setattr__(obj, field.name, value)
            try:
                function(**required, **{name: obj})
            except RangeError as err:
                return _clear(err, qualified, value, field.accepted)
            except Exception as err:  # noqa: BLE001
                return "crash", f"not refused before the work: {type(err).__name__}: {err}"
        return "silent wrong", "accepted"

    return Case("api", fname, qualified, value, field.accepted, True, run)


def _override_cases() -> list[Case]:
    """run_study(overrides={key: value}): each budget key probed like an option of its type and range
    (a list is never a number, nor a string)."""
    out = []
    for key, limit in study.BUDGET_RANGES.items():
        option = Option(key, int if limit.integer else float, limit)
        for value in (*NUMBER_PROBES, [5], [], 5):
            out.append(_override_case(option, value))
    return out


def _override_case(option, value) -> Case:
    refused = _refused(option, value)

    def run():
        # a refused value must stop before the scale's checks; an accepted one ends at the documents' check
        try:
            study.run_study("noise", "smoke", overrides={option.name: value}, train_docs=["x"])
        except RangeError as err:
            if not refused:
                return "silent wrong", f"an accepted value refused: {err}"
            return _clear(err, option.name, value, option.accepted)
        except Exception as err:  # noqa: BLE001
            if refused:
                return "crash", f"not refused before the work: {type(err).__name__}: {err}"
            return "ok", f"accepted; then {type(err).__name__}: {str(err)[:80]}"
        return "silent wrong", "ran"

    return Case("api", "run_study.overrides", option.name, value, option.accepted, refused, run)


# ----------------------------------------------------------------------------- the walk
def covered() -> dict[str, list[str]]:
    """door -> 'owner.option' for every option the walk probes."""
    out = {"api": [], "dataclass": [], "cli": []}
    for fname, function in api_functions().items():
        out["api"] += [f"{fname}.{n}" for n, o in options_of(function).items() if probes(o)]
    for cname, cls in options_dataclasses().items():
        out["dataclass"] += [f"{cname}.{n}" for n, o in _fields(cls).items()
                             if probes(o) and (numeric(o.hint) or _type_checks_all(cls))]
    for command, parser in command_parsers().items():
        out["cli"] += [f"{command}.{n}" for cls in parser.dataclass_types for n, o in options_of(cls).items()
                       if numeric(o.hint)]
    return out


def unannotated(owner) -> list[str]:
    """The options of a function or dataclass with no annotation (so no type check): the walk fails on any."""
    names = [f.name for f in dataclasses.fields(owner) if f.init] if dataclasses.is_dataclass(owner) else [
        n for n, p in inspect.signature(owner).parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [n for n in names if n not in hints_of(owner)]


def unannotated_options() -> list[str]:
    """'owner.option' for every public option without an annotation (recipe functions, options dataclasses)."""
    out = [f"{name}.{option}" for name, fn in api_functions().items() for option in unannotated(fn)]
    return out + [f"{name}.{option}" for name, cls in options_dataclasses().items() for option in unannotated(cls)]


def _unannotated_case(qualified: str) -> Case:
    owner, option = qualified.split(".", 1)
    return Case("api", owner, option, None, None, True,
                lambda: ("unannotated", "no annotation: its values are not type-checked; annotate it"))


def cases(scratch: Path, doors=("api", "dataclass", "cli", "recipe")) -> list[Case]:
    out = []
    if "api" in doors:
        out += [_unannotated_case(name) for name in unannotated_options() if name not in UNANNOTATED_PENDING]
        for fname, function in api_functions().items():
            for option in options_of(function).values():
                out += [_api_case(fname, function, option, v) for v in probes(option)]
        out += _changed_object_cases() + _override_cases()
    if "dataclass" in doors:
        for cls in options_dataclasses().values():
            for option in _fields(cls).values():
                if numeric(option.hint) or _type_checks_all(cls):
                    out += [_dataclass_case(cls, option, v, scratch) for v in probes(option)]
    for door in ("cli", "recipe"):
        if door not in doors:
            continue
        for command, parser in command_parsers().items():
            seen = set()
            for cls in parser.dataclass_types:
                for option in options_of(cls).values():
                    if not numeric(option.hint) or option.name in seen:
                        continue
                    seen.add(option.name)
                    dests = {a.dest for a in parser._actions}
                    out += [_cli_case(command, option, v, scratch, door == "recipe", dests) for v in probes(option)
                            if _refused(option, v) and (door == "recipe" or v != [])]
    return out


def run_walk(doors=("api", "dataclass", "cli", "recipe")) -> list[tuple[Case, str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        return [(case, *case.run()) for case in cases(Path(tmp), doors)]
