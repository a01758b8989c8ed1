"""`hf-tangent`: the command line. A thin layer over the library; every subcommand shares the
options of `common_parser` and writes report.json and report.md into --output-dir."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from ._version import __version__
from .models import DEFAULT_MODEL, OFFLINE_MODELS


def common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"hub id, local folder, or an offline name ({', '.join(OFFLINE_MODELS)}); default {DEFAULT_MODEL}")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--text-files", nargs="+", metavar="FILE",
                     help="local UTF-8 text files (default: held-out Austen novels)")
    src.add_argument("--dataset", help="hub dataset: wikitext-2, wikitext-103, openwebtext-10k or a hub path")
    g.add_argument("--dataset-split", default="test", help="split of --dataset (default test)")
    g.add_argument("--output-dir", default="runs/latest", help="where report.json and report.md go")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    g.add_argument("--max-windows", type=int, default=8, help="windows evaluated (default 8)")
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--seed", type=int, default=0)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-tangent", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hf_tangent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from .evaluation import update_variants

    ev = sub.add_parser("eval", parents=[common_parser()],
                        help="perplexity of the unpatched model and of each update rule on held-out text")
    ev.add_argument("--updates", nargs="+", choices=list(update_variants()), metavar="NAME",
                    help="variants to evaluate (default all): " + "; ".join(update_variants()))
    ev.set_defaults(run=run_eval)
    return parser


def _check_common(args) -> None:
    if args.seq_len < 2:
        raise SystemExit(f"hf-tangent: --seq-len {args.seq_len} is too short (at least 2).")
    if args.max_windows < 1:
        raise SystemExit(f"hf-tangent: --max-windows {args.max_windows} must be at least 1.")


def load_inputs(args):
    """(model, windows) for the common options; errors before any long work starts."""
    from .data import load_documents, pack_windows
    from .models import load_model

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if context and args.seq_len > context:
        raise SystemExit(f"hf-tangent: --seq-len {args.seq_len} exceeds the model's context of {context} tokens.")
    docs = load_documents(args.text_files, args.dataset, split="evaluation", dataset_split=args.dataset_split)
    windows = pack_windows(tokenizer, docs, args.seq_len, args.max_windows)
    return model, windows


def run_eval(args) -> dict:
    from tqdm.auto import tqdm

    from .evaluation import perplexity, update_variants
    from .patching import patch, unpatch

    variants = update_variants()
    names = args.updates or list(variants)
    if "unpatched" not in names:
        names = ["unpatched", *names]
    model, windows = load_inputs(args)
    rows = []
    start = time.time()
    with tqdm(total=len(names) * len(windows), desc="hf-tangent eval", unit="window") as bar:
        for name in names:
            bar.set_postfix_str(name)
            if variants[name] is not None:
                patch(model, variants[name])
            try:
                result = perplexity(model, windows, batch_size=args.batch_size, progress=bar)
            finally:
                unpatch(model)
            rows.append({"variant": name, "config": None if variants[name] is None else variants[name].to_dict(),
                         "nll": result["nll"], "perplexity": result["perplexity"], "tokens": result["tokens"]})
    base = rows[0]
    for row in rows:
        row["delta_nll"] = row["nll"] - base["nll"]
        row["delta_perplexity"] = row["perplexity"] - base["perplexity"]
    report = {
        "command": "eval", "hf_tangent_version": __version__, "model": args.model, "dtype": args.dtype,
        "device": args.device, "text": args.text_files or args.dataset or "austen:evaluation",
        "seq_len": args.seq_len, "windows": len(windows), "tokens_per_variant": base["tokens"],
        "seed": args.seed, "seconds": round(time.time() - start, 1), "torch": torch.__version__,
        "python": platform.python_version(), "rows": rows,
    }
    write_report(args.output_dir, report, eval_markdown(report))
    return report


def eval_markdown(report: dict) -> str:
    lines = [
        f"# hf-tangent eval: {report['model']}",
        "",
        f"Text: {report['text']}; {report['windows']} windows x {report['seq_len']} tokens "
        f"({report['tokens_per_variant']} predicted tokens per variant); dtype {report['dtype']}, "
        f"device {report['device']}, {report['seconds']} s.",
        "",
        "| variant | NLL | perplexity | delta NLL | delta perplexity |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['variant']} | {r['nll']:.4f} | {r['perplexity']:.3f} | {r['delta_nll']:+.4f} | "
                     f"{r['delta_perplexity']:+.3f} |")
    return "\n".join(lines) + "\n"


def write_report(output_dir: str, report: dict, markdown: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(output_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    print(markdown)
    print(f"wrote {os.path.join(output_dir, 'report.json')} and report.md")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _check_common(args)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"hf-tangent {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
