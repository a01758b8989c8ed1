"""What the commands share: option dataclasses (HfArgumentParser turns their fields into options,
help text included), YAML recipes, and the checks that run before any expensive work.

A recipe is a YAML mapping whose keys are the command's option names (`seq_len` or `seq-len`);
every value is checked against its option's type before anything runs, and options given on the
command line win over the recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import operator
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal

import torch

from ..artifacts.models import DEFAULT_MODEL, OFFLINE_MODELS
from ..core.destinations import DestinationError
from ..core.options import ChoiceError, ListChoiceError, OptionTypeError, _same_kind
from ..experiments.runs import claim_run_folder, in_run_folder
from ..ranges import TEXT_RANGES, DType, Option, Range, RangeError, at_least, check_ranges, matches, options_of, shown
from ..training import data
from ..training.data import TextSource

DOCS = "https://github.com/hf-tangent/hf_tangent/blob/main/docs/"  # the help names pages by URL: a wheel has no docs/


class CommandError(ValueError):
    """A user error found by a command: printed as one `hf-tangent <command>: error: ...` line."""


class Checked:
    """Base of the option dataclasses: `RANGES` (field -> ranges.Range) is checked when an instance
    is made, so the command line, recipes and the Python API refuse the same values."""

    RANGES: ClassVar[dict[str, Range]] = {}

    def __post_init__(self):
        check_ranges(self)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ModelArguments(Checked):
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": f"hub id, local folder, or an offline name ({', '.join(OFFLINE_MODELS)})"})
    dtype: DType = field(default="float32", metadata={"help": "weights dtype"})


@dataclass
class RunArguments(Checked):
    """Where and how a command that trains nothing runs."""

    RANGES: ClassVar[dict[str, Range]] = {"batch_size": at_least(1)}

    output_dir: str = field(default="runs/latest", metadata={"help": "where report.json, report.md and plots go"})
    device: str = field(default_factory=_default_device, metadata={"help": "cpu, cuda, cuda:1, ..."})
    seed: int = field(default=0, metadata={"help": "random seed"})
    batch_size: int = field(default=1, metadata={"help": "windows per forward pass"})


@dataclass
class EvalTextArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = {k: TEXT_RANGES[k] for k in ("seq_len", "max_windows")}

    text_files: list[str] | None = field(default=None, metadata={
        "help": "local UTF-8 text files to evaluate on (default: the held-out Austen novels)"})
    dataset: str | None = field(default=None, metadata={
        "help": "hub dataset to evaluate on: wikitext-2, wikitext-103, openwebtext-10k or a hub path"})
    dataset_split: str = field(default="test", metadata={"help": "evaluation split of --dataset"})
    seq_len: int = field(default=512, metadata={"help": "tokens per window"})
    max_windows: int = field(default=8, metadata={"help": "held-out windows evaluated (per held-out domain with the mixed corpus)"})


@dataclass
class CalibrationTextArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = {"train_windows": at_least(1)}

    calibration_files: list[str] | None = field(default=None, metadata={
        "help": "calibration / training text files (default: the Austen calibration novels; with --text-files "
                "only, the first 80% of its documents)"})
    train_windows: int = field(default=64, metadata={"help": "calibration / training windows of --seq-len tokens"})
    corpus: Literal["austen", "mixed"] | None = field(default=None, metadata={
        "help": "the offline text where none is given: austen (the novels) or mixed (the novels and English prose "
                "from Debian packages, each domain split by document); default: mixed for heal, austen for calibrate and "
                "finetune. heal reports every held-out domain of the mixed corpus either way. "
                f"See {DOCS}recipes.md#the-mixed-corpus"})


def text_source(text: EvalTextArguments | None, calibration: CalibrationTextArguments | None = None,
                corpus: str | None = None) -> TextSource:
    tuple_or_none = lambda v: tuple(v) if v else None  # noqa: E731
    return TextSource(text_files=tuple_or_none(text and text.text_files), dataset=text and text.dataset,
                      dataset_split=text.dataset_split if text else "test",
                      calibration_files=tuple_or_none(calibration and calibration.calibration_files),
                      corpus=corpus or getattr(calibration, "corpus", None))


# ----------------------------------------------------------------------------- checks before work
def check_device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise CommandError(f"--device {device!r} is not a device ({err}); accepted: cpu, cuda, cuda:N, mps.") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {device}: CUDA is not available here (torch.cuda.is_available() is False); "
                           "use --device cpu.")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise CommandError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices.")


def check_output_dir(path: str) -> None:
    """The output folder is writable (or can be created) and is not someone else's (new, empty, or an
    earlier run's: experiments.runs.claim_run_folder): checked before the run, not after it, and without
    creating anything, so that a run refused later leaves the user's files as they were."""
    try:
        claim_run_folder(path, writer="--output-dir")
    except DestinationError as err:
        raise CommandError(str(err)) from None


def check_text_files(*groups) -> None:
    try:
        data.check_text_files([name for group in groups for name in (group or [])])
    except (FileNotFoundError, ValueError) as err:
        raise CommandError(str(err)) from None


def preflight(*groups, output_dir: str | None = None, device: str | None = None) -> None:
    """Every check that needs no model (the ranges were checked when the options were made): device,
    output folder, text files."""
    if device is not None:
        check_device(device)
    for group in groups:
        check_text_files(getattr(group, "text_files", None), getattr(group, "calibration_files", None))
        if getattr(group, "text_files", None) and getattr(group, "dataset", None):
            raise CommandError("pass --text-files or --dataset, not both.")
    if output_dir is not None:
        check_output_dir(output_dir)


# What the shared dataclasses (and the command itself: model, text) declare for every analysis.
SHARED_PARAMETERS = frozenset({"model", "tokenizer", "text", "seq_len", "max_windows", "batch_size", "dtype", "device",
                               "seed", "progress"})


_ENTRY = re.compile(r"(?P<names>\w+(?:, \w+)*)(?: \([^)]*\))?:(?: (?P<text>.*))?")  # `a, b: text`, `a (int): text`


def documented(function) -> dict[str, str]:
    """Each parameter's help in `function`'s docstring: the lines `name: text` after the one that starts with
    `Args:` (`a, b: text` documents both), each continued on the lines below it that are indented deeper or are not
    of that form; blank lines are skipped and a line indented less ends the section. A name that is not a parameter
    of `function` raises (a continuation line read as an entry)."""
    lines = (inspect.getdoc(function) or "").splitlines()
    helps, names, indent = {}, [], None
    for line in lines[next((i + 1 for i, line in enumerate(lines) if line.startswith("Args:")), len(lines)):]:
        depth = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        indent = depth if indent is None else indent
        if depth < indent or depth == 0:
            break
        entry = _ENTRY.fullmatch(line.strip()) if depth == indent else None
        if entry is not None:
            names = entry["names"].split(", ")
            helps.update(dict.fromkeys(names, entry["text"] or ""))
        for name in names if entry is None else ():
            helps[name] = f"{helps[name]} {line.strip()}".strip()
    unknown = sorted(set(helps) - set(inspect.signature(function).parameters))
    if unknown:
        raise TypeError(f"{function.__name__}: its docstring's Args name {unknown}, which are not its parameters")
    return helps


def _command_type(hint, help: str) -> tuple:
    """The annotation as HfArgumentParser reads it, and the field's metadata: a path is given as a str
    (`str | os.PathLike | None` -> `str | None`), a tuple as a list; `list[Literal[...]]` -> `list[str]`, the
    literals its choices; choices with a space in them ('soft beta=0.5') are listed in the help, after a NAME."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and os.PathLike in args:
        hint = functools.reduce(operator.or_, [a for a in args if a is not os.PathLike])
    item = typing.get_args(hint)[0] if typing.get_origin(hint) in (list, tuple) else None
    hint = hint if item is None else list[item]
    metadata = {"help": help}
    if typing.get_origin(item) is Literal:
        hint, metadata["choices"] = list[str], list(typing.get_args(item))
    choices = metadata.get("choices") or [c for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is Literal
                                          for c in typing.get_args(a)]
    if any(" " in str(choice) for choice in choices):
        metadata |= {"help": f"{help}: {'; '.join(choices)}", "metavar": "NAME"}
    return hint, metadata


def _option(name: str, hint, help: str, default) -> tuple:
    """A field of a command's options dataclass (a list default copied for each instance)."""
    hint, metadata = _command_type(hint, help)
    return name, hint, (field(default_factory=functools.partial(list, default), metadata=metadata)
                        if isinstance(default, (list, tuple)) else field(default=default, metadata=metadata))


def options_dataclass(function, module: str, *, skip: frozenset[str] = SHARED_PARAMETERS,
                      names: tuple[str, ...] | None = None) -> type:
    """The command's own options, made from the recipe function it runs: each keyword parameter not in `skip` (or
    each of `names`), with its annotation, its default, its help (the docstring's Args) and its checks (the
    function's: `__options_of__`). One declaration: the function's; the command line, a recipe file and the Python
    call refuse the same values in the same words. `module` is the command's, which binds the class to its name
    there (so that it pickles)."""
    hints, helps, fields = typing.get_type_hints(function), documented(function), []
    parameters = inspect.signature(function).parameters
    keywords = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY and p.default is not p.empty]
    if names is not None and set(names) - set(keywords):
        raise TypeError(f"{function.__name__}: {sorted(set(names) - set(keywords))} are not keyword parameters with a "
                        "default (what an option is)")
    for name, parameter in parameters.items():
        if parameter.kind is not parameter.KEYWORD_ONLY or (name in skip if names is None else name not in names):
            continue
        if parameter.default is parameter.empty:
            raise TypeError(f"{function.__name__}: parameter {name!r} has no default, which an option needs")
        if name not in helps:
            raise TypeError(f"{function.__name__}: parameter {name!r} is not in its docstring's Args (a command's help)")
        fields.append(_option(name, hints[name], helps[name], parameter.default))
    title = "".join(word.title() for word in function.__name__.split("_"))
    return dataclasses.make_dataclass(f"{title}Arguments", fields, bases=(Checked,),
                                      namespace={"__options_of__": function, "__module__": module})


def prefixed(cls, prefix: str, module: str) -> type:
    """An options dataclass's fields as command-line options under `prefix` (LoraSettings.r -> --lora_r): the same
    types, defaults, help (its fields' metadata) and ranges; `.settings()` makes the `cls` they stand for."""
    hints = typing.get_type_hints(cls)
    fields = [_option(prefix + f.name, hints[f.name], f.metadata["help"],
                      f.default if f.default is not dataclasses.MISSING else f.default_factory())
              for f in dataclasses.fields(cls) if f.init]

    def settings(self):
        return cls(**{name.removeprefix(prefix): value for name, value in vars(self).items()})

    return dataclasses.make_dataclass(f"{cls.__name__}Arguments", fields, bases=(Checked,), namespace={
        "RANGES": {prefix + k: v for k, v in getattr(cls, "RANGES", {}).items()}, "settings": settings,
        "__module__": module})


def experiment_command(subparsers, name: str, help: str, experiment, own, docs: str | None = None, extra=(), **run):
    """A command that runs one experiment (`experiment`, a recipe function) on held-out text: the model, the text, the
    run, `extra` dataclasses and its own options (`own`: options_dataclass(experiment), or a dataclass of the
    command's); `run`: run_experiment's keywords."""
    return add_command(subparsers, name, (ModelArguments, EvalTextArguments, RunArguments, *extra, own), help,
                       functools.partial(run_experiment, experiment=experiment, **run), docs=docs,
                       recipe_function=experiment)


def run_experiment(args, experiment, *, options=dataclasses.asdict, text=None) -> int:
    """Run `experiment` (a function of experiments/) for an experiment_command: the model, the text (`text(text, own)`;
    default: the held-out text and an extra dataclass's calibration files), the run's shared sizes it takes, and
    `options(own)` (default: every field of the command's own options, under its name); its report saved into
    --output_dir."""
    model, text_args, run, *extra, own = dataclasses_of(args.parser, args)
    preflight(text_args, run, *extra, own, output_dir=run.output_dir, device=run.device)
    shared = {"seq_len": text_args.seq_len, "max_windows": text_args.max_windows, "batch_size": run.batch_size,
              "dtype": model.dtype, "device": run.device, "seed": run.seed}
    taken = inspect.signature(experiment).parameters
    source = text_source(text_args, *extra) if text is None else text(text_args, own)
    report = experiment(model.model, text=source, **{k: v for k, v in shared.items() if k in taken}, **options(own))
    report.save(run.output_dir, echo=True)
    return 0


def training_command(subparsers, name: str, own: tuple, training_class, help: str, experiment, options,
                     docs: str | None = None):
    """A command that trains (`experiment`, a recipe function, which gives the defaults: add_command): the model,
    the held-out and the training text, its own options (the dataclasses `own`; `options(*own, training)`:
    run_training), the Trainer's."""
    return add_command(subparsers, name, (ModelArguments, EvalTextArguments, CalibrationTextArguments, *own,
                                          training_class), help,
                       functools.partial(run_training, experiment=experiment, options=options), docs=docs,
                       recipe_function=experiment)


def run_training(args, experiment, options) -> int:
    """Run `experiment` for a training_command: the model, the text, the sizes, the TrainingArguments and
    `options(*own, training)`; the report saved into --output_dir by the main process."""
    model, text, calibration, *own, training = dataclasses_of(args.parser, args)
    kwargs = options(*own, training)
    preflight(text, calibration, training, output_dir=training.output_dir)
    report = experiment(model.model, text=text_source(text, calibration), seq_len=text.seq_len,
                        max_windows=text.max_windows, train_windows=calibration.train_windows, training_args=training,
                        dtype=model.dtype, **kwargs)
    if training.process_index == 0:
        report.save(training.output_dir, echo=True)
    return 0


# ----------------------------------------------------------------------------- smoke size
SMOKE = {  # option -> its size under HF_TANGENT_SMOKE=1 (the documented commands, run by CI in seconds on 2 cores)
    "max_steps": 2, "max_windows": 2, "calibration_windows": 2, "seq_len": 64,
    "train_windows": 6,  # one per domain of the mixed corpus (heal's default text); training is max_steps batches
    "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 1,
    "limit": 2, "random_starts": 2, "token_starts": 2, "steps": 10, "max_iter": 5, "tokens": 2, "greedy_max_k": 1,
    "seeds": 1, "random_seeds": 1, "scale": "smoke",  # scale: the checkout's `python -m studies study`
    "stages": 1}  # progressive healing in stages needs a step per stage; 2 steps hold one
SMOKE_NONE_IS_ALL = {"limit", "greedy_max_k"}  # None means "every item / layer" here, elsewhere the command's own size


def smoke_sizes(args: argparse.Namespace) -> list[str] | None:
    """With HF_TANGENT_SMOKE=1, every option of SMOKE that the command has is capped in `args`: a number to
    min(value, cap), a list to its first `cap` items, a scale replaced; a value already smaller stays. Returns
    "option old -> new" for each value changed (None without HF_TANGENT_SMOKE=1)."""
    flag = os.environ.get("HF_TANGENT_SMOKE", "")
    if flag not in ("", "0", "1"):
        raise CommandError(f"HF_TANGENT_SMOKE={flag!r} is not accepted; accepted: unset, '', 0 (full size) or 1 "
                           "(every size capped to a smoke run).")
    if flag != "1":
        return None
    changed = []
    for name, cap in SMOKE.items():
        if name not in vars(args):
            continue
        value = getattr(args, name)
        if isinstance(cap, str):
            new = cap
        elif isinstance(value, list):
            new = value[:cap]
        elif value is None:
            new = cap if name in SMOKE_NONE_IS_ALL else None
        else:
            new = min(value, cap)
        if new != value:
            setattr(args, name, new)
            changed.append(f"{name} {value} -> {new}")
    return changed


# ----------------------------------------------------------------------------- recipes
def is_file(path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for a path, a folder that cannot be read: no recipe there
        return False


def find_recipe(name: str) -> Path:
    """A recipe path, or the name of one shipped with hf_tangent (recipes/<name>.yaml in the wheel)."""
    path = Path(name)
    if is_file(path):
        return path
    shipped = resources.files("hf_tangent.recipes") / f"{name}.yaml"
    if is_file(shipped):
        return Path(str(shipped))
    names = sorted(p.name[:-5] for p in resources.files("hf_tangent.recipes").iterdir() if p.name.endswith(".yaml"))
    raise CommandError(f"recipe {name!r} not found: not a file, nor a shipped recipe ({', '.join(names)}).")


class _Number:
    """The `type` of a numeric option: int / float, with an error that says what the option accepts
    (`argument --seq-len: 'x' has the wrong type; accepted: an integer >= 2.`); `optional`: the word
    None is None (an option whose accepted values end in ", or None"). A recipe's numeric strings
    (YAML reads `1e-3` as one) go through the same call."""

    def __init__(self, base, accepted: str, optional: bool = False):
        self.base, self.accepted, self.optional, self.__name__ = base, accepted, optional, base.__name__

    def __call__(self, text):
        if self.optional and text == "None":
            return None
        try:
            return self.base(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} has the wrong type; accepted: {self.accepted}.") from None


def _accepted(dataclass_types) -> dict[str, str]:
    """What each numeric option and each option with choices (a Literal) of these dataclasses accepts, in the words
    of ranges.Option (the API's)."""
    return {name: option.accepted for name, option in _options(dataclass_types).items()
            if option.range is not None or _has_choices(option.hint)}


def _has_choices(hint) -> bool:
    return typing.get_origin(hint) is Literal or any(_has_choices(arg) for arg in typing.get_args(hint))


def _options(dataclass_types) -> dict[str, Option]:
    return {name: option for kind in dataclass_types for name, option in options_of(kind).items()}


def _kind(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.const is True:
        return "bool"
    base = getattr(action.type, "base", action.type)
    if base in (int, float, str):
        return base.__name__
    return "other"


YAML_BOOLEANS = {True: ("yes", "on", "true"), False: ("no", "off", "false")}  # words YAML 1.1 reads as booleans


def _check_value(action: argparse.Action, key: str, value, where: str, accepted: str | None = None,
                 optional: bool = False):
    """The recipe's value for `action`, type-checked (YAML already typed it): quoted "false" is not a bool;
    `null` is None where the option takes None (`optional`); a string for a number goes through the
    command line's own conversion (YAML reads `1e-3` as a string, the command line as a number).
    The ranges are checked when the command's dataclasses are made, as for the command line."""
    def fail(expected, error=OptionTypeError):  # the words of every door (core/options.py)
        words = [c for c in map(str, action.choices or ()) if isinstance(value, bool) and c in YAML_BOOLEANS[value]]
        quote = (f" YAML reads an unquoted {'/'.join(YAML_BOOLEANS[value])} as {str(value).lower()}: write "
                 f"{' or '.join(repr(w) for w in words)} in quotes." if words else "")
        raise CommandError(f"recipe {where}: {error(key, value, accepted or expected)}{quote}")

    kind = _kind(action)
    if value is None and optional:
        return None
    if action.nargs in ("+", "*"):
        if not isinstance(value, list):
            fail("a list")
        unknown = [v for v in value if action.choices is not None and v not in action.choices]
        if unknown and accepted and all(any(_same_kind(v, choice) for choice in action.choices) for v in value):
            raise CommandError(f"recipe {where}: {ListChoiceError(key, value, accepted, unknown)}")  # the API's words
        return [_check_value(argparse.Action([], action.dest, type=action.type, choices=action.choices), key, v, where,
                             accepted) for v in value]
    if kind in ("int", "float") and isinstance(value, str) and action.type is not None:
        try:
            return action.type(value)  # exactly what the command line does with the same text
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            fail("an integer" if kind == "int" else "a number")
    if kind == "bool":
        if not isinstance(value, bool):
            fail("true or false")
        return value
    if kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
        fail("an integer")
    if kind == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        fail("a number")
    if kind == "str" and not isinstance(value, str):
        fail("a string")
    if action.choices is not None and not any(_same_kind(value, choice) for choice in action.choices):
        fail("one of " + ", ".join(map(repr, action.choices)))  # a value of another type than the choices'
    if kind == "other" and action.type is not None and value is not None:
        try:
            action.type(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            fail(f"a value --{action.dest} takes")
    if action.choices is not None and value not in action.choices and str(value) not in map(str, action.choices):
        fail("one of " + ", ".join(map(repr, action.choices)), ChoiceError)
    return value


def apply_recipe(parser: argparse.ArgumentParser, recipe: str, command: str) -> None:
    """Set the recipe's values as the parser's defaults (so the command line still wins)."""
    import yaml

    path = find_recipe(recipe)
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise CommandError(f"recipe {path} is not valid YAML: {err}") from None
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise CommandError(f"recipe {path} must be a YAML mapping of option: value, got {type(values).__name__}.")
    wanted = values.pop("command", command)
    if wanted != command:
        raise CommandError(f"recipe {path} is for `{wanted}`, not `{command}`.")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "recipe", "func")}
    accepted = _accepted(getattr(parser, "dataclass_types", ()))
    options = _options(getattr(parser, "dataclass_types", ()))
    defaults = {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            raise CommandError(f"recipe {path}: key {key!r} is not an option of `{command}`; accepted: "
                               f"{', '.join(sorted(actions))}.")
        optional = dest in options and matches(None, options[dest].hint)
        defaults[dest] = _check_value(actions[dest], str(key), value, str(path), accepted.get(dest), optional)
    parser.set_defaults(**defaults)
    parser.applied_recipe = path.stem if path.parent.name == "recipes" else str(path)
    for action in parser._actions:  # the help marks what the recipe set
        if action.dest in defaults:
            action.recipe = parser.applied_recipe


def _as_option(err: RangeError) -> str:
    """A RangeError in command-line words: `--seq-len 1 is out of range; accepted: ...`."""
    word = lambda v: shown(v) if isinstance(v, int) else str(v)  # noqa: E731  (10**400 by its size)
    value = " ".join(map(word, err.value)) or "[]" if isinstance(err.value, (list, tuple)) else word(err.value)
    return f"--{err.name.replace('_', '-')} {value} {err.problem}; accepted: {err.accepted}."


def dataclasses_of(parser, namespace: argparse.Namespace) -> tuple:
    """The parser's dataclass instances from a parsed namespace (what HfArgumentParser builds)."""
    out = []
    for kind in parser.dataclass_types:
        names = {f.name for f in dataclasses.fields(kind) if f.init}
        try:
            out.append(kind(**{k: v for k, v in vars(namespace).items() if k in names}))
        except RangeError as err:
            raise CommandError(_as_option(err)) from None
        except (TypeError, ValueError) as err:
            raise CommandError(str(err)) from None
    return tuple(out)


DEFAULT_WORD = re.compile(r"\bdefault(s|ed)?\b", re.I)
FIRST = ("recipe", "model", "output_dir")  # what a user needs first: the recipe, the model, where the output goes


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default printed once: appended as "(default: X)" unless the help text already
    says what the default is, and never as "(default: None)" (the help says what no value means); a
    value a --recipe set is printed as "(recipe NAME: X)"."""

    def _get_help_string(self, action):
        text = action.help or ""
        recipe = getattr(action, "recipe", None)
        if recipe is not None:
            return f"{text} (recipe {recipe}: {action.default})"
        if DEFAULT_WORD.search(text) or action.default is None or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreFalseAction) and action.option_strings[0].startswith("--no"):
            return text  # --no_X: its own help says what it turns off
        return super()._get_help_string(action)

    def _split_lines(self, text, width):  # a URL stays whole, so that it can be clicked and copied
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def _arrange(sub, name: str, dataclass_types) -> None:
    """The help in the order a user reads it: the recipe, the model and the output first; then the command's own
    options, then the shared ones (text, dtype, device); the Trainer's (transformers.TrainingArguments) last,
    those hf_tangent gives its own default first. A --no_X option says what it turns off. The usage line names
    the first three only."""
    from transformers import TrainingArguments

    trainer_kinds = [k for k in dataclass_types if issubclass(k, TrainingArguments)]
    trainer_fields = {f.name for k in trainer_kinds for f in dataclasses.fields(k)}
    ours = {name for k in trainer_kinds for c in k.__mro__ if issubclass(c, TrainingArguments) and c is not TrainingArguments
            for name in vars(c).get("__annotations__", {})}  # the fields hf_tangent declares again: its defaults, its help
    own_fields = [f.name for k in dataclass_types if k not in trainer_kinds and k.__module__ != __name__  # not shared
                  for f in dataclasses.fields(k)]
    for action in sub._actions:
        if isinstance(action, argparse._StoreFalseAction) and action.option_strings[0].startswith("--no"):
            action.help = f"the opposite of --{action.dest}: turn it off"
    named = [a for a in sub._actions if a.option_strings and a.dest not in ("help",)]

    def rank(action) -> tuple:
        if action.dest in FIRST:
            return (0, FIRST.index(action.dest))
        if action.dest in trainer_fields:
            return (3, 0 if action.dest in ours else 1)
        return (1 if action.dest in own_fields else 2, 0)

    titles = {0: "the run", 1: f"{name} options", 2: "shared options (text, model dtype, device)",
              3: "Trainer options (transformers.TrainingArguments; the ones hf_tangent sets itself first)"}
    groups = {}
    for action in sorted(named, key=rank):  # sorted is stable: the dataclass order within a rank
        key = rank(action)[0]
        if key not in groups:
            groups[key] = sub.add_argument_group(titles[key])
        for group in sub._action_groups:
            if action in group._group_actions and group is not groups[key]:
                group._group_actions.remove(action)
        groups[key]._group_actions.append(action)
    new = [groups[k] for k in sorted(groups)]
    sub._action_groups = [g for g in sub._action_groups if g not in new and g._group_actions] + new
    sub.trainer_group, sub.trainer_own = groups.get(3), ours
    shown = " ".join(f"[{a.option_strings[0]} {a.metavar or a.dest.upper()}]" for a in sorted(named, key=rank)
                     if a.dest in FIRST)
    sub.usage = f"{sub.prog} [-h] {shown} [options]".replace("  ", " ")


def _recipes_for(command: str) -> list[tuple[str, dict]]:
    """The shipped recipes for `command`, with their values (name, {option: value})."""
    import yaml

    found = []
    for path in sorted(resources.files("hf_tangent.recipes").iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".yaml"):
            continue
        try:
            values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            continue
        if isinstance(values, dict) and values.pop("command", None) == command:
            found.append((path.name[:-5], {str(k).replace("-", "_"): v for k, v in values.items()}))
    return found


def _defaults_text(sub, command: str, recipes: list[tuple[str, dict]]) -> str:
    """What the defaults shown are, and, for each shipped recipe of the command, the values it sets that differ
    from them (so a reader sees where the main job's numbers come from)."""
    applied = getattr(sub, "applied_recipe", None)
    if applied is not None:
        return textwrap.fill(f"Defaults shown: recipe {applied}'s values where it sets them (marked \"recipe {applied}\"), "
                             "the command's own elsewhere.", 100)
    import shlex

    def shown(value) -> str:
        return " ".join(shlex.quote(str(v)) for v in value) if isinstance(value, list) else str(value)

    defaults = {a.dest: a.default for a in sub._actions}
    lines = ["Defaults shown: the command's own, without a recipe."]
    for name, values in recipes:
        differ = [f"--{k} {shown(v)}" for k, v in values.items() if k in defaults and defaults[k] != v and k != "output_dir"]
        main = " (the README's main job)" if name == "offline_default" else ""
        lines.append(f"--recipe {name}{main} sets " + (", ".join(differ) if differ else "the defaults") + ".")
    if len(lines) > 1:
        lines.append(f"`hf-tangent {command} --recipe NAME --help` shows a recipe's values as the defaults.")
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="  ") for line in lines)


def recipe_defaults(parser, function) -> dict:
    """The defaults of `function`'s parameters that are options of `parser`, as the command line holds them (a
    tuple as a list); None or an empty tuple leaves the option's own (None there too: `device` picks one,
    `model_folders` is none)."""
    dests = {action.dest for action in parser._actions}
    return {name: list(p.default) if isinstance(p.default, tuple) else p.default
            for name, p in inspect.signature(function).parameters.items()
            if name in dests and p.default not in (None, (), p.empty)}


def add_command(subparsers, name: str, dataclass_types, help: str, func, recipe: bool = True, docs: str | None = None,
                recipe_function=None):
    """A subcommand whose options are the fields of `dataclass_types` (plus --recipe); `docs`: its page under DOCS,
    named in the description (an installed package has no docs/ folder). Where the command runs a recipe function
    (`recipe_function`: `critical`, `heal`, ...), that function's defaults are the command's: the shared options
    (seq_len, max_windows, ...) are declared once for every command, and a command runs what the function does
    when called with the same arguments."""
    sub = subparsers.add_parser(name, dataclass_types=dataclass_types, help=help, description=help,
                                formatter_class=HelpFormatter,
                                allow_abbrev=False)  # --seed must not silently mean --seeds
    for action in sub._actions:  # argparse reads help as a %-format: ours is plain text ("95%"), the
        if action.help and action.help is not argparse.SUPPRESS:  # Trainer's is escaped already ("20%%")
            action.help = action.help.replace("%%", "%").replace("%", "%%")
    options = _options(dataclass_types)
    for action in sub._actions:  # a value that is not a number says what the option accepts
        option = options.get(action.dest)
        if option is not None and option.range is not None and action.type in (int, float):
            action.type = _Number(action.type, option.accepted, optional=matches(None, option.hint))
    if recipe_function is not None:
        sub.set_defaults(**recipe_defaults(sub, recipe_function))
    if recipe:
        sub.add_argument("--recipe", help="YAML recipe: a path, or the name of a shipped recipe; the command line wins")
    sub.set_defaults(func=in_run_folder(func), parser=sub)  # the recipe and its report: one run of --output_dir
    _arrange(sub, name, dataclass_types)
    description = textwrap.fill(help, 100) + (f"\nDocs: {DOCS}{docs}" if docs else "")
    sub.description = description
    if sub.trainer_group is not None:
        sub.add_argument("--help-all", action=_HelpAll, help="this help with every Trainer option, and exit")
        sub.usage = sub.usage.replace("[-h]", "[-h | --help-all]")
    if recipe or sub.trainer_group is not None:
        format_help = sub.format_help

        def with_defaults():  # the recipes are read when the help is shown, not on every start
            recipes = _recipes_for(name) if recipe else []
            if recipe:
                sub.description = f"{description}\n\n{_defaults_text(sub, name, recipes)}"
            return _with_trainer_options_hidden(sub, name, recipes, format_help)

        sub.format_help = with_defaults
    return sub


TRAINER_DOCS = "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"


class _HelpAll(argparse.Action):
    """--help-all: --help with every option of transformers.TrainingArguments (--help shows only those hf_tangent or
    a recipe sets: the Trainer's ~120 others made `calibrate --help` 527 lines)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.help_all = True
        parser.print_help()
        parser.exit()


def _with_trainer_options_hidden(sub, name: str, recipes: list[tuple[str, dict]], format_help) -> str:
    """The help, the Trainer's options left out (argparse.SUPPRESS, for this once) but those hf_tangent gives its own
    default and those a shipped or the given recipe sets; the group says where the rest are. Parsing is unchanged."""
    group = sub.trainer_group
    if group is None or getattr(sub, "help_all", False):
        return format_help()
    shown = sub.trainer_own | {key for _, values in recipes for key in values}
    hidden = [a for a in group._group_actions if a.dest not in shown and getattr(a, "recipe", None) is None]
    saved = [a.help for a in hidden]
    group.description = (f"Shown: those hf_tangent or a shipped recipe sets. All of them: `hf-tangent {name} --help-all`,"
                         f" or\n{TRAINER_DOCS}")
    for action in hidden:
        action.help = argparse.SUPPRESS
    try:
        return format_help()
    finally:
        group.description = None
        for action, text in zip(hidden, saved, strict=True):
            action.help = text
