"""Reports: what every experiment returns.

A `Report` is JSON-able data plus its kind (the command that made it); `to_markdown()` and
`plot(folder)` render it, `save(folder)` writes report.json, report.md and the plots, and
`Report.load(path)` reads a saved one back, so a page regenerates from the kept JSON alone.

Each experiment module renders its own kinds and registers them here (`register_report`); the
package's __init__ imports every experiment module, so the table is whole before any Report exists.
"""

from __future__ import annotations

import json
import numbers
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..ranges import plain
from .runs import RunFolder, temporary_path, write_atomically

# kind -> Markdown renderer / plot writer, filled by the experiment modules (register_report)
MARKDOWN: dict[str, Callable[[dict], str]] = {}
PLOTS: dict[str, Callable[[dict, str], list[str]]] = {}


def register_report(kind: str, markdown: Callable[[dict], str],
                    plot: Callable[[dict, str], list[str]] | None = None) -> None:
    """Declare a report kind: its Markdown renderer and, if it has plots, the function writing them."""
    if kind in MARKDOWN:
        raise ValueError(f"report kind {kind!r} is registered twice.")
    MARKDOWN[kind] = markdown
    if plot is not None:
        PLOTS[kind] = plot


# Published values the pages quote beside ours (not measured here)
PAPER_MEAN_GATES = "GPT-2 0.852, GPT-2-large 0.917, Pythia 1.063 / 1.048, Mistral 1.009"


@dataclass
class Report:
    """The result of one experiment (`kind`: eval, calibrate, finetune, diagnose, ablate,
    sensitivity, parallel-sweep, heal, critical, pressure, ffn-jacobian, and the kinds registered from
    outside, as the checkout's studies/ registers "study"); `data` is what report.json holds."""

    kind: str
    data: dict
    tensors: dict | None = None  # named tensors saved beside report.json as data["directions_file"] (safetensors)

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in MARKDOWN:
            raise ValueError(f"unknown report kind {self.kind!r}; accepted: {', '.join(MARKDOWN)}.")
        if not isinstance(self.data, dict):
            raise TypeError(f"Report data must be a dict (what report.json holds), got {type(self.data).__name__}.")

    def __getitem__(self, key: str):
        return self.data[key]

    def to_dict(self) -> dict:
        return self.data

    def to_markdown(self) -> str:
        return MARKDOWN[self.kind](self.data)

    def plot(self, folder: str | os.PathLike) -> list[str]:
        """Write this report's plots (PNG) into `folder`; returns their paths."""
        os.makedirs(folder, exist_ok=True)
        return PLOTS.get(self.kind, lambda data, folder: [])(self.data, str(folder))

    def save(self, folder: str | os.PathLike, *, echo: bool = False) -> Path:
        """report.json, report.md and the plots in `folder`, a run folder (runs.claim_run_folder): inside the
        RunFolder of the run that made the report when it is open, else in one of its own. Each file is
        replaced atomically (a temporary name, then os.replace), report.json last; `echo` also prints the
        Markdown."""
        with RunFolder(folder, writer="Report.save") as target:
            self._write(target)
        if echo:
            print(self.to_markdown())
            print(f"wrote {target / 'report.json'} and report.md")
        return Path(folder)

    def _write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = temporary_path(folder / "plots")  # the plots and tensors, moved in one by one
        scratch.mkdir()
        try:
            for path in self.plot(scratch):
                os.replace(path, folder / Path(path).name)
            if self.tensors is not None:
                from safetensors.torch import save_file

                name = self.data["directions_file"]
                save_file(self.tensors, str(scratch / name), metadata={"report": self.kind})
                os.replace(scratch / name, folder / name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        write_atomically(folder / "report.md", self.to_markdown())
        write_atomically(folder / "report.json", json.dumps(self.data, indent=2, default=_json_default))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Report:
        """A saved report.json (its "command" or "study" field says which kind), checked whole: a
        report that could not be rendered (a JSON list, a field missing) is refused here, not later."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"Report.load expects the path of a report.json, got {type(path).__name__}.")
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable report.json ({err}).") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not an hf-tangent report: a JSON {type(data).__name__}, accepted: a JSON object "
                             "with a 'command' field.")
        kind = data.get("command") or ("study" if "study" in data else None)
        if kind == "study" and kind not in MARKDOWN:
            raise ValueError(f"{path}: a report of the checkout's from-scratch studies (`python -m studies`); `import "
                             "studies` (from the checkout's root) lets Report.load read it.")
        if not isinstance(kind, str) or kind not in MARKDOWN:
            raise ValueError(f"{path}: not an hf-tangent report (command={data.get('command')!r}; accepted: "
                             f"{', '.join(MARKDOWN)}).")
        problems = provenance_problems(data)
        if problems:
            raise ValueError(f"{path}: a damaged {kind!r} report: its provenance is malformed ({'; '.join(problems)}).")
        try:
            MARKDOWN[kind](data)
        except KeyError as err:
            raise ValueError(f"{path}: an incomplete {kind!r} report: field {err.args[0]!r} is missing.") from None
        except (TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as err:
            raise ValueError(f"{path}: a damaged {kind!r} report ({type(err).__name__}: {err}).") from None
        return cls(kind, data)


def _hex(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _digest_problems(key: str, entry) -> list[str]:
    """A recorded digest (identity.scored_weights, a saved folder's files): a dict whose digest is 64 hex
    digits, or None with the reason why."""
    if not isinstance(entry, dict):
        return [f"{key} is {type(entry).__name__}, not an object"]
    digest = entry.get("digest")
    if digest is None:
        return [] if isinstance(entry.get("why_none"), str) else [f"{key}.digest is missing, with no why_none"]
    out = [] if _hex(digest) else [f"{key}.digest is {digest!r}, not 64 hex digits"]
    if "dtypes" in entry and not (isinstance(entry["dtypes"], list) and all(isinstance(d, str) for d in entry["dtypes"])):
        out.append(f"{key}.dtypes is {entry['dtypes']!r}, not a list of dtype names")
    if "patch" in entry and entry["patch"] is not None and not isinstance(entry["patch"], dict):
        out.append(f"{key}.patch is {type(entry['patch']).__name__}, not an object (or null)")
    if "parameters" in entry and (isinstance(entry["parameters"], bool) or not isinstance(entry["parameters"], int)
                                  or entry["parameters"] < 0):
        out.append(f"{key}.parameters is {entry['parameters']!r}, not a count")
    return out


def provenance_problems(data: dict) -> list[str]:
    """What is malformed in a report's provenance fields, where present (common.environment, lm-eval's
    variant_weights and task_files): each named with its value; [] when none is."""
    out = []
    if "weights" in data:
        out += _digest_problems("weights", data["weights"])
    versions = data.get("versions")
    if "versions" in data and not (isinstance(versions, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in versions.items())):
        out.append(f"versions is {versions!r}, not an object of library -> version string (or null)")
    for key, check in (("variant_weights", lambda k, v: _digest_problems(f"variant_weights[{k!r}]", v)),
                       ("task_files", lambda k, v: [] if v is None or _hex(v) else
                        [f"task_files[{k!r}] is {v!r}, not 64 hex digits (or null)"])):
        if key in data:
            if not isinstance(data[key], dict):
                out.append(f"{key} is {type(data[key]).__name__}, not an object")
                continue
            for label, value in data[key].items():
                out += check(label, value)
    return out


def perplexity_text(p: float) -> str:
    """A perplexity as people read it: exp(NLL) explodes for a damaged model, so two decimals below 1e4
    and scientific notation from there on (2.93e+09, not 2926224549.558)."""
    text = f"{p:.2f}"
    return text if float(text) < 1e4 else f"{p:.2e}"  # 9999.996 is 1.00e+04, not 10000.00


def variants_table(rows: list[dict]) -> str:
    """The rule table: the difference from the unpatched model first (nats per token: what to compare)."""
    lines = ["| variant | delta NLL (nats) | NLL | perplexity |", "|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['delta_nll']:+.4f} | {r['nll']:.4f} | {perplexity_text(r['perplexity'])} |"
              for r in rows]
    return "\n".join(lines)


def _json_default(value):
    """A value JSON has no type for: a number of any kind (numpy, Fraction) as a JSON number (it was written as
    a string), anything else (a path, a dtype) as its str."""
    return plain(value, float) if isinstance(value, numbers.Real) else str(value)
