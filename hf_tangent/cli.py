"""`hf-tangent`: the command line, a thin layer over the library.

Every subcommand shares the options of `common_parser`, writes report.json and report.md into
--output-dir, and takes `--recipe FILE.yaml`: a YAML mapping whose keys are the subcommand's long
options (dashes or underscores); options given on the command line win over the recipe.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from ._version import __version__
from .models import DEFAULT_MODEL, OFFLINE_MODELS

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    g.add_argument("--recipe", help="YAML recipe (a path, or a name in recipes/); command-line options win")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"hub id, local folder, or an offline name ({', '.join(OFFLINE_MODELS)}); default {DEFAULT_MODEL}")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--text-files", nargs="+", metavar="FILE",
                     help="local UTF-8 text files to evaluate on (default: held-out Austen novels)")
    src.add_argument("--dataset", help="hub dataset: wikitext-2, wikitext-103, openwebtext-10k or a hub path")
    g.add_argument("--dataset-split", default="test", help="evaluation split of --dataset (default test)")
    g.add_argument("--output-dir", default="runs/latest", help="where report.json and report.md go")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    g.add_argument("--max-windows", type=int, default=8, help="held-out windows evaluated (default 8)")
    g.add_argument("--batch-size", type=int, default=1, help="windows per forward pass / per-device train batch")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--seed", type=int, default=0)
    return p


def training_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("training options")
    g.add_argument("--calibration-files", nargs="+", metavar="FILE",
                   help="training text files (default: the Austen calibration novels; with --text-files only, "
                        "the last 20%% of the documents are held out)")
    g.add_argument("--train-windows", type=int, default=64, help="training windows of --seq-len tokens")
    g.add_argument("--max-steps", type=int, default=50, help="optimizer steps")
    g.add_argument("--learning-rate", type=float, default=1e-2)
    g.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    g.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False,
                   help="continue from the last checkpoint in --output-dir")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False, help="bf16 mixed precision")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--report-to", default="none", help="Trainer logging backend: none, tensorboard, wandb, ...")
    g.add_argument("--push-to-hub", metavar="REPO_ID", help="publish the output model to the Hub")
    g.add_argument("--hub-private", action=argparse.BooleanOptionalAction, default=False)
    return p


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from .evaluation import update_variants

    parser = argparse.ArgumentParser(prog="hf-tangent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf_tangent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    variants = list(update_variants())
    variant_help = "; ".join(variants)

    ev = sub.add_parser("eval", parents=[common_parser()],
                        help="perplexity of the unpatched model and of each update rule on held-out text")
    ev.add_argument("--updates", nargs="+", choices=variants, metavar="NAME",
                    help=f"variants to evaluate (default all): {variant_help}")
    ev.set_defaults(run=run_eval)

    ca = sub.add_parser("calibrate", parents=[common_parser(), training_parser()],
                        help="train one scalar FFN gate per layer, all weights frozen (math.md section 5)")
    ca.add_argument("--update", default="add", help="update rule the gates scale (default add: x + g_l * FFN)")
    ca.add_argument("--layers", nargs="+", type=int, help="layers to gate (default all)")
    ca.add_argument("--compare-updates", nargs="*", choices=variants, metavar="NAME", default=[],
                    help=f"also evaluate these update variants, untrained, on the held-out text: {variant_help}")
    ca.add_argument("--save-model", action=argparse.BooleanOptionalAction, default=True,
                    help="write the calibrated model as a Hub repository folder in OUTPUT_DIR/model")
    ca.set_defaults(run=run_calibrate)

    ft = sub.add_parser("finetune", parents=[common_parser(), training_parser()],
                        help="the same fine-tuning for the unpatched model and each update rule; perplexity deltas")
    ft.add_argument("--updates", nargs="+", choices=variants, metavar="NAME",
                    default=["projected", "soft beta=0.5", "norm_preserving", "retract p=2 (cayley)"],
                    help=f"update variants trained besides the unpatched model: {variant_help}")
    ft.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="one run per seed and variant")
    ft.add_argument("--method", choices=["full", "lora"], default="lora")
    ft.add_argument("--lora-r", type=int, default=8)
    ft.add_argument("--lora-alpha", type=int, default=16)
    ft.add_argument("--lora-targets", nargs="+", default=["q_proj", "v_proj", "up_proj", "down_proj"],
                    help="LoRA target modules (names of the model's Linear layers)")
    ft.add_argument("--lr-scheduler", default="cosine")
    ft.add_argument("--warmup-steps", type=int, default=0)
    ft.add_argument("--save-models", action=argparse.BooleanOptionalAction, default=False,
                    help="write every run's final model as a Hub repository folder")
    ft.set_defaults(run=run_finetune, learning_rate=2e-4)
    from .ablation import VARIANTS as ABLATIONS

    di = sub.add_parser("diagnose", parents=[common_parser()],
                        help="per-layer radial fraction, norms, angles, diversity, deficit (math.md section 4)")
    di.add_argument("--layers", nargs="+", type=int, help="layers to observe (default all)")
    di.add_argument("--update", choices=variants, metavar="NAME",
                    help=f"diagnose the model patched with this variant (default: unpatched): {variant_help}")
    di.set_defaults(run=run_diagnose)

    ab = sub.add_parser("ablate", parents=[common_parser()],
                        help="loss increase of zero-FFN, radial-only, tangential-only, attention-zero (paired bootstrap CI)")
    ab.add_argument("--variants", nargs="+", choices=ABLATIONS, default=list(ABLATIONS))
    ab.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=False,
                    help="also ablate one layer at a time (layers x variants forward passes)")
    ab.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the intervals")
    ab.set_defaults(run=run_ablate)
    se = sub.add_parser("sensitivity", parents=[common_parser()],
                        help="FFN input-sensitivity C_l of every layer on calibration text (math.md section 4)")
    se.add_argument("--calibration-files", nargs="+", metavar="FILE",
                    help="calibration text (default: the Austen calibration novels)")
    se.set_defaults(run=run_sensitivity)

    sw = sub.add_parser("parallel-sweep", parents=[common_parser()],
                        help="held-out loss vs number of parallel-converted layers: low-C_l, high-C_l, random, greedy")
    sw.add_argument("--calibration-files", nargs="+", metavar="FILE",
                    help="calibration text for C_l and the greedy selection (default: Austen calibration novels)")
    sw.add_argument("--calibration-windows", type=int, default=4, help="calibration windows (C_l, greedy, budget)")
    sw.add_argument("--ks", nargs="+", type=int, help="numbers of converted layers to evaluate (default 0..L)")
    sw.add_argument("--random-seeds", nargs="+", type=int, default=[0, 1, 2])
    sw.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                    help="also the loss-aware greedy selection (O(L^2) calibration evaluations)")
    sw.add_argument("--greedy-max-k", type=int, help="stop the greedy selection after this many layers")
    sw.add_argument("--budget", type=float, default=0.02, help="loss budget (nats/token) for the recommendation")
    sw.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                    help="measure T_A, T_Phi and the end-to-end latency of the recommended conversion")
    sw.set_defaults(run=run_parallel_sweep)
    from .studies import ARCHS, SCALES, STUDIES

    st = sub.add_parser("study", parents=[common_parser()],
                        help="from-scratch training studies: tangential, retraction, noise (docs/studies.md)")
    st.add_argument("study", nargs="?", help=f"one of: {', '.join(STUDIES)} (or `study:` in a --recipe)")
    st.add_argument("--scale", default="smoke", help=f"one of: {', '.join(SCALES)} (default smoke)")
    st.add_argument("--arch", default="gpt2", help=f"one of: {', '.join(ARCHS)}")
    st.add_argument("--variants", nargs="+", help="subset of the study's variants (the baseline always runs)")
    st.add_argument("--seeds", nargs="+", type=int, help="default: the scale's seeds")
    st.add_argument("--branches", nargs="+", default=["ffn"], help="ffn, or ffn attention (rule on both branches)")
    budget = st.add_argument_group("budget (default: the scale's; --seq-len, --batch-size and --max-windows too)")
    budget.add_argument("--max-steps", type=int, help="optimizer steps per run")
    budget.add_argument("--eval-every", type=int, help="steps between validation / diagnostics logs")
    budget.add_argument("--learning-rate", type=float, help="peak AdamW learning rate (cosine schedule)")
    budget.add_argument("--train-windows", type=int, help="training windows of --seq-len tokens")
    st.add_argument("--calibration-files", nargs="+", metavar="FILE",
                    help="training text files (with --text-files as validation text; default: Austen calibration novels)")
    # Studies build their models from scratch and take their seeds from --seeds: the common options
    # below have no default here, so that passing one is an error instead of being ignored.
    st.set_defaults(run=run_study, model=None, dtype=None, seed=None, seq_len=None, batch_size=None, max_windows=None)

    sr = sub.add_parser("study-report", help="write docs/studies.md from study report.json files")
    sr.add_argument("reports", nargs="+", help="report.json files written by `hf-tangent study`")
    sr.add_argument("--output", default=str(Path(__file__).resolve().parent.parent / "docs" / "studies.md"))
    sr.set_defaults(run=run_study_report)
    return parser, {"eval": ev, "calibrate": ca, "finetune": ft, "diagnose": di, "ablate": ab,
                    "sensitivity": se, "parallel-sweep": sw, "study": st, "study-report": sr}


# ----------------------------------------------------------------------------- recipes
def recipe_argv(recipe: str, subparser: argparse.ArgumentParser) -> tuple[dict, list[str]]:
    """A YAML recipe turned into command-line tokens, so argparse checks types and choices:
    (positional arguments by name, option tokens)."""
    import yaml

    path = Path(recipe)
    if not path.is_file() and (RECIPES_DIR / f"{recipe}.yaml").is_file():
        path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise SystemExit(f"hf-tangent: recipe {recipe!r} not found (a YAML path, or a name in {RECIPES_DIR}).")
    values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(values, dict):
        raise SystemExit(f"hf-tangent: recipe {path} must be a YAML mapping of option: value.")
    options = {a.dest: a for a in subparser._actions if a.option_strings and a.dest not in ("help", "recipe")}
    positional_names = [a.dest for a in subparser._actions if not a.option_strings]
    positionals = {name: str(values.pop(name)) for name in positional_names if name in values}
    command = values.pop("command", None)
    if command is not None and command != subparser.prog.split()[-1]:
        raise SystemExit(f"hf-tangent: recipe {path} is for `{command}`, not `{subparser.prog}`.")
    argv = []
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in options:
            raise SystemExit(f"hf-tangent: recipe key {key!r} does not exist for `{subparser.prog}`; accepted: "
                             f"{', '.join(sorted([*options, *positional_names]))}.")
        action = options[dest]
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            argv += [flag, *map(str, value)] if value or action.nargs == "*" else []
        elif value is not None:
            argv += [flag, str(value)]
    return positionals, argv


def parse_args(argv=None) -> argparse.Namespace:
    parser, subparsers = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if getattr(args, "recipe", None):
        # recipe tokens first: options given on the command line come later and win
        positionals, options = recipe_argv(args.recipe, subparsers[args.command])
        given = [name for name in positionals if getattr(args, name, None) is not None]  # the command line wins
        head = [value for name, value in positionals.items() if name not in given]
        argv = [args.command, *head, *options, *argv[argv.index(args.command) + 1 :]]
        args = parser.parse_args(argv)
    for name in ("seq_len", "max_windows", "batch_size", "train_windows", "max_steps", "grad_accum"):
        value = getattr(args, name, None)
        if value is not None and value < (2 if name == "seq_len" else 1):
            raise SystemExit(f"hf-tangent: --{name.replace('_', '-')} {value} is too small "
                             f"(at least {2 if name == 'seq_len' else 1}).")
    return args


# ----------------------------------------------------------------------------- inputs
def _load_model(args):
    from .models import load_model

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if context and args.seq_len > context:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's context of {context} tokens.")
    return model, tokenizer


def _documents(args, training: bool) -> tuple[list[str], list[str] | None]:
    """(evaluation documents, calibration documents or None), split by document, never overlapping."""
    from .data import load_documents

    if args.dataset:
        evaluation = load_documents(dataset=args.dataset, dataset_split=args.dataset_split)
        return evaluation, load_documents(dataset=args.dataset, dataset_split="train") if training else None
    if not training:
        return load_documents(args.text_files, split="evaluation"), None
    if args.calibration_files:
        overlap = set(map(os.path.abspath, args.calibration_files)) & set(map(os.path.abspath, args.text_files or []))
        if overlap:
            raise ValueError(f"files used both for calibration and evaluation: {sorted(overlap)}.")
        evaluation = load_documents(args.text_files, split="evaluation")
        return evaluation, load_documents(args.calibration_files)
    if args.text_files:
        docs = load_documents(args.text_files)
        if len(docs) < 2:
            raise ValueError("training needs calibration text separate from the evaluation text: pass "
                             "--calibration-files, or at least two documents in --text-files (split by document).")
        held_out = max(1, len(docs) // 5)
        return docs[-held_out:], docs[:-held_out]
    return load_documents(split="evaluation"), load_documents(split="calibration")


def load_inputs(args, training: bool = False):
    """(model, tokenizer, eval windows, train windows or None); every input error before long work."""
    from .data import pack_windows

    model, tokenizer = _load_model(args)
    evaluation, calibration = _documents(args, training)
    eval_windows = pack_windows(tokenizer, evaluation, args.seq_len, args.max_windows)
    train_windows = pack_windows(tokenizer, calibration, args.seq_len, args.train_windows) if training else None
    return model, tokenizer, eval_windows, train_windows


def _environment(args) -> dict:
    return {"hf_tangent_version": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": args.device, "dtype": args.dtype, "seed": args.seed}


def _world_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ----------------------------------------------------------------------------- eval
def run_eval(args) -> dict:
    from tqdm.auto import tqdm

    from .evaluation import evaluate_variants, perplexity, update_variants
    from .patching import get_config, unpatch

    names = args.updates or list(update_variants())
    model, _, windows, _ = load_inputs(args)
    loaded = get_config(model)  # a folder saved with a patch: evaluate that patch too
    start = time.time()
    total = (len(set(names) | {"unpatched"}) + (loaded is not None)) * len(windows)
    with tqdm(total=total, desc="hf-tangent eval", unit="window") as bar:
        saved_row = None
        if loaded is not None:
            bar.set_postfix_str("saved patch")
            result = perplexity(model, windows, batch_size=args.batch_size, progress=bar)
            saved_row = {"variant": "saved patch (as loaded)", "config": loaded.to_dict(), "nll": result["nll"],
                         "perplexity": result["perplexity"], "tokens": result["tokens"]}
            unpatch(model)
        rows = evaluate_variants(model, windows, names, batch_size=args.batch_size, progress=bar)
    if saved_row is not None:
        saved_row["delta_nll"] = saved_row["nll"] - rows[0]["nll"]
        saved_row["delta_perplexity"] = saved_row["perplexity"] - rows[0]["perplexity"]
        rows.insert(1, saved_row)
    report = {
        "command": "eval", "model": args.model, "text": args.text_files or args.dataset or "austen:evaluation",
        "seq_len": args.seq_len, "windows": len(windows), "tokens_per_variant": rows[0]["tokens"],
        "seconds": round(time.time() - start, 1), **_environment(args), "rows": rows,
    }
    write_report(args.output_dir, report, eval_markdown(report))
    return report


def variants_table(rows: list[dict]) -> str:
    lines = ["| variant | NLL | perplexity | delta NLL | delta perplexity |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['nll']:.4f} | {r['perplexity']:.3f} | {r['delta_nll']:+.4f} | "
                     f"{r['delta_perplexity']:+.3f} |")
    return "\n".join(lines)


def eval_markdown(report: dict) -> str:
    return "\n".join([
        f"# hf-tangent eval: {report['model']}",
        "",
        f"Text: {report['text']}; {report['windows']} windows x {report['seq_len']} tokens "
        f"({report['tokens_per_variant']} predicted tokens per variant); dtype {report['dtype']}, "
        f"device {report['device']}, {report['seconds']} s. Every rule is applied to every layer, untrained.",
        "",
        variants_table(report["rows"]),
    ]) + "\n"


# ----------------------------------------------------------------------------- calibrate
def run_calibrate(args) -> dict:
    from tqdm.auto import tqdm

    from . import plots
    from .config import TangentConfig
    from .evaluation import evaluate_variants, perplexity
    from .hub import push_to_hub, save_hub_folder
    from .patching import patch
    from .registry import decoder_layers
    from .training import freeze_all_but_gates, gate_summary, gate_values, lm_dataset, loss_curve, train
    from .training import training_arguments as make_training_arguments

    tangent = TangentConfig(update=args.update, layers=args.layers, gates=True)  # validated before any work
    model, tokenizer, eval_windows, train_windows = load_inputs(args, training=True)
    tangent.resolve_layers(len(decoder_layers(model)))
    start = time.time()
    main = _world_rank() == 0
    probe = train_windows[: min(len(train_windows), 8)]  # calibration loss before/after, same windows
    if main:
        with tqdm(total=(len(args.compare_updates) + 1) * len(eval_windows) + len(probe),
                  desc="held-out evaluation", unit="window") as bar:
            table = evaluate_variants(model, eval_windows, args.compare_updates, batch_size=args.batch_size, progress=bar)
            calibration_before = perplexity(model, probe, batch_size=args.batch_size, progress=bar)
    patch(model, tangent)
    freeze_all_but_gates(model)
    training_args = make_training_arguments(
        os.path.join(args.output_dir, "checkpoints"), max_steps=args.max_steps, learning_rate=args.learning_rate,
        batch_size=args.batch_size, grad_accum=args.grad_accum, seed=args.seed, save_steps=args.save_steps,
        bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing, device=args.device,
        report_to=args.report_to)
    trainer = train(model, lm_dataset(train_windows), training_args, resume=args.resume)
    if not trainer.is_world_process_zero():
        return {}
    model.eval()
    gated = perplexity(model, eval_windows, batch_size=args.batch_size)
    calibration_after = perplexity(model, probe, batch_size=args.batch_size)
    natural = table[0]
    gates = gate_values(model)
    summary = gate_summary(gates)
    os.makedirs(args.output_dir, exist_ok=True)
    plots.gate_profile(gates, os.path.join(args.output_dir, "gate_profile.png"),
                       title=f"Calibrated FFN gates: {args.model}")
    curve = loss_curve(trainer)
    plots.loss_curves({"gates": [curve]}, os.path.join(args.output_dir, "loss_curve.png"), title="Calibration loss")
    report = {
        "command": "calibrate", "model": args.model, "tangent_config": tangent.to_dict(),
        "text": {"evaluation": args.text_files or args.dataset or "austen:evaluation",
                 "calibration": args.calibration_files or (f"{args.dataset}:train" if args.dataset else
                                                           "held-out split of --text-files" if args.text_files
                                                           else "austen:calibration")},
        "seq_len": args.seq_len, "eval_windows": len(eval_windows), "train_windows": len(train_windows),
        "training": {"max_steps": args.max_steps, "learning_rate": args.learning_rate, "batch_size": args.batch_size,
                     "grad_accum": args.grad_accum, "world_size": training_args.world_size,
                     "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing},
        "gates": {str(k): v for k, v in gates.items()}, "gate_summary": summary,
        "heldout": {"natural_nll": natural["nll"], "gated_nll": gated["nll"], "delta_nll": gated["nll"] - natural["nll"],
                    "natural_perplexity": natural["perplexity"], "gated_perplexity": gated["perplexity"]},
        "calibration": {"natural_nll": calibration_before["nll"], "gated_nll": calibration_after["nll"],
                        "windows": len(probe)},
        "update_variants": table, "loss_curve": curve,
        "seconds": round(time.time() - start, 1), **_environment(args),
    }
    markdown = calibrate_markdown(report)
    if args.save_model or args.push_to_hub:
        folder = save_hub_folder(model, os.path.join(args.output_dir, "model"), tokenizer=tokenizer, card={
            "title": f"{args.model} with calibrated FFN gates (hf_tangent)",
            "training": _training_card(report), "results": markdown.split("## Held-out", 1)[-1],
            "notes": "Gates trained with all model weights frozen (hf_tangent `calibrate`)."})
        report["model_folder"] = str(folder)
        if args.push_to_hub:
            push_to_hub(folder, args.push_to_hub, private=args.hub_private)
            report["pushed_to"] = args.push_to_hub
    write_report(args.output_dir, report, markdown)
    return report


def _training_card(report: dict) -> str:
    t = report["training"]
    return (f"Text: {json.dumps(report['text'])}. {report['train_windows']} training windows of {report['seq_len']} "
            f"tokens; {t['max_steps']} optimizer steps, learning rate {t['learning_rate']}, batch "
            f"{t['batch_size']} x {t['grad_accum']} accumulation x {t['world_size']} processes; bf16 {t['bf16']}; "
            f"seed {report['seed']}; hf_tangent {report['hf_tangent_version']}, torch {report['torch']}.")


def calibrate_markdown(report: dict) -> str:
    s, h, c = report["gate_summary"], report["heldout"], report["calibration"]
    gates = ", ".join(f"{int(k)}: {v:.3f}" for k, v in report["gates"].items())
    lines = [
        f"# hf-tangent calibrate: {report['model']}",
        "",
        f"{report['train_windows']} calibration windows, {report['training']['max_steps']} steps, "
        f"{report['eval_windows']} held-out windows of {report['seq_len']} tokens; {report['seconds']} s on "
        f"{report['device']}.",
        "",
        "## Gate profile",
        "",
        f"mean gate **{s['mean']:.3f}**, min {s['min']:.3f} (layer {s['argmin']}) .. max {s['max']:.3f} "
        f"(layer {s['argmax']}). Paper: GPT-2 0.852, GPT-2-large 0.917, Pythia 1.063 / 1.048, Mistral 1.009.",
        "",
        f"Gates by layer: {gates}",
        "",
        "![gate profile](gate_profile.png)",
        "",
        "## Held-out loss",
        "",
        "| | NLL | perplexity |",
        "|---|---:|---:|",
        f"| natural (gates = 1) | {h['natural_nll']:.4f} | {h['natural_perplexity']:.3f} |",
        f"| calibrated gates | {h['gated_nll']:.4f} | {h['gated_perplexity']:.3f} |",
        f"| **Delta L** | **{h['delta_nll']:+.4f}** | |",
        "",
        f"Calibration windows ({c['windows']}): NLL {c['natural_nll']:.4f} natural -> {c['gated_nll']:.4f} gated.",
    ]
    if len(report["update_variants"]) > 1:
        lines += ["", "## Update rules, untrained, every layer", "", variants_table(report["update_variants"])]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- finetune
def run_finetune(args) -> dict:
    from . import plots
    from .evaluation import perplexity, update_variants
    from .hub import save_hub_folder
    from .models import load_model
    from .patching import patch
    from .training import lm_dataset, loss_curve, summarize_finetune, train
    from .training import training_arguments as make_training_arguments

    variants = update_variants()
    names = ["unpatched", *[n for n in args.updates if n != "unpatched"]]
    model, tokenizer, eval_windows, train_windows = load_inputs(args, training=True)
    del model
    dataset = lm_dataset(train_windows)
    start = time.time()
    rows, curves = [], {}
    main = _world_rank() == 0
    for seed in args.seeds:
        for name in names:
            model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
            if variants[name] is not None:
                patch(model, variants[name])
            if args.method == "lora":
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                                                         target_modules=args.lora_targets, lora_dropout=0.0))
            run_dir = os.path.join(args.output_dir, "runs", f"{name.split(' (')[0].replace(' ', '_')}-seed{seed}")
            training_args = make_training_arguments(
                run_dir, max_steps=args.max_steps, learning_rate=args.learning_rate, batch_size=args.batch_size,
                grad_accum=args.grad_accum, seed=seed, save_steps=args.save_steps, bf16=args.bf16,
                gradient_checkpointing=args.gradient_checkpointing, device=args.device, report_to=args.report_to,
                lr_scheduler=args.lr_scheduler, warmup_steps=args.warmup_steps)
            trainer = train(model, dataset, training_args, resume=args.resume)
            if main:
                model.eval()
                result = perplexity(model, eval_windows, batch_size=args.batch_size)
                curve = loss_curve(trainer)
                rows.append({"variant": name, "seed": seed, "nll": result["nll"], "perplexity": result["perplexity"],
                             "final_train_loss": curve[-1][1] if curve else None, "loss_curve": curve})
                curves.setdefault(name, []).append(curve)
                if args.save_models:
                    final = model.merge_and_unload() if args.method == "lora" else model
                    if variants[name] is not None:
                        save_hub_folder(final, os.path.join(run_dir, "model"), tokenizer=tokenizer)
            del model, trainer
            gc.collect()
    if not main:
        return {}
    summary = summarize_finetune(rows)
    plots.loss_curves(curves, os.path.join(args.output_dir, "loss_curves.png"),
                      title=f"{args.method} fine-tuning, {args.model}")
    report = {
        "command": "finetune", "model": args.model, "method": args.method, "variants": names, "seeds": args.seeds,
        "text": {"evaluation": args.text_files or args.dataset or "austen:evaluation",
                 "calibration": args.calibration_files or "austen:calibration"},
        "seq_len": args.seq_len, "eval_windows": len(eval_windows), "train_windows": len(train_windows),
        "training": {"max_steps": args.max_steps, "learning_rate": args.learning_rate, "batch_size": args.batch_size,
                     "grad_accum": args.grad_accum, "lr_scheduler": args.lr_scheduler, "bf16": args.bf16,
                     "gradient_checkpointing": args.gradient_checkpointing,
                     "lora": {"r": args.lora_r, "alpha": args.lora_alpha, "targets": args.lora_targets}
                     if args.method == "lora" else None},
        "summary": summary, "runs": rows, "seconds": round(time.time() - start, 1), **_environment(args),
    }
    write_report(args.output_dir, report, finetune_markdown(report))
    return report


def finetune_markdown(report: dict) -> str:
    t = report["training"]
    lines = [
        f"# hf-tangent finetune: {report['model']} ({report['method']})",
        "",
        f"Same data order, steps ({t['max_steps']}), optimizer (AdamW, lr {t['learning_rate']}, {t['lr_scheduler']}) "
        f"for every variant; seeds {report['seeds']}; {report['train_windows']} training and "
        f"{report['eval_windows']} held-out windows of {report['seq_len']} tokens; {report['seconds']} s.",
        "",
        "| variant | seeds | held-out NLL (mean +- sd) | perplexity | delta NLL vs unpatched | delta perplexity | p (paired permutation) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["summary"]:
        p = "" if s["variant"] == "unpatched" else f"{s['p_value']:.3f}"
        lines.append(f"| {s['variant']} | {s['seeds']} | {s['nll_mean']:.4f} +- {s['nll_std']:.4f} | "
                     f"{s['perplexity_mean']:.3f} | {s['delta_nll_mean']:+.4f} | {s['delta_perplexity_mean']:+.3f} | {p} |")
    lines += ["", "With n seeds the exact sign-flip test cannot go below p = 2 / 2^n.", "",
              "![training loss](loss_curves.png)"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- diagnose / ablate
def run_diagnose(args) -> dict:
    from tqdm.auto import tqdm

    from . import plots
    from .diagnostics import QUANTITIES, diagnose
    from .evaluation import update_variants
    from .patching import patch

    model, _, windows, _ = load_inputs(args)
    if args.update and update_variants()[args.update] is not None:
        patch(model, update_variants()[args.update])
    start = time.time()
    with tqdm(total=len(windows), desc="hf-tangent diagnose", unit="window") as bar:
        records = diagnose(model, windows, layers=args.layers, batch_size=args.batch_size, progress=bar)
    os.makedirs(args.output_dir, exist_ok=True)
    plots.diagnostics_layers(records, os.path.join(args.output_dir, "diagnostics_layers.png"),
                             title=f"{args.model} ({args.update or 'unpatched'})")
    report = {"command": "diagnose", "model": args.model, "update": args.update or "unpatched",
              "text": args.text_files or args.dataset or "austen:evaluation", "seq_len": args.seq_len,
              "windows": len(windows), "definitions": QUANTITIES, "seconds": round(time.time() - start, 1),
              **_environment(args), "layers": records}
    write_report(args.output_dir, report, diagnose_markdown(report))
    return report


def diagnose_markdown(report: dict) -> str:
    cols = ["rho", "orthogonality_error", "norm_x", "ffn_angle", "diversity_before_attention",
            "diversity_after_attention", "diversity_after_ffn", "deficit", "ffn_share"]
    lines = [f"# hf-tangent diagnose: {report['model']} ({report['update']})", "",
             f"{report['windows']} windows x {report['seq_len']} tokens of {report['text']}; per-layer means over "
             "tokens (diversity: mean over sequences). Definitions: docs/diagnostics.md.", "",
             "| layer | " + " | ".join(cols) + " | norm drift |", "|---" * (len(cols) + 2) + "|"]
    for r in report["layers"]:
        lines.append(f"| {r['layer']} | " + " | ".join(f"{r[c]['mean']:.4g}" for c in cols) + f" | {r['norm_drift']:.4g} |")
    lines += ["", "![per-layer diagnostics](diagnostics_layers.png)"]
    return "\n".join(lines) + "\n"


def run_ablate(args) -> dict:
    from tqdm.auto import tqdm

    from . import plots
    from .ablation import forward_passes, run_ablation
    from .registry import decoder_layers

    model, _, windows, _ = load_inputs(args)
    start = time.time()
    total = forward_passes(len(windows), args.variants, args.layerwise, len(decoder_layers(model)))
    with tqdm(total=total, desc="hf-tangent ablate", unit="window") as bar:
        result = run_ablation(model, windows, variants=args.variants, layerwise=args.layerwise,
                              batch_size=args.batch_size, n_boot=args.bootstrap, seed=args.seed, progress=bar)
    os.makedirs(args.output_dir, exist_ok=True)
    plots.ablation_bars(result["rows"], os.path.join(args.output_dir, "ablation_bars.png"), title=f"{args.model}: ablations")
    if args.layerwise:
        plots.ablation_heatmap(result["rows"], os.path.join(args.output_dir, "ablation_heatmap.png"),
                               title=f"{args.model}: one layer at a time")
    report = {"command": "ablate", "model": args.model, "text": args.text_files or args.dataset or "austen:evaluation",
              "seq_len": args.seq_len, "seconds": round(time.time() - start, 1), **_environment(args), **result}
    write_report(args.output_dir, report, ablate_markdown(report))
    return report


def ablate_markdown(report: dict) -> str:
    lines = [f"# hf-tangent ablate: {report['model']}", "",
             f"Full model loss {report['full_loss']:.4f} nats/token on {report['windows']} windows x "
             f"{report['seq_len']} tokens of {report['text']}; increase over full with a 95% paired bootstrap "
             "interval over windows.", "",
             "| variant | layers | loss | increase | 95% CI |", "|---|---|---:|---:|---|"]
    for r in report["rows"]:
        if r["layer"] == "all":
            lines.append(f"| {r['variant']} | all | {r['loss']:.4f} | {r['increase']:+.4f} | "
                         f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] |")
    layerwise = [r for r in report["rows"] if r["layer"] != "all"]
    if layerwise:
        variants = list(dict.fromkeys(r["variant"] for r in layerwise))
        lines += ["", "One layer at a time (loss increase):", "", "| layer | " + " | ".join(variants) + " |",
                  "|---" * (len(variants) + 1) + "|"]
        for layer in sorted({r["layer"] for r in layerwise}):
            cells = [next(r for r in layerwise if r["layer"] == layer and r["variant"] == v) for v in variants]
            lines.append(f"| {layer} | " + " | ".join(f"{c['increase']:+.4f}" for c in cells) + " |")
        lines += ["", "![layerwise](ablation_heatmap.png)"]
    lines += ["", "![ablations](ablation_bars.png)"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- parallel residual
def _calibration_windows(args, tokenizer, count):
    from .data import load_documents, pack_windows

    docs = load_documents(args.calibration_files) if args.calibration_files else load_documents(split="calibration")
    return pack_windows(tokenizer, docs, args.seq_len, count)


def run_sensitivity(args) -> dict:
    from tqdm.auto import tqdm

    from . import plots
    from .parallel import sensitivity

    model, tokenizer = _load_model(args)
    windows = _calibration_windows(args, tokenizer, args.max_windows)
    start = time.time()
    with tqdm(total=len(windows), desc="hf-tangent sensitivity", unit="window") as bar:
        result = sensitivity(model, windows, batch_size=args.batch_size, progress=bar)
    os.makedirs(args.output_dir, exist_ok=True)
    if len(result["already_parallel"]) < len(result["layers"]):
        plots.sensitivity_profile(result["layers"], os.path.join(args.output_dir, "sensitivity.png"),
                                  title=f"C_l: {args.model}")
    report = {"command": "sensitivity", "model": args.model, "seq_len": args.seq_len,
              "text": args.calibration_files or "austen:calibration", "seconds": round(time.time() - start, 1),
              **_environment(args), **result}
    write_report(args.output_dir, report, sensitivity_markdown(report))
    return report


def sensitivity_markdown(report: dict) -> str:
    lines = [f"# hf-tangent sensitivity: {report['model']}", "",
             f"C_l on {report['windows']} calibration windows x {report['seq_len']} tokens of {report['text']}.", ""]
    if report["already_parallel"]:
        lines += [f"Layers {report['already_parallel']} are already parallel-residual blocks: nothing to convert there.", ""]
    lines += ["| layer | C_l (token mean) | window mean +- sd | q05 .. q95 |", "|---:|---:|---:|---|"]
    for r in report["layers"]:
        if not r["already_parallel"]:
            t = r["token_stats"]
            lines.append(f"| {r['layer']} | {r['c']:.4f} | {r['window_mean']:.4f} +- {r['window_std']:.4f} | "
                         f"{t['q05']:.3f} .. {t['q95']:.3f} |")
    return "\n".join(lines + ["", "![C_l](sensitivity.png)"]) + "\n"


def run_parallel_sweep(args) -> dict:
    from tqdm.auto import tqdm

    from . import plots
    from .config import TangentConfig
    from .parallel import estimated_speedup, greedy_order, parallel_sweep, recommend, sensitivity, submodule_times
    from .patching import patch, unpatch
    from .registry import get_spec

    model, tokenizer, heldout, _ = load_inputs(args)
    calibration = _calibration_windows(args, tokenizer, args.calibration_windows)
    start = time.time()
    sens = sensitivity(model, calibration, batch_size=args.batch_size)
    scores = sens["scores"]
    convertible = [i for i, c in enumerate(scores) if c is not None]
    if not convertible:
        raise ValueError("every layer is already a parallel-residual block (use_parallel_residual=True): "
                         "nothing to convert.")
    greedy = None
    if args.greedy:
        max_k = args.greedy_max_k or len(convertible)
        n_evals = sum(len(convertible) - j for j in range(max_k))
        with tqdm(total=n_evals, desc="greedy selection (calibration)", unit="eval") as bar:
            greedy = greedy_order(model, calibration, max_k=max_k, batch_size=args.batch_size, progress=bar)
    ks = args.ks if args.ks is not None else list(range(len(convertible) + 1))
    n_evals = len(ks) * (2 + len(args.random_seeds) + (1 if greedy else 0))
    with tqdm(total=n_evals, desc="sweep (held-out)", unit="eval") as bar:
        sweep = parallel_sweep(model, heldout, scores=scores, ks=ks, random_seeds=args.random_seeds, greedy=greedy,
                               batch_size=args.batch_size, progress=bar)
    orders = {"low_c": sorted(convertible, key=lambda i: scores[i])}
    if greedy:
        orders["greedy"] = [step["layer"] for step in greedy]
    recommendations = {name: recommend(model, calibration, heldout, budget=args.budget, order=order,
                                       batch_size=args.batch_size) for name, order in orders.items()}
    best = max(recommendations.values(), key=lambda r: (r["within_budget_heldout"], r["k"]))
    speed = None
    if args.speed and best["layers"]:
        from .timing import interleaved_ratio

        times = submodule_times(model, heldout[:2], batch_size=args.batch_size)
        estimate = estimated_speedup(times, best["layers"])
        ids = heldout[:1].to(args.device)
        variants = {"hooks": TangentConfig(parallel_layers=tuple(best["layers"]))}
        if get_spec(model.config.model_type).fused_attention_in:
            variants["fused"] = TangentConfig(parallel_layers=tuple(best["layers"]), parallel_execution="fused")
        measured = {}
        import copy

        baseline = model
        for name, config in variants.items():
            converted = patch(copy.deepcopy(model), config)

            @torch.no_grad()
            def run(m):
                m(input_ids=ids, use_cache=False)

            measured[name] = interleaved_ratio(lambda: run(baseline), lambda conv=converted: run(conv), repeats=7)
            unpatch(converted)
        speed = {"layers": best["layers"], "estimated_speedup": estimate, "submodule_times": times,
                 "measured_time_ratio": {k: v["ratio_median"] for k, v in measured.items()},
                 "measured_speedup": {k: 1.0 / v["ratio_median"] for k, v in measured.items()},
                 "measured": measured, "tokens": int(ids.numel())}
    os.makedirs(args.output_dir, exist_ok=True)
    plots.sensitivity_profile(sens["layers"], os.path.join(args.output_dir, "sensitivity.png"), title=f"C_l: {args.model}")
    plots.parallel_sweep(sweep["curves"], sweep["random_std"], os.path.join(args.output_dir, "parallel_sweep.png"),
                         title=f"{args.model}: parallel-residual conversion")
    report = {"command": "parallel-sweep", "model": args.model, "seq_len": args.seq_len,
              "heldout_windows": len(heldout), "calibration_windows": len(calibration),
              "text": {"evaluation": args.text_files or args.dataset or "austen:evaluation",
                       "calibration": args.calibration_files or "austen:calibration"},
              "sensitivity": sens, "greedy": greedy, "sweep": sweep, "recommendations": recommendations,
              "speed": speed, "seconds": round(time.time() - start, 1), **_environment(args)}
    write_report(args.output_dir, report, sweep_markdown(report))
    return report


def sweep_markdown(report: dict) -> str:
    sweep, curves = report["sweep"], report["sweep"]["curves"]
    schedules = list(curves)
    lines = [f"# hf-tangent parallel-sweep: {report['model']}", "",
             f"Held-out loss {sweep['base_loss']:.4f} nats/token unconverted ({report['heldout_windows']} windows x "
             f"{report['seq_len']} tokens); C_l and greedy on {report['calibration_windows']} calibration windows. "
             "Loss increase by number of converted layers (random: mean over seeds):", "",
             "| k | " + " | ".join(schedules) + " |", "|---:" * (len(schedules) + 1) + "|"]
    for k in sweep["ks"]:
        lines.append(f"| {k} | " + " | ".join(f"{curves[s][k]:+.4f}" if k in curves[s] else "-" for s in schedules) + " |")
    lines += ["", "![sweep](parallel_sweep.png)", "", f"## Largest set within +{next(iter(report['recommendations'].values()))['budget']} nats (chosen on calibration text)", "",
              "| order | k | layers | held-out increase | within budget on held-out |", "|---|---:|---|---:|---|"]
    for name, r in report["recommendations"].items():
        lines.append(f"| {name} | {r['k']} | {r['layers']} | {r['heldout_increase']:+.4f} | {r['within_budget_heldout']} |")
    if report["speed"]:
        sp = report["speed"]
        lines += ["", "## Speed", "", f"Converted layers {sp['layers']}: estimated speedup (A and FFN concurrent, "
                  f"from measured T_A, T_Phi) **{sp['estimated_speedup']:.3f}x**; measured end-to-end (1 x "
                  f"{sp['tokens']} tokens, same run): " + ", ".join(f"{k} {v:.3f}x" for k, v in sp["measured_speedup"].items()) + "."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- studies
def run_study(args) -> dict:
    from tqdm.auto import tqdm

    from .studies import SCALES, STUDIES, check_request, run_study, study_markdown, write_plots

    if args.study is None:
        raise ValueError(f"name a study: one of {', '.join(STUDIES)} (or `study:` in a --recipe).")
    for name, instead in (("model", "models are built from scratch"), ("dtype", "studies train in float32"),
                          ("seed", "use --seeds")):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name} does not apply to `study` ({instead}).")
    names = check_request(args.study, args.scale, args.variants, args.arch)  # errors before any work
    overrides = {"max_steps": args.max_steps, "eval_every": args.eval_every, "learning_rate": args.learning_rate,
                 "train_windows": args.train_windows, "seq_len": args.seq_len, "batch_size": args.batch_size,
                 "val_windows": args.max_windows}
    train_docs = val_docs = data = None
    if args.text_files or args.dataset or args.calibration_files:
        if args.calibration_files and not args.text_files:
            raise ValueError("--calibration-files needs --text-files as the validation text.")
        val_docs, train_docs = _documents(args, training=True)
        data = (f"{' '.join(args.calibration_files or [])} / {' '.join(args.text_files)}" if args.calibration_files else
                f"{args.dataset} (train / {args.dataset_split})" if args.dataset else
                f"{' '.join(args.text_files)} (split by document, last 20% held out)")
    seeds = args.seeds or SCALES[args.scale]["seeds"]
    with tqdm(total=len(names) * len(seeds), desc=f"study {args.study} ({args.scale})", unit="run") as bar:
        report = run_study(args.study, args.scale, arch=args.arch, variants=args.variants, seeds=seeds,
                           branches=tuple(args.branches), output_dir=args.output_dir, device=args.device, progress=bar,
                           overrides=overrides, train_docs=train_docs, val_docs=val_docs, data=data)
    report |= {k: v for k, v in _environment(args).items() if v is not None}  # study has no --dtype / --seed
    report["plots"] = write_plots(report, args.output_dir)
    write_report(args.output_dir, report, study_markdown(report))
    return report


def run_study_report(args) -> dict:
    """docs/studies.md from study report.json files; each report (JSON and regenerated plots) is kept
    in results/studies/<study>-<arch>-<branches>/ next to the page, so the page regenerates from there."""
    from .studies import OVERVIEW_HEADER, merge_reports, overview_row, study_markdown, write_plots

    page = Path(args.output)
    text = ["# From-scratch studies: results", "",
            "Generated by `hf-tangent study-report` from the report.json files of `hf-tangent study` runs; every",
            "number and plot comes from those files, kept next to this page in `results/studies/`. To regenerate:",
            f"`hf-tangent study-report {(page.parent / 'results' / 'studies').as_posix()}/*/report.json --output {page}`.", "",
            "Overview. The hypothesis \"held\": the means point its way and every paired p <= 0.05; \"held in the",
            "mean only\": the means do and every seed agrees, too few seeds for p <= 0.05; \"inconclusive\": the means",
            "do but a seed disagrees; otherwise \"did not hold\" ([studies-guide.md](studies-guide.md)).", "",
            *OVERVIEW_HEADER]
    groups: dict[str, list] = {}  # reports of one study / arch / branches (more seeds) are merged
    for path in args.reports:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        for key in ("study", "scale", "arch", "branches", "runs", "summary", "settings"):
            if key not in report:
                raise ValueError(f"{path} is not a `hf-tangent study` report (no {key!r}).")
        groups.setdefault(f"{report['study']}-{report['arch']}-{'+'.join(report['branches'])}", []).append((path, report))
    sections = []
    for name, members in groups.items():
        report = merge_reports([r for _, r in members])
        folder = page.parent / "results" / "studies" / name
        folder.mkdir(parents=True, exist_ok=True)
        if len(members) > 1 or Path(members[0][0]).resolve() != (folder / "report.json").resolve():
            report.pop("plots", None)
            (folder / "report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
        files = write_plots(report, str(folder))
        rel = folder.relative_to(page.parent).as_posix()
        text.append(overview_row(report))
        sections.append(study_markdown(report | {"plots": {title: f"{rel}/{file}" for title, file in files.items()}}))
    page.write_text("\n".join([*text, "", *sections]), encoding="utf-8")
    print(f"wrote {page}")
    return {}


def write_report(output_dir: str, report: dict, markdown: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(output_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    print(markdown)
    print(f"wrote {os.path.join(output_dir, 'report.json')} and report.md")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"hf-tangent {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
