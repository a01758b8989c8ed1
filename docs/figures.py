"""Every figure quoted in README.md and docs/ comes from a kept report, written there by this script.

    python docs/figures.py            # render every generated region in place
    python docs/figures.py --check    # exit 1 on a region that differs from its rendering, or a
                                      # number outside the regions that is not a listed constant

A generated region in a Markdown file:

    <!-- figures: NAME -->
    ...text rendered by REGIONS[NAME] from kept reports...
    <!-- /figures -->

Kept reports: docs/results/**/*.json (experiments) and benchmarks/results/*.json (benchmarks). A
number outside the regions (and outside code) must be a setting, threshold or paper value listed in
CONSTANTS for its file: the list is what a reviewer reads to see that nothing measured is typed by
hand. tests/test_docs.py runs --check. Report pages (docs/results/**/report.md and the like) are
rendered from their JSON by hf_tangent's own renderer and checked against it there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
REGION = re.compile(r"(<!-- figures: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)
NUMBER = re.compile(r"(?<![\w.#/-])[-+]?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])|(?<![\w.#/-])\d+e[-+]?\d+(?![\w.])")
# the files whose numbers must all be rendered or listed (generated pages have their own checks)
CHECKED = ("README.md", "docs/results/README.md", "docs/recipes.md", "docs/geometry.md", "docs/core.md",
           "docs/parallel.md", "docs/diagnostics.md", "docs/studies-guide.md", "docs/performance.md", "docs/math.md")


@cache
def report(path: str) -> dict:
    """A kept report: a path under docs/results/ (or benchmarks/results/ with that prefix)."""
    base = ROOT if path.startswith("benchmarks/") else RESULTS
    return json.loads((base / path).read_text(encoding="utf-8"))


def signed(value: float, digits: int) -> str:
    return f"{value:+.{digits}f}"


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60)} s"


# ----------------------------------------------------------------------------- regions
def main_job() -> str:
    r = report("offline_default_smollm2.json")
    g, h, t = r["gate_summary"], r["heldout"], r["training"]
    return (f"Measured here (2 CPU cores, seed {r['seed']}, {t['max_steps']} steps of {t['batch_size']} x {r['seq_len']} "
            f"tokens, {r['eval_windows']} held-out windows of {r['seq_len']} tokens): {minutes(r['seconds'])} wall, "
            f"{r['peak_rss_gb']:.1f} GB peak RSS; mean gate {g['mean']:.3f}, range {g['min']:.3f} (layer {g['argmin']})\n"
            f".. {g['max']:.3f} (layer {g['argmax']}), Delta L = {h['delta_nll']:.4f} nats (perplexity "
            f"{h['natural_perplexity']:.2f} -> {h['gated_perplexity']:.2f}).\n")


def sweep_count() -> str:
    r = report("hostile_sweep.json")
    o = r["outcomes"]
    return (f"`python tests/sweeps/hostile_inputs.py` runs the {r['cases']}-case hostile-input sweep ({o['ok']} ok, "
            f"{o['clear']} clear errors, {r['cases'] - o['ok'] - o['clear']} other; "
            "[docs/results/hostile_sweep.md](docs/results/hostile_sweep.md)); pytest runs its groups too.\n")


REGIONS = {
    "main-job": main_job,
    "sweep-count": sweep_count,
}

# Numbers outside the regions that are not measurements: settings, thresholds, formulas, paper values.
CONSTANTS: dict[str, set[str]] = {
    "README.md": set(),
    "docs/results/README.md": set(),
    "docs/recipes.md": set(),
    "docs/geometry.md": set(),
    "docs/core.md": set(),
    "docs/parallel.md": set(),
    "docs/diagnostics.md": set(),
    "docs/studies-guide.md": set(),
    "docs/performance.md": set(),
    "docs/math.md": set(),
}


# ----------------------------------------------------------------------------- rendering and checks
def render(text: str) -> str:
    def fill(match):
        name = match.group("name")
        if name not in REGIONS:
            raise KeyError(f"unknown figures region {name!r}; known: {', '.join(REGIONS)}")
        return match.group(1) + REGIONS[name]() + match.group(4)

    return REGION.sub(fill, text)


def stray_numbers(path: str, text: str) -> list[str]:
    """Numbers outside generated regions, code and links that CONSTANTS does not list for `path`."""
    text = REGION.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    return sorted({n for n in NUMBER.findall(text) if n.lstrip("+-") not in CONSTANTS.get(path, set())})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on any difference")
    args = parser.parse_args(argv)
    problems = []
    for path in CHECKED:
        file = ROOT / path
        text = file.read_text(encoding="utf-8")
        rendered = render(text)
        if rendered != text:
            if args.check:
                problems.append(f"{path}: a generated region differs from its rendering (run python docs/figures.py)")
            else:
                file.write_text(rendered, encoding="utf-8")
        stray = stray_numbers(path, rendered)
        if stray:
            problems.append(f"{path}: numbers neither rendered from a report nor listed in CONSTANTS: {', '.join(stray)}")
    print("\n".join(problems) or "figures: every region matches its reports; no stray numbers")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
